"""Block-scaled formats (MXFP8, MXFP4, NVFP4): what quantizing a tensor into them would do.

A block-scaled format stores a tensor as small elements (E4M3, E5M2, E2M1) that share one
scale per *block* of consecutive values along the last dimension, so what underflows,
saturates or loses precision depends on each block's largest value, not on the tensor's
range. For each tracked tensor and each format ``f`` of the trackers' ``block_formats``
option, five ``scalar_stats`` columns say what the format would do:

``f.underflow``    non-zero finite values that become zero after scaling and rounding
``f.subnormal``    non-zero finite values whose rounded element is a non-zero subnormal
``f.saturated``    finite values whose scaled magnitude exceeds the element's largest
                   finite value (they are clamped to it)
``f.sq_err``       sum over finite values of (dequantized - x)**2
``f.block_range``  the largest log2(max |x| / min non-zero |x|) over the blocks (0 when
                   no block holds a non-zero finite value)

Definitions:

- Blocks are consecutive elements along the last dimension (the last block of a row is
  shorter where the row length is not a multiple of the block size); a 0-d or 1-d tensor
  is one row.
- MX (OCP Microscaling v1.0): blocks of 32, scale ``2**(floor(log2(max |x|)) - emax)``
  with emax 8 (E4M3), 15 (E5M2), 2 (E2M1); an all-zero block has scale 1. ``x / scale``
  is rounded to nearest-even into the element format, saturating at its largest finite
  value (448, 57344, 6).
- NVFP4: blocks of 16; a per-tensor float32 scale ``s_t = max |x| / (448 * 6)`` (1 for a
  tensor without a non-zero finite value); each block's scale ``s_b`` is
  ``(max |x| in block / 6) / s_t`` rounded to nearest-even into E4M3 (saturating at 448);
  elements ``x / (s_b * s_t)`` are rounded to nearest-even into E2M1, saturating at 6.
  All in float32 arithmetic in that order (``s_t``, ``amax_b / 6``, ``/ s_t``, the product
  ``s_b * s_t`` rounded to float32, the division); a block whose scale is zero counts each
  of its non-zero values as underflow. The dequantized value is ``q * (s_b * s_t)``.
  (A tensor whose largest magnitude is below ``2688 * 2**-149`` has ``s_t`` 0 in float32:
  its block scales are then ``448 * 0`` or, where ``amax_b / 6`` is 0 too, ``0 / 0``; both
  count as zero, so all its non-zero values underflow.)
- NaN and inf are left out of every count, of the error and of the block maxima.

Summaries carry the columns as custom statistics (:attr:`tandv.stats.summary.Layout.extras`)
that merge by their rule: counts and ``sq_err`` add, ``block_range`` takes the maximum.
:func:`block_stats` is the plain numpy reference (rounding by ``ml_dtypes``) every kernel
is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "BlockFormat",
    "BLOCK_FORMATS",
    "BLOCK_COLUMNS",
    "parse_block_formats",
    "block_extras",
    "block_formats_of",
    "block_stats",
]


@dataclass(frozen=True)
class BlockFormat:
    """One block-scaled format.

    Attributes:
        name: the option's name, e.g. ``"mxfp8_e4m3"``.
        block: elements per block.
        element: the ``ml_dtypes`` name of the element format.
        mantissa: mantissa bits of the element format.
        emin: exponent of the element format's smallest normal value.
        max: largest finite element value (saturation).
        emax: exponent of the element format's largest power of two (MX scale); ``None``
            for NVFP4, whose block scale is an E4M3 number.
    """

    name: str
    block: int
    element: str
    mantissa: int
    emin: int
    max: float
    emax: int | None

    @property
    def smallest_normal(self) -> float:
        """The element format's smallest normal value: below it, elements are subnormal."""
        return 2.0**self.emin


#: The block-scaled formats by name.
BLOCK_FORMATS: Mapping[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("mxfp8_e4m3", 32, "float8_e4m3fn", 3, -6, 448.0, 8),
        BlockFormat("mxfp8_e5m2", 32, "float8_e5m2", 2, -14, 57344.0, 15),
        BlockFormat("mxfp4_e2m1", 32, "float4_e2m1fn", 1, 0, 6.0, 2),
        BlockFormat("nvfp4", 16, "float4_e2m1fn", 1, 0, 6.0, None),
    )
}
#: The columns of each format, and how two observations' values merge.
BLOCK_COLUMNS: tuple[tuple[str, str], ...] = (
    ("underflow", "sum"),
    ("subnormal", "sum"),
    ("saturated", "sum"),
    ("sq_err", "sum"),
    ("block_range", "max"),
)


def parse_block_formats(spec: Any) -> tuple[str, ...]:
    """The trackers' ``block_formats`` option as a tuple of format names (in the order
    given, without repeats).

    Raises:
        TypeError: if ``spec`` is not a sequence of names (a lone string is accepted).
        ValueError: naming an unknown format, with the known ones.
    """
    if spec is None:
        return ()
    names = (spec,) if isinstance(spec, str) else spec
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"block_formats={spec!r}: expected a sequence of format names, e.g. "
            f"('mxfp8_e4m3', 'nvfp4')"
        )
    for n in names:
        if n not in BLOCK_FORMATS:
            raise ValueError(
                f"block_formats: unknown format {n!r}; the known ones are "
                f"{', '.join(BLOCK_FORMATS)}"
            )
    return tuple(dict.fromkeys(names))


