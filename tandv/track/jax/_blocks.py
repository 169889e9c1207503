"""Block-scaled formats' columns (:mod:`tandv.stats.blocks`) on the JAX device paths.

JAX runs without 64-bit types, and float32 holds neither a count past 2**24, nor a
``sq_err`` of values below about 1e-19 or above 1e19 (its terms underflow or overflow), nor
the float64 ``log2`` a block range equals. So the device computes, per format, *words* from
which the host finishes the five columns exactly (:func:`decode`):

- in the int32 part of the summary (after the exponent counts): ``underflow``,
  ``subnormal``, ``saturated`` (exact int32 counts), the bits of the largest and smallest
  non-zero finite magnitude of the block with the largest ratio (found by an exact
  comparison of the ratios, below) and ``sq_exp``; then one marker word, ``-1 - formats``;
- in the float32 part (right after the core values): ``sq_scaled``, the squared error
  divided by ``2**sq_exp`` (at most twice the number of blocks).

The host computes ``block_range = log2(float64(hi) / float64(lo))`` (what the numpy
reference computes for that block) and ``sq_err = sq_scaled * 2**sq_exp``.
:func:`._summary.to_vector` recognizes such a summary by its negative last count (every
count is otherwise non-negative) and decodes it into the layout's columns.

On XLA:CPU the host kernel computes the words in its custom call (:mod:`._ffi`), in the
same layout but for one change, marked by the marker word ``-1 - HOST_MARK - formats``:
in place of ``hi`` and ``lo``, the two words of the largest block ratio ``max / min`` as
the kernel computed it in float64 (low word first), whose ``log2`` the host takes.

Everything a count depends on is computed in integer arithmetic on the values' bits
(XLA:CPU flushes float32 subnormals to zero in float arithmetic) or in float32 operations on
normal numbers whose results are exact:

- MX: the scale exponent ``s = floor(log2 amax) - emax`` from the bits of the block maximum;
  ``x / 2**s`` rebuilt from the bits (exact); rounding to the element grid (nearest, ties
  to even) by shifting the significand; the error ``q - x / 2**s`` is exact (Sterbenz).
- NVFP4: the chain ``s_t``, ``amax_b / 6 / s_t``, its E4M3 rounding and ``s_b * s_t`` in
  float32 as the definition says, per block (the divisions by 6 and 2688 and the product
  in int32, rounded as float32 rounds them by :func:`_round_int`, the module's one rounding,
  which rounds the E4M3 scale and the elements too); the element division ``x / scale`` as the
  float32 division of ``x * 2**k`` by ``scale * 2**k`` (the same quotient, so the same
  rounding, with both operands normal); the error ``q * scale - x`` in int32 (at most 30
  bits). Where that chain meets float32 subnormals (tensors whose largest magnitude is below
  about ``2**-100``), XLA:CPU flushes them: such tensors can differ from the reference.
- Each block's squared error is a float32 sum in the block's own unit (``2**(2 s)``; in
  :func:`block_words_many`, per 16 elements where NVFP4 is among the formats);
  blocks are summed in the unit of the largest contribution, so no term overflows and none
  that matters underflows (terms below ``2**-126`` of the largest are dropped).
- Ratios ``amax / amin`` are compared exactly as ``(e, f)``: the power of two ``e`` and
  the ratio of the significands ``f`` in ``[1, 2)``, whose 56 bits after the point come from
  integer long division (two distinct ratios of 24-bit significands differ in the first 49).

By XLA's operations (:func:`block_words_many`) all the formats are one computation, the
formats a leading axis (:func:`_stack_words`): the program is about half the size of one
computation per format, and XLA:CPU compiles it in less than half the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...stats.blocks import BLOCK_COLUMNS, BlockFormat

__all__ = [
    "INT_WORDS",
    "HOST_MARK",
    "block_words",
    "block_words_many",
    "block_partials",
    "merge_partials",
    "merge_two",
    "finish",
    "decode",
    "encoded_formats",
]

#: int32 words per format in a summary's counts part (see the module docstring).
INT_WORDS = 6
#: Added to the marker's magnitude where the host kernel wrote the words (see above).
HOST_MARK = 16
_MB, _BIAS, _MASK, _INF = 23, 127, 0x7FFFFFFF, 0x7F800000
_I32, _F32 = jnp.int32, jnp.float32


def _bits(x: Any) -> Any:
    return jax.lax.bitcast_convert_type(x, _I32)


def _float(b: Any) -> Any:
    return jax.lax.bitcast_convert_type(jnp.asarray(b, _I32), _F32)


def _floor_log2(m: Any) -> Any:
    """Exact ``floor(log2 v)`` of the finite non-zero float32 magnitude with bits ``m``
    (subnormals from the exponent field of ``float(m)``, exact as ``m < 2**23``)."""
    efield = m >> _MB
    sub = (_bits(m.astype(_F32)) >> _MB) - _BIAS - (_BIAS + _MB - 1)
    return jnp.where(efield > 0, efield - _BIAS, sub)


def _pow2(j: Any) -> Any:
    """``2.0**j`` (float32) for integer ``j``: 0 below the normal range, clamped at the top."""
    return jnp.where(j < 1 - _BIAS, 0.0, _float((jnp.clip(j, 1 - _BIAS, _BIAS) + _BIAS) << _MB))


def _rescaled(m: Any, k: Any) -> Any:
    """``v * 2**k`` of the magnitude bits ``m`` (float32, built from the integer
    significand: exact where the result is at least about ``2**-103``, else 0)."""
    efield = m >> _MB
    normal = efield > 0
    e = jnp.where(normal, efield - _BIAS, 1 - _BIAS)
    full = jnp.where(normal, (m & ((1 << _MB) - 1)) | (1 << _MB), m)
    return full.astype(_F32) * _pow2(e - _MB + k)


def _significand(m: Any) -> tuple[Any, Any]:
    """``(M, e)`` with ``v = M * 2**(e - 23)``, ``M`` in ``[2**23, 2**24)``, of the
    non-zero finite magnitude bits ``m`` (subnormals normalized)."""
    e = _floor_log2(jnp.maximum(m, 1))
    normal = (m >> _MB) > 0
    sub = jnp.left_shift(m, jnp.clip(_MB - (e + _BIAS + _MB - 1), 0, 31))
    return jnp.where(normal, (m & ((1 << _MB) - 1)) | (1 << _MB), sub), e


def _ilog2(p: Any) -> Any:
    """``floor(log2 p)`` of a positive int32 (from the exponent of ``float(p)``, exact below
    2**24; larger ones shifted first)."""
    big = p >= (1 << 24)
    v = jnp.where(big, p >> 7, p)
    return (_bits(v.astype(_F32)) >> _MB) - _BIAS + jnp.where(big, 7, 0)


def _round_int(
    n: Any, e: Any, mantissa: Any, emin: Any, sticky: Any = None, lead: Any = None
) -> tuple[Any, Any]:
    """``(q, g)``: the value ``(n + f) * 2**e`` rounded to nearest-even onto the grid of a
    format with ``mantissa`` bits and smallest normal ``2**emin`` (no saturation), as
    ``q * 2**g``; ``n`` an int32 in ``[2**mantissa, 2**30)`` (or 0), ``f`` in ``[0, 1)``
    non-zero where ``sticky``; ``lead``: ``floor(log2 n) + e`` where the caller knows it.
    The one rounding of the module: the element formats' (the scaled elements, NVFP4's E4M3
    block scale) and float32's (``mantissa`` 23, ``emin`` -126: subnormal results
    included, which XLA:CPU's float arithmetic would flush)."""
    if lead is None:
        lead = _ilog2(jnp.maximum(n, 1)) + e
    g = jnp.maximum(lead, emin) - mantissa
    d = jnp.clip(g - e, 0, 31)  # the bits dropped (at least 1 where any is non-zero)
    q = n >> d
    rem = n - (q << d)
    half = jnp.left_shift(1, jnp.maximum(d - 1, 0))
    odd = (q & 1) == 1
    if sticky is not None:
        odd = odd | sticky
    up = (d > 0) & ((rem > half) | ((rem == half) & odd))
    return q + up.astype(_I32), g


