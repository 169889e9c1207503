"""One-pass summaries of arrays in host memory, compiled with numba.

When a framework runs on the CPU, its tensors already live in host memory and a summary
costs only the passes over the data. Built from framework operations it costs a dozen
(extrema, magnitudes, exponent keys, their counts, three powers, their sums, the centred
sum), each streaming the whole tensor through memory. :func:`host_summaries` reads each
value from memory once: per 64K-element chunk (which stays in the L2 cache) one loop
accumulates the extrema and the counts of special values, a second the float64 sums, a
third counts the exponent fields (a fourth counts the values above the format's largest
finite value, only in the rare chunks whose largest magnitude exceeds it). The trackers
call it for their CPU tensors (PyTorch) and arrays (JAX).

Exactness: counts, extrema and exponent counts are exact. The power sums are plain
float64 sums of ``|x|**K`` (relative error ~n * 2**-53), scaled by ``max|x|**K`` at the
end, which is exact enough and cannot overflow while ``max|x|`` lies in
:data:`SAFE_RANGE`; an array outside it takes a second pass that sums
``(|x| / max|x|)**K``. The variance comes from float64 sums of ``x - p`` and ``(x - p)**2``
shifted by a pivot ``p``, the array's first finite value: the shift keeps the subtraction
``S2 - S1**2 / n`` well conditioned even when ``|mean| >> std``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any, NamedTuple

import ml_dtypes
import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba import types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from . import _compile_notice  # noqa: F401 - says so when the kernels below compile long
from .blocks import BLOCK_COLUMNS, BlockFormat, block_formats_of
from .formats import NumberFormat
from .summary import FIELD_INDEX, HIGHER_FIELDS, N_CORE, N_CORE_VALUES, N_LEADING_COUNTS, Layout

__all__ = [
    "host_summaries",
    "host_higher_moments",
    "higher_serial",
    "summary_serial",
    "split_serial",
    "serial_tables",
    "blocks_serial",
    "serial_block_table",
    "SAFE_RANGE",
    "HOST_DTYPES",
    "frozen",
]

#: The largest magnitude of an array must lie in this range (or be 0) for the unscaled
#: float64 power sums to neither overflow nor lose the powers that matter to underflow;
#: outside it the power sums take a second, scaled pass.
SAFE_RANGE = (2.0**-100, 2.0**100)
_SAFE_LO, _SAFE_HI = SAFE_RANGE
#: Input dtypes the kernel reads (narrower floats are widened to float32 first).
HOST_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        np.float32,
        np.float16,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float8_e4m3b11fnuz,
        ml_dtypes.float8_e4m3,
        ml_dtypes.float8_e3m4,
    )
)

# Columns of the kernel's per-item partial results (:func:`_item` writes them in this order).
_INF, _ZERO, _OVER, _MIN, _MAX, _MINABS, _S1, _S2, _A1, _A2, _A4, _A8, _PIVOT = range(13)
_NPART = 13
_NSUB = 23  # float32 subnormal exponents -149 .. -127
#: Arrays are cut into items of at most this many elements, which threads share.
_CHUNK = 1 << 16
#: Arrays of at most this many elements are copied into one buffer and run together
#: (per-call costs dominate below it).
_SMALL = 1 << 12
_F32_MAX = float(np.finfo(np.float32).max)
#: The scale ``s_t`` the MX formats pass to the block loops, which only NVFP4 reads (as a
#: float32): a float32 as NVFP4's, so that each loop is compiled for one argument type
#: (numba compiles a function once per argument types; for the same reason the parallel
#: loops pass their index, unsigned there, on as an int64).
_ONE = np.float32(1.0)


# The kernel is three loops over each item, not one: one loop doing everything compiles to
# scalar code, while these three compile to vector code (the first two) and to four
# interleaved tables (the histogram, which counts pairs of elements in large items); the
# figures are in stats/DESIGN.md.
_FAST = {"reassoc", "contract"}  # lets sums vectorize; NaN and inf semantics are kept


_I32 = np.int32
#: A float of the compiled code: float64 or float32, as the loop computes.
_F = float | np.float32


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _bit_reductions(
    bits: np.ndarray,
) -> tuple[
    np.int32, np.int32, np.int32, np.int32, np.int32, np.int32, np.int32, np.int32
]:  # pragma: no cover - compiled
    """Integer reductions of float32 bit patterns (``bits``: int32): counts of inf, of
    zeros, of exponent field 0 (zeros and subnormals) and of inf and NaN, the order keys
    of the finite minimum and maximum, and the bits of the smallest and largest finite
    magnitudes (int32 compares vectorize where float min/max would not).

    Every intermediate is wrapped in ``int32``: numba widens int32 arithmetic to int64,
    which halves the lanes of each vector and adds a sign extension per element (0.51 ns
    per element before, 0.16 after, on the 2-core CPU). The common item has no inf or NaN:
    a first loop reduces without the selects that keep them out of the extrema and counts
    them (0.19 -> 0.17 ns per element, the count of field 0 included); only an item that
    has any runs the second."""
    low = _I32(0)
    zero = _I32(0)
    nonfinite = _I32(0)
    kmin = _I32(0x7FFFFFFF)
    kmax = _I32(-0x7FFFFFFF - 1)
    amin = _I32(0x7F800000)
    amax = _I32(0)
    for i in range(bits.size):
        b = bits[i]
        m = _I32(b & _I32(0x7FFFFFFF))  # magnitude bits; finite below the inf pattern
        nonfinite = _I32(nonfinite + _I32(m >= _I32(0x7F800000)))
        zero = _I32(zero + _I32(m == _I32(0)))
        low = _I32(low + _I32(m < _I32(0x00800000)))
        key = _I32(b ^ _I32(_I32(b >> _I32(31)) & _I32(0x7FFFFFFF)))  # orders floats as int32
        kmin = min(kmin, key)
        kmax = max(kmax, key)
        amin = min(amin, m)
        amax = max(amax, m)
    if nonfinite == 0:
        return _I32(0), zero, low, nonfinite, kmin, kmax, amin, amax
    inf = _I32(0)
    kmin = _I32(0x7FFFFFFF)
    kmax = _I32(-0x7FFFFFFF - 1)
    amin = _I32(0x7F800000)
    amax = _I32(0)
    for i in range(bits.size):
        b = bits[i]
        m = _I32(b & _I32(0x7FFFFFFF))
        fin = m < _I32(0x7F800000)
        inf = _I32(inf + _I32(m == _I32(0x7F800000)))
        key = _I32(b ^ _I32(_I32(b >> _I32(31)) & _I32(0x7FFFFFFF)))
        kmin = min(kmin, key if fin else _I32(0x7FFFFFFF))
        kmax = max(kmax, key if fin else _I32(-0x7FFFFFFF - 1))
        amin = min(amin, m if fin else _I32(0x7F800000))
        amax = max(amax, m if fin else _I32(0))
    return inf, zero, low, nonfinite, kmin, kmax, amin, amax


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _float_sums(
    x: np.ndarray, pivot: float, scale: float
) -> tuple[float, float, float, float, float, float]:  # pragma: no cover - compiled
    """float64 sums over the finite values: of ``x - pivot`` and its square, of
    ``|x| * scale`` to the powers 1, 2, 4, 8."""
    s1 = 0.0
    s2 = 0.0
    a1 = 0.0
    a2 = 0.0
    a4 = 0.0
    a8 = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        a = abs(v)
        fin = a <= 3.4028234663852886e38  # false for inf and NaN
        af = a * scale if fin else 0.0
        d = v - pivot if fin else 0.0
        s1 += d
        s2 += d * d
        q = af * af
        a1 += af
        a2 += q
        q = q * q
        a4 += q
        a8 += q * q
    return s1, s2, a1, a2, a4, a8


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _finite_sums(
    x: np.ndarray, pivot: float
) -> tuple[float, float, float, float, float, float]:  # pragma: no cover - compiled
    """:func:`_float_sums` (scale 1) of an ``x`` without inf or NaN: the same loop less
    the selects (0.29 -> 0.25 ns per element), which compiles to the same vector code
    and so gives the same sums, bit for bit."""
    s1 = 0.0
    s2 = 0.0
    a1 = 0.0
    a2 = 0.0
    a4 = 0.0
    a8 = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        a = abs(v)
        d = v - pivot
        s1 += d
        s2 += d * d
        q = a * a
        a1 += a
        a2 += q
        q = q * q
        a4 += q
        a8 += q * q
    return s1, s2, a1, a2, a4, a8


@numba.njit(cache=True, nogil=True)
def _count_over(x: np.ndarray, over_at: float) -> int:  # pragma: no cover - compiled
    """The count of finite magnitudes in ``x`` above ``over_at``: run only on items whose
    largest finite magnitude exceeds it (rare), so the common item skips the pass."""
    over = 0
    for i in range(x.size):
        a = abs(np.float64(x[i]))
        over += (a <= 3.4028234663852886e38) & (a > over_at)
    return over


@numba.njit(cache=True, nogil=True)
def _field_counts(bits: np.ndarray, hist: np.ndarray) -> None:  # pragma: no cover - compiled
    """Adds the counts of the exponent fields to ``hist`` (int64[4, 256]): four tables
    so that consecutive increments of one field do not wait for each other."""
    n = bits.size // 4 * 4
    for h in range(0, n, 4):
        hist[0, (bits[h] >> 23) & 0xFF] += 1
        hist[1, (bits[h + 1] >> 23) & 0xFF] += 1
        hist[2, (bits[h + 2] >> 23) & 0xFF] += 1
        hist[3, (bits[h + 3] >> 23) & 0xFF] += 1
    for h in range(n, bits.size):
        hist[0, (bits[h] >> 23) & 0xFF] += 1


#: Items of at least this many elements count their exponent fields in pairs
#: (:func:`_exponent_counts`); below it the tables cost more than the pairs save.
_PAIRS_MIN = 1 << 14
#: Slots of a pair count: 0 for exponent field 0 (and any field below the window), 1 ..
#: 31 for the window of 31 fields that ends at the item's largest finite one, 32 for 255.
_SLOTS = 33
_TABLE = 1096  # _SLOTS**2 rounded up to a multiple of 8: one of four interleaved tables


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _pair_slots(
    a: np.ndarray, b: np.ndarray, base: int, idx: np.ndarray
) -> None:  # pragma: no cover - compiled
    """``idx[k]``: the slot of ``a[k]``'s exponent field times :data:`_SLOTS` plus that of
    ``b[k]``'s (``a``, ``b``: int32 bits; field ``f`` has slot ``f - base`` clipped to
    0 .. 32). Vector code: the clip is a min and a max, no compare per element."""
    lo = _I32(base)
    for k in range(idx.size):
        s0 = min(max(_I32(_I32(_I32(a[k] >> _I32(23)) & _I32(0xFF)) - lo), _I32(0)), _I32(32))
        s1 = min(max(_I32(_I32(_I32(b[k] >> _I32(23)) & _I32(0xFF)) - lo), _I32(0)), _I32(32))
        idx[k] = np.uint16(_I32(s0 * _I32(_SLOTS)) + s1)


@numba.njit(cache=True, nogil=True)
def _exponent_counts(
    bits: np.ndarray, hist: np.ndarray, top: int | np.int32, field0: int | np.int32
) -> None:  # pragma: no cover - compiled
    """Adds the counts of the exponent fields of ``bits`` (int32) to ``hist`` (int64[4,
    256]), as :func:`_field_counts`, but one table increment per pair of elements, not
    per element (0.34 -> 0.25 ns per element): the first half of the item is paired with
    the second, each pair's two slots (:func:`_pair_slots`) index a table of
    ``_SLOTS**2`` counts, whose rows and columns give each slot's count. ``top`` is the
    item's largest finite exponent field: the window of 31 fields ending there holds
    every finite nonzero field of almost every item (gradients and activations span about
    20); ``field0`` is the count of field 0, which slot 0 must equal, or a field below
    the window fell into it, and the item is counted by :func:`_field_counts` instead."""
    n = bits.size
    if n < _PAIRS_MIN:
        _field_counts(bits, hist)
        return
    base = max(1, top - 30) - 1  # fields base + 1 .. base + 31 take slots 1 .. 31
    h = n // 2
    idx = np.empty(h, np.uint16)
    _pair_slots(bits[:h], bits[h : 2 * h], base, idx)
    t = np.zeros(4 * _TABLE, np.int32)
    m = h // 4 * 4
    for k in range(0, m, 4):  # four tables: consecutive increments do not wait for each other
        t[np.uint32(idx[k])] += 1
        t[np.uint32(idx[k + 1]) + np.uint32(_TABLE)] += 1
        t[np.uint32(idx[k + 2]) + np.uint32(2 * _TABLE)] += 1
        t[np.uint32(idx[k + 3]) + np.uint32(3 * _TABLE)] += 1
    for k in range(m, h):
        t[np.uint32(idx[k])] += 1
    c = np.zeros(_SLOTS, np.int64)
    for i in range(_SLOTS):
        for j in range(_SLOTS):
            p = i * _SLOTS + j
            v = t[p] + t[p + _TABLE] + t[p + 2 * _TABLE] + t[p + 3 * _TABLE]
            c[i] += v
            c[j] += v
    if n & 1:  # the odd last element
        c[min(max(((bits[n - 1] >> 23) & 0xFF) - base, 0), 32)] += 1
    if c[0] != field0:
        _field_counts(bits, hist)
        return
    hist[0, 0] += c[0]
    hist[0, 255] += c[32]
    for i in range(1, 32):
        hist[0, base + i] += c[i]


@numba.njit(cache=True, nogil=True)
def _f32_of(b: int | np.int32) -> np.float32:  # pragma: no cover - compiled
    """The float32 whose bit pattern is the int32 ``b`` (:data:`_f32_bits`, which compiles
    quicker than a one-element array's view)."""
    f: np.float32 = _f32_bits(_I32(b))
    return f


@numba.njit(cache=True, nogil=True)
def _item(
    x: np.ndarray,
    bits: np.ndarray,
    pivot: float,
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """Partials of one item ``x`` (with ``bits``, its int32 view) into ``part``
    (float64[_NPART]), ``hist`` (int64[4, 256]) and ``sub`` (subnormal exponent counts)."""
    inf, zero, low, nonfinite, kmin, kmax, amin, amax = _bit_reductions(bits)
    if nonfinite == 0:
        s1, s2, a1, a2, a4, a8 = _finite_sums(x, pivot)
    else:
        s1, s2, a1, a2, a4, a8 = _float_sums(x, pivot, 1.0)
    over = _count_over(x, over_at) if _f32_of(amax) > over_at else 0
    _exponent_counts(bits, hist, (amax >> 23) & 0xFF, low)
    if low > zero:
        for i in range(bits.size):  # subnormals: their exponents, exactly
            if (bits[i] & 0x7FFFFFFF) != 0 and (bits[i] & 0x7F800000) == 0:
                sub[math.frexp(np.float64(abs(x[i])))[1] + 148] += 1
    f = np.float64
    got = (f(inf), f(zero), f(over), f(kmin), f(kmax), f(amin), s1, s2, a1, a2, a4, a8)
    for c in range(_PIVOT):  # the columns _INF .. _A8 are 0 .. 11, in this order
        part[c] = got[c]


# ------------------------------------------------------------------ block-scaled formats
# Parameters of one block format, a row of the float64 table :func:`_block_table` builds.
_B_SIZE, _B_SPLIT, _B_SUBK, _B_NORMAL, _B_MAX, _B_EMAX, _B_SPLIT32, _B_SUBK32 = range(8)
# Columns of a block format's partial results: the four sums, then the largest block ratio.
_B_UNDER, _B_SUBN, _B_SAT, _B_ERR, _B_RATIO = range(5)
_NV_E4M3 = (2.0**49 + 1.0, 2.0 ** (52 - 6 - 3), 2.0**-6)  # E4M3 split, subnormal K, normal


@cache
def _formats_of(extras: tuple[tuple[str, str], ...]) -> tuple[BlockFormat, ...]:
    """:func:`tandv.stats.blocks.block_formats_of`, once per layout's extras."""
    return block_formats_of(extras)


@cache
def _block_table(formats: tuple[BlockFormat, ...]) -> np.ndarray:
    """One row of kernel parameters per block format: block size, the Veltkamp constant that
    rounds a float64 to the element's mantissa, the constant that rounds it to the
    element's subnormal grid, its smallest normal and largest finite value, the MX emax
    (NaN: NVFP4), and the two rounding constants for float32. Cached: shared by calls,
    which only read it."""
    t = np.zeros((len(formats), 8))
    for i, f in enumerate(formats):
        t[i] = (
            f.block,
            2.0 ** (52 - f.mantissa) + 1.0,
            2.0 ** (52 + f.emin - f.mantissa),
            f.smallest_normal,
            f.max,
            np.nan if f.emax is None else f.emax,
            2.0 ** (23 - f.mantissa) + 1.0,  # the same two constants for float32
            2.0 ** (23 + f.emin - f.mantissa),
        )
    return t


@numba.njit(cache=True, nogil=True)
def _round_element(a: _F, split: _F, subk: _F, normal: _F) -> _F:  # pragma: no cover - compiled
    """``a >= 0`` rounded to nearest-even onto the element grid: Veltkamp's split keeps the
    mantissa's bits where ``a`` is normal, adding and removing ``subk`` rounds to the
    subnormal spacing below (both exact float64 tricks: this function has no fastmath)."""
    g = split * a
    qn = g - (g - a)
    qs = (a + subk) - subk
    return qs if a < normal else qn


def _bitcast(source: types.Type, target: types.Type) -> Callable[..., Any]:
    """A numba intrinsic that reinterprets a ``source`` value's bits as a ``target`` (both
    32-bit): free in vector code. Called from compiled code only (typed for mypy as a
    plain callable)."""

    def typing(typingctx: object, v: types.Type) -> object:  # pragma: no cover - compiled
        if v != source:
            return None

        def codegen(context: object, builder: object, sig: object, args: list[object]) -> object:
            return builder.bitcast(args[0], context.get_value_type(target))  # type: ignore[attr-defined]

        return target(source), codegen

    typing.__name__ = f"bitcast_{source}_to_{target}"
    return intrinsic(typing)


#: The float32 whose bit pattern is an int32, and the bit pattern (int32) of a float32.
_f32_bits = _bitcast(types.int32, types.float32)
_i32_bits = _bitcast(types.float32, types.int32)


@numba.njit(cache=True, nogil=True)
def _grid(u: np.float32, c: np.float32) -> np.float32:  # pragma: no cover - compiled
    """``u >= 0`` rounded to nearest-even onto multiples of ``ulp(c)``, for a power of two
    ``c`` at least ``2**23`` times ``u``: ``u + c`` lies in ``c``'s binade, where the
    addition rounds ``u`` to that spacing, and removing ``c`` again is exact. Compiled
    without fastmath (reassociation would cancel ``c``), called from the element loops,
    whose own flags do not reach it."""
    q: np.float32 = (u + c) - c
    return q


#: :func:`_grid_constants`' result.
_GridC = tuple[np.float32, np.float32, np.float32, np.int32, np.int32]


@numba.njit(cache=True, nogil=True)
def _grid_constants(p: np.ndarray) -> _GridC:  # pragma: no cover - compiled
    """The element loops' constants for format ``p`` (a row of :func:`_block_table`): its
    largest finite value; the largest scaled magnitude that rounds to zero (half the
    smallest subnormal: a tie, to even) and the smallest that rounds to a normal (the
    smallest normal less half the subnormal spacing: a tie, to the even normal), so that
    a scaled magnitude's count is two compares; the bits of the smallest normal and the
    exponent offset of :func:`_quantize`."""
    f32 = np.float32
    subk, normal = f32(p[_B_SUBK32]), f32(p[_B_NORMAL])  # subk: 2**(emin + 23 - m)
    thr_u = subk * f32(2.0**-24)  # 2**(emin - m - 1)
    nbits = _i32_bits(normal)
    return f32(p[_B_MAX]), thr_u, normal - thr_u, nbits, _I32(_i32_bits(subk) - nbits)


@numba.njit(cache=True, nogil=True, inline="always")
def _quantize(
    t: np.float32, fmax: np.float32, nbits: np.int32, koff: np.int32
) -> np.float32:  # pragma: no cover - compiled
    """A scaled magnitude ``t >= 0`` (float32) rounded to nearest-even into the element
    format, saturating at ``fmax``: :func:`_grid` with the power of two ``c`` whose spacing
    is the element grid's at ``t`` (``2**(e - m)`` in a normal binade ``e``, the subnormal
    spacing below the smallest normal, whose bits are ``nbits``; ``koff`` adds ``23 - m``
    to the exponent field). Integer and bit operations on the vector lanes: no compare and
    select between a normal and a subnormal rounding."""
    u = min(t, fmax)
    c = _f32_bits(_I32(max(_I32(_i32_bits(u) & _I32(0x7F800000)), nbits) + koff))
    return _grid(u, c)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _one_block(
    x: np.ndarray, s: int, e: int, p: np.ndarray, s_t: _F, acc: np.ndarray
) -> None:  # pragma: no cover - compiled
    """Adds block ``x[s:e]`` of the format with parameters ``p`` to ``acc`` (its partials);
    ``s_t`` is the tensor's float32 scale (NVFP4 only; IEEE division by an ``s_t`` of 0,
    as in :func:`_nv_scales`)."""
    amax = 0.0
    amin = np.inf
    for i in range(s, e):
        v = abs(np.float64(x[i]))
        if v <= _F32_MAX:
            amax = max(amax, v)
            if v > 0.0:
                amin = min(amin, v)
    if amax == 0.0:  # no non-zero finite value: nothing to count, no error
        return
    acc[_B_RATIO] = max(acc[_B_RATIO], amax / amin)
    split, subk, normal, fmax = p[_B_SPLIT], p[_B_SUBK], p[_B_NORMAL], p[_B_MAX]
    under = 0.0
    subn = 0.0
    sat = 0.0
    err = 0.0
    if not np.isnan(p[_B_EMAX]):  # MX: a power of two, exact in float64
        ex = math.frexp(amax)[1] - 1 - int(p[_B_EMAX])
        scale = math.ldexp(1.0, ex)
        inv = math.ldexp(1.0, -ex)
        for i in range(s, e):
            v = abs(np.float64(x[i]))
            fin = v <= _F32_MAX
            a = v * inv
            q = _round_element(min(a, fmax), split, subk, normal)
            nz = fin & (v > 0.0)
            sat += fin & (a > fmax)
            under += nz & (q == 0.0)
            subn += nz & (q > 0.0) & (q < normal)
            d = (q - a) * scale if fin else 0.0
            err += d * d
    else:  # NVFP4, in float32 in the definition's order
        f32 = np.float32
        u: float = min(np.float64((f32(amax) / f32(6.0)) / f32(s_t)), 448.0)
        s_b = _round_element(u, _NV_E4M3[0], _NV_E4M3[1], _NV_E4M3[2])
        scale = f32(f32(s_b) * f32(s_t))
        for i in range(s, e):
            xi = x[i]
            v = abs(np.float64(xi))
            fin = v <= _F32_MAX
            nz = fin & (v > 0.0)
            if not scale > 0.0:  # the block's scale is zero (or NaN: 0 / 0, s_t = 0)
                under += nz
                err += v * v if fin else 0.0
                continue
            a = abs(np.float64(f32(xi) / scale))
            q = _round_element(min(a, fmax), split, subk, normal)
            sat += fin & (a > fmax)
            under += nz & (q == 0.0)
            subn += nz & (q > 0.0) & (q < normal)
            d = q * np.float64(scale) - v if fin else 0.0
            err += d * d
    acc[_B_UNDER] += under
    acc[_B_SUBN] += subn
    acc[_B_SAT] += sat
    acc[_B_ERR] += err


_V8 = llvm_ir.VectorType(llvm_ir.IntType(32), 8)


def _pick(builder: Any, x: Any, y: Any, larger: bool) -> Any:
    """The lane-wise larger (or smaller) of two int32 vectors (LLVM makes it one
    ``pmaxsd``/``pminsd``)."""
    return builder.select(builder.icmp_signed(">" if larger else "<", x, y), x, y)


def _lanes_of(builder: Any, vectors: list[Any], larger: bool) -> Any:
    """One vector whose lane ``t`` is the largest (smallest) lane of ``vectors[t]`` (8 int32
    vectors of 8 lanes): three rounds that each halve the vectors by pairing the lower and
    the upper halves of two (shuffles), where reducing each vector alone would take three
    shuffle rounds per vector."""
    i32 = llvm_ir.IntType(32)
    level = vectors
    for lower, upper in (
        ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]),
        ([0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]),
        ([0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]),
    ):
        lo_mask = llvm_ir.Constant(llvm_ir.VectorType(i32, 8), lower)
        hi_mask = llvm_ir.Constant(llvm_ir.VectorType(i32, 8), upper)
        level = [
            _pick(
                builder,
                builder.shuffle_vector(level[i], level[i + 1], lo_mask),
                builder.shuffle_vector(level[i], level[i + 1], hi_mask),
                larger,
            )
            for i in range(0, len(level), 2)
        ]
    return level[0]


