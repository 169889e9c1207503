"""The rows of a log: a row's identity (:class:`TensorKey`) and the building of rows from a
step's merged host summaries (:func:`row_columns`, :func:`build_rows`).

Both the step buffer (which merges a step's summaries into entries) and the cross-rank merge
(:mod:`.distributed`) speak in these types; the log stream builds the rows from them on its
writer thread. They live here, beneath all three, so that each imports them one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
import pandas as pd

from ...schema.columns import OVERFLOW, TENSOR_TYPES, UNDERFLOW
from ...schema.writer import Rows, step_period
from ...stats.summary import (
    COUNT_STATS,
    DEFAULT_STATS,
    HIGHER_STATS,
    Layout,
    exponent_labels,
    finalize_many,
)

__all__ = ["TensorKey", "Entries", "Scratch", "build_rows", "row_columns"]

#: A step's merged host summaries: (row key, layout, summary vector) per row.
Entries = list[tuple["TensorKey", Layout, np.ndarray]]

_key_of = itemgetter(0)
_layout_of = itemgetter(1)
_name_of = attrgetter("name")
_module_type_of = attrgetter("module_type")
_tensor_type_of = attrgetter("tensor_type")
_dtype_of = attrgetter("dtype")


@dataclass(frozen=True)
class TensorKey:
    """Identity of one row of a step: which tensor, of which kind, from which module class."""

    name: str
    tensor_type: str
    module_type: str
    dtype: str
    #: the hash, found once: a step's summaries are grouped by key on the writer thread
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tensor_type not in TENSOR_TYPES:
            raise ValueError(f"tensor_type {self.tensor_type!r} is not one of {TENSOR_TYPES}")
        object.__setattr__(
            self, "_hash", hash((self.name, self.tensor_type, self.module_type, self.dtype))
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, tuple[str, str, str, str]]:
        # by the fields (a string's hash differs between processes: it is found anew)
        return (TensorKey, (self.name, self.tensor_type, self.module_type, self.dtype))


def build_rows(
    step: int | Sequence[int] | np.ndarray, entries: Sequence[tuple[TensorKey, Layout, np.ndarray]]
) -> pd.DataFrame:
    """Log rows from merged host summaries, one row per entry, in order.

    ``step`` is the step of every entry, or one step per entry (the log stream builds the
    rows of several buffered steps at once). Entries sharing a layout are finalized
    together (vectorized). Exponent columns are the union over the entries' formats; a
    format that lacks an exponent contributes a zero count there.
    """
    return row_columns(step, entries).frame()


class Scratch:
    """Memory :func:`row_columns` builds a batch's rows in, kept from one batch to the next
    by its caller (the log's writer thread): the float64 stack of the batch's summaries
    and the int64 exponent counts of its rows. Fresh arrays of that size (megabytes) are
    new memory at every batch, which the kernel maps in page by page, at a cost of the
    order of the copy itself (on the 2-core VM, about a third of ``finalize_many``'s time
    beside the training thread)."""

    __slots__ = ("_stack", "_counts")

    def __init__(self) -> None:
        self._stack = np.empty(0)
        self._counts = np.empty(0, np.int64)

    def stack(self, size: int) -> np.ndarray:
        """``size`` float64 values of the stack (grown when it is smaller)."""
        if self._stack.size < size:
            self._stack = np.empty(size)
        return self._stack[:size]

    def counts(self, rows: int, columns: int) -> np.ndarray:
        """An int64 ``(rows, columns)`` array of the counts' memory (grown when smaller)."""
        if self._counts.size < rows * columns:
            self._counts = np.empty(rows * columns, np.int64)
        return self._counts[: rows * columns].reshape(rows, columns)


def row_columns(
    step: int | Sequence[int] | np.ndarray,
    entries: Sequence[tuple[TensorKey, Layout, np.ndarray]],
    scratch: Scratch | None = None,
) -> Rows:
    """:func:`build_rows` as plain columns (:class:`~tandv.schema.writer.Rows`), which
    the log's writer stores without a DataFrame.

    ``scratch``: memory kept between batches, where the summaries are stacked and, for a
    batch of one layout, the rows' exponent counts are rounded into: such rows' ``counts``
    are the scratch's, valid until its next use (the writer thread writes a batch's rows,
    and hands its sinks DataFrames of their own, before it builds the next batch's).
    ``None``: new arrays."""
    n = len(entries)
    steps = (
        np.full(n, step, dtype=np.int64)
        if isinstance(step, (int, np.integer))
        else np.asarray(step, dtype=np.int64)
    )
    if steps.shape != (n,):
        raise ValueError(f"build_rows: {len(steps)} steps for {n} entries")
    groups = _groups(list(map(_layout_of, entries)))
    stat_names = list(DEFAULT_STATS)
    for layout in groups:
        higher = HIGHER_STATS if layout.num_higher else ()  # skew, kurtosis (moments=4)
        stat_names += [n for n in higher if n not in stat_names]
        stat_names += [name for name, _ in layout.extras if name not in stat_names]
    labels: dict[Any, int] = {}
    for layout in groups:
        for lab in exponent_labels(layout.format):
            labels.setdefault(lab, len(labels))
    stats = {k: np.full(n, np.nan) for k in stat_names if k not in COUNT_STATS}
    stats.update({k: np.zeros(n, np.int64) for k in COUNT_STATS})
    # one layout (the common case): its rows are every row, and finalize_many's counts are
    # the rows' counts as they are (rounded into the scratch where there is one); several:
    # each layout's counts go into one array of every label
    one = len(groups) == 1
    counts = np.zeros((0, 0) if one else (n, len(labels)), dtype=np.int64)
    for layout, rows in groups.items():
        # (concatenated, then shaped: np.stack costs two Python steps per row)
        vectors = [entries[r][2] for r in rows]
        stacked = None if scratch is None else scratch.stack(len(rows) * layout.size)
        stacked = np.concatenate(vectors, out=stacked)
        kept = scratch.counts(n, layout.num_counts) if one and scratch is not None else None
        # (finalize_many's statistics are arrays of their own, never views of the stack,
        # which the next batch overwrites)
        st, c = finalize_many(stacked.reshape(len(rows), layout.size), layout, counts_out=kept)
        if one:  # (the labels are this layout's, in its order)
            for k, a in st.items():
                stats[k][:] = a
            counts = c
            continue
        idx = np.asarray(rows, dtype=np.intp)
        for k, a in st.items():
            stats[k][idx] = a
        cols_ix = np.array([labels[lab] for lab in exponent_labels(layout.format)], dtype=np.intp)
        counts[np.ix_(idx, cols_ix)] = c
    order = [UNDERFLOW, *sorted(l for l in labels if l not in (UNDERFLOW, OVERFLOW)), OVERFLOW]
    if not labels:
        counts = np.zeros((n, 2), np.int64)
    else:
        at = [labels[lab] for lab in order]
        if at != list(range(len(labels))):
            counts = counts[:, at]
    keys = list(map(_key_of, entries))
    # (steps that logged the same tensors in the same order: one step's strings, repeated)
    period = step_period(steps, keys)
    block, times = (keys[:period], n // period) if period else (keys, 1)
    return Rows(
        names=list(map(_name_of, block)) * times,
        types=list(map(_module_type_of, block)) * times,
        tensor_types=list(map(_tensor_type_of, block)) * times,
        steps=steps,
        dtypes=list(map(_dtype_of, block)) * times,
        stats={k: stats[k] for k in stat_names},
        labels=order,
        counts=counts,
    )


def _groups(layouts: list[Layout]) -> dict[Layout, list[int]]:
    """The entries' indices by layout, in order; grouped by identity first (hashing a
    Layout costs more than the rest; layouts are cached, and equal layouts in two groups
    give the same columns)."""
    if layouts and len(set(map(id, layouts))) == 1:  # one layout (the common case)
        return {layouts[0]: list(range(len(layouts)))}
    by_id: dict[int, tuple[Layout, list[int]]] = {}
    for i, layout in enumerate(layouts):
        group = by_id.get(id(layout))
        if group is None:
            group = by_id[id(layout)] = (layout, [])
        group[1].append(i)
    return dict(by_id.values()) if len(by_id) == 1 else _by_layout(by_id)


def _by_layout(by_id: dict[int, tuple[Layout, list[int]]]) -> dict[Layout, list[int]]:
    """Groups of entries by equal layout, from groups by layout identity (in order)."""
    groups: dict[Layout, list[int]] = {}
    for layout, rows in by_id.values():
        groups.setdefault(layout, []).extend(rows)
    return {k: sorted(v) for k, v in groups.items()}