def _f32_bits(n: Any, e: Any, sticky: Any = None) -> Any:
    """The float32 bits of ``(n + f) * 2**e`` rounded to nearest-even (:func:`_round_int`
    onto float32's grid; ``n`` 0 gives 0)."""
    q, g = _round_int(n, e, _MB, 1 - _BIAS, sticky)
    # the exponent field is g + 150 for a normal result; a subnormal one has g = -149 and
    # q below 2**23 (q = 2**23, rounded up to the smallest normal, gives its bits too)
    return jnp.where(n > 0, ((g + _BIAS + _MB) << _MB) + q - (1 << _MB), 0)


def _round_grid(yb: Any, mantissa: Any, emin: Any) -> tuple[Any, Any]:
    """``(n, g)``: the float32 ``y >= 0`` (bits ``yb``; a subnormal counts as 0) rounded to
    nearest-even onto the grid of an element format with ``mantissa`` bits and smallest
    normal ``2**emin`` (no saturation), as ``n * 2**g`` (:func:`_round_int`)."""
    ey = (yb >> _MB) - _BIAS
    my = (yb & ((1 << _MB) - 1)) | (1 << _MB)
    n, g = _round_int(my, ey - _MB, mantissa, emin, lead=ey)
    return jnp.where(ey > -_BIAS, n, 0), g


