"""The fused summary kernel in Pallas: one read of an array for all of its summary.

:func:`._summary.summarize_jax` is a dozen XLA passes over the array and a histogram (a
scatter on the CPU, one-hot products elsewhere). This kernel reads each element once. The
grid is one program per chunk of consecutive elements (:func:`chunk_size`: a multiple of
:data:`BLOCK`, at least :data:`MIN_READ_PER_WRITE` times the bytes of the rows a program
writes, otherwise enough chunks for :data:`TARGET_PROGRAMS` programs). A program loops over
its chunk :data:`BLOCK` elements at a time (reads past the end of the array masked) and
keeps, per lane of the block, in registers:

- NaN, inf and zero counts, and the extrema as bit patterns (the order-preserving keys of
  the smallest and largest finite value, the bits of the smallest and largest finite
  magnitude): integer reductions are exact where float ones are not (XLA:CPU, which runs
  the kernel in interpret mode, flushes subnormals in float arithmetic);
- moments of the lane's values times ``2**k``, ``k`` from the lane's largest magnitude so
  far (so ``|x| * 2**k < 2`` and ``x**8`` cannot overflow): the count, sums of the
  differences from a shift that follows the lane's mean (and of their squares), and the
  power sums of ``|x|``; when a larger magnitude arrives the state moves to the new scale
  by exact powers of two;

and, for the whole block, the exponent counts as the product of two one-hot matrices (the
bin index split into a low and a high part, ``onehot(low)^T @ onehot(high)``, int8 factors
and int32 accumulation): no scatter, no atomics, exact. After the loop the lanes reduce to
one row per output: ``ints`` (counts and extrema), ``hist`` (16 x high exponent counts) and
``moments`` (the program's scale ``k`` from its largest magnitude, the lanes merged at that
scale by Chan's formula).

A small XLA epilogue merges the rows into the :class:`._summary.DeviceSummary` layout:
counts add, extrema reduce, and the moments are brought from each program's scale to the
array's (factors ``2**(K - k)``, exact powers of two) and merged by Chan's formula.

Small arrays of one dtype that each fill one program of the same chunk can share one
grid (:func:`pallas_summaries`: a program per array, its size read from an input rather
than fixed in the program) and one epilogue vectorized over them: the same rows as their
own calls, in one kernel rather than one per array (each kernel is a program to compile:
about a second apiece on XLA:CPU when interpreted).

Values are rescaled in the integer domain (``|x| = m * 2**(e - 23)`` rebuilt as
``float(m) * 2**(e - 23 + k)``), so subnormal inputs count exactly on any backend, and
exponents are read without ``clz`` (subnormals: from ``float(m)``'s exponent field), which
keeps the kernel within what Pallas lowers to Triton.

Why this shape (figures from ``tests/test_jax_gpu_compile.py``: the kernel lowered for CUDA
on a machine without a GPU and its Triton module compiled for sm_90 by the pip triton; no
GPU has run it): one program per 2048 elements, each with 2048 x high one-hot matrices in
float32, spilled 56-3336 bytes of stack per thread (bfloat16 and float16 at the cap of 255
registers), and its rows (a 2 KiB histogram per 8 KiB of float32 or 4 KiB of bfloat16) were
26-52% of the bytes it read. Chunks of many 128-element blocks, per-lane state, int8
factors and the low part as the product's 16 rows (one operand of 16 x 128 per warp) use
64-79 registers and no stack for float32, bfloat16 and float16 arrays (254 for the float64
format's histogram of 16 x 256, still no stack), and the rows are 0.6-1.6% of the input's
bytes at 1M elements and more.

On accelerators the kernel is compiled by Pallas (Triton on GPUs); on the CPU it runs with
``interpret=True`` (the same kernel as an XLA loop over the grid), which is how CI tests it
against the numpy reference. float64 arrays are not handled here (the XLA path serves them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ...stats.blocks import BlockFormat, block_formats_of
from ...stats.formats import NumberFormat
from ...stats.summary import N_CORE_VALUES, POWERS, VALUE_INDEX, Layout, pack_parts, unpack_fields
from ._blocks import (  # the float32 bit helpers serve both the XLA and the Pallas code
    _BIAS,
    _MASK,
    _MB,
    INT_WORDS,
    _bits,
    _float,
    _floor_log2,
    _pow2,
    block_partials,
    check_blockable,
    finish,
    merge_partials,
    merge_two,
    tensor_scale,
    with_words,
)
from ._summary import DeviceSummary, check_countable

__all__ = [
    "BLOCK",
    "KERNEL_DTYPES",
    "Fp8Code",
    "chunk_size",
    "fp8_code",
    "pallas_blocks",
    "pallas_summaries",
    "pallas_summary",
    "program_extent",
]

#: Elements a program reads per pass of its loop (a sub-block of its chunk).
BLOCK = 128
#: Programs the grid aims at where the array is large enough (four per SM of an H100).
TARGET_PROGRAMS = 4 * 132
#: A program reads at least this many times the bytes of the rows it writes.
MIN_READ_PER_WRITE = 64
#: Warps per program on GPUs.
NUM_WARPS = 4
#: Input dtypes the kernel reads in their own type; 8-bit floats are read as their raw codes
#: (:func:`fp8_code`), others are widened to float32 first.
KERNEL_DTYPES = frozenset({np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)})
_INF = 0x7F800000
_QNAN = 0x7FC00000
_KEY_NINF = int(np.int32(np.array(-np.inf, np.float32).view(np.int32) ^ _MASK))  # order key of -inf
_LOW = 16  # width of the low part of a bin index
_NO_SCALE = 2 * (_BIAS + _MB)  # a lane's scale exponent before its first non-zero value
_ONEHOT = jnp.int8  # one-hot factors: 0 and 1 exact, products accumulate in int32
#: The columns of a program's rows of partials (each padded to 8 by :func:`_row`): counts
#: and extrema as integers (order keys, magnitude bits), and the program's scale exponent and
#: moments of its values times ``2**k``. The epilogue reads them by name.
_INT_COLUMNS = ("nan", "inf", "zero", "finite", "key_min", "key_max", "mag_min", "mag_max")
_MOMENT_COLUMNS = ("k", "mean", "m2", "p1", "p2", "p4", "p8")
#: With ``moments=4``: the program's third and fourth centred sums too (a row of 16).
#: ``mean_lo``: the program's mean less its float32 ``mean``, from the lanes' shifts and
#: residues (a float32 mean is off by up to half its last bit, far beyond the spread when the
#: mean dominates; the third moment's merge needs the means' differences to the spread's
#: precision).
_HIGHER_COLUMNS = (*_MOMENT_COLUMNS, "m3", "m4", "mean_lo")


def _order_key(b: Any) -> Any:
    """Involution mapping float32 bits to an int32 whose order is the floats' order."""
    return b ^ ((b >> 31) & _MASK)