def _tile_bits(per: int) -> Callable[..., Any]:
    """A numba intrinsic ``(src, hi, lo) -> bool`` over 8 consecutive blocks of ``8 * per``
    int32 float bits at address ``src``: the bits of each block's largest magnitude into
    the 8 int32 at ``hi`` and of its smallest non-zero one (the inf pattern if none, inf
    and NaN left out) into those at ``lo``; True when a block's largest magnitude is inf
    or NaN (the caller then takes that maximum again without them). Branch-free vector
    code: the magnitudes' maxima, and the minima of ``(m - 1) & 0x7FFFFFFF``, which sends
    0 to the top and keeps the order of the rest (inf and NaN above every finite value),
    each reduced across the 8 blocks at once (:func:`_lanes_of`)."""

    def typing(typingctx: object, src: types.Type, hi: types.Type, lo: types.Type) -> object:
        if not (src == hi == lo == types.int64):  # pragma: no cover - compiled
            return None

        def codegen(
            context: object, b: Any, sig: object, args: list[Any]
        ) -> Any:  # pragma: no cover
            i64 = llvm_ir.IntType(64)
            at = b.inttoptr(args[0], _V8.as_pointer())
            magnitude = llvm_ir.Constant(_V8, [0x7FFFFFFF] * 8)
            one = llvm_ir.Constant(_V8, [1] * 8)
            top = llvm_ir.Constant(_V8, [0x7F7FFFFF] * 8)  # the largest finite, less 1
            largest, smallest = [], []
            for t in range(8):
                ms = [
                    b.and_(
                        b.load(b.gep(at, [llvm_ir.Constant(i64, per * t + v)]), align=4), magnitude
                    )
                    for v in range(per)
                ]
                us = [b.and_(b.sub(m, one), magnitude) for m in ms]
                while len(ms) > 1:
                    ms = [_pick(b, ms[i], ms[i + 1], True) for i in range(0, len(ms), 2)]
                    us = [_pick(b, us[i], us[i + 1], False) for i in range(0, len(us), 2)]
                largest.append(ms[0])
                smallest.append(us[0])
            hi = _lanes_of(b, largest, True)
            lo = b.add(_pick(b, _lanes_of(b, smallest, False), top, False), one)
            b.store(hi, b.inttoptr(args[1], _V8.as_pointer()), align=4)
            b.store(lo, b.inttoptr(args[2], _V8.as_pointer()), align=4)
            flags = b.bitcast(b.icmp_signed(">", hi, top), llvm_ir.IntType(8))
            return b.icmp_unsigned("!=", flags, llvm_ir.Constant(llvm_ir.IntType(8), 0))

        return types.boolean(types.int64, types.int64, types.int64), codegen

    typing.__name__ = f"tile_bits_{8 * per}"
    return intrinsic(typing)