def _div(a: Any, c: int, shift: int) -> Any:
    """The float32 bits of ``a / (c * 2**shift)`` rounded to nearest-even, subnormal results
    included (``a``: bits of a non-negative finite float32; ``c`` odd, below 32): the
    significand times ``2**6`` divided by ``c`` in int32 (a quotient of at least 25 bits,
    the remainder the sticky part), rounded once by :func:`_f32_bits`."""
    ma, ea = _significand(jnp.maximum(a, 1))
    num = ma << 6
    n = jax.lax.div(num, jnp.int32(c))
    bits = _f32_bits(n, ea - _MB - 6 - shift, num - n * c > 0)
    return jnp.where(a == 0, 0, bits)


def _mul(sb: Any, gb: Any, st: Any) -> Any:
    """The float32 bits of ``sb * 2**gb * st`` rounded to nearest-even, subnormal results
    included: ``sb`` a small integer (an E4M3 significand, below 2**5) and ``st`` the bits of
    a positive finite float32; the product of the significands is exact in int32."""
    mt, et = _significand(jnp.maximum(st, 1))
    bits = _f32_bits(sb * mt, gb + et - _MB)  # sb * mt < 2**29
    return jnp.where((sb > 0) & (st > 0), bits, 0)


def _nvfp4_scale(amax: Any, st: Any, strict: bool = True) -> Any:
    """Each NVFP4 block's float32 scale ``s_b * s_t`` as bits (0 where it is zero or
    undefined) from the bits of its maximum ``amax`` and of the tensor scale ``st``, in the
    definition's order and float32 rounding, subnormals included (:func:`_div`,
    :func:`_mul`)."""
    third = _div(amax, 3, 1)  # amax / 6
    # third / s_t: both significands normal, then the power of two (a result too small to
    # be normal rounds to zero in E4M3 anyway)
    m3, e3 = _significand(jnp.maximum(third, 1))
    mt, et = _significand(jnp.maximum(st, 1))
    one = _BIAS << _MB
    u = _float((m3 & ((1 << _MB) - 1)) | one) / _float((mt & ((1 << _MB) - 1)) | one)
    if strict:
        u = jax.lax.optimization_barrier(u)
    u = u * _pow2(e3 - et)
    u = jnp.where((third > 0) & (st > 0), jnp.minimum(u, 448.0), 0.0)
    n, g = _round_grid(_bits(u), 3, -6)
    return _mul(n, g, st)


def tensor_scale(amax_t: Any) -> Any:
    """The bits of NVFP4's per-tensor scale ``s_t`` from the bits of the tensor's largest
    finite magnitude: ``max |x| / 2688`` (subnormal results included, :func:`_div`), 1 where
    it is 0."""
    return jnp.where(amax_t > 0, _div(amax_t, 21, 7), _bits(jnp.float32(1.0)))


def _ratio_key(hi: Any, lo: Any) -> tuple[Any, Any, Any]:
    """An int32 triple whose lexicographic order is that of ``hi / lo`` (bits of non-zero
    finite magnitudes): the power of two of the ratio, then 28 and 28 more bits of the ratio
    of the significands (in ``[1, 2)``) after the point, by long division in int32."""
    ma, ea = _significand(hi)
    mb, eb = _significand(lo)
    low = ma < mb
    e = ea - eb - low.astype(_I32)
    r = jnp.where(low, 2 * ma, ma) - mb  # the ratio's integer part is 1
    words = []
    for _ in range(2):
        w = jnp.zeros_like(r)
        for _ in range(4):  # 7 bits at a time: r < mb < 2**24, so r << 7 < 2**31
            r = r << 7
            digit = jax.lax.div(r, mb)
            r = r - digit * mb
            w = (w << 7) | digit
        words.append(w)
    return e, words[0], words[1]