def _scale(amax: Any) -> Any:
    """The exponent ``k`` with ``amax * 2**k`` in ``[1, 2)`` (0 where ``amax`` is 0), of the
    bits ``amax`` of a finite magnitude."""
    return jnp.where(amax > 0, -_floor_log2(jnp.maximum(amax, 1)), 0)


def _rescaled(m: Any, k: Any) -> Any:
    """``|x| * 2**k`` of the magnitude bits ``m``, built in the integer domain (normal
    numbers only, so no flush of subnormal inputs)."""
    efield = m >> _MB
    normal = efield > 0
    e = jnp.where(normal, efield - _BIAS, 1 - _BIAS)
    full = jnp.where(normal, (m & ((1 << _MB) - 1)) | (1 << _MB), m)
    return full.astype(jnp.float32) * _pow2(e - _MB + k)


def _row(values: list[Any], dtype: Any, width: int = 8, interpret: bool = False) -> Any:
    """The scalars ``values`` as one vector of ``width``: built by selection for Triton
    (which has no stack), as one concatenation where Pallas interprets the kernel (XLA
    would copy the chain of selections into each reader of a column: a fifth of the
    interpreted kernel's optimized program)."""
    if interpret:
        pad = jnp.zeros((width - len(values),), dtype)
        return jnp.concatenate([jnp.stack([v.astype(dtype) for v in values]), pad])
    lane = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
    out = jnp.zeros((width,), dtype)
    for j, v in enumerate(values):
        out = jnp.where(lane == j, v.astype(dtype), out)
    return out


@dataclass(frozen=True)
class Fp8Code:
    """How an 8-bit float format's codes decode to float32 bits, in integer arithmetic the
    kernel runs on the raw bytes (no float32 copy of the array): sign in bit 7, then the
    exponent field, ``nmant`` mantissa bits, exponent ``bias``; the magnitude code of
    infinity (or None), the first magnitude code that is NaN (or None), and whether the
    code of -0 is NaN (the ``fnuz`` formats). Read off ml_dtypes' own decoding of all 256
    codes by :func:`fp8_code`."""

    nmant: int
    bias: int
    inf_code: int | None
    nan_from: int | None
    nan_negzero: bool


def _decode_fp8(b: Any, code: Fp8Code, xp: Any = jnp) -> Any:
    """float32 bits (int32) of the 8-bit float codes ``b`` (int32 in [0, 256)): normal
    numbers by moving the fields, subnormals as ``m * 2**(1 - bias - nmant)`` (exact: a
    normal float32), then the special codes. ``xp``: jnp in the kernel, numpy to check the
    decoding against ml_dtypes."""
    i32 = xp.int32
    sign = (b >> 7) * i32(-(2**31))
    mag = b & 0x7F
    e = mag >> code.nmant
    m = mag & ((1 << code.nmant) - 1)
    normal = ((e - code.bias + _BIAS) << _MB) | (m << (_MB - code.nmant))
    tiny = xp.float32(2.0 ** (1 - code.bias - code.nmant))
    sub = (
        (m.astype(xp.float32) * tiny).view(i32) if xp is np else _bits(m.astype(jnp.float32) * tiny)
    )
    bits = xp.where(e > 0, normal, sub) | sign
    if code.inf_code is not None:
        bits = xp.where(mag == code.inf_code, sign | _INF, bits)
    if code.nan_from is not None:
        bits = xp.where(mag >= code.nan_from, i32(_QNAN), bits)
    if code.nan_negzero:
        bits = xp.where(b == 0x80, i32(_QNAN), bits)
    return bits.astype(i32)


