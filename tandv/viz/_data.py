"""Argument checking and data selection shared by the figures.

Every public plotting function goes through :func:`check_log` and the ``select_*``
helpers, so a bad argument fails the same way everywhere: a :class:`VizArgumentError`
that names the argument and lists what the log holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..schema import (
    EXPONENT_COUNTS,
    METADATA,
    NAME,
    OVERFLOW,
    SCALAR_STATS,
    STEP,
    TENSOR_TYPE,
    TENSOR_TYPES,
    UNDERFLOW,
    validate,
)

__all__ = [
    "VizArgumentError",
    "logged_scalars",
    "check_log",
    "layer_order",
    "select_tensor_types",
    "select_layers",
    "select_metrics",
    "select_steps",
    "thin_steps",
    "check_step",
    "exponent_table",
    "rows_for",
]

_NAME = (METADATA, NAME)
_TT = (METADATA, TENSOR_TYPE)
_STEP = (METADATA, STEP)


class VizArgumentError(ValueError):
    """A plotting argument names something the log does not hold; the message lists
    what is available."""


def _listing(values: Iterable[Any], limit: int = 20) -> str:
    vals = list(values)
    shown = ", ".join(repr(v) for v in vals[:limit])
    return shown + (f", ... ({len(vals)} in all)" if len(vals) > limit else "")


def _step_listing(steps: Sequence[int]) -> str:
    steps = sorted(int(s) for s in steps)
    if len(steps) <= 20:
        return ", ".join(map(str, steps))
    head, tail = ", ".join(map(str, steps[:10])), ", ".join(map(str, steps[-5:]))
    return f"{head}, ..., {tail} ({len(steps)} steps)"


def check_log(df: Any) -> pd.DataFrame:
    """Validate ``df`` as a tandv log (raising :class:`tandv.SchemaError` if it is not) and
    require at least one row, since there is nothing to draw otherwise."""
    validate(df)
    if len(df) == 0:
        raise VizArgumentError("the log has no rows; there is nothing to plot")
    return df


def layer_order(df: pd.DataFrame) -> list[str]:
    """Tensor names in the order they first appear in the log (the model's order, as
    trackers write rows in execution order), rather than alphabetically."""
    return list(pd.unique(df[_NAME]))


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, (str, re.Pattern)):
        return [value]
    return list(value)


def select_tensor_types(df: pd.DataFrame, tt: Any) -> list[str]:
    """The tensor types named by ``tt`` (one or a list), each checked against the log."""
    present = [t for t in TENSOR_TYPES if (df[_TT] == t).any()]
    wanted = _as_list(tt)
    if not wanted:
        raise VizArgumentError(
            f"tt: expected a tensor type or a non-empty list; the log holds {_listing(present)}"
        )
    for t in wanted:
        if t not in TENSOR_TYPES:
            raise VizArgumentError(
                f"tt={t!r} is not a tensor type; expected one of {_listing(TENSOR_TYPES)} "
                f"(this log holds {_listing(present)})"
            )
        if t not in present:
            raise VizArgumentError(
                f"tt={t!r}: the log has no {t} rows; it holds {_listing(present)}"
            )
    return list(dict.fromkeys(wanted))


def select_layers(df: pd.DataFrame, layer: Any, tts: Sequence[str] | None = None) -> list[str]:
    """The tensor names selected by ``layer``, in log order.

    ``layer`` may be an exact name, a list of exact names, a compiled regular
    expression, or a string that names no tensor exactly, which is then used as a
    regular expression (``re.search``); ``None`` selects every tensor. Only tensors
    with rows of the tensor types ``tts`` (when given) count.
    """
    rows = df if tts is None else df[df[_TT].isin(list(tts))]
    names = layer_order(rows)
    where = "" if tts is None else f" of type {_listing(tts)}"
    if layer is None:
        if not names:
            raise VizArgumentError(f"the log has no tensors{where}")
        return names
    picked: list[str] = []
    for item in _as_list(layer):
        if isinstance(item, str) and item in names:
            hits = [item]
        elif isinstance(item, (str, re.Pattern)):
            try:
                pattern = re.compile(item)
            except re.error as e:
                raise VizArgumentError(
                    f"layer={item!r} names no tensor{where} and is not a valid regular expression "
                    f"({e}); available: {_listing(names)}"
                ) from None
            hits = [n for n in names if pattern.search(n)]
        else:
            raise VizArgumentError(
                f"layer: expected a name, a regex or a list of names; found {item!r}"
            )
        if not hits:
            raise VizArgumentError(
                f"layer={item!r} matches no tensor{where}; available: {_listing(names)}"
            )
        picked += hits
    return [n for n in names if n in set(picked)]


def select_metrics(df: pd.DataFrame, metric: Any) -> list[str]:
    """The scalar statistics named by ``metric`` (one or a list), checked against the log."""
    present = [c for g, c in df.columns if g == SCALAR_STATS]
    wanted = _as_list(metric)
    if not wanted:
        raise VizArgumentError(
            f"scalar_metric: expected a name or a non-empty list; available: {_listing(present)}"
        )
    for m in wanted:
        if m not in present:
            raise VizArgumentError(
                f"scalar_metric={m!r} is not in the log; available: {_listing(present)}"
            )
    return list(dict.fromkeys(wanted))


def select_steps(df: pd.DataFrame, inc: int = 1) -> list[int]:
    """Every ``inc``-th logged step of ``df`` (the first always included), ascending."""
    return thin_steps(pd.unique(df[_STEP]), inc)


def thin_steps(steps: Iterable[Any], inc: int = 1) -> list[int]:
    """Every ``inc``-th of the distinct ``steps`` in ascending order, the first included."""
    if not isinstance(inc, (int, np.integer)) or isinstance(inc, bool) or inc < 1:
        raise VizArgumentError(f"inc={inc!r}: expected an int >= 1")
    return sorted({int(s) for s in steps})[:: int(inc)]


def check_step(df: pd.DataFrame, step: Any, what: str) -> int:
    """``step`` as an int, if ``df`` (already narrowed to ``what``) has rows at it."""
    steps = sorted(int(s) for s in pd.unique(df[_STEP]))
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or int(step) not in steps:
        raise VizArgumentError(
            f"step={step!r}: {what} has no rows at that step; logged steps: {_step_listing(steps)}"
        )
    return int(step)


def exponent_table(df: pd.DataFrame) -> pd.DataFrame:
    """The exponent counts of ``df`` as a flat int64 frame with columns ordered
    ``-inf``, ascending exponents, ``+inf`` (the order of the value axis)."""
    labels = [c for g, c in df.columns if g == EXPONENT_COUNTS]
    ints = sorted(c for c in labels if c not in (UNDERFLOW, OVERFLOW))
    order = [UNDERFLOW, *ints, OVERFLOW]
    out = pd.DataFrame(
        {c: df[(EXPONENT_COUNTS, c)].to_numpy(dtype=np.int64) for c in order}, index=df.index
    )
    return out


def rows_for(
    df: pd.DataFrame, names: Sequence[str] | None = None, tts: Sequence[str] | None = None
) -> pd.DataFrame:
    """Rows of the given tensor names and tensor types."""
    mask = np.ones(len(df), dtype=bool)
    if names is not None:
        mask &= df[_NAME].isin(list(names)).to_numpy()
    if tts is not None:
        mask &= df[_TT].isin(list(tts)).to_numpy()
    return df[mask]


def logged_scalars(df: pd.DataFrame) -> pd.DataFrame | None:
    """The training scalars logged beside the log ``df`` was read from
    (``tracker.log_scalars``; :func:`tandv.read_scalars`), or ``None`` when it has none, was
    built in memory, or its scalars cannot be read (a figure without them is still useful)."""
    from ..schema.scalars import SOURCE_ATTR, read_scalars

    if not df.attrs.get(SOURCE_ATTR):
        return None
    try:
        ts = read_scalars(df)
    except (OSError, ValueError):
        return None
    return ts if len(ts) and len(ts.columns) > 1 else None