class _Consts(NamedTuple):
    """The constants of element formats, as Python numbers (one format) or arrays with a
    leading format axis (several formats computed together): mantissa bits, the exponent
    of the smallest normal, the largest finite value, the smallest normal value, and
    whether the scale is NVFP4's (an E4M3 number rather than a power of two)."""

    mantissa: Any
    emin: Any
    top: Any
    smallest: Any
    nv: Any
    emax: Any

    @staticmethod
    def of(formats: Sequence[BlockFormat], ndim: int = 0) -> _Consts:
        """One format's constants as numbers (``ndim`` 0), else the formats' constants as
        arrays of shape ``(len(formats),) + (1,) * ndim``."""
        if not ndim:
            (f,) = formats
            return _Consts(f.mantissa, f.emin, f.max, f.smallest_normal, f.emax is None, f.emax)

        def col(values: list[Any], dtype: Any) -> Any:
            return np.asarray(values, dtype).reshape((len(formats),) + (1,) * ndim)

        return _Consts(
            col([f.mantissa for f in formats], np.int32),
            col([f.emin for f in formats], np.int32),
            col([f.max for f in formats], np.float32),
            col([f.smallest_normal for f in formats], np.float32),
            col([f.emax is None for f in formats], np.bool_),
            col([f.emax or 0 for f in formats], np.int32),
        )


def _elements(
    m: Any, fin: Any, k: Any, sk: Any, has: Any, c: _Consts, strict: bool
) -> tuple[Any, Any, Any, Any]:
    """Per element (magnitude bits ``m``, ``fin`` where finite): whether it underflows,
    is a subnormal element, saturates, and its error ``q * scale - x`` in the unit
    ``2**-k``. The scale is ``sk * 2**-k`` (``sk`` in ``[1, 2)``, broadcast along the last
    axis; ``None``: 1, a power-of-two scale), 0 where ``has`` is False. ``c``: the element
    format's constants (:class:`_Consts`, arrays where several formats are computed as one).
    """
    nz = m > 0
    xk = _rescaled(m, k)  # x * 2**k: exact for a power-of-two scale, normal where it matters
    if sk is None:
        y = xk
    else:
        # XLA's simplifier makes a division by a broadcast a product by the broadcast
        # reciprocal (rounded): the barrier keeps the divisor an array of its own
        sk = jnp.broadcast_to(jnp.where(has, sk, 1.0), xk.shape)
        if strict:
            sk = jax.lax.optimization_barrier(sk)
        y = jnp.where(has, xk / sk, 0.0)
    n, gq = _round_grid(_bits(y), c.mantissa, c.emin)
    sat = fin & (y > c.top)
    q = jnp.where(sat, c.top, n.astype(_F32) * _pow2(gq))
    err = q - y  # a power-of-two scale: exact, q within a factor 2 of y, or 0
    if sk is not None:
        # NVFP4: q * scale - x times 2**(k + 25) in int32: q = n * 2**gq (n <= 3, or 6
        # saturated), scale * 2**k = ms * 2**-23, x * 2**k = mx * 2**(ex - 23) with ex in
        # [-2, 4] where q > 0
        n = jnp.where(sat, 3, n)
        gq = jnp.where(sat, 1, gq)
        ms = (_bits(sk) & ((1 << _MB) - 1)) | (1 << _MB)  # (1 where has is False: unused)
        xb = _bits(xk)
        mx = (xb & ((1 << _MB) - 1)) | (1 << _MB)
        ex = (xb >> _MB) - _BIAS
        lhs = jnp.left_shift(n * ms, jnp.clip(gq + 2, 0, 31))
        rhs = jnp.left_shift(mx, jnp.clip(ex + 2, 0, 31))
        exact = (lhs - rhs).astype(_F32) * 2.0**-25
        err = jnp.where(c.nv, jnp.where(has & (q > 0), exact, xk), err)
    err = jnp.where(fin, err, 0.0)
    qa = jnp.abs(q)
    return nz & (qa == 0), nz & (qa > 0) & (qa < c.smallest), sat, err


def _nvfp4_k(sbits: Any, amax: Any) -> Any:
    """The power of two ``k`` that brings NVFP4's block scale (bits ``sbits``; where it is
    0, the block maximum ``amax``) into ``[1, 2)``."""
    return -_floor_log2(jnp.maximum(jnp.where(sbits > 0, sbits, amax), 1))


