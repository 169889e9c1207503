"""Arrays of more elements than one on-device summary counts: summarized in segments.

A summary computed on the device counts in int32 (JAX runs without 64-bit integers unless
``jax_enable_x64`` is set), and Pallas's Triton lowering scales a block index by the block
size in int32 too. So no kernel takes more than :data:`._summary.MAX_ELEMENTS` (2**31 - 1)
elements at once. The tracker summarizes a larger array (logits of batch 8 x sequence 4096
x vocabulary 128K: 4.3e9 elements) as its flattened elements cut into a few equal, static
segments of at most :data:`SEGMENT_ELEMENTS` elements, each summarized by the kernel the
array would have had (host kernel, XLA, Pallas) as one row of a stack; the rows leave the
device like any summary, and the host merges them (:func:`merge_segments`) in float64, where
counts are exact integers up to 2**53: no count past 2**31 is ever held in int32.

Segments start at multiples of 1024 elements (whole blocks of every block format). Custom
statistics (``stats=``, ``percentiles=``) are computed once, of the whole array, as they
would be without segments; every row carries them and the merged row keeps them as they are
(not merged by their rules: a percentile of the whole array is not the mean of its
segments' percentiles).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...stats.blocks import BLOCK_COLUMNS, block_formats_of
from ...stats.summary import Layout, merge_all
from ._summary import MAX_ELEMENTS, CustomStat, DeviceSummary, with_custom

__all__ = [
    "SEGMENT_ELEMENTS",
    "core_layout",
    "segment_count",
    "segmented",
    "merge_segments",
    "is_segmented",
]

#: The most elements of one segment (a ``jax.make_user_context`` value, so part of every
#: ``jax.jit`` cache key: a program traced under another value is traced again). Test hook:
#: ``with SEGMENT_ELEMENTS(1000): ...`` makes arrays of more than 1000 elements take the
#: segmented path without allocating 2**31 elements; values above :data:`MAX_ELEMENTS` are
#: refused.
SEGMENT_ELEMENTS = jax.make_user_context(MAX_ELEMENTS)


def _limit() -> int:
    limit = SEGMENT_ELEMENTS.value
    if not isinstance(limit, int) or not 1 <= limit <= MAX_ELEMENTS:
        raise ValueError(
            f"tandv: SEGMENT_ELEMENTS={limit!r}: expected an int in [1, 2**31 - 1] (a "
            "segment's counts are int32)"
        )
    return limit


#: Segments start at multiples of this many elements (where the limit allows).
_ALIGN = 1024


def _cuts(n: int) -> list[int]:
    """Where the segments of ``n`` elements start, then ``n``: as few as the limit allows, of
    equal length (a multiple of :data:`_ALIGN`) but the last."""
    limit = _limit()
    if n <= limit:
        return [0, n]
    align = _ALIGN if limit >= _ALIGN else 1
    longest = limit // align * align
    segments = -(-n // longest)
    even = -(-n // segments)  # elements per segment, rounded up
    per = min(-(-even // align) * align, longest)
    return [*range(0, n, per), n]


def segment_count(n: int) -> int:
    """How many segments an array of ``n`` elements is summarized in (1: it is not cut)."""
    return len(_cuts(n)) - 1


def segmented(
    core: Callable[[Any], tuple[Any, ...]],
    x: Any,
    custom: Mapping[str, CustomStat] | None,
) -> tuple[Any, ...]:
    """``core(x)`` (traceable: counts, values, then any further parts) with the custom
    statistics of ``x`` inserted in its values (:func:`._summary.with_custom`), for an array
    of at most :data:`SEGMENT_ELEMENTS` elements; for a larger one, ``core`` of each
    segment of its flattened elements, each part stacked (``(segments, ...)``), every row's
    values with the custom statistics of the whole ``x``. :func:`merge_segments` joins the
    rows' vectors on the host."""
    cuts = _cuts(x.size)
    if len(cuts) == 2:
        parts = tuple(core(x))
    else:
        flat = jnp.ravel(x)
        rows = [tuple(core(flat[a:b])) for a, b in zip(cuts, cuts[1:])]
        parts = tuple(jnp.stack(p) for p in zip(*rows))
    if not custom:
        return parts
    return (*with_custom(DeviceSummary(*parts[:2]), x, custom), *parts[2:])


def is_segmented(counts_shape: tuple[int, ...]) -> bool:
    """Whether a summary of one array whose counts have this shape came in segments."""
    return len(counts_shape) == 2


def _custom_start(layout: Layout) -> int:
    """Where the custom statistics start among ``layout``'s extras (block formats' columns,
    which kernels compute, lead them)."""
    return len(BLOCK_COLUMNS) * len(block_formats_of(layout.extras))


def core_layout(layout: Layout) -> Layout:
    """``layout`` without its extras (custom statistics and block formats' columns): what a
    kernel's core summary holds (:func:`segmented` appends the custom statistics; the
    tracker appends the block formats' words of a whole array after them)."""
    return dataclasses.replace(layout, extras=())


def merge_segments(rows: np.ndarray, layout: Layout) -> np.ndarray:
    """The summary vector of an array from its segments' vectors (``rows``, one per
    segment, see :func:`segmented`), merged in float64. Custom statistics, computed of the
    whole array, are those of the first row (the tracker refuses block formats on an array
    summarized in segments, so their leading columns are not here)."""
    rows = np.asarray(rows, dtype=np.float64)
    out = merge_all(list(rows), layout)
    custom = slice(layout.extras_start + _custom_start(layout), layout.higher_start)
    out[custom] = rows[0, custom]
    return out