@cache
def fp8_code(dtype: Any) -> Fp8Code | None:
    """The :class:`Fp8Code` of an 8-bit float dtype, or None (not an 8-bit float, or one
    whose codes the arithmetic of :func:`_decode_fp8` does not reproduce bit for bit:
    ``float8_e8m0fnu`` has no sign bit). Checked here on all 256 codes against ml_dtypes'
    conversion to float32 (NaNs as NaNs, zeros with their sign)."""
    dtype = np.dtype(dtype)
    if dtype.itemsize != 1 or not jnp.issubdtype(dtype, jnp.floating):
        return None
    import ml_dtypes

    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(dtype).astype(np.float32)
    nmant = int(ml_dtypes.finfo(dtype).nmant)
    smallest_normal = float(want[1 << nmant])
    if not 0 < smallest_normal < np.inf:
        return None
    mags = np.arange(128)
    nans = mags[np.isnan(want[:128])]
    infs = mags[np.isinf(want[:128])]
    code = Fp8Code(
        nmant=nmant,
        bias=1 - int(np.log2(smallest_normal)),
        inf_code=int(infs[0]) if len(infs) == 1 else None,
        nan_from=int(nans.min()) if len(nans) else None,
        nan_negzero=bool(np.isnan(want[0x80])),
    )
    got = _decode_fp8(codes.astype(np.int32), code, np).view(np.float32)
    same = (np.isnan(got) & np.isnan(want)) | (got.view(np.int32) == want.view(np.int32))
    return code if same.all() else None