def block_partials(
    bits: Any, f: BlockFormat, st: Any = None, strict: bool = True
) -> dict[str, Any]:
    """Per block, the partial results of format ``f`` for ``bits`` (float32 bits, blocks along
    the last axis, NaN for padding): the three counts (int32), ``t`` the squared error in the
    unit ``2**g2`` (float32, with ``g2``), and the bits of the block's largest and smallest
    non-zero finite magnitude (0 and 0 where none). ``st``: NVFP4's tensor scale
    (:func:`tensor_scale`). ``strict``: keep XLA's simplifier from rewriting the float32
    divisions (optimization barriers; off in a Pallas kernel compiled for Triton, which
    does not rewrite them). (:func:`block_words_many` computes all formats together.)"""
    mag = bits & _MASK
    fin = mag < _INF
    m = jnp.where(fin, mag, 0)
    amax = jnp.max(m, axis=-1)
    amin = jnp.min(jnp.where(m > 0, m, _INF), axis=-1)
    if f.emax is not None:  # MX: a power-of-two scale
        k = jnp.where(amax > 0, f.emax - _floor_log2(jnp.maximum(amax, 1)), 0)
        sk = has = None
    else:
        sbits = _nvfp4_scale(amax, st, strict)
        k = _nvfp4_k(sbits, amax)
        has = (sbits > 0)[..., None]
        sk = _rescaled(sbits, k)[..., None]  # the scale * 2**k, in [1, 2)
    under, sub, sat, err = _elements(m, fin, k[..., None], sk, has, _Consts.of([f]), strict)
    i32 = _I32
    return {
        "underflow": jnp.sum(under.astype(i32), axis=-1),
        "subnormal": jnp.sum(sub.astype(i32), axis=-1),
        "saturated": jnp.sum(sat.astype(i32), axis=-1),
        "t": jnp.sum(err * err, axis=-1),
        "g2": -2 * k,
        "hi": amax,
        "lo": jnp.where(amax > 0, amin, 0),
    }


def _better(a: tuple[Any, ...], b: tuple[Any, ...]) -> Any:
    """Where the ratio key ``a`` is larger than ``b`` (lexicographic)."""
    return (a[0] > b[0]) | ((a[0] == b[0]) & ((a[1] > b[1]) | ((a[1] == b[1]) & (a[2] > b[2]))))


def _key(hi: Any, lo: Any) -> tuple[Any, Any, Any]:
    """:func:`_ratio_key`, ``(-1, -1, -1)`` where there is no non-zero value (``hi`` 0)."""
    e, w1, w2 = _ratio_key(jnp.maximum(hi, 1), jnp.maximum(lo, 1))
    has = hi > 0
    return tuple(jnp.where(has, w, -1) for w in (e, w1, w2))  # type: ignore[return-value]


def _sq_exp(t: Any, g2: Any) -> Any:
    """The exponent of each block's squared error ``t * 2**g2`` (a very low one where 0)."""
    tb = _bits(t)
    return jnp.where(tb > 0, g2 + _floor_log2(jnp.maximum(tb, 1)), -(2**30))


def _merge_errors(p: dict[str, Any], axis: int) -> dict[str, Any]:
    """The counts of the partials ``p`` added along ``axis``, the squared errors summed in
    the unit of the largest (``t`` in the unit ``2**g2``)."""
    e = jnp.max(_sq_exp(p["t"], p["g2"]), axis=axis, keepdims=True)
    top = jnp.where(e > -(2**30), e, 0)
    t = jnp.sum(_rescaled(_bits(p["t"]), p["g2"] - top), axis=axis)
    return {
        **{c: jnp.sum(p[c], axis=axis) for c in ("underflow", "subnormal", "saturated")},
        "t": t,
        "g2": jnp.squeeze(top, axis),
    }


def _merge_ranges(hi: Any, lo: Any, axis: int) -> tuple[Any, Any]:
    """The pair ``(hi, lo)`` of the largest ratio along ``axis`` (exact, :func:`_key`)."""
    key = _key(hi, lo)
    win = key[0] == jnp.max(key[0], axis=axis, keepdims=True)
    for w in key[1:]:
        win = win & (w == jnp.max(jnp.where(win, w, -1), axis=axis, keepdims=True))
    return jnp.max(jnp.where(win, hi, 0), axis=axis), jnp.max(jnp.where(win, lo, 0), axis=axis)