def block_extras(names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """The summary extras (``(column, merge rule)`` pairs) of the formats ``names``: five
    per format, ``<format>.<column>`` in :data:`BLOCK_COLUMNS` order."""
    return tuple((f"{n}.{col}", rule) for n in names for col, rule in BLOCK_COLUMNS)


def block_formats_of(extras: Sequence[tuple[str, str]]) -> tuple[BlockFormat, ...]:
    """The block formats whose columns lead ``extras`` (a layout's custom statistics): the
    kernels compute those columns, the custom statistics that follow come from elsewhere."""
    out: list[BlockFormat] = []
    k = len(BLOCK_COLUMNS)
    while len(extras) >= k * (len(out) + 1):
        name = extras[k * len(out)][0].partition(".")[0]
        if name not in BLOCK_FORMATS or tuple(extras[k * len(out) : k * (len(out) + 1)]) != (
            block_extras([name])
        ):
            break
        out.append(BLOCK_FORMATS[name])
    return tuple(out)


# ------------------------------------------------------------------ the numpy reference


def _rows(x: Any, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as float64 rows of whole blocks ``(rows, blocks, block)`` (padded with NaN, which
    every statistic leaves out) and the mask of its finite values."""
    a = np.asarray(x)
    a = a.astype(np.float64).reshape(math.prod(a.shape[:-1]), a.shape[-1] if a.ndim else 1)
    rows, n = a.shape
    nb = -(-n // block)
    pad = np.full((rows, nb * block), np.nan)
    pad[:, :n] = a
    blocks = pad.reshape(rows, nb, block)
    return blocks, np.isfinite(blocks)


def _round(v: np.ndarray, f: BlockFormat) -> np.ndarray:
    """``v`` rounded to nearest-even into ``f``'s element format, saturating (float64)."""
    dtype = np.dtype(getattr(ml_dtypes, f.element))
    rounded: np.ndarray = np.clip(v, -f.max, f.max).astype(dtype)  # numpy's stubs: Any
    return rounded.astype(np.float64)


def block_stats(x: Any, name: str) -> dict[str, float]:
    """The five columns of format ``name`` for the array ``x`` (numpy reference, written
    from the definitions in this module's documentation; rounding by ``ml_dtypes``).

    Arguments:
        x: any array numpy can hold (float32, bfloat16, ...), any shape.
        name: a key of :data:`BLOCK_FORMATS`.

    Returns:
        ``{"underflow", "subnormal", "saturated", "sq_err", "block_range"}``: counts as
        floats, as the summary carries them.
    """
    f = BLOCK_FORMATS[name]
    blocks, fin = _rows(x, f.block)
    vals = np.where(fin, blocks, 0.0)
    mag = np.abs(vals)
    amax = mag.max(axis=-1, keepdims=True)
    nz = fin & (mag > 0)
    amin = np.where(nz, mag, np.inf).min(axis=-1, keepdims=True)
    has = nz.any(axis=-1)
    ratio = (amax / np.where(np.isfinite(amin), amin, 1.0))[..., 0]
    block_range = float(np.log2(ratio[has]).max()) if has.any() else 0.0
    if f.emax is not None:  # MX: a power-of-two scale per block
        e = np.frexp(np.where(amax > 0, amax, 1.0))[1] - 1  # exact floor(log2)
        scale = np.where(amax > 0, np.ldexp(1.0, e - f.emax), 1.0)
        y = vals / scale  # exact: a power of two
        sat = fin & (np.abs(y) > f.max)
        q = _round(y, f)
        deq = q * scale
    else:  # NVFP4, in float32 in the stated order
        f32 = np.float32
        amax_t = f32(mag.max()) if mag.size else f32(0)
        s_t = amax_t / f32(448.0 * 6.0) if amax_t > 0 else f32(1.0)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            u = (amax.astype(f32) / f32(6.0)) / s_t
        u = np.where(amax > 0, u, f32(0))
        s_b = np.clip(u.astype(np.float64), 0, 448.0).astype(ml_dtypes.float8_e4m3fn)
        scale = (s_b.astype(f32) * s_t).astype(f32)
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(scale > 0, vals.astype(f32) / np.where(scale > 0, scale, 1), 0)
        y = y.astype(np.float64)
        sat = fin & (np.abs(y) > f.max)
        q = _round(y, f)
        deq = np.where(scale > 0, q * scale.astype(np.float64), 0.0)
    qa = np.abs(q)
    return {
        "underflow": float((nz & (qa == 0)).sum()),
        "subnormal": float((nz & (qa > 0) & (qa < f.smallest_normal)).sum()),
        "saturated": float(sat.sum()),
        "sq_err": float(np.where(fin, (deq - vals) ** 2, 0.0).sum()),
        "block_range": block_range,
    }