def program_extent(n: int, chunk: int) -> tuple[int, int]:
    """``(programs, tail)``: how many programs of ``chunk`` elements cover ``n`` elements,
    and how many elements the last one reads (the others read ``chunk``). Python integers,
    exact for any ``n``: the kernel masks its reads by ``tail`` and its own offsets into
    the chunk, so no value in it grows with the array (``program_id * chunk``, or ``n``,
    would pass 2**31 before the array does in elements times ``chunk``)."""
    programs = max(1, -(-n // chunk))
    return programs, n - (programs - 1) * chunk


def _kernel(
    x_ref: Any,
    ints_ref: Any,
    hist_ref: Any,
    moments_ref: Any,
    *,
    last: int,
    tail: int,
    chunk: int,
    **body: Any,
) -> None:
    """One program of one array's grid: its chunk of ``chunk`` elements (``tail`` for the
    program ``last``) into one row of each output (:func:`_program`)."""
    # elements of this chunk to read: offsets into the chunk only, never into the array
    limit = chunk - (pl.program_id(0) == last).astype(jnp.int32) * (chunk - tail)
    _program(x_ref, ints_ref, hist_ref, moments_ref, limit, chunk=chunk, **body)


def _shared_kernel(
    x_ref: Any, size_ref: Any, ints_ref: Any, hist_ref: Any, moments_ref: Any, **body: Any
) -> None:
    """One program of :func:`pallas_summaries`' grid: one whole small array, a row of the
    stacked input, whose size is in its row of ``size_ref`` (16 copies: a vector load)."""
    _program(x_ref, ints_ref, hist_ref, moments_ref, jnp.max(size_ref[...]), **body)


class _Lanes(NamedTuple):
    """One pass of a program's loop, lane by lane: which of its :data:`BLOCK` elements are
    read (``valid``), their float32 bits and magnitude bits, and their class."""

    valid: Any
    bits: Any
    mag: Any
    nan: Any
    inf: Any
    fin: Any
    nonzero: Any


def _lanes(x_ref: Any, start: Any, valid: Any, fp8: Fp8Code | None) -> _Lanes:
    """The :data:`BLOCK` elements from ``start`` (those not ``valid`` masked: the last
    program reads past the end), as float32 bits (8-bit floats decoded from their codes)."""
    x = plt.load(x_ref.at[pl.ds(start, BLOCK)], mask=valid, other=0)
    bits = _bits(x.astype(jnp.float32)) if fp8 is None else _decode_fp8(x.astype(jnp.int32), fp8)
    mag = bits & _MASK
    nan = valid & (mag > _INF)
    inf = valid & (mag == _INF)
    fin = valid & (mag < _INF)
    return _Lanes(valid, bits, mag, nan, inf, fin, fin & (mag != 0))


def _count_lanes(ints: tuple[Any, ...], v: _Lanes) -> tuple[Any, ...]:
    """Each lane's NaN, inf and zero counts and its extrema (order keys of the finite
    values, bits of their magnitudes) with the pass ``v`` added."""
    nan_n, inf_n, zero_n, key_lo, key_hi, mag_lo, mag_hi = ints
    key = _order_key(v.bits)
    return (
        nan_n + v.nan.astype(jnp.int32),
        inf_n + v.inf.astype(jnp.int32),
        zero_n + (v.fin & (v.mag == 0)).astype(jnp.int32),
        jnp.minimum(key_lo, jnp.where(v.fin, key, _INF)),
        jnp.maximum(key_hi, jnp.where(v.fin, key, _KEY_NINF)),
        jnp.minimum(mag_lo, jnp.where(v.fin, v.mag, _INF)),
        jnp.maximum(mag_hi, jnp.where(v.fin, v.mag, 0)),
    )


def _moment_lanes(moments: tuple[Any, ...], v: _Lanes, e: Any, higher: bool) -> tuple[Any, ...]:
    """Each lane's moments with the pass ``v`` added (``e``: the floor of the values'
    log2), on the lane's scale ``2**k`` from its largest magnitude so far.

    The sums of the values' differences from a shift c and of their squares, and the power
    sums of |x|. The state moves to a new scale by exact powers of two, and c to the lane's
    first value, then to its mean before each value by the exact move rounding allows (the
    residue stays in s1): s1 stays small beside the spread, and s2 - s1**2 / n does not
    cancel, whatever the values' offset (Welford's update loses the spread of values that
    vary only in their last bits, about 2% of the deviation of 1000 + N(0, 1e-3) in
    float32). With ``higher``, the sums of cubes and fourth powers too."""
    count, k, c, s1, s2, *powers = moments[:9]
    k_new = jnp.where(v.nonzero, jnp.minimum(k, -e), k)
    r = _pow2(k_new - k)
    xs = jnp.where(v.fin, _rescaled(v.mag, k_new), 0.0)
    xs = jnp.where(v.bits < 0, -xs, xs)
    c = c * r
    s1 = s1 * r
    s2 = s2 * (r * r)
    n_old = count.astype(jnp.float32)
    c_new = jnp.where(count == 0, xs, c + s1 / jnp.maximum(n_old, 1.0))
    h = c_new - c  # exact (c_new is c or near it), or times n_old = 0
    nh = n_old * h
    if higher:  # the sums of cubes and fourth powers about c_new (binomially)
        s3, s4 = moments[9] * (r * r * r), moments[10] * (r * r * (r * r))
        s4 = s4 - h * (4.0 * s3 - h * (6.0 * s2 - h * (4.0 * s1 - nh)))
        s3 = s3 - h * (3.0 * s2 - h * (3.0 * s1 - nh))
    s2 = s2 - 2.0 * h * s1 + nh * h
    s1 = s1 - nh
    c = c_new
    d = jnp.where(v.fin, xs - c, 0.0)
    s1 = s1 + d
    d2 = d * d
    s2 = s2 + d2
    count = count + v.fin.astype(jnp.int32)
    u = jnp.abs(xs)
    u2 = u * u
    u4 = u2 * u2
    powers = [
        s * _pow2(p * (k_new - k)) + w for p, s, w in zip(POWERS, powers, (u, u2, u4, u4 * u4))
    ]
    out = (count, k_new, c, s1, s2, *powers)
    if higher:
        out = (*out, s3 + d2 * d, s4 + d2 * d2)
    return out


def _bin_index(
    v: _Lanes, e: Any, *, nbins: int, min_exponent: int, under_bits: int, over_bits: int
) -> Any:
    """Each lane's exponent bin: 0 underflow, ``nbins - 1`` overflow, ``nbins`` dropped
    (zeros, NaN, padding)."""
    over = v.valid & ~v.nan & ((v.mag > over_bits) | v.inf)
    under = v.nonzero & ~over & (v.mag < under_bits)
    idx = jnp.clip(e - min_exponent + 1, 1, nbins - 2)
    idx = jnp.where(under, 0, idx)
    idx = jnp.where(over, nbins - 1, idx)
    return jnp.where(v.nonzero | over, idx, nbins)


def _int_row(ints: tuple[Any, ...], count: Any) -> dict[str, Any]:
    """The program's counts and extrema (:data:`_INT_COLUMNS`) from its lanes' (``count``:
    each lane's finite values)."""
    amax = jnp.max(ints[6])
    n_fin = jnp.sum(count)
    return {
        "nan": jnp.sum(ints[0]),
        "inf": jnp.sum(ints[1]),
        "zero": jnp.sum(ints[2]),
        "finite": n_fin,
        "key_min": jnp.min(ints[3]),
        "key_max": jnp.max(ints[4]),
        "mag_min": jnp.min(ints[5]),
        "mag_max": amax,
    }


def _moment_row(moments: tuple[Any, ...], amax: Any, n_fin: Any, higher: bool) -> dict[str, Any]:
    """The program's moments (:data:`_MOMENT_COLUMNS`, with ``higher``
    :data:`_HIGHER_COLUMNS`): its lanes' merged at the program's scale (from ``amax``, the
    bits of its largest magnitude) by Chan's formula."""
    count, k, c, s1, s2, *powers = moments[:9]
    big_k = _scale(amax)
    has = count > 0
    lane_n = jnp.maximum(count, 1).astype(jnp.float32)
    mean = c + s1 / lane_n
    m2 = s2 - s1 * s1 / lane_n
    r = jnp.where(has, _pow2(jnp.minimum(big_k - k, 0)), 0.0)
    means = mean * r
    lane_c = count.astype(jnp.float32)
    mean_p = jnp.sum(lane_c * means) / jnp.maximum(n_fin, 1).astype(jnp.float32)
    dev = jnp.where(has, means - mean_p, 0.0)
    out = {
        "k": big_k,
        "mean": mean_p,
        "m2": jnp.sum(m2 * (r * r)) + jnp.sum(lane_c * dev * dev),
        **{
            f"p{p}": jnp.sum(jnp.where(has, s * _pow2(jnp.minimum(p * (big_k - k), 0)), 0.0))
            for p, s in zip(POWERS, powers)
        },
    }
    if higher:  # the lanes' centred sums (about their means), then shifted to the program's
        e = s1 / lane_n
        s3, s4 = moments[9], moments[10]
        m3 = s3 - e * (3.0 * s2 - 2.0 * s1 * e)
        m4 = s4 - e * (4.0 * s3 - e * (6.0 * s2 - 3.0 * s1 * e))
        # the lanes' means less the program's from their shifts and residues (shifts near
        # the float32 mean subtract exactly), then less their weighted mean: the program's
        # own rounding, mean_lo
        lo, dev_h = _recentred(lane_c, has, c * r - mean_p, e * r, n_fin)
        out["m3"], out["m4"] = _shifted(lane_c, dev_h, m2 * (r * r), m3 * r**3, m4 * r**4)
        out["mean_lo"] = lo
        out["m2"] = jnp.sum(m2 * (r * r)) + jnp.sum(lane_c * dev_h * dev_h)  # likewise
    return out


def _program(
    x_ref: Any,
    ints_ref: Any,
    hist_ref: Any,
    moments_ref: Any,
    limit: Any,
    *,
    chunk: int,
    nbins: int,
    high: int,
    min_exponent: int,
    under_bits: int,
    over_bits: int,
    fp8: Fp8Code | None,
    higher: bool,
    interpret: bool,
) -> None:
    """One program's body: the first ``limit`` elements of its chunk of ``chunk``,
    :data:`BLOCK` at a time (the loop runs ``chunk / BLOCK`` times, reads from ``limit`` on
    masked), into one row of each output (see the module docstring): per lane, counts and
    extrema (:func:`_count_lanes`) and moments (:func:`_moment_lanes`), and for the block
    the exponent counts (:func:`_bin_index`), then the lanes reduced to the rows
    (:func:`_int_row`, :func:`_moment_row`).
    ``fp8``: the input holds the raw codes of an 8-bit float format, decoded here.
    ``higher`` (``moments=4``): each lane also sums the cubes and fourth powers of its
    differences from its shift, moved with the shift binomially, and the moments row ends
    with the program's ``m3``, ``m4``. ``interpret``: Pallas interprets the kernel (see
    :func:`_row`)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
    lows = jax.lax.broadcasted_iota(jnp.int32, (_LOW, BLOCK), 0)
    highs = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, high), 1)
    bins = {
        "nbins": nbins,
        "min_exponent": min_exponent,
        "under_bits": under_bits,
        "over_bits": over_bits,
    }

    def step(j: Any, state: tuple[Any, ...]) -> tuple[Any, ...]:
        ints, moments, table = state
        start = pl.multiple_of(j * BLOCK, BLOCK)
        v = _lanes(x_ref, start, start + lane < limit, fp8)
        ints = _count_lanes(ints, v)
        e = _floor_log2(jnp.maximum(v.mag, 1))
        moments = _moment_lanes(moments, v, e, higher)
        # the exponent counts as onehot(low)^T @ onehot(high): with the 16 low values as
        # the product's rows, each warp holds one 16 x BLOCK operand (with the high part as
        # rows, one per 16 of them: the float64 format's 256 spilled)
        idx = _bin_index(v, e, **bins)
        lo_t = ((idx % _LOW)[None, :] == lows).astype(_ONEHOT)
        hi = ((idx // _LOW)[:, None] == highs).astype(_ONEHOT)
        table = table + jnp.dot(lo_t, hi, preferred_element_type=jnp.int32)
        return ints, moments, table

    zeros = jnp.zeros((BLOCK,), jnp.int32)
    fzeros = jnp.zeros((BLOCK,), jnp.float32)
    ints0 = (zeros, zeros, zeros, zeros + _INF, zeros + _KEY_NINF, zeros + _INF, zeros)
    moments0 = (zeros, zeros + _NO_SCALE, *([fzeros] * (9 if higher else 7)))
    table0 = jnp.zeros((_LOW, high), jnp.int32)
    ints, moments, table = jax.lax.fori_loop(0, chunk // BLOCK, step, (ints0, moments0, table0))
    row = _int_row(ints, moments[0])
    ints_ref[...] = _row([row[c] for c in _INT_COLUMNS], jnp.int32, interpret=interpret)
    out = _moment_row(moments, row["mag_max"], row["finite"], higher)
    columns = _HIGHER_COLUMNS if higher else _MOMENT_COLUMNS
    moments_ref[...] = _row([out[c] for c in columns], jnp.float32, 16 if higher else 8, interpret)
    hist_ref[...] = table


def _recentred(n: Any, has: Any, head: Any, tail: Any, total: Any) -> tuple[Any, Any]:
    """``(lo, dev)`` of parts (vectors; ``has``: the part holds values) whose means are a
    float32 mean ``M`` plus ``head + tail`` (``head`` exact: a shift less ``M``, ``tail`` a
    small residue): ``lo``, the parts' weighted mean less ``M``, and ``dev``, each part's
    mean less the weighted one, both to the residues' precision."""
    raw = jnp.where(has, head + tail, 0.0)
    lo = jnp.sum(n * raw) / jnp.maximum(total, 1).astype(jnp.float32)
    return lo, jnp.where(has, raw - lo, 0.0)


def _shifted(n: Any, dev: Any, m2: Any, m3: Any, m4: Any) -> tuple[Any, Any]:
    """The third and fourth centred sums of parts (vectors: counts ``n``, means ``dev`` from
    the total's mean, centred sums ``m2 .. m4``, one scale) together: each part's sums
    shifted to the total's mean (binomially; its own first centred sum is 0)."""
    m3t = jnp.sum(m3 + dev * (3.0 * m2 + n * dev * dev))
    m4t = jnp.sum(m4 + dev * (4.0 * m3 + dev * (6.0 * m2 + n * dev * dev)))
    return m3t, m4t


def chunk_size(n: int, itemsize: int, high: int) -> int:
    """Elements per program for an array of ``n`` elements of ``itemsize`` bytes and a
    histogram of ``high`` x 16 counts: a multiple of :data:`BLOCK`, large enough that a
    program reads :data:`MIN_READ_PER_WRITE` times the bytes of the rows it writes (the
    epilogue reads them back: traffic beside the one read of the array), and otherwise
    small enough for :data:`TARGET_PROGRAMS` programs; one program for a small array."""
    row_bytes = 4 * (8 + high * _LOW + 8)
    floor = -(-MIN_READ_PER_WRITE * row_bytes // itemsize)
    spread = -(-n // TARGET_PROGRAMS)
    chunk = min(max(floor, spread), max(n, 1))
    return -(-chunk // BLOCK) * BLOCK


def _bits_of(value: float) -> int:
    with np.errstate(over="ignore", under="ignore"):
        return int(np.array(value, np.float32).view(np.int32))


def _high(nbins: int) -> int:
    """Rows of the histogram's table: bins plus the dropped one, as ``high x _LOW`` with
    ``high >= 16`` (Triton's smallest dot), a power of two."""
    high = max(16, -(-(nbins + 1) // _LOW))
    return 1 << (high - 1).bit_length()


def _kernel_input(x: Any) -> Any:
    """``x`` flattened as the kernel reads it: 8-bit floats as their raw codes (a bitcast:
    no copy; decoded in the kernel), dtypes outside :data:`KERNEL_DTYPES` as float32."""
    flat = jnp.ravel(x)
    if fp8_code(flat.dtype) is not None:
        return jax.lax.bitcast_convert_type(flat, jnp.uint8)
    if np.dtype(flat.dtype) not in KERNEL_DTYPES:
        return flat.astype(jnp.float32)
    return flat


def _body(
    fmt: NumberFormat, nbins: int, dtype: Any, higher: bool, interpret: bool
) -> dict[str, Any]:
    """The static arguments of :func:`_program` but ``chunk``, for arrays of ``dtype`` (before
    :func:`_kernel_input`: 8-bit floats are decoded in the kernel)."""
    return {
        "fp8": fp8_code(dtype),
        "nbins": nbins,
        "high": _high(nbins),
        "min_exponent": fmt.min_exponent,
        "under_bits": _bits_of(fmt.underflow_threshold),
        "over_bits": _bits_of(fmt.overflow_threshold),
        "higher": higher,
        "interpret": interpret,
    }


def _call(
    kernel: Any,
    inputs: list[Any],
    in_specs: list[Any],
    programs: int,
    high: int,
    higher: bool,
    interpret: bool,
) -> tuple[Any, Any, Any]:
    """The kernel's grid of ``programs``, each writing its row of ``ints``, ``hist`` and
    ``moments`` (16 wide with ``higher``)."""
    width = 16 if higher else 8
    ints, hist, moments = pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, 8), lambda i: (i, 0)),
            pl.BlockSpec((None, _LOW, high), lambda i: (i, 0, 0)),
            pl.BlockSpec((None, width), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((programs, 8), jnp.int32),
            jax.ShapeDtypeStruct((programs, _LOW, high), jnp.int32),
            jax.ShapeDtypeStruct((programs, width), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=NUM_WARPS),
    )(*inputs)
    return ints, hist, moments


@partial(jax.jit, static_argnames=("fmt", "num_counts", "interpret", "higher"))
def _summary(
    x: Any, fmt: NumberFormat, num_counts: int, interpret: bool, higher: bool
) -> tuple[Any, Any]:
    flat = _kernel_input(x)
    body = _body(fmt, num_counts, x.dtype, higher, interpret)
    n = flat.shape[0]
    chunk = chunk_size(n, flat.dtype.itemsize, body["high"])
    programs, tail = program_extent(n, chunk)
    kernel = partial(_kernel, last=programs - 1, tail=tail, chunk=chunk, **body)
    ints, hist, moments = _call(
        kernel,
        [flat if n else jnp.zeros(1, flat.dtype)],
        [pl.BlockSpec((chunk,), lambda i: (i,))],
        programs,
        body["high"],
        higher,
        interpret,
    )
    return _merge_blocks(ints, hist, moments, n, num_counts, higher)


@partial(jax.jit, static_argnames=("fmt", "num_counts", "interpret", "higher"))
def _shared_summaries(
    arrays: list[Any], fmt: NumberFormat, num_counts: int, interpret: bool, higher: bool
) -> list[tuple[Any, Any]]:
    """:func:`_summary` of several arrays of one dtype that each fill one program of the
    same chunk: one grid, a program per array (its row of the stacked, zero-padded input,
    read up to the array's size), the same rows as each array's own grid, merged per
    array."""
    flats = [_kernel_input(a) for a in arrays]
    body = _body(fmt, num_counts, arrays[0].dtype, higher, interpret)
    sizes = [f.shape[0] for f in flats]
    chunk = chunk_size(max(sizes), flats[0].dtype.itemsize, body["high"])
    stacked = jnp.stack([jnp.pad(f, (0, chunk - f.shape[0])) for f in flats])
    size_rows = jnp.broadcast_to(jnp.asarray(sizes, jnp.int32)[:, None], (len(sizes), 16))
    ints, hist, moments = _call(
        partial(_shared_kernel, chunk=chunk, **body),
        [stacked, size_rows],
        [pl.BlockSpec((None, chunk), lambda i: (i, 0)), pl.BlockSpec((None, 16), lambda i: (i, 0))],
        len(flats),
        body["high"],
        higher,
        interpret,
    )
    # the epilogue of each array (one row each) as one vectorized program: written out per
    # array it was most of the program (24 arrays: 18,000 lines of optimized HLO, not 4,300)
    merge = jax.vmap(partial(_merge_blocks, nbins=num_counts, higher=higher))
    counts, values = merge(ints[:, None], hist[:, None], moments[:, None], size_rows[:, 0])
    return [(counts[i], values[i]) for i in range(len(sizes))]


def _merge_blocks(
    ints: Any, hist: Any, moments: Any, n: Any, nbins: int, higher: bool = False
) -> tuple[Any, Any]:
    """The summary's counts and values from the per-program rows (XLA, small arrays) of
    an array of ``n`` elements; with ``higher``, the values end with ``m3``, ``m4``."""
    col = unpack_fields(ints, _INT_COLUMNS)
    mom = unpack_fields(moments, _HIGHER_COLUMNS if higher else _MOMENT_COLUMNS)
    n_nan, n_inf, n_zero, n_fin = (jnp.sum(col[c]) for c in ("nan", "inf", "zero", "finite"))
    has = n_fin > 0
    kmin = jnp.where(has, jnp.min(col["key_min"]), _INF)
    kmax = jnp.where(has, jnp.max(col["key_max"]), _KEY_NINF)
    amin = jnp.where(has, jnp.min(col["mag_min"]), _INF)
    amax = jnp.where(has, jnp.max(col["mag_max"]), 0)
    s = _float(amax)
    big_k = jnp.where(amax > 0, -_floor_log2(jnp.maximum(amax, 1)), 0)
    s_scaled = jnp.where(amax > 0, _rescaled(amax, big_k), 1.0)  # s * 2**K, in [1, 2)
    nb = col["finite"].astype(jnp.float32)
    # each block's moments from its scale 2**k to the array's 2**K (K <= k): exact powers of two
    r = jnp.where(col["finite"] > 0, _pow2(jnp.minimum(big_k - mom["k"].astype(jnp.int32), 0)), 0.0)
    nf = jnp.maximum(n_fin, 1).astype(jnp.float32)
    means = mom["mean"] * r
    mean_k = jnp.sum(nb * means) / nf
    dev = jnp.where(col["finite"] > 0, means - mean_k, 0.0)
    m2 = (jnp.sum(mom["m2"] * r * r) + jnp.sum(nb * dev * dev)) / (s_scaled * s_scaled)
    powers = [jnp.sum(mom[f"p{p}"] * r**p) / s_scaled**p for p in POWERS]
    bins = jnp.sum(hist, axis=0).T.reshape(-1)[:nbins]
    core = {
        "numel": jnp.asarray(n, jnp.int32),
        "nan_count": n_nan,
        "inf_count": n_inf,
        "zero_count": n_zero,
        "min": _float(_order_key(kmin)),
        "max": _float(_order_key(kmax)),
        "min_abs": _float(amin),
        "max_abs": s,
        "mean": mean_k / s_scaled * s,
        "m2": m2,
        **{f"p{p}": v for p, v in zip(POWERS, powers)},
    }
    if not higher:
        return pack_parts(core, bins, xp=jnp)
    # the programs' means less mean_k to their residues' precision (see _HIGHER_COLUMNS)
    part = col["finite"] > 0
    _, dev_h = _recentred(nb, part, mom["mean"] * r - mean_k, mom["mean_lo"] * r, n_fin)
    m3, m4 = _shifted(nb, dev_h, mom["m2"] * r * r, mom["m3"] * r**3, mom["m4"] * r**4)
    m2_h = jnp.sum(mom["m2"] * r * r) + jnp.sum(nb * dev_h * dev_h)
    core["m2"] = m2_h / (s_scaled * s_scaled)  # likewise
    higher_sums = jnp.stack([m3 / s_scaled**3, m4 / s_scaled**4])
    return pack_parts(core, bins, higher_sums, xp=jnp)


def pallas_summary(
    x: Any, fmt: NumberFormat, num_counts: int, interpret: bool | None = None, moments: int = 2
) -> DeviceSummary:
    """The core summary of ``x`` (any float dtype but float64) for format ``fmt`` by the
    fused kernel (traceable); :func:`._summary.to_vector` of it equals
    ``tandv.stats.summarize(x, fmt, moments=moments)`` (counts, extrema and exponent counts
    exactly, moments to float32 rounding). Its ``values`` hold the core fields, then with
    ``moments=4`` ``m3``, ``m4`` (:func:`._summary.with_custom` puts custom statistics
    before them). ``interpret``: run Pallas's interpreter (default: on the CPU)."""
    check_countable(x)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return DeviceSummary(*_summary(x, fmt, num_counts, interpret, moments == 4))


def _own_chunk(x: Any, num_counts: int) -> int | None:
    """The chunk of :func:`_summary`'s grid for ``x`` where that grid is one program (the
    array fits its chunk), else None."""
    dtype = np.dtype(x.dtype)
    # the bytes of an element as the kernel reads it (see _kernel_input)
    itemsize = dtype.itemsize if fp8_code(dtype) is not None or dtype in KERNEL_DTYPES else 4
    chunk = chunk_size(x.size, itemsize, _high(num_counts))
    return chunk if program_extent(x.size, chunk)[0] == 1 else None


def pallas_summaries(
    arrays: list[Any],
    fmt: NumberFormat,
    num_counts: int,
    interpret: bool | None = None,
    moments: int = 2,
) -> list[DeviceSummary]:
    """:func:`pallas_summary` of each of ``arrays`` (one dtype; traceable), the same
    summaries: arrays that each fill one program of the same chunk (small arrays: sizes
    within one :data:`BLOCK` of each other) share one kernel call, a program per array,
    so that a program holds one kernel per chunk size rather than one per array (each is
    compiled: about a second apiece for XLA:CPU when interpreted); the others take their
    own."""
    for a in arrays:
        check_countable(a)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    higher = moments == 4
    shared: dict[int, list[int]] = {}
    for i, a in enumerate(arrays):
        chunk = _own_chunk(a, num_counts)
        if chunk is not None:
            shared.setdefault(chunk, []).append(i)
    out: dict[int, DeviceSummary] = {}
    for idx in shared.values():
        if len(idx) > 1:
            got = _shared_summaries([arrays[i] for i in idx], fmt, num_counts, interpret, higher)
            out.update((i, DeviceSummary(*g)) for i, g in zip(idx, got))
    return [
        out[i] if i in out else pallas_summary(a, fmt, num_counts, interpret, moments)
        for i, a in enumerate(arrays)
    ]


# ------------------------------------------------------------------ block-scaled formats
def _tile_rows(size: int) -> int:
    """Blocks of ``size`` elements a program's loop reads at a time (:data:`BLOCK`)."""
    return BLOCK // size


_BLOCK_INTS = ("underflow", "subnormal", "saturated", "hi", "lo", "g2")


def _blocks_kernel(
    x_ref: Any,
    st_ref: Any,
    ints_ref: Any,
    floats_ref: Any,
    *,
    fmt: BlockFormat,
    last: int,
    tail: int,
    chunk: int,
    strict: bool,
) -> None:
    """One program of :func:`pallas_blocks`: its ``chunk`` blocks (``tail`` for the program
    ``last``) of format ``fmt``, a tile of :func:`_tile_rows` blocks at a time; per lane
    (a block position in the tile) the counts, the squared error in the unit of its largest
    part and the pair of the largest ratio; then the lanes merged into one row."""
    rows = _tile_rows(fmt.block)
    limit = chunk - (pl.program_id(0) == last).astype(jnp.int32) * (chunk - tail)
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, fmt.block), 0)
    st = jnp.max(st_ref[...])

    def step(j: Any, state: dict[str, Any]) -> dict[str, Any]:
        start = pl.multiple_of(j * rows, rows)
        valid = start + lane < limit
        x = plt.load(x_ref.at[pl.ds(start, rows), :], mask=valid, other=jnp.nan)
        bits = _bits(x.astype(jnp.float32))
        return merge_two(state, block_partials(bits, fmt, st, strict))

    zeros = jnp.zeros((rows,), jnp.int32)
    state0 = {
        **{c: zeros for c in _BLOCK_INTS},
        "t": jnp.zeros((rows,), jnp.float32),
    }
    state = jax.lax.fori_loop(0, -(-chunk // rows), step, state0)
    out = merge_partials(state, axis=0)
    ints_ref[...] = _row([out[c] for c in _BLOCK_INTS], jnp.int32)
    floats_ref[...] = _row([out["t"]], jnp.float32)


def _program_blocks(n: int, rows: int) -> int:
    """Blocks per program for ``n`` blocks read ``rows`` at a time: a multiple of ``rows``,
    at least 64 tiles (the rows a program writes are small beside what it reads), otherwise
    enough for :data:`TARGET_PROGRAMS` programs."""
    chunk = min(max(64 * rows, -(-n // TARGET_PROGRAMS)), max(n, 1))
    return -(-chunk // rows) * rows


@partial(jax.jit, static_argnames=("fmt", "interpret"))
def _format_words(x: Any, st: Any, fmt: BlockFormat, interpret: bool) -> tuple[Any, Any]:
    """One format's words of ``x`` (see :mod:`._blocks`) by the Pallas kernel; ``st``: the
    bits of NVFP4's tensor scale (:func:`._blocks.tensor_scale`)."""
    length = x.shape[-1] if x.ndim else 1
    rows = x.reshape(-1, length)
    if np.dtype(rows.dtype) not in KERNEL_DTYPES:
        rows = rows.astype(jnp.float32)
    pad = -length % fmt.block
    if pad:  # each row to whole blocks: NaN, which every column leaves out (an XLA copy)
        rows = jnp.pad(rows, ((0, 0), (0, pad)), constant_values=np.nan)
    blocks = rows.reshape(-1, fmt.block)
    n = blocks.shape[0]
    chunk = _program_blocks(n, _tile_rows(fmt.block))
    programs = max(1, -(-n // chunk))
    tail = n - (programs - 1) * chunk
    kernel = partial(
        _blocks_kernel, fmt=fmt, last=programs - 1, tail=tail, chunk=chunk, strict=interpret
    )
    ints, floats = pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[
            pl.BlockSpec((chunk, fmt.block), lambda i: (i, 0)),
            pl.BlockSpec((16,), lambda i: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, 8), lambda i: (i, 0)),
            pl.BlockSpec((None, 8), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((programs, 8), jnp.int32),
            jax.ShapeDtypeStruct((programs, 8), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=NUM_WARPS),
    )(blocks, jnp.broadcast_to(jnp.asarray(st, jnp.int32), (16,)))
    parts = {c: ints[:, i] for i, c in enumerate(_BLOCK_INTS)}
    return finish(merge_partials({**parts, "t": floats[:, 0]}, axis=0))


def pallas_blocks(
    summary: DeviceSummary, x: Any, layout: Layout, interpret: bool | None = None
) -> DeviceSummary:
    """``summary`` (of ``x``, by :func:`pallas_summary`) with the words of the block formats
    that lead ``layout.extras`` (:mod:`._blocks`), computed by a second Pallas kernel that
    reads ``x`` as rows of whole blocks (``(blocks, block size)``: block maxima are a
    reduction along one axis of a tile). A second read of the array: NVFP4's tensor scale
    needs the tensor's largest magnitude before any block, and the summary's ``max_abs``
    gives it; rows whose length is not a multiple of the block size are padded first (an
    XLA copy). Unchanged without block formats (traceable)."""
    formats = block_formats_of(layout.extras)
    if not formats:
        return summary
    check_blockable(x)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if x.size == 0:
        ints = jnp.zeros((len(formats) * INT_WORDS,), jnp.int32)
        floats = jnp.zeros((len(formats),), jnp.float32)
    else:
        amax = _bits(summary.values[..., VALUE_INDEX["max_abs"]].astype(jnp.float32))
        st = tensor_scale(amax)
        words = [_format_words(x, st, f, interpret) for f in formats]
        ints = jnp.concatenate([w[0] for w in words])
        floats = jnp.stack([w[1] for w in words])
    return DeviceSummary(*with_words(summary.counts, summary.values, ints, floats, N_CORE_VALUES))