def merge_partials(p: dict[str, Any], axis: int = 0) -> dict[str, Any]:
    """The partials ``p`` (:func:`block_partials`, or parts of them) reduced along ``axis``:
    counts added, the squared errors summed in the unit of the largest (``t`` in the unit
    ``2**g2``), the pair of the largest ratio kept."""
    hi, lo = _merge_ranges(p["hi"], p["lo"], axis)
    return {**_merge_errors(p, axis), "hi": hi, "lo": lo}


def merge_two(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two sets of partials merged element by element (as :func:`merge_partials` merges
    along an axis; no stacking, which Pallas's Triton lowering lacks)."""
    ea, eb = _sq_exp(a["t"], a["g2"]), _sq_exp(b["t"], b["g2"])
    top = jnp.maximum(ea, eb)
    top = jnp.where(top > -(2**30), top, 0)
    t = _rescaled(_bits(a["t"]), a["g2"] - top) + _rescaled(_bits(b["t"]), b["g2"] - top)
    take = _better(_key(b["hi"], b["lo"]), _key(a["hi"], a["lo"]))
    return {
        **{c: a[c] + b[c] for c in ("underflow", "subnormal", "saturated")},
        "t": t,
        "g2": top,
        "hi": jnp.where(take, b["hi"], a["hi"]),
        "lo": jnp.where(take, b["lo"], a["lo"]),
    }


def finish(p: dict[str, Any]) -> tuple[Any, Any]:
    """The int32 words and the float32 ``sq_scaled`` of one format from merged partials."""
    ints = jnp.stack(
        [p["underflow"], p["subnormal"], p["saturated"], p["hi"], p["lo"], p["g2"]], axis=-1
    )
    return ints.astype(_I32), p["t"].astype(_F32)


def _block_bits(x: Any, size: int) -> Any:
    """``x`` as float32 bits, blocks of ``size`` along the last axis ``(blocks, size)``, each
    row of the last dimension padded with NaN (which every column leaves out)."""
    length = x.shape[-1] if x.ndim else 1
    rows = x.reshape(-1, length).astype(_F32)
    pad = -length % size
    if pad:
        rows = jnp.pad(rows, ((0, 0), (0, pad)), constant_values=np.nan)
    return _bits(rows.reshape(-1, size))


def check_blockable(x: Any) -> None:
    """Refuses a float64 array (whose values float32 would round): the device paths compute
    the block formats' columns in float32 arithmetic."""
    if jnp.dtype(x.dtype) == jnp.float64:
        raise NotImplementedError(
            "track(block_formats=...): the JAX device paths compute the block formats' "
            "columns of float32, bfloat16, float16 and 8-bit float arrays; a float64 array "
            "(jax_enable_x64) is not served. Leave block_formats out, or exclude the array "
            "(track(..., exclude=...))."
        )


def block_words(x: Any, formats: Sequence[BlockFormat]) -> tuple[Any, Any]:
    """The block formats' words of the array ``x`` by XLA operations (traceable): int32
    ``(len(formats) * INT_WORDS,)`` and float32 ``(len(formats),)`` (see the module
    docstring); :func:`block_words_many` of the one array."""
    ints, floats = block_words_many([x], formats)
    return ints[0], floats[0]


#: float32 bits of a quiet NaN: the padding of the stacks of :func:`block_words_many`
#: (every column leaves NaN out, as in :func:`_block_bits`' rows).
_NAN_BITS = int(np.array(np.nan, np.float32).view(np.int32))


def _stack_words(
    stack: Any, formats: Sequence[BlockFormat], strict: bool = True
) -> tuple[Any, Any]:
    """The words of each of the formats for each array of ``stack`` (float32 bits ``(arrays,
    blocks, size)``, ``size`` the largest block size of ``formats``, NaN for padding): int32
    ``(arrays, len(formats) * INT_WORDS)`` and float32 ``(arrays, len(formats))``.

    One program for all the formats: the elements are read as sub-blocks of the smallest
    block size (NVFP4's 16 within MX's 32), and the scales, the rounding, the counts and
    the squared errors are computed once with the formats as a leading axis (their
    constants arrays along it, :class:`_Consts`); the block maxima and minima, the
    largest ratio among them, and the power of two of the MX scales once per block size
    (shared by the MX formats)."""
    sizes = sorted({f.block for f in formats})
    sub, size = sizes[0], sizes[-1]
    arrays, n = stack.shape[0], stack.shape[1]
    r = size // sub
    mag = (stack & _MASK).reshape(arrays, n, r, sub)
    fin = mag < _INF
    m = jnp.where(fin, mag, 0)
    # per sub-block, then per block of the largest size (broadcast over its sub-blocks)
    amax = {sub: jnp.max(m, axis=-1)}
    amin = {sub: jnp.min(jnp.where(m > 0, m, _INF), axis=-1)}
    if r > 1:
        amax[size] = jnp.broadcast_to(jnp.max(amax[sub], -1, keepdims=True), amax[sub].shape)
        amin[size] = jnp.broadcast_to(jnp.min(amin[sub], -1, keepdims=True), amin[sub].shape)
    c = _Consts.of(formats, 4)
    # the scales as one expression along the formats (no stack of per-format arrays: XLA
    # fuses a scale's chain into each of its uses, so each use would compile it again)
    mx = amax[size] if any(f.emax is not None for f in formats) else amax[sub]
    k = jnp.where(mx > 0, c.emax[..., 0] - _floor_log2(jnp.maximum(mx, 1)), 0)
    sk = has = None
    if any(f.emax is None for f in formats):  # NVFP4: an E4M3 scale of blocks of 16
        a = amax[sub]
        sbits = _nvfp4_scale(a, tensor_scale(jnp.max(a, axis=(1, 2)))[:, None, None], strict)
        k_nv = _nvfp4_k(sbits, a)
        nv = c.nv[..., 0]
        k = jnp.where(nv, k_nv, k)
        sk = jnp.where(nv, _rescaled(sbits, k_nv), 1.0)[..., None]  # the scale * 2**k
        has = (~nv | (sbits > 0))[..., None]
    k = jnp.broadcast_to(k, (len(formats),) + m.shape[:-1])[..., None]
    under, subn, sat, err = _elements(m[None], fin[None], k, sk, has, c, strict)
    # one reduction of the four and of the unit (one fusion: XLA would otherwise compile the
    # elements' chain, and the scales' it contains, into each reduction)
    under, subn, sat, t, g2 = jax.lax.reduce(
        (
            under.astype(_I32),
            subn.astype(_I32),
            sat.astype(_I32),
            err * err,
            jnp.broadcast_to(-2 * k, err.shape),
        ),
        (np.int32(0), np.int32(0), np.int32(0), np.float32(0), np.int32(-(2**30))),
        lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], jnp.maximum(a[4], b[4])),
        (m.ndim,),
    )
    parts = {
        "underflow": under,
        "subnormal": subn,
        "saturated": sat,
        "t": t,
        "g2": g2,
    }  # (formats, arrays, blocks, sub-blocks)
    flat = {w: v.reshape(len(formats), arrays, n * r) for w, v in parts.items()}
    merged = _merge_errors(flat, axis=-1)  # (formats, arrays)
    # the largest ratio once per block size
    his = jnp.stack([amax[b] for b in sizes]).reshape(len(sizes), arrays, n * r)
    los = jnp.stack([jnp.where(amax[b] > 0, amin[b], 0) for b in sizes])
    hi, lo = _merge_ranges(his, los.reshape(his.shape), axis=-1)  # (sizes, arrays)
    level = [sizes.index(f.block) for f in formats]
    ints, t = finish(
        {**merged, "hi": jnp.stack([hi[j] for j in level]), "lo": jnp.stack([lo[j] for j in level])}
    )  # (formats, arrays, INT_WORDS), (formats, arrays)
    return jnp.swapaxes(ints, 0, 1).reshape(arrays, -1), t.T