_tile_bits_16 = _tile_bits(2)
_tile_bits_32 = _tile_bits(4)


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _block_bits(
    bits: np.ndarray, hi: np.ndarray, lo: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The bits of the largest finite magnitude (``hi``) and of the smallest non-zero one
    (``lo``; the inf pattern if none) of each block, a row of ``bits`` (int32, blocks x
    block size). Blocks of 16 and 32 of contiguous arrays go 8 at a time through
    :func:`_tile_bits` (0.18 -> 0.10 ns per value for blocks of 16: each block's own
    reductions ended in two horizontal reductions of the vector registers, which cost more
    than its elements); the rest, and the tiles with inf or NaN, take
    :func:`_block_bits_rows`."""
    n, size = bits.shape
    dense = bits.strides == (4 * size, 4) and hi.strides == lo.strides == (4,)
    tiles = n // 8 * 8 if dense and (size == 16 or size == 32) else 0
    src, at_hi, at_lo = bits.ctypes.data, hi.ctypes.data, lo.ctypes.data
    for k in range(0, tiles, 8):
        if size == 16:
            fix = _tile_bits_16(src + k * 64, at_hi + k * 4, at_lo + k * 4)
        else:
            fix = _tile_bits_32(src + k * 128, at_hi + k * 4, at_lo + k * 4)
        if fix:  # a block holds inf or NaN: the tile again, without them
            _block_bits_rows(bits, hi, lo, k, k + 8)
    _block_bits_rows(bits, hi, lo, tiles, n)


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _block_bits_rows(
    bits: np.ndarray, hi: np.ndarray, lo: np.ndarray, k0: int, k1: int
) -> None:  # pragma: no cover - compiled
    """:func:`_block_bits` of the blocks ``k0:k1``, one at a time: int32 compares that
    vectorize (the 2-D indices, loop counters known non-negative, let LLVM vectorize the
    row loop)."""
    for k in range(k0, k1):
        mx = _I32(0)
        mn = _I32(0x7F800000)
        for j in range(bits.shape[1]):
            m = _I32(bits[k, j] & _I32(0x7FFFFFFF))
            fin = m < _I32(0x7F800000)
            mx = max(mx, m if fin else _I32(0))
            mn = min(mn, m if fin & (m > _I32(0)) else _I32(0x7F800000))
        hi[k] = mx
        lo[k] = mn


#: The element loops take this many blocks per pass over the positions of a block, so that
#: the accumulators (one per position) are read and written once per that many blocks.
_GROUP = 4


def _fma32_typing(
    typingctx: object, a: types.Type, b: types.Type, c: types.Type
) -> object:  # pragma: no cover - compiled
    """``a * b + c`` (float32) rounded once (LLVM's ``fma``): exact but for that rounding,
    whatever fastmath flags the caller has."""
    if not all(v == types.float32 for v in (a, b, c)):
        return None

    def codegen(context: object, builder: object, sig: object, args: list[object]) -> object:
        t = args[0].type  # type: ignore[attr-defined]
        fnty = llvm_ir.FunctionType(t, [t, t, t])
        f = builder.module.declare_intrinsic("llvm.fma", [t], fnty)  # type: ignore[attr-defined]
        return builder.call(f, args)  # type: ignore[attr-defined]

    return types.float32(types.float32, types.float32, types.float32), codegen


_fma32: Callable[..., Any] = intrinsic(_fma32_typing)


@numba.njit(cache=True, nogil=True, inline="always")
def _tally(
    a: np.float32,
    t: np.float32,
    q: np.float32,
    deq: np.float32,
    pw: np.float32,
    fmax: np.float32,
    thr_u: np.float32,
    thr_n: np.float32,
) -> tuple[np.int32, np.int32, np.int32, np.float32]:  # pragma: no cover - compiled
    """What one element does, given its magnitude ``a`` (inf and NaN make the error inf or
    NaN: see :func:`_finite_of`), scaled magnitude
    ``t`` and element ``q`` (:func:`_quantize`), and its block's dequantizing scale ``deq``
    times the tensor's power of two ``pw`` (:func:`_normalizer`): whether it saturates
    (``t > fmax``), whether it is non-zero and rounds to zero (``t <= thr_u``) or to
    below the smallest normal (``t < thr_n``: the subnormals are the difference of the
    two, which share the non-zero test), and its error ``(q * deq - a) * pw``: the
    difference in one float32 rounding (:func:`_fma32`; exact where ``deq`` is a power of
    two), which the element loops square in float32 (see :func:`_mx_elements`)."""
    nz = _i32_bits(a) > _I32(0)  # an integer test: one vector instruction
    d: np.float32 = _fma32(q, deq, -(a * pw))
    return _I32(t > fmax), _I32(nz & (t <= thr_u)), _I32(nz & (t < thr_n)), d


@numba.njit(cache=True, nogil=True)
def _finite_of(x: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """A copy of the float32 rows ``x`` with inf and NaN replaced by 0 (which count nothing
    and add no error, as the definition leaves them out): what the element loops run on
    again where their first run met inf or NaN."""
    b = x.view(np.int32)
    out = np.empty_like(b)
    for k in range(b.shape[0]):
        for j in range(b.shape[1]):
            v = b[k, j]
            out[k, j] = v if _I32(v & _I32(0x7FFFFFFF)) < _I32(0x7F800000) else _I32(0)
    return out.view(np.float32)


@numba.njit(cache=True, nogil=True, inline="always")
def _abs_bits(b: np.int32) -> np.float32:  # pragma: no cover - compiled
    """``|x|`` of the float32 with bits ``b``, inf and NaN included (the element loops'
    sums then come out inf or NaN, and the loops run again on :func:`_finite_of`'s copy):
    one instruction less per element than sending them to 0 here."""
    a: np.float32 = _f32_bits(_I32(b & _I32(0x7FFFFFFF)))
    return a


@numba.njit(cache=True, nogil=True, inline="always")
def _mx_one(
    b: np.int32, iv: np.float32, sc: np.float32, pw: np.float32, c: _GridC
) -> tuple[np.int32, np.int32, np.int32, np.float32]:  # pragma: no cover - compiled
    """One element (bits ``b``) of an MX block scaled by ``iv``, dequantized by ``sc /
    pw`` (``sc``: the block's scale times the tensor's power of two ``pw``); ``c``:
    :func:`_grid_constants`."""
    a = _abs_bits(b)
    t = a * iv
    return _tally(a, t, _quantize(t, c[0], c[3], c[4]), sc, pw, c[0], c[1], c[2])


@numba.njit(cache=True, nogil=True, inline="always")
def _mx_err(
    b: np.int32, iv: np.float32, sc: np.float32, pw: np.float32, c: _GridC
) -> np.float32:  # pragma: no cover - compiled
    """:func:`_mx_one`'s error alone, for blocks that count nothing."""
    a = _abs_bits(b)
    d: np.float32 = _fma32(_quantize(a * iv, c[0], c[3], c[4]), sc, -(a * pw))
    return d


@numba.njit(cache=True, nogil=True, inline="always")
def _mx_sat(
    b: np.int32, iv: np.float32, sc: np.float32, pw: np.float32, c: _GridC
) -> tuple[np.int32, np.float32]:  # pragma: no cover - compiled
    """:func:`_mx_one`'s saturation and error, for blocks that count nothing else."""
    a = _abs_bits(b)
    t = a * iv
    d: np.float32 = _fma32(_quantize(t, c[0], c[3], c[4]), sc, -(a * pw))
    return _I32(t > c[0]), d


@numba.njit(cache=True, nogil=True, inline="always")
def _add_partials(
    tiny: np.ndarray, low: np.ndarray, sat: np.ndarray, err: np.ndarray, acc: np.ndarray
) -> None:  # pragma: no cover - compiled
    """Adds the element loops' per-position accumulators to the partials ``acc``: the
    values that round to zero (underflow), those that round below the smallest normal
    less the former (subnormal), the saturated ones and the squared errors."""
    u = tiny.sum()
    acc[_B_UNDER] += u
    acc[_B_SUBN] += low.sum() - u
    acc[_B_SAT] += sat.sum()
    acc[_B_ERR] += err.sum()


#: The block sizes of the MX formats and of NVFP4: the element loops' inner loops run
#: over a constant count, which the compiler unrolls into whole vectors.
_MX_BLOCK = 32
_NV_BLOCK = 16


@numba.njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def _mx_elements(
    x: np.ndarray,
    inv: np.ndarray,
    scl: np.ndarray,
    pw: np.float32,
    hi: np.ndarray,
    lo: np.ndarray,
    p: np.ndarray,
    acc: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """Adds the counts and the squared errors times ``pw**2`` of the MX blocks, the rows
    of ``x`` (float32, blocks x :data:`_MX_BLOCK`), scaled by ``inv`` and dequantized by
    ``scl / pw`` (``scl``: float32 powers of two, one per block, times the tensor's power
    of two ``pw``, :func:`_normalizer`), to ``acc``. All in float32 (vector lanes): ``x *
    inv`` is exact wherever it is not far below the element's smallest subnormal (where it
    rounds to zero either way), and the error ``(q * scl / pw - |x|) * pw`` is exact too
    (the rounding error of a rounding to a coarser grid is a float32; the caller keeps
    blocks whose scale is not a normal float32 away) but where it is below float32's
    normals (errors under ``2**-126`` of the tensor's largest magnitude). A group's
    squares add in float32 (``contract`` fuses them into FMAs: relative error at most
    ``2**-22``) before one conversion to float64, and squares under ``2**-126`` (errors
    under ``2**-63`` of the largest magnitude) lose their precision: :func:`_squares_kept`
    tells the caller whether the total is still within ``2**-20`` of the exact sum.
    Counts add in int32 (numba's int64 halves the lanes), one accumulator per position in
    the block, so that no block ends in a horizontal sum of the vector registers;
    :data:`_GROUP` blocks at a time, so that the accumulators leave memory once per group.
    ``reassoc`` lets the sums vectorize; the rounding (:func:`_grid`, compiled without
    it) keeps IEEE semantics; ``error_model="numpy"`` drops numba's checks for a division
    by zero (no division here, but the flag is shared with :func:`_nv_elements`).

    The loop does not test for inf and NaN: such an element's error is itself inf or NaN
    (``-(|x| * pw)`` with ``pw > 0``), and so is the sum of the squares; only then does
    the caller run it again, on a copy with them replaced by 0 (:func:`_finite_of`), so
    that the tensors without them (nearly all) save an instruction per element. One
    compiled function: inlined twice, it doubled the elements' compile time.

    A group whose blocks' maxima and minima (``hi``, ``lo``: their bits) say that no
    element saturates (``max * inv <= fmax``) and none underflows or becomes subnormal
    (``min * inv`` at least the smallest scaled magnitude that rounds to a normal) skips
    the counts (about a third of the work), and one whose minima say so counts only
    saturation: most groups of MXFP8 blocks."""
    c = _grid_constants(p)
    amax = hi.view(np.float32)
    amin = lo.view(np.float32)
    b = x.view(np.int32)
    tiny = np.zeros(_MX_BLOCK, np.int32)  # one accumulator per position in the block
    low = np.zeros(_MX_BLOCK, np.int32)
    sat = np.zeros(_MX_BLOCK, np.int32)
    err = np.zeros(_MX_BLOCK)
    # each block's class, in a loop over the blocks that vectorizes: 1 where no element
    # underflows or becomes subnormal, 2 where none saturates (a block without a value:
    # 0 and inf bits, both)
    clean = np.empty(x.shape[0], np.int32)
    for k in range(x.shape[0]):
        clean[k] = _I32(amin[k] * inv[k] >= c[2]) | _I32(_I32(amax[k] * inv[k] <= c[0]) << 1)
    whole = x.shape[0] // _GROUP * _GROUP
    for k in range(0, whole, _GROUP):
        i0, i1, i2, i3 = inv[k], inv[k + 1], inv[k + 2], inv[k + 3]
        s0, s1, s2, s3 = scl[k], scl[k + 1], scl[k + 2], scl[k + 3]
        both = clean[k] & clean[k + 1] & clean[k + 2] & clean[k + 3]
        clean_low = (both & 1) != 0  # no element underflows or becomes subnormal
        clean_high = (both & 2) != 0  # no element saturates
        if clean_low and clean_high:
            for j in range(_MX_BLOCK):
                d0 = _mx_err(b[k, j], i0, s0, pw, c)
                d1 = _mx_err(b[k + 1, j], i1, s1, pw, c)
                d2 = _mx_err(b[k + 2, j], i2, s2, pw, c)
                d3 = _mx_err(b[k + 3, j], i3, s3, pw, c)
                err[j] += np.float64((d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3))
            continue
        if clean_low:  # saturation alone
            for j in range(_MX_BLOCK):
                a0, d0 = _mx_sat(b[k, j], i0, s0, pw, c)
                a1, d1 = _mx_sat(b[k + 1, j], i1, s1, pw, c)
                a2, d2 = _mx_sat(b[k + 2, j], i2, s2, pw, c)
                a3, d3 = _mx_sat(b[k + 3, j], i3, s3, pw, c)
                sat[j] += _I32(_I32(a0 + a1) + _I32(a2 + a3))
                err[j] += np.float64((d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3))
            continue
        for j in range(_MX_BLOCK):
            a0, b0, c0, d0 = _mx_one(b[k, j], i0, s0, pw, c)
            a1, b1, c1, d1 = _mx_one(b[k + 1, j], i1, s1, pw, c)
            a2, b2, c2, d2 = _mx_one(b[k + 2, j], i2, s2, pw, c)
            a3, b3, c3, d3 = _mx_one(b[k + 3, j], i3, s3, pw, c)
            sat[j] += _I32(_I32(a0 + a1) + _I32(a2 + a3))
            tiny[j] += _I32(_I32(b0 + b1) + _I32(b2 + b3))
            low[j] += _I32(_I32(c0 + c1) + _I32(c2 + c3))
            err[j] += np.float64((d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3))
    for k in range(whole, x.shape[0]):
        for j in range(_MX_BLOCK):
            a0, b0, c0, d0 = _mx_one(b[k, j], inv[k], scl[k], pw, c)
            sat[j] += a0
            tiny[j] += b0
            low[j] += c0
            err[j] += np.float64(d0 * d0)
    _add_partials(tiny, low, sat, err, acc)


@numba.njit(cache=True, nogil=True, inline="always")
def _nv_one(
    b: np.int32, s: np.float32, deq: np.float32, pw: np.float32, c: _GridC
) -> tuple[np.int32, np.int32, np.int32, np.float32]:  # pragma: no cover - compiled
    """One element (bits ``b``) of an NVFP4 block divided by ``s``, dequantized by ``deq
    / pw`` (``deq``: the block's scale times the tensor's power of two ``pw``); ``c``:
    :func:`_grid_constants`."""
    a = _abs_bits(b)
    t = a / s
    return _tally(a, t, _quantize(t, c[0], c[3], c[4]), deq, pw, c[0], c[1], c[2])


#: Below this block scale, NVFP4's float32 error could lose its precision to float32's
#: subnormal range: :func:`_nv_tiled` takes such blocks in float64 (:func:`_one_block`).
_NV_SMALL_SCALE = 2.0**-99


@numba.njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def _nv_elements(
    x: np.ndarray,
    div: np.ndarray,
    deq: np.ndarray,
    pw: np.float32,
    p: np.ndarray,
    acc: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """As :func:`_mx_elements` for NVFP4 blocks (rows of :data:`_NV_BLOCK`) divided by
    the float32 scales ``div`` and dequantized by ``deq / pw`` (``deq``: the same scales
    times ``pw``, but for blocks whose scale is zero: ``div`` inf, so that each value
    becomes 0 and a non-zero one counts as underflow, and ``deq`` 0, so that its error is
    its square, as the definition says); the division is float32's, as the definition
    says (``error_model="numpy"``: without numba's test for a zero divisor, which ``div``
    never holds). The error ``(q * deq / pw - |x|) * pw`` is rounded once to float32
    (relative error 2**-24, squares 2**-23: within the 1e-6 promised), and only where it
    is 0, ``|x| * pw`` itself, or at least float32's smallest normal: every ``deq / pw``
    is 0 or at least :data:`_NV_SMALL_SCALE` (the caller sees to it), so that a non-zero
    difference of ``q * deq / pw`` (``q`` a multiple of 1/2) and ``|x| >= deq / pw / 4``
    is a multiple of ``2**-124`` before the scaling by ``pw``, whose result is normal but
    where it is under ``2**-126`` of the tensor's largest magnitude. Inf and NaN as in
    :func:`_mx_elements`: an error inf or NaN, then the caller's run on a finite copy."""
    c = _grid_constants(p)
    b = x.view(np.int32)
    tiny = np.zeros(_NV_BLOCK, np.int32)  # one accumulator per position in the block
    low = np.zeros(_NV_BLOCK, np.int32)
    sat = np.zeros(_NV_BLOCK, np.int32)
    err = np.zeros(_NV_BLOCK)
    whole = x.shape[0] // _GROUP * _GROUP
    for k in range(0, whole, _GROUP):
        s0, s1, s2, s3 = div[k], div[k + 1], div[k + 2], div[k + 3]
        e0, e1, e2, e3 = deq[k], deq[k + 1], deq[k + 2], deq[k + 3]
        for j in range(_NV_BLOCK):
            a0, b0, c0, d0 = _nv_one(b[k, j], s0, e0, pw, c)
            a1, b1, c1, d1 = _nv_one(b[k + 1, j], s1, e1, pw, c)
            a2, b2, c2, d2 = _nv_one(b[k + 2, j], s2, e2, pw, c)
            a3, b3, c3, d3 = _nv_one(b[k + 3, j], s3, e3, pw, c)
            sat[j] += _I32(_I32(a0 + a1) + _I32(a2 + a3))
            tiny[j] += _I32(_I32(b0 + b1) + _I32(b2 + b3))
            low[j] += _I32(_I32(c0 + c1) + _I32(c2 + c3))
            err[j] += np.float64((d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3))
    for k in range(whole, x.shape[0]):
        for j in range(_NV_BLOCK):
            a0, b0, c0, d0 = _nv_one(b[k, j], div[k], deq[k], pw, c)
            sat[j] += a0
            tiny[j] += b0
            low[j] += c0
            err[j] += np.float64(d0 * d0)
    _add_partials(tiny, low, sat, err, acc)


#: :func:`_largest_ratio`'s margin on the difference of a block's maximum's and minimum's
#: bits, in units of 2**-23 binades: more than twice the largest gap between ``log2(1 +
#: f)`` and ``f`` on [0, 1) (0.0861).
_RATIO_MARGIN = 1 << 21


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _largest_ratio(
    hi: np.ndarray, lo: np.ndarray, ratio: float
) -> float:  # pragma: no cover - compiled
    """The largest of ``ratio`` and the blocks' ``max / min`` (float64; ``hi``, ``lo`` from
    :func:`_block_bits`; blocks without a non-zero value give 0), with a division only
    for the blocks that may hold it: the difference of the bits of two normal float32
    (``hi - lo``) is ``2**23 * log2`` of their ratio to within ``2**23 * 0.0861``, so a block
    whose difference falls more than :data:`_RATIO_MARGIN` below the largest cannot have
    the largest ratio. A block whose minimum is subnormal (its bits no logarithm) is always
    divided; the divisions are float64's, of float32 values: exact but for one rounding."""
    n = hi.size
    key = np.empty(n, np.int32)
    best = _I32(-0x7FFFFFFF)
    for k in range(n):
        d = _I32(hi[k] - lo[k])  # a block without a non-zero value: 0 - inf bits < 0
        sub = lo[k] < _I32(0x00800000)
        key[k] = _I32(0x7FFFFFFF) if sub else d
        best = max(best, _I32(-0x7FFFFFFF) if sub else d)
    floor = _I32(best - _RATIO_MARGIN) if best > _I32(_RATIO_MARGIN - 0x7FFFFFFF) else best
    amax = hi.view(np.float32)
    amin = lo.view(np.float32)
    for k in range(n):
        if key[k] >= floor:
            m = amin[k] if hi[k] > _I32(0) else np.float32(1.0)
            ratio = max(ratio, np.float64(amax[k]) / np.float64(m))
    return ratio


@numba.njit(cache=True, nogil=True)
def _mx_scales(
    hi: np.ndarray, emax: np.int32, inv: np.ndarray, scl: np.ndarray
) -> bool:  # pragma: no cover - compiled
    """Each block's MX scale ``2**(floor(log2 max) - emax)`` (``scl``) and its inverse
    (``inv``), both float32, built from the bits of the block maxima ``hi`` (1 for a block
    without a non-zero value). Returns False where a scale is no normal float32 (a block
    maximum below ``2**(emax - 126)``): the caller then takes the float64 blocks."""
    ok = True
    one = _I32(127 << 23)
    for k in range(hi.size):
        h = hi[k]
        e = _I32(h >> _I32(23))  # the biased exponent of the block maximum
        ok &= (h == _I32(0)) | (e > emax)
        inv[k] = one if h == _I32(0) else _I32(_I32(_I32(254) - e + emax) << _I32(23))
        scl[k] = one if h == _I32(0) else _I32(_I32(e - emax) << _I32(23))
    return ok


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _nv_scales(
    hi: np.ndarray, st: np.float32, div: np.ndarray, deq: np.ndarray
) -> None:  # pragma: no cover - compiled
    """Each NVFP4 block's float32 scale ``s_b * s_t`` (``deq``) from its maximum's bits
    ``hi`` and the tensor's scale ``st``, in the definition's order (``s_b``: ``(max / 6) /
    s_t`` rounded to E4M3 in float64, exact for a float32 value; 0 for a block without a
    non-zero value), and the divisor of its values (``div``: the scale, inf where it is
    zero, see :func:`_nv_elements`). IEEE division (``error_model="numpy"``): ``s_t`` is 0
    where the tensor's maximum is a float32 subnormal (``/ 2688`` underflows), and every
    block's ``u`` is then inf, saturating at 448, or NaN (``0 / 0``): its scale ``448 * 0``
    or NaN counts as zero (all its values underflow)."""
    f32 = np.float32
    amax = hi.view(np.float32)
    for k in range(hi.size):
        u: float = min(np.float64((amax[k] / f32(6.0)) / st), 448.0)
        s_b = _round_element(u, _NV_E4M3[0], _NV_E4M3[1], _NV_E4M3[2])
        s = f32(f32(s_b) * st)
        ok = s > f32(0)  # False for 0 and NaN
        deq[k] = s if ok else f32(0)
        div[k] = s if ok else f32(np.inf)


@numba.njit(cache=True, nogil=True)
def _tiles(rowlen: int, a: int, b: int, size: int) -> bool:  # pragma: no cover - compiled
    """Whether blocks of ``size`` tile ``[a, b)`` of rows of ``rowlen``: the rows are a
    multiple of ``size`` long and ``a``, ``b`` lie on block bounds."""
    return rowlen % size == 0 and a % size == 0 and b % size == 0


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _pair_bits(
    hi16: np.ndarray, lo16: np.ndarray, hi32: np.ndarray, lo32: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The maxima and minima bits of blocks of 32 (``hi32``, ``lo32``) from those of the
    blocks of 16 (:func:`_block_bits`): the larger and the smaller of each pair (int32
    compares of non-negative float bits order as the floats do)."""
    h = hi16.reshape(hi32.size, 2)
    lo = lo16.reshape(lo32.size, 2)
    for k in range(hi32.size):
        hi32[k] = max(h[k, 0], h[k, 1])
        lo32[k] = min(lo[k, 0], lo[k, 1])


@numba.njit(cache=True, nogil=True)
def _untiled(
    x: np.ndarray, a: int, b: int, rowlen: int, p: np.ndarray, s_t: _F, acc: np.ndarray
) -> None:  # pragma: no cover - compiled
    """Partials (``acc``: 5) of format ``p``'s blocks that start in ``x[a:b]``, block by
    block (:func:`_one_block`): where they do not tile it. ``x`` is one tensor's values in
    rows of ``rowlen`` elements; a block may reach past ``b``, never past its row."""
    size = int(p[_B_SIZE])
    r = a // rowlen
    o = (a - r * rowlen + size - 1) // size * size
    if o >= rowlen:
        r += 1
        o = 0
    st = r * rowlen + o
    while st < b:
        _one_block(x, st, min(st + size, r * rowlen + rowlen), p, s_t, acc)
        o += size
        if o >= rowlen:
            r += 1
            o = 0
        st = r * rowlen + o


@numba.njit(cache=True, nogil=True)
def _normalizer(hi: np.ndarray) -> np.float32:  # pragma: no cover - compiled
    """The power of two ``pw`` that brings the largest of the block maxima (``hi``: their
    bits) into [1, 2) (2**126 and 2**-126 at the ends of float32's range; 0 where all are
    0: no element then counts or adds an error). The element loops take the errors times
    ``pw``: an exact scaling but where it falls below float32's normals, so that the
    squares of the errors that matter (those above ``2**-63`` of the largest magnitude)
    are normal float32."""
    m = _I32(0)
    for k in range(hi.size):
        m = max(m, hi[k])
    e = min(max(_I32(m >> _I32(23)), _I32(1)), _I32(253))  # biased exponent, kept in range
    pw: np.float32 = _f32_bits(_I32(_I32(_I32(254) - e) << _I32(23)))
    return pw if m > _I32(0) else np.float32(0.0)


#: The least sum of the normalized squares (:func:`_normalizer`) per element that
#: :func:`_squares_kept` accepts: each square that falls below float32's normals loses
#: at most ``2**-149``, so a sum of at least this many times the element count is within
#: ``2**-29`` of the exact one.
_KEPT_PER_ELEMENT = 2.0**-120


@numba.njit(cache=True, nogil=True)
def _squares_kept(
    part: np.ndarray, n: int, pw: np.float32, acc: np.ndarray
) -> bool:  # pragma: no cover - compiled
    """Adds the element loops' partials ``part`` (counts, and squared errors times
    ``pw**2``) of ``n`` elements to ``acc`` and returns True, unless their squares lost
    precision to float32's subnormals (their sum below :data:`_KEPT_PER_ELEMENT` per
    element, which the tensors of nearly exact values reach): then it returns False, and
    the caller takes the blocks again in float64."""
    if not part[_B_ERR] >= n * _KEPT_PER_ELEMENT:
        return False
    w = np.float64(pw)
    acc[_B_UNDER] += part[_B_UNDER]
    acc[_B_SUBN] += part[_B_SUBN]
    acc[_B_SAT] += part[_B_SAT]
    acc[_B_ERR] += part[_B_ERR] / (w * w)
    return True


@numba.njit(cache=True, nogil=True)
def _mx_tiled(
    x: np.ndarray, a: int, b: int, p: np.ndarray, hi: np.ndarray, lo: np.ndarray, acc: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The MX blocks that tile ``x[a:b]``, given the bits of their maxima and minima
    (``hi``, ``lo``): the largest block ratio, the scales (loops over the blocks that
    vectorize), then one vectorized loop over the elements, with the errors scaled by
    :func:`_normalizer`; all blocks take :func:`_one_block` where a scale is no normal
    float32, the squares lost precision (:func:`_squares_kept`), or the blocks are not
    :data:`_MX_BLOCK` long (every MX format's are)."""
    size = int(p[_B_SIZE])
    nblk = (b - a) // size
    acc[_B_RATIO] = _largest_ratio(hi, lo, acc[_B_RATIO])
    inv = np.empty(nblk, np.int32)
    scl = np.empty(nblk, np.int32)
    if size != _MX_BLOCK or not _mx_scales(hi, _I32(p[_B_EMAX]), inv, scl):
        for k in range(nblk):  # the float64 blocks
            _one_block(x, a + k * size, a + k * size + size, p, _ONE, acc)
        return
    rows = x[a:b].reshape(nblk, size)  # one block a row: 2-D loops vectorize
    pw = _normalizer(hi)
    if pw == np.float32(0.0):
        return
    iv, sc = inv.view(np.float32), scl.view(np.float32) * pw
    part = np.zeros(5)
    _mx_elements(rows, iv, sc, pw, hi, lo, p, part)
    if not np.isfinite(part[_B_ERR]):  # an inf or NaN in the blocks: again, without them
        part[:] = 0.0
        _mx_elements(frozen(_finite_of(rows)), iv, sc, pw, hi, lo, p, part)
    if not _squares_kept(part, b - a, pw, acc):  # the float64 blocks
        for k in range(nblk):
            _one_block(x, a + k * size, a + k * size + size, p, _ONE, acc)


@numba.njit(cache=True, nogil=True)
def _nv_tiled(
    x: np.ndarray, a: int, b: int, p: np.ndarray, hi: np.ndarray, st: np.float32, acc: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The NVFP4 blocks that tile ``x[a:b]`` but for their ratios (the first pass took
    them), given the bits of their maxima ``hi`` (kept from the first pass) and the
    tensor's scale ``st`` (float32): the block scales, then the elements, with the errors
    scaled by :func:`_normalizer` (block by block in float64 where a scale is below
    :data:`_NV_SMALL_SCALE` or the squares lost precision, :func:`_squares_kept`)."""
    nblk = (b - a) // 16
    div = np.empty(nblk, np.float32)
    deq = np.empty(nblk, np.float32)
    _nv_scales(hi, st, div, deq)
    small = False
    for k in range(nblk):
        small |= (deq[k] > np.float32(0)) & (deq[k] < np.float32(_NV_SMALL_SCALE))
    if small:  # a tensor whose largest magnitude is below about 2**-80: in float64
        for k in range(nblk):
            _one_block(x, a + 16 * k, a + 16 * k + 16, p, st, acc)
        return
    pw = _normalizer(hi)
    if pw == np.float32(0.0):
        return
    rows, dq = x[a:b].reshape(nblk, 16), deq * pw
    part = np.zeros(5)
    _nv_elements(rows, div, dq, pw, p, part)
    if not np.isfinite(part[_B_ERR]):  # an inf or NaN in the blocks: again, without them
        part[:] = 0.0
        _nv_elements(frozen(_finite_of(rows)), div, dq, pw, p, part)
    if not _squares_kept(part, b - a, pw, acc):  # the float64 blocks
        for k in range(nblk):
            _one_block(x, a + 16 * k, a + 16 * k + 16, p, st, acc)


@numba.njit(cache=True, nogil=True)
def _has_nv(table: np.ndarray) -> bool:  # pragma: no cover - compiled
    """Whether the formats' table (:func:`_block_table`) holds NVFP4 (emax NaN)."""
    for k in range(table.shape[0]):
        if np.isnan(table[k, _B_EMAX]):
            return True
    return False


@numba.njit(cache=True, nogil=True)
def _first_blocks(
    x: np.ndarray, a: int, b: int, rowlen: int, table: np.ndarray, acc: np.ndarray, hi16: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The first pass's share of the block formats (partials ``acc``: formats x 5) over
    the blocks that start in ``x[a:b]``, ``x`` being one tensor's values in rows of
    ``rowlen`` elements: MX formats whole, NVFP4's block ratios where its blocks tile the
    item. With NVFP4, the maxima of the blocks of 16 are read once (their bits kept in
    ``hi16``, ``(b - a) // 16`` long, for the second pass), and the MX blocks of 32 take
    the larger of each pair; without it, the MX blocks read their own."""
    if rowlen == 0:
        return
    t16 = _has_nv(table) and _tiles(rowlen, a, b, np.int64(16))
    lo16 = np.empty(hi16.size if t16 else 0, np.int32)
    if t16:
        _block_bits(x[a:b].reshape(hi16.size, 16).view(np.int32), hi16, lo16)
    hi32 = np.empty(0, np.int32)
    lo32 = np.empty(0, np.int32)
    for k in range(table.shape[0]):
        p = table[k]
        if np.isnan(p[_B_EMAX]):  # NVFP4: the rest needs the tensor's scale
            if t16:
                acc[k, _B_RATIO] = _largest_ratio(hi16, lo16, acc[k, _B_RATIO])
            continue
        size = int(p[_B_SIZE])
        if not _tiles(rowlen, a, b, size):
            _untiled(x, a, b, rowlen, p, _ONE, acc[k])
            continue
        if hi32.size == 0 and b > a:  # the maxima of the blocks of 32, for every MX format
            hi32 = np.empty((b - a) // size, np.int32)
            lo32 = np.empty(hi32.size, np.int32)
            if t16 and size == 32:
                _pair_bits(hi16, lo16, hi32, lo32)
            else:
                _block_bits(x[a:b].reshape(hi32.size, size).view(np.int32), hi32, lo32)
        _mx_tiled(x, a, b, p, hi32, lo32, acc[k])


@numba.njit(cache=True, nogil=True)
def _second_blocks(
    x: np.ndarray,
    a: int,
    b: int,
    rowlen: int,
    table: np.ndarray,
    st: np.float32,
    acc: np.ndarray,
    hi16: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """NVFP4's share of the second pass (see :func:`_first_blocks`), given the tensor's
    scale ``st`` (float32): the tiled blocks from the maxima the first pass kept in
    ``hi16``, the others block by block."""
    if rowlen == 0:
        return
    for k in range(table.shape[0]):
        p = table[k]
        if not np.isnan(p[_B_EMAX]):
            continue
        if _tiles(rowlen, a, b, np.int64(16)):
            _nv_tiled(x, a, b, p, hi16, st, acc[k])
        else:
            _untiled(x, a, b, rowlen, p, st, acc[k])


@numba.njit(cache=True, nogil=True)
def _tensor_scales(
    part: np.ndarray, seg: np.ndarray, st: np.ndarray
) -> None:  # pragma: no cover - compiled
    """NVFP4's tensor scale ``s_t = max|x| / (448 * 6)`` (float32; 1 without a non-zero
    finite value) into ``st``, one per item, from the items' partials (``part``, as
    :func:`_item` leaves them: the largest magnitude is the larger of the extrema's, from
    their order keys) and their tensors (``seg``; the items of a tensor are consecutive
    and all present)."""
    n = seg.size
    j = 0
    while j < n:
        e = j
        m = np.float32(0)
        while e < n and seg[e] == seg[j]:
            for c in (_MIN, _MAX):
                key = _I32(part[e, c])
                v = abs(_f32_of(_I32(key ^ _I32(_I32(key >> _I32(31)) & _I32(0x7FFFFFFF)))))
                if v > m:  # False for NaN (an item without a finite value)
                    m = v
            e += 1
        s = m / np.float32(448.0 * 6.0) if m > 0 else np.float32(1.0)
        for i in range(j, e):
            st[i] = s
        j = e


@numba.njit(cache=True, nogil=True, inline="always")
def _first_of_item(
    x: np.ndarray,
    bits: np.ndarray,
    j: int,
    a: int,
    b: int,
    pivot: float,
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    blk: _Blocks | None,
) -> None:  # pragma: no cover - compiled
    """The first pass over item ``j`` (``x[a:b]``, with its pivot): :func:`_item` into row
    ``j`` of ``part``, ``hist`` and ``sub``, and its blocks' share (:func:`_first_blocks`)."""
    _item(x[a:b], bits[a:b], pivot, over_at, part[j], hist[j], sub[j])
    if blk is not None:
        t0, t1 = blk.bases[j], blk.ends[j]
        h = blk.hi16[blk.hoff[j] : blk.hoff[j] + (b - a) // 16]
        _first_blocks(x[t0:t1], a - t0, b - t0, blk.rowlens[j], blk.table, blk.acc[j], h)


@numba.njit(cache=True, nogil=True, inline="always")
def _second_of_item(
    x: np.ndarray, j: int, a: int, b: int, st: np.float32, blk: _Blocks
) -> None:  # pragma: no cover - compiled
    """NVFP4's second pass over item ``j`` (``x[a:b]``) with its tensor's scale ``st``."""
    t0, t1 = blk.bases[j], blk.ends[j]
    h = blk.hi16[blk.hoff[j] : blk.hoff[j] + (b - a) // 16]
    _second_blocks(x[t0:t1], a - t0, b - t0, blk.rowlens[j], blk.table, st, blk.acc[j], h)


@numba.njit(cache=True, nogil=True, parallel=True)
def _first_pass(
    x: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    pivots: np.ndarray,
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    blk: _Blocks | None,
) -> None:  # pragma: no cover - compiled
    """:func:`_item` of the items ``x[starts[j]:stops[j]]`` with their pivots, into row
    ``j`` of ``part``, ``hist`` and ``sub``, and their blocks' share of the first pass
    (:func:`_first_blocks`), shared among ``numba.get_num_threads()`` threads."""
    bits = x.view(np.int32)
    for j in numba.prange(starts.size):
        _first_of_item(x, bits, j, starts[j], stops[j], pivots[j], over_at, part, hist, sub, blk)


@numba.njit(cache=True, nogil=True, parallel=True)
def _second_pass(
    x: np.ndarray, starts: np.ndarray, stops: np.ndarray, st: np.ndarray, blk: _Blocks
) -> None:  # pragma: no cover - compiled
    """:func:`_second_blocks` of the items (as :func:`_first_pass`) with their tensors'
    NVFP4 scales ``st``."""
    for j in numba.prange(starts.size):
        _second_of_item(x, j, starts[j], stops[j], st[j], blk)


@numba.njit(cache=True, nogil=True)
def _run(
    x: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    pivots: np.ndarray,
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    blk: _Blocks | None,
) -> None:  # pragma: no cover - compiled
    """The items ``x[starts[j]:stops[j]]`` with their pivots, into row ``j`` of ``part``,
    ``hist`` and ``sub``, shared among ``numba.get_num_threads()`` threads (one thread
    costs about a microsecond more than a plain loop). With a :class:`_Blocks` ``blk``,
    each item's blocks too, while the item is in cache: MX formats in the same pass;
    NVFP4, which needs each tensor's largest magnitude before its first block, in a second
    pass over these items once the first has found it (the items of a tensor are all
    here), from the block maxima the first pass kept."""
    _first_pass(x, starts, stops, pivots, over_at, part, hist, sub, blk)
    if blk is None:
        return
    if not _has_nv(blk.table):
        return
    st = np.empty(starts.size, np.float32)
    _tensor_scales(part, blk.seg, st)
    _second_pass(x, starts, stops, st, blk)


def _address_typing(typingctx: object, address: types.Type) -> object:  # pragma: no cover
    """An int64 address as a raw pointer, what ``numba.carray`` reads from."""
    if address != types.int64:
        return None

    def codegen(context: object, builder: object, sig: object, args: list[object]) -> object:
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))  # type: ignore[attr-defined]

    return types.voidptr(types.int64), codegen


#: Compiled code's view of arrays it gets as addresses (:func:`_run_lanes`): a list of
#: arrays costs 60-220 microseconds a call to pass in, an int64 array of addresses nothing.
_address: Callable[..., Any] = intrinsic(_address_typing)


def _frozen_typing(typingctx: object, arr: types.Type) -> object:  # pragma: no cover
    """The same array, typed read-only (a writable and a read-only array have one data
    model: the value passes through unchanged)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context: object, builder: object, sig: Any, args: list[object]) -> object:
        return impl_ret_borrowed(context, builder, sig.return_type, args[0])  # type: ignore[no-untyped-call]

    return arr.copy(readonly=True)(arr), codegen


#: Compiled code's read-only view of an array it made or took by address: the kernels'
#: inputs are read-only everywhere (see :func:`_read_only`), so each compiles once.
frozen: Callable[..., Any] = intrinsic(_frozen_typing)


@numba.njit(cache=True, nogil=True)
def _run_unit(
    x: np.ndarray,
    r0: int,
    r1: int,
    starts: np.ndarray,
    stops: np.ndarray,
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    blk: _Blocks | None,
) -> None:  # pragma: no cover - compiled
    """:func:`_run` of the items ``r0 .. r1 - 1`` (rows of ``part`` ..., offsets into
    ``x``), whole tensors, on the calling thread: the same passes, in the same order, with
    the same per-item results (pivots in ``part``)."""
    bits = x.view(np.int32)
    for j in range(r0, r1):
        _first_of_item(
            x, bits, j, starts[j], stops[j], part[j, _PIVOT], over_at, part, hist, sub, blk
        )
    if blk is None:
        return
    if not _has_nv(blk.table):
        return
    st = np.empty(r1 - r0, np.float32)
    _tensor_scales(part[r0:r1], blk.seg[r0:r1], st)
    for j in range(r0, r1):
        _second_of_item(x, j, starts[j], stops[j], st[j - r0], blk)


@numba.njit(cache=True, nogil=True)
def _run_sources(
    addresses: np.ndarray,
    sizes: np.ndarray,
    first: np.ndarray,
    last: np.ndarray,
    u0: int,
    u1: int,
    starts: np.ndarray,
    stops: np.ndarray,
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    blk: _Blocks | None,
) -> None:  # pragma: no cover - compiled
    """Sources ``u0 .. u1 - 1`` (float32 buffers at ``addresses``, ``sizes`` elements,
    their items the rows ``first[u] .. last[u] - 1``), each by :func:`_run_unit`, on the
    calling thread: one lane of :func:`_run_lanes`, or every source of a call that has
    one thread (no parallel launch, and no parallel code to compile)."""
    for u in range(u0, u1):
        x = frozen(numba.carray(_address(addresses[u]), (sizes[u],), np.float32))
        _run_unit(x, first[u], last[u], starts, stops, over_at, part, hist, sub, blk)


@numba.njit(cache=True, nogil=True, parallel=True)
def _run_lanes(
    addresses: np.ndarray,
    sizes: np.ndarray,
    first: np.ndarray,
    last: np.ndarray,
    lanes: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    blk: _Blocks | None,
) -> None:  # pragma: no cover - compiled
    """Sources (as :func:`_run_sources`), each whole on one thread: the sources
    ``lanes[l] .. lanes[l + 1] - 1`` on lane ``l``, one lane a thread. For sources too
    small to share among threads (an item or two), which :func:`_run` would run one at a
    time on one thread while the others wait, and with a parallel launch each."""
    for lane in numba.prange(lanes.size - 1):
        _run_sources(
            addresses,
            sizes,
            first,
            last,
            lanes[lane],
            lanes[lane + 1],
            starts,
            stops,
            over_at,
            part,
            hist,
            sub,
            blk,
        )


@numba.njit(cache=True, nogil=True)
def _first_finite(
    x: np.ndarray, starts: np.ndarray, stops: np.ndarray
) -> np.ndarray:  # pragma: no cover - compiled
    """The first finite value of each segment ``x[starts[j]:stops[j]]`` (0 if none)."""
    out = np.zeros(starts.size)
    for j in range(starts.size):
        for i in range(starts[j], stops[j]):
            if abs(np.float64(x[i])) <= 3.4028234663852886e38:
                out[j] = x[i]
                break
    return out


@numba.njit(cache=True, nogil=True)
def _widen_bf16(half: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[i] = half[i] << 16``: bfloat16 bits (uint16) to float32 bits (uint32)."""
    for i in range(half.size):
        out[i] = np.uint32(half[i]) << np.uint32(16)


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``.

    numba compiles a kernel once per argument type, and an array's writeable flag is part
    of its type: a JAX array's memory is read-only, a torch tensor's is not. The kernels
    only read their input, so every input reaches them read-only, and each kernel is
    compiled once, not twice (the host kernel's three test files compiled 105 signatures,
    30 of them a second time for writable arrays; 66 now, with the other types unified)."""
    if not a.flags.writeable:
        return a
    view: np.ndarray = a.view()
    view.flags.writeable = False
    return view


def _as_float32(a: np.ndarray) -> np.ndarray:
    """A flat, read-only float32 view (float32 input) or widened copy (narrower floats)
    of ``a`` (read-only: see :func:`_read_only`)."""
    a = np.ascontiguousarray(a).reshape(-1)
    if a.dtype == np.float32:
        return _read_only(a)
    if a.dtype == ml_dtypes.bfloat16:  # the top half of a float32: a shift, no rounding
        # one compiled pass into one new array (numpy's astype and shift: two passes, two
        # arrays): 0.16 -> 0.07 ns per element
        out = np.empty(a.size, np.uint32)
        _widen_bf16(_read_only(a.view(np.uint16)), out)
        return _read_only(out.view(np.float32))
    return _read_only(a.astype(np.float32))


@cache
def _fold(fmt: NumberFormat) -> tuple[np.ndarray, np.ndarray]:
    """The layout count bin of each float32 exponent field and of each subnormal
    exponent (-149 .. -127). Fields 0 (zeros and subnormals, the latter counted apart) and
    255 (inf, counted apart, and NaN) go to the discard bin ``num_bins + 2``. int32, as
    the in-program kernel gets them from JAX: one type for every caller, one compile."""
    nb = fmt.num_bins

    def bins(exp: np.ndarray) -> np.ndarray:
        b = np.where(exp < fmt.min_exponent, 0, exp - fmt.min_exponent + 1).clip(max=nb + 1)
        return b.astype(np.int32)

    field = bins(np.arange(256) - 127)
    field[0] = field[255] = nb + 2
    return field, bins(np.arange(_NSUB) - 149)


# Where :func:`_finish` writes each core field (module-level ints: constants to numba).
_O_NUMEL = FIELD_INDEX["numel"]
_O_NAN = FIELD_INDEX["nan_count"]
_O_INF = FIELD_INDEX["inf_count"]
_O_ZERO = FIELD_INDEX["zero_count"]
_O_MIN = FIELD_INDEX["min"]
_O_MAX = FIELD_INDEX["max"]
_O_MINABS = FIELD_INDEX["min_abs"]
_O_MAXABS = FIELD_INDEX["max_abs"]
_O_MEAN = FIELD_INDEX["mean"]
_O_M2 = FIELD_INDEX["m2"]
_O_P1 = FIELD_INDEX["p1"]
_O_P2 = FIELD_INDEX["p2"]
_O_P4 = FIELD_INDEX["p4"]
_O_P8 = FIELD_INDEX["p8"]
# The wire format's part boundaries (:func:`tandv.stats.summary.split_summary`), as ints.
_NCORE = N_CORE
_NLEAD = N_LEADING_COUNTS
_NVALUES = N_CORE_VALUES


@numba.njit(cache=True, nogil=True)
def _finish(
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    item_seg: np.ndarray,
    lens: np.ndarray,
    field_bin: np.ndarray,
    sub_bin: np.ndarray,
    nb: int,
    out: np.ndarray,
    ok: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """Combines the items of each array and writes its summary vector to ``out`` (core
    fields, then the ``nb + 2`` exponent counts); ``ok`` marks the rows whose largest
    magnitude lies in :data:`SAFE_RANGE` (or is 0): the others' power sums are left to
    :func:`_scaled_powers`."""
    k = lens.size
    P = np.zeros((k, _NPART))
    keys = np.empty((k, 3), dtype=np.int32)  # min key, max key, min |x| bits
    keys[:, 0] = 0x7FFFFFFF
    keys[:, 1] = -0x7FFFFFFF - 1
    keys[:, 2] = 0x7F800000
    counts = np.zeros((k, nb + 3))
    field255 = np.zeros(k)  # inf and NaN
    for j in range(item_seg.size):
        r = item_seg[j]
        field255[r] += hist[j, 0, 255] + hist[j, 1, 255] + hist[j, 2, 255] + hist[j, 3, 255]
        for c in (_INF, _ZERO, _OVER, _S1, _S2, _A1, _A2, _A4, _A8):
            P[r, c] += part[j, c]
        P[r, _PIVOT] = part[j, _PIVOT]
        keys[r, 0] = min(keys[r, 0], np.int32(part[j, _MIN]))
        keys[r, 1] = max(keys[r, 1], np.int32(part[j, _MAX]))
        keys[r, 2] = min(keys[r, 2], np.int32(part[j, _MINABS]))
        for t in range(4):
            for f in range(256):
                counts[r, field_bin[f]] += hist[j, t, f]
        for e in range(_NSUB):
            counts[r, sub_bin[e]] += sub[j, e]
    for r in range(k):  # order keys back to float bits
        for c in range(2):
            keys[r, c] = keys[r, c] ^ ((keys[r, c] >> 31) & 0x7FFFFFFF)
    ext = keys.view(np.float32)
    for r in range(k):
        inf = P[r, _INF]
        nan = field255[r] - inf
        nfin = lens[r] - nan - inf
        out[r, _O_NUMEL] = lens[r]
        out[r, _O_NAN] = nan
        out[r, _O_INF] = inf
        out[r, _O_ZERO] = P[r, _ZERO]
        if nfin > 0:
            mn = np.float64(ext[r, 0])
            mx = np.float64(ext[r, 1])
            s = max(abs(mn), abs(mx))  # +0.0 for an all-zero array (-mn would be -0.0)
            out[r, _O_MIN] = mn
            out[r, _O_MAX] = mx
            out[r, _O_MINABS] = np.float64(ext[r, 2])
        else:
            s = 0.0
            out[r, _O_MIN] = np.inf
            out[r, _O_MAX] = -np.inf
            out[r, _O_MINABS] = np.inf
        out[r, _O_MAXABS] = s
        ok[r] = s == 0.0 or (s >= _SAFE_LO and s <= _SAFE_HI)
        scale = s if s > 0.0 else 1.0
        nf = nfin if nfin > 0 else 1.0
        s1 = P[r, _S1]
        out[r, _O_MEAN] = P[r, _PIVOT] + s1 / nf if nfin > 0 else 0.0
        out[r, _O_M2] = max(P[r, _S2] - s1 * s1 / nf, 0.0) / (scale * scale)
        if ok[r]:
            out[r, _O_P1] = P[r, _A1] / scale
            out[r, _O_P2] = P[r, _A2] / scale**2
            out[r, _O_P4] = P[r, _A4] / scale**4
            out[r, _O_P8] = P[r, _A8] / scale**8
        # values above a format max inside its top binade (float8_e4m3fn: 448 < 512) were
        # counted in the top exponent: move them to the overflow bin, with the infinities
        over = P[r, _OVER]
        counts[r, nb] -= over - counts[r, nb + 1]
        counts[r, nb + 1] = over + inf
        for c in range(nb + 2):
            out[r, _NCORE + c] = counts[r, c]


@numba.njit(cache=True, nogil=True)
def _scaled_powers(x: np.ndarray, s: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Writes the power sums of ``|x| / s`` over the finite values to ``out``'s p1 .. p8:
    a second pass for arrays whose largest magnitude ``s`` lies outside :data:`SAFE_RANGE`."""
    _, _, out[_O_P1], out[_O_P2], out[_O_P4], out[_O_P8] = _float_sums(x, 0.0, 1.0 / s)


@numba.njit(cache=True, nogil=True)
def _one_start(
    x: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:  # pragma: no cover - compiled
    """The partials (zeros) of one flat float32 array ``x`` cut into items of
    :data:`_CHUNK` elements, and its pivot (its first finite value)."""
    n = x.size
    items = max(1, (n + _CHUNK - 1) // _CHUNK)
    part = np.zeros((items, _NPART))
    hist = np.zeros((items, 4, 256), dtype=np.int64)
    sub = np.zeros((items, _NSUB), dtype=np.int64)
    pivot = _first_finite(x, np.zeros(1, np.int64), np.full(1, n, np.int64))[0]
    return part, hist, sub, pivot


@numba.njit(cache=True, nogil=True)
def _one_item(
    x: np.ndarray,
    j: int,
    pivot: float,
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """:func:`_item` of item ``j`` of ``x`` (as :func:`_one_start` cuts it)."""
    a = j * _CHUNK
    b = min(x.size, a + _CHUNK)
    part[j, _PIVOT] = pivot
    _item(x[a:b], x.view(np.int32)[a:b], pivot, over_at, part[j], hist[j], sub[j])


@numba.njit(cache=True, nogil=True)
def _one_finish(
    x: np.ndarray,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    field_bin: np.ndarray,
    sub_bin: np.ndarray,
    nb: int,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """The summary vector of ``x`` into ``out`` from its items' partials, with the
    second, scaled pass where its range needs it."""
    items = part.shape[0]
    ok = np.zeros(1, dtype=np.bool_)
    row = out.reshape(1, out.size)
    _finish(
        part,
        hist,
        sub,
        np.zeros(items, np.int64),
        np.full(1, x.size, np.int64),
        field_bin,
        sub_bin,
        nb,
        row,
        ok,
    )
    if not ok[0]:
        _scaled_powers(x, out[_O_MAXABS], out)


@numba.njit(cache=True, nogil=True)
def summary_serial(
    x: np.ndarray,
    field_bin: np.ndarray,
    sub_bin: np.ndarray,
    nb: int,
    over_at: float,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """The summary vector of one float32 array ``x`` into ``out`` on the calling thread,
    valid whatever its range (out-of-range arrays take a second, scaled pass).

    For callers that run inside another runtime's thread (XLA:CPU's custom calls): no
    numba threads, no Python. ``field_bin``, ``sub_bin`` and ``nb`` come from :func:`_fold`
    and the format; ``over_at`` is the format's largest finite value (at most float32's)."""
    part, hist, sub, pivot = _one_start(x)
    for j in range(part.shape[0]):
        _one_item(x, j, pivot, over_at, part, hist, sub)
    _one_finish(x, part, hist, sub, field_bin, sub_bin, nb, out)


@numba.njit(cache=True, nogil=True, parallel=True)
def _summary_one(
    x: np.ndarray,
    field_bin: np.ndarray,
    sub_bin: np.ndarray,
    nb: int,
    over_at: float,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """:func:`summary_serial` with the items shared among ``numba.get_num_threads()``
    threads: :func:`host_summaries`' path for one array without block formats (one
    tensor per hook, its commonest call), which skips the planning of many arrays' items
    (about 50 -> 15 microseconds a call). The same items, pivot and merge, so the same row."""
    part, hist, sub, pivot = _one_start(x)
    for j in numba.prange(part.shape[0]):
        _one_item(x, np.int64(j), pivot, over_at, part, hist, sub)
    _one_finish(x, part, hist, sub, field_bin, sub_bin, nb, out)


@numba.njit(cache=True, nogil=True)
def _one_first(
    x: np.ndarray,
    j: int,
    pivot: float,
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    rowlen: int,
    table: np.ndarray,
    acc: np.ndarray,
    hi16: np.ndarray,
    per: int,
) -> None:  # pragma: no cover - compiled
    """The first pass over item ``j`` of ``x`` (as :func:`_one_start` cuts it):
    :func:`_one_item`, and its blocks' share (:func:`_first_blocks`) into ``acc[j]``,
    keeping the maxima of its blocks of 16 in ``hi16`` (``per`` a chunk; 0: no NVFP4)."""
    a = j * _CHUNK
    b = min(x.size, a + _CHUNK)
    _one_item(x, j, pivot, over_at, part, hist, sub)
    h = hi16[j * per : j * per + min(per, (b - a) // 16)]
    _first_blocks(x, a, b, rowlen, table, acc[j], h)


@numba.njit(cache=True, nogil=True)
def _one_second(
    x: np.ndarray,
    j: int,
    rowlen: int,
    table: np.ndarray,
    amax: float,
    acc: np.ndarray,
    hi16: np.ndarray,
    per: int,
) -> None:  # pragma: no cover - compiled
    """NVFP4's second pass over item ``j`` of ``x`` (:func:`_second_blocks`), its tensor's
    scale from the largest magnitude ``amax`` (a float32's value), from the maxima that
    :func:`_one_first` kept."""
    a = j * _CHUNK
    b = min(x.size, a + _CHUNK)
    m = np.float32(amax)
    st = m / np.float32(448.0 * 6.0) if m > 0 else np.float32(1.0)
    h = hi16[j * per : j * per + (b - a) // 16]
    _second_blocks(x, a, b, rowlen, table, st, acc[j], h)


@numba.njit(cache=True, nogil=True, parallel=True)
def _summary_blocks_one(
    x: np.ndarray,
    rowlen: int,
    field_bin: np.ndarray,
    sub_bin: np.ndarray,
    nb: int,
    over_at: float,
    table: np.ndarray,
    out: np.ndarray,
    acc: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """:func:`_summary_one` with the block formats of ``table`` (:func:`_block_table`;
    ``x`` in rows of ``rowlen``), their partials into ``acc`` (items x formats x 5, zeros):
    :func:`host_summaries`' path for one array with block formats (a hook's tensor), which
    skips the planning of many arrays' items (91 -> 20 microseconds a call of a small
    array). The same items, pivot, passes and merge as that planning gives, so the same
    row: the first pass's blocks with each item, NVFP4's second pass once the summary has
    the tensor's largest magnitude (``max_abs``, a float32's value) from the maxima the
    first kept."""
    part, hist, sub, pivot = _one_start(x)
    per = _CHUNK // 16 if _has_nv(table) else 0
    hi16 = np.empty(part.shape[0] * per, np.int32)
    for j in numba.prange(part.shape[0]):
        _one_first(x, np.int64(j), pivot, over_at, part, hist, sub, rowlen, table, acc, hi16, per)
    _one_finish(x, part, hist, sub, field_bin, sub_bin, nb, out)
    if per == 0:
        return
    for j in numba.prange(part.shape[0]):
        _one_second(x, np.int64(j), rowlen, table, out[_O_MAXABS], acc, hi16, per)


@numba.njit(cache=True, nogil=True)
def _summary_blocks_serial(
    x: np.ndarray,
    rowlen: int,
    field_bin: np.ndarray,
    sub_bin: np.ndarray,
    nb: int,
    over_at: float,
    table: np.ndarray,
    out: np.ndarray,
    acc: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """:func:`_summary_blocks_one` on the calling thread (a call with one thread: no
    parallel launch, and no parallel code compiled for a run that never needs it)."""
    part, hist, sub, pivot = _one_start(x)
    per = _CHUNK // 16 if _has_nv(table) else 0
    hi16 = np.empty(part.shape[0] * per, np.int32)
    for j in range(part.shape[0]):
        _one_first(x, j, pivot, over_at, part, hist, sub, rowlen, table, acc, hi16, per)
    _one_finish(x, part, hist, sub, field_bin, sub_bin, nb, out)
    if per == 0:
        return
    for j in range(part.shape[0]):
        _one_second(x, j, rowlen, table, out[_O_MAXABS], acc, hi16, per)


@numba.njit(cache=True, nogil=True)
def split_serial(
    v: np.ndarray, counts: np.ndarray, values: np.ndarray
) -> None:  # pragma: no cover - compiled
    """:func:`tandv.stats.summary.split_summary` of one summary ``v`` without custom
    statistics, for compiled callers (XLA's custom call): the leading and exponent counts
    into ``counts`` (``len(v) - N_CORE_VALUES`` of them) and the core values into
    ``values`` (at least ``N_CORE_VALUES``; custom statistics, which ``v`` lacks, are left
    as they are), converted to the arrays' dtypes as ``numpy`` converts scalars."""
    for i in range(_NLEAD):
        counts[i] = v[i]
    for i in range(_NVALUES):
        values[i] = v[_NLEAD + i]
    for i in range(counts.size - _NLEAD):
        counts[_NLEAD + i] = v[_NCORE + i]


@numba.njit(cache=True, nogil=True)
def blocks_serial(
    x: np.ndarray, rowlen: int, table: np.ndarray, amax: float, acc: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The block formats' partials of one flat float32 array ``x`` (rows of ``rowlen``
    elements) added to ``acc`` (formats x 5: underflow, subnormal, saturated, squared
    error, largest block ratio ``max / min``), on the calling thread: for compiled callers
    (XLA's custom call), after :func:`summary_serial`, whose largest magnitude ``amax``
    gives NVFP4's tensor scale. Chunk by chunk, as :func:`host_summaries` runs a large
    array's items, each chunk's NVFP4 blocks while it is still in cache. ``table``:
    :func:`serial_block_table`."""
    n = x.size
    nv = _has_nv(table)
    f32 = np.float32
    st = f32(amax) / f32(448.0 * 6.0) if amax > 0 else f32(1.0)
    hi16 = np.empty(_CHUNK // 16 if nv else 0, np.int32)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        h = hi16[: (b - a) // 16] if nv else hi16
        _first_blocks(x, a, b, rowlen, table, acc, h)
        if nv:
            _second_blocks(x, a, b, rowlen, table, st, acc, h)


def serial_block_table(formats: tuple[BlockFormat, ...]) -> np.ndarray:
    """The ``table`` argument of :func:`blocks_serial` for ``formats`` (float64, formats x
    8; shared: read only)."""
    return _block_table(tuple(formats))


@cache
def serial_tables(fmt: NumberFormat) -> tuple[np.ndarray, np.ndarray, int, float]:
    """The arguments after ``x`` of :func:`summary_serial` for format ``fmt``:
    ``(field_bin, sub_bin, nb, over_at)``, the tables int32 (shared: read only)."""
    field_bin, sub_bin = _fold(fmt)
    return field_bin, sub_bin, fmt.num_bins, min(fmt.max, _F32_MAX)


#: numba's simplest threading layer (workqueue, used when no OpenMP or TBB runtime is
#: found) aborts when two threads launch parallel kernels at once: ours go one at a time.
_launch = threading.Lock()


class _Blocks(NamedTuple):
    """What the kernel needs for the block-scaled formats of its items (row ``j`` each):
    the formats' parameters (:func:`_block_table`; no rows: none), the extent of the item's
    tensor in the buffer (``bases``, ``ends``), its row length, its tensor (``seg``: the
    items of one tensor are consecutive), the offset (``hoff``) of its blocks' maxima in
    ``hi16`` (one int32 per block of 16 of each item, kept from the first pass for NVFP4's
    second; empty without NVFP4), and the partials (``acc``: items x formats x 5)."""

    table: np.ndarray
    bases: np.ndarray
    ends: np.ndarray
    rowlens: np.ndarray
    seg: np.ndarray
    hoff: np.ndarray
    hi16: np.ndarray
    acc: np.ndarray

    def rows(self, rows: slice) -> _Blocks:
        """The items ``rows`` of these (``table`` and ``hi16`` are shared)."""
        return _Blocks(
            self.table,
            self.bases[rows],
            self.ends[rows],
            self.rowlens[rows],
            self.seg[rows],
            self.hoff[rows],
            self.hi16,
            self.acc[rows],
        )


def _blocks_of(
    formats: tuple[BlockFormat, ...],
    bases: np.ndarray,
    ends: np.ndarray,
    rowlens: np.ndarray,
    seg: np.ndarray,
    sizes: np.ndarray,
) -> _Blocks | None:
    """The :class:`_Blocks` of items of ``sizes`` elements for ``formats``, or None
    without formats: the kernels are compiled for that None apart (their block-format
    code pruned at typing time), so that a run without block formats never compiles it."""
    if not formats:
        return None
    nv = any(f.emax is None for f in formats)
    per_item = sizes // 16 if nv else np.zeros(sizes.size, np.int64)
    return _Blocks(
        _block_table(formats),
        bases,
        ends,
        rowlens,
        seg,
        np.concatenate([[0], np.cumsum(per_item)[:-1]]).astype(np.int64),
        np.empty(int(per_item.sum()), np.int32),
        np.zeros((sizes.size, len(formats), len(BLOCK_COLUMNS))),
    )


@contextmanager
def _numba_threads(threads: int, elements: int) -> Iterator[int]:
    """Runs the block with ``threads`` numba threads (fewer for less than two chunks of
    ``elements``), one launch at a time, and restores the caller's setting; gives the
    block that number (with one, the block calls the serial kernels: no parallel launch,
    and no parallel code compiled for a run that never needs more)."""
    with _launch:
        before = numba.get_num_threads()  # the caller's setting, restored below
        # numba.config sets its options with setattr at import time: invisible to mypy
        most = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
        use = max(1, min(threads, most, elements // _CHUNK))
        if use == before:  # each set costs about 2 microseconds
            yield use
            return
        numba.set_num_threads(use)
        try:
            yield use
        finally:
            numba.set_num_threads(before)


#: Sources of at most this many elements run whole on one thread (:func:`_run_lanes`),
#: beside other such sources on the other threads; larger ones share their items.
_LANE_MAX = 2 * _CHUNK


def _lanes(sizes: list[int], lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """The sources of ``sizes`` (elements) dealt to ``lanes`` lanes, the largest first to
    the least loaded lane: the sources' numbers, lane by lane (each lane's in order), and
    where each lane starts (``lanes + 1`` offsets)."""
    load = [0] * lanes
    dealt: list[list[int]] = [[] for _ in range(lanes)]
    for u in sorted(range(len(sizes)), key=lambda u: -sizes[u]):
        lane = load.index(min(load))
        load[lane] += sizes[u]
        dealt[lane].append(u)
    order = np.array([u for d in dealt for u in sorted(d)], np.int64)
    bounds = np.cumsum([0] + [len(d) for d in dealt]).astype(np.int64)
    return order, bounds


def _run_all(
    sources: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    over_at: float,
    part: np.ndarray,
    hist: np.ndarray,
    sub: np.ndarray,
    threads: int,
    blk: _Blocks | None,
) -> None:
    """Runs every item of ``sources`` (``(x, starts, stops, pivots)``; rows numbered in
    order), on ``threads`` threads when there are at least two items' worth of elements.
    Threads come from numba's parallel loop, not a Python thread pool (stats/DESIGN.md
    says why). The block formats of ``blk`` run in the same call, source by source: a
    source's NVFP4 pass follows its first pass, so that it finds the values still in the
    cache where they fit, not after every other array's pass. Sources of at most
    :data:`_LANE_MAX` elements run whole, each on one thread, all in one parallel launch
    (:func:`_run_lanes`); the larger ones share their items among the threads, one launch
    (two with NVFP4) a source. With one thread, every source runs whole in one serial
    call (:func:`_run_sources`): the same items, passes and results."""
    total = sum(int(sp[-1] - st[0]) for _, st, sp, _ in sources if st.size)
    rows = np.cumsum([0] + [st.size for _, st, _, _ in sources]).astype(np.int64)
    with _numba_threads(threads, total) as use:
        whole = [
            u
            for u, (x, st, _, _) in enumerate(sources)
            if st.size and (use == 1 or x.size <= _LANE_MAX)
        ]
        done = set(whole)
        if whole:
            order, bounds = _lanes([sources[u][0].size for u in whole], use)
            units = [whole[u] for u in order]
            addresses = np.array([sources[u][0].ctypes.data for u in units], np.int64)
            sizes = np.array([sources[u][0].size for u in units], np.int64)
            first, last = rows[units], rows[np.array(units) + 1]
            starts = np.concatenate([st for _, st, _, _ in sources])
            stops = np.concatenate([sp for _, _, sp, _ in sources])
            if use == 1:
                _run_sources(
                    addresses,
                    sizes,
                    first,
                    last,
                    0,
                    len(units),
                    starts,
                    stops,
                    over_at,
                    part,
                    hist,
                    sub,
                    blk,
                )
            else:
                _run_lanes(
                    addresses,
                    sizes,
                    first,
                    last,
                    bounds,
                    starts,
                    stops,
                    over_at,
                    part,
                    hist,
                    sub,
                    blk,
                )
        for u, (x, st, sp, pv) in enumerate(sources):
            if u in done:
                continue
            r = slice(rows[u], rows[u + 1])
            _run(
                x,
                st,
                sp,
                pv,
                over_at,
                part[r],
                hist[r],
                sub[r],
                None if blk is None else blk.rows(r),
            )


def _host_one(
    x: np.ndarray,
    shape: tuple[int, ...],
    layout: Layout,
    formats: tuple[BlockFormat, ...],
    threads: int,
    out: np.ndarray,
) -> None:
    """:func:`host_summaries`' row ``out`` of one array (flat float32 ``x`` of ``shape``)
    by the one-array kernels, which skip the planning of many arrays' items."""
    field_bin, sub_bin, nb, over_at = serial_tables(layout.format)
    if not formats:
        with _numba_threads(threads, x.size) as use:
            kernel = summary_serial if use == 1 else _summary_one
            kernel(x, field_bin, sub_bin, nb, over_at, out)
        return
    acc = np.zeros((max(1, -(-x.size // _CHUNK)), len(formats), len(BLOCK_COLUMNS)))
    rowlen = shape[-1] if shape else 1
    table = _block_table(formats)
    with _numba_threads(threads, x.size) as use:
        with_blocks = _summary_blocks_serial if use == 1 else _summary_blocks_one
        with_blocks(x, rowlen, field_bin, sub_bin, nb, over_at, table, out, acc)
    cols = _block_columns(acc, np.zeros(acc.shape[0], np.int64), 1)
    out[layout.extras_start :] = cols.reshape(-1)


def host_summaries(arrays: Sequence[np.ndarray], layout: Layout, threads: int = 1) -> np.ndarray:
    """Summary vectors of host arrays, all in one layout (custom statistics excluded, but
    for the block-scaled formats' columns that lead them: :func:`tandv.stats.blocks.
    block_formats_of`).

    Arguments:
        arrays: numpy arrays of a dtype in :data:`HOST_DTYPES`, any shape (blocks run
            along the last dimension).
        layout: gives the number format of the exponent counts, and the block formats.
        threads: how many threads may share the work (numba's threads, at most
            ``numba.config.NUMBA_NUM_THREADS``); less than two chunks of elements
            (:data:`_CHUNK`) run on the calling thread alone.

    Returns:
        A float64 array with one row per input: the fields of ``CORE_FIELDS``, the
        exponent counts, then the block formats' columns (``layout.extras_start + 5 *
        formats`` columns).

    Raises:
        TypeError: if an array's dtype is not one of :data:`HOST_DTYPES`.
    """
    flats = []
    for a in arrays:
        if a.dtype not in HOST_DTYPES:
            raise TypeError(
                f"host_summaries: dtype {a.dtype} is not one of "
                f"{', '.join(str(d) for d in HOST_DTYPES)}"
            )
        flats.append(_as_float32(a))
    formats = _formats_of(layout.extras)
    k = len(flats)
    out = np.zeros((k, layout.extras_start + len(BLOCK_COLUMNS) * len(formats)))
    if k == 0:
        return out
    if k == 1:  # one tensor (a hook's): no planning of many arrays' items
        _host_one(flats[0], arrays[0].shape, layout, formats, threads, out[0])
        return out
    lens = np.array([f.size for f in flats], dtype=np.int64)
    rowlens = np.array([a.shape[-1] if a.ndim else 1 for a in arrays], dtype=np.int64)
    # Items: each array cut in chunks (read in place, all with the array's pivot), except
    # the small ones, concatenated into one buffer, one item and pivot each.
    sources: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    bases = []
    small = lens <= _SMALL
    for i in np.flatnonzero(~small):
        x = flats[i]
        st = np.arange(0, lens[i], _CHUNK)
        pivot = _first_finite(x, np.zeros(1, np.int64), np.array([x.size]))[0]
        sources.append(
            (x, st, np.minimum(st + _CHUNK, lens[i]), np.full(st.size, pivot), np.full(st.size, i))
        )
        bases.append(np.zeros(st.size, np.int64))
    if small.any():
        idx = np.flatnonzero(small)
        sp = np.cumsum(lens[idx])
        st = sp - lens[idx]
        x = _read_only(np.concatenate([flats[i] for i in idx])) if idx.size > 1 else flats[idx[0]]
        sources.append((x, st, sp, _first_finite(x, st, sp), idx))
        bases.append(st)
    item_seg = np.concatenate([src[4] for src in sources])
    n_items = item_seg.size
    part = np.zeros((n_items, _NPART))
    hist = np.zeros((n_items, 4, 256), dtype=np.int64)
    sub = np.zeros((n_items, _NSUB), dtype=np.int64)
    part[:, _PIVOT] = np.concatenate([src[3] for src in sources])
    fmt = layout.format
    base = np.concatenate(bases)
    starts = np.concatenate([src[1] for src in sources])
    stops = np.concatenate([src[2] for src in sources])
    # NVFP4 needs the tensor's largest magnitude first: a second read. No smaller summary
    # of a block can stand in for it: before s_t is known, the block's scale s_b * s_t is
    # known only within E4M3's rounding (a factor 1 +- 2**-4 for a normal s_b, up to 2 for a
    # subnormal one, 0 or not for blocks far below the tensor's maximum), and an element's
    # count and error depend on where x / (s_b * s_t) falls against E2M1's midpoints (0.25,
    # 0.75, ..., 5) and 6, where any element may lie within that window; the error
    # s**2 sum(q**2) - 2 s sum(q |x|) + sum(x**2) needs every q, which moves with s. So
    # exact counts need the block's values, that is, a second read; the first pass keeps
    # the blocks' maxima (1/16 of the values) for it.
    blk = _blocks_of(
        formats, base, base + lens[item_seg], rowlens[item_seg], item_seg, stops - starts
    )
    over_at = min(fmt.max, _F32_MAX)
    _run_all([src[:4] for src in sources], over_at, part, hist, sub, threads, blk)
    field_bin, sub_bin = _fold(fmt)
    ok = np.zeros(k, dtype=np.bool_)
    _finish(part, hist, sub, item_seg, lens, field_bin, sub_bin, fmt.num_bins, out, ok)
    for i in np.flatnonzero(~ok):  # largest magnitude outside SAFE_RANGE
        _scaled_powers(flats[i], out[i, _O_MAXABS], out[i])
    if blk is None:
        return out
    cols = _block_columns(blk.acc, item_seg, k)
    out[:, layout.extras_start :] = cols.reshape(k, -1)
    return out


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _centred_sums(
    x: np.ndarray, mean: float, inv: float
) -> tuple[float, float, float, float, float]:  # pragma: no cover - compiled
    """float64 sums over the finite values of ``d = (x - mean) * inv`` to the powers 1..4,
    and their count (reassociated, so the sums vectorize; NaN and inf semantics kept)."""
    n = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    s4 = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        fin = abs(v) <= 1.7976931348623157e308  # false for inf and NaN
        d = (v - mean) * inv if fin else 0.0
        d2 = d * d
        n += 1.0 if fin else 0.0
        s1 += d
        s2 += d2
        s3 += d2 * d
        s4 += d2 * d2
    return n, s1, s2, s3, s4


@numba.njit(cache=True, nogil=True)
def higher_serial(
    x: np.ndarray, v: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    """``out[0], out[1] = m3, m4`` of a flat array ``x`` given its summary vector ``v`` (the
    mean and largest magnitude are read from it), on the calling thread: the pass of
    :func:`host_higher_moments` for compiled callers (XLA's custom call)."""
    s = v[_O_MAXABS]
    n, s1, s2, s3, s4 = _centred_sums(x, v[_O_MEAN], 1.0 / s if s > 0 else 1.0)
    out[0] = 0.0
    out[1] = 0.0
    if n > 0:
        e = s1 / n
        out[0] = s3 - 3.0 * e * s2 + 2.0 * n * e**3
        out[1] = s4 - 4.0 * e * s3 + 6.0 * e * e * s2 - 3.0 * n * e**4


def host_higher_moments(arrays: Sequence[np.ndarray], summaries: np.ndarray) -> np.ndarray:
    """The third and fourth centred sums (``m3``, ``m4`` of :data:`HIGHER_FIELDS`) of host
    arrays, given their summaries from :func:`host_summaries`: one more compiled pass per
    array (only for ``Layout(moments=4)``), in float64.

    Each array's deviations are taken from its summary's mean and scaled by its largest
    magnitude, like ``m2``; the rounding of that mean is then taken out exactly
    (``sum((d - e)**3) = S3 - 3 e S2 + 2 n e**3``, ``e`` the deviations' own mean), so the
    sums stay accurate when ``|mean| >> std``.

    Returns:
        A ``(len(arrays), 2)`` float64 array, to append after the custom statistics.
    """
    out = np.zeros((len(arrays), len(HIGHER_FIELDS)))
    for i, a in enumerate(arrays):
        x = _as_float32(a) if a.dtype != np.float64 else a.reshape(-1)
        higher_serial(x.reshape(-1), np.ascontiguousarray(summaries[i], np.float64), out[i])
    return out


@numba.njit(cache=True, nogil=True)
def _merge_items(
    acc: np.ndarray, item_seg: np.ndarray, k: int
) -> np.ndarray:  # pragma: no cover - compiled
    """The items' partials (``acc``: items x formats x 5) merged per array (``item_seg``:
    each item's array, ``k`` arrays): sums added, in item order, and the largest block
    ratio kept. Compiled: a handful of numpy calls cost more than the loop, per call."""
    merged = np.zeros((k, acc.shape[1], acc.shape[2]))
    for j in range(item_seg.size):
        r = item_seg[j]
        for f in range(acc.shape[1]):
            for c in range(_B_RATIO):
                merged[r, f, c] += acc[j, f, c]
            merged[r, f, _B_RATIO] = max(merged[r, f, _B_RATIO], acc[j, f, _B_RATIO])
    return merged


def _block_columns(acc: np.ndarray, item_seg: np.ndarray, k: int) -> np.ndarray:
    """The block formats' columns (``k`` arrays x formats x 5) from their items' partials
    (:func:`_merge_items`), the largest block ratio as its log2 (numpy's, as the
    reference's)."""
    merged = _merge_items(acc, item_seg, k)
    merged[:, :, _B_RATIO] = np.log2(np.maximum(merged[:, :, _B_RATIO], 1.0))
    return merged