def block_words_many(arrays: Sequence[Any], formats: Sequence[BlockFormat]) -> tuple[Any, Any]:
    """The block formats' words of each of ``arrays`` (traceable): int32 ``(len(arrays),
    len(formats) * INT_WORDS)`` and float32 ``(len(arrays), len(formats))``, by a program
    whose size grows neither with the number of arrays nor much with the formats.

    Computed array by array, the words made the program grow with the arrays
    (20 small arrays with MXFP8 E4M3 and NVFP4: 35,679 operations against 2,247 for one; on a
    GPU each is about a kernel the host launches). Here the blocks (of the largest block
    size among ``formats``) of arrays whose block counts lie within one power of two are
    stacked into ``(arrays, blocks, size)``, the shorter ones padded with NaN blocks (whose
    partials are neutral), and all formats' words computed once per stack
    (:func:`_stack_words`); NVFP4's tensor scales are those stacks' per-array maxima. An
    array's counts and block ranges do not depend on the arrays beside it; its squared error
    is the same float32 terms summed over a longer axis (the padding's zeros), so its
    float32 sum may round differently (tested within 1e-6)."""
    for a in arrays:
        check_blockable(a)
    if not formats:
        raise ValueError("block_words_many: formats is empty; give at least one BlockFormat")
    size = max(f.block for f in formats)
    stacks: dict[int, list[int]] = {}
    blocks = []
    for i, a in enumerate(arrays):
        length = a.shape[-1] if a.ndim else 1
        count = (a.size // length) * -(-length // size) if a.size else 0
        blocks.append(count)
        if count:
            stacks.setdefault(count.bit_length(), []).append(i)
    empty = [i for i, b in enumerate(blocks) if not b]
    order = [i for members in stacks.values() for i in members] + empty
    words, errors = [], []
    for members in stacks.values():
        most = max(blocks[i] for i in members)
        stack = jnp.stack(
            [
                jnp.pad(
                    _block_bits(arrays[i], size),
                    ((0, most - blocks[i]), (0, 0)),
                    constant_values=_NAN_BITS,
                )
                for i in members
            ]
        )
        i_words, t = _stack_words(stack, formats)
        words.append(i_words)
        errors.append(t)
    if empty:
        words.append(jnp.zeros((len(empty), len(formats) * INT_WORDS), _I32))
        errors.append(jnp.zeros((len(empty), len(formats)), _F32))
    ints, floats = jnp.concatenate(words), jnp.concatenate(errors)
    if order != sorted(order):
        back = np.argsort(np.asarray(order))  # rows in the arrays' order
        ints, floats = ints[back], floats[back]
    return ints, floats


def with_words(
    counts: Any, values: Any, ints: Any, floats: Any, n_core: int, host: bool = False
) -> tuple[Any, Any]:
    """A summary's parts with the block words appended (``ints`` and the marker after the
    counts, ``floats`` right after the ``n_core`` core values). ``host``: the words come
    from the host kernel's custom call (the block ratio in place of ``hi`` and ``lo``)."""
    formats = floats.shape[-1]
    mark = -1 - formats - (HOST_MARK if host else 0)
    marker = jnp.full(counts.shape[:-1] + (1,), mark, counts.dtype)
    counts = jnp.concatenate([counts, ints.astype(counts.dtype), marker], axis=-1)
    floats = floats.astype(values.dtype)
    values = jnp.concatenate([values[..., :n_core], floats, values[..., n_core:]], axis=-1)
    return counts, values


def encoded_formats(counts: np.ndarray) -> int:
    """How many formats' words a fetched summary's counts part ends with (0: none)."""
    if counts.shape[-1] == 0:
        return 0
    last = np.asarray(counts[..., -1]).reshape(-1)
    return int(-1 - last[0]) % HOST_MARK if last.size and last[0] < 0 else 0


def decode(counts: np.ndarray, values: np.ndarray, n_core: int) -> tuple[np.ndarray, np.ndarray]:
    """The parts of a fetched summary (or stack of them) with the block words replaced by
    the layout's columns (float64 values: five per format after the core values), as
    :func:`tandv.stats.summary.join_summary` expects them."""
    k = encoded_formats(counts)
    if not k:
        return counts, values
    words = counts[..., -1 - INT_WORDS * k : -1].reshape(counts.shape[:-1] + (k, INT_WORDS))
    words = words.astype(np.int32)
    sq = np.asarray(values[..., n_core : n_core + k], np.float64)
    ratio = np.ascontiguousarray(words[..., 3:5]).view(np.float64)[..., 0]
    host = (counts[..., -1] <= -1 - HOST_MARK)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):  # (host words: hi, lo unused)
        hi = words[..., 3].view(np.float32).astype(np.float64)
        lo = words[..., 4].view(np.float32).astype(np.float64)
        rng = np.where(hi > 0, np.log2(hi / np.where(lo > 0, lo, 1.0)), 0.0)
        rng = np.where(host, np.log2(np.maximum(ratio, 1.0)), rng)
    cols = np.stack(
        [
            words[..., 0].astype(np.float64),
            words[..., 1].astype(np.float64),
            words[..., 2].astype(np.float64),
            np.ldexp(sq, words[..., 5]),
            rng,
        ],
        axis=-1,
    )
    assert cols.shape[-1] == len(BLOCK_COLUMNS)
    values = np.concatenate(
        [
            np.asarray(values[..., :n_core], np.float64),
            cols.reshape(cols.shape[:-2] + (-1,)),
            np.asarray(values[..., n_core + k :], np.float64),
        ],
        axis=-1,
    )
    return counts[..., : -1 - INT_WORDS * k], values
