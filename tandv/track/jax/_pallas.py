"""The fused summary kernel in Pallas: one read of an array for all of its summary.

:func:`._summary.summarize_jax` is a dozen XLA passes over the array and a histogram (a
scatter on the CPU, one-hot products elsewhere). This kernel reads each element once: a
program takes :data:`BLOCK` consecutive elements and writes one small row of partials,

- ``ints``: NaN, inf, zero and finite counts, and the extrema as bit patterns (the
  order-preserving keys of the smallest and largest finite value, the bits of the smallest
  and largest finite magnitude): integer reductions are exact where float ones are not
  (XLA:CPU, which runs the kernel in interpret mode, flushes subnormals in float arithmetic);
- ``hist``: the block's exponent counts, as the product of two one-hot matrices (the bin
  index split into a high and a low part, ``onehot(high)^T @ onehot(low)``): no scatter, no
  atomics, exact (0/1 factors, float32 accumulation of at most :data:`BLOCK` ones);
- ``moments``: the block's scale ``k`` (its largest magnitude times ``2**k`` lies in
  ``[1, 2)``), and, of its values times ``2**k``, the mean, the centred second moment (two
  passes over the block in registers, with the rounding of the mean corrected) and the
  power sums of ``|x|``.

A small XLA epilogue merges the rows into the :class:`._summary.DeviceSummary` layout:
counts add, extrema reduce, and the moments are brought from each block's scale to the
array's (factors ``2**(K - k)``, exact powers of two) and merged by Chan's formula.

Values are rescaled in the integer domain (``|x| = m * 2**(e - 23)`` rebuilt as
``float(m) * 2**(e - 23 + k)``), so subnormal inputs count exactly on any backend, and
exponents are read without ``clz`` (subnormals: from ``float(m)``'s exponent field), which
keeps the kernel within what Pallas lowers to Triton.

On accelerators the kernel is compiled by Pallas (Triton on GPUs); on the CPU it runs with
``interpret=True`` (the same kernel as an XLA loop over the grid), which is how CI tests it
against the numpy reference. float64 arrays are not handled here (the XLA path serves them).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ...stats.formats import NumberFormat
from ...stats.summary import POWERS, pack_parts, unpack_fields
from ._summary import DeviceSummary

__all__ = ["BLOCK", "pallas_summary", "KERNEL_DTYPES"]

#: Elements per program.
BLOCK = 2048
#: Input dtypes the kernel reads in their own type (others are widened to float32 first).
KERNEL_DTYPES = frozenset({np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)})
_MB, _BIAS = 23, 127  # float32 mantissa bits, exponent bias
_MASK = 0x7FFFFFFF
_INF = 0x7F800000
_KEY_NINF = int(np.int32(np.array(-np.inf, np.float32).view(np.int32) ^ _MASK))  # order key of -inf
_LOW = 16  # width of the low part of a bin index
#: The columns of a program's rows of partials (each padded to 8 by :func:`_row`): counts
#: and extrema as integers (order keys, magnitude bits), and the block's scale exponent and
#: moments of its values times ``2**k``. The epilogue reads them by name.
_INT_COLUMNS = ("nan", "inf", "zero", "finite", "key_min", "key_max", "mag_min", "mag_max")
_MOMENT_COLUMNS = ("k", "mean", "m2", "p1", "p2", "p4", "p8")


def _bits(x: Any) -> Any:
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _float(b: Any) -> Any:
    return jax.lax.bitcast_convert_type(jnp.asarray(b, jnp.int32), jnp.float32)


def _order_key(b: Any) -> Any:
    """Involution mapping float32 bits to an int32 whose order is the floats' order."""
    return b ^ ((b >> 31) & _MASK)


def _floor_log2(m: Any) -> Any:
    """Exact ``floor(log2 |x|)`` of a finite non-zero magnitude ``m`` (bits): subnormals'
    from the exponent field of ``float(m)`` (exact: ``m < 2**23``), without ``clz``."""
    efield = m >> _MB
    sub = (_bits(m.astype(jnp.float32)) >> _MB) - _BIAS - (_BIAS + _MB - 1)
    return jnp.where(efield > 0, efield - _BIAS, sub)


def _pow2(j: Any) -> Any:
    """``2.0**j`` for integer ``j`` (0 below the normal range, clamped at the top)."""
    return jnp.where(j < 1 - _BIAS, 0.0, _float((jnp.clip(j, 1 - _BIAS, _BIAS) + _BIAS) << _MB))


def _rescaled(m: Any, k: Any) -> Any:
    """``|x| * 2**k`` of the magnitude bits ``m``, built in the integer domain (normal
    numbers only, so no flush of subnormal inputs)."""
    efield = m >> _MB
    normal = efield > 0
    e = jnp.where(normal, efield - _BIAS, 1 - _BIAS)
    full = jnp.where(normal, (m & ((1 << _MB) - 1)) | (1 << _MB), m)
    return full.astype(jnp.float32) * _pow2(e - _MB + k)


def _row(values: list[Any], dtype: Any) -> Any:
    """The scalars ``values`` as one vector of 8 (built by selection: Triton has no stack)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (8,), 0)
    out = jnp.zeros((8,), dtype)
    for j, v in enumerate(values):
        out = jnp.where(lane == j, v.astype(dtype), out)
    return out


def _kernel(
    x_ref: Any,
    ints_ref: Any,
    hist_ref: Any,
    moments_ref: Any,
    *,
    n: int,
    nbins: int,
    high: int,
    min_exponent: int,
    under_bits: int,
    over_bits: int,
) -> None:
    pos = pl.program_id(0) * BLOCK + jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
    valid = pos < n  # the last block reads past the end
    bits = _bits(x_ref[...].astype(jnp.float32))
    mag = bits & _MASK
    nan = valid & (mag > _INF)
    inf = valid & (mag == _INF)
    fin = valid & (mag < _INF)
    zero = fin & (mag == 0)
    nonzero = fin & (mag != 0)

    def count(b: Any) -> Any:
        return jnp.sum(jnp.where(b, 1, 0).astype(jnp.int32))

    n_fin = count(fin)
    key = _order_key(bits)
    amax = jnp.max(jnp.where(fin, mag, 0))
    ints = {
        "nan": count(nan),
        "inf": count(inf),
        "zero": count(zero),
        "finite": n_fin,
        "key_min": jnp.min(jnp.where(fin, key, _INF)),
        "key_max": jnp.max(jnp.where(fin, key, _KEY_NINF)),
        "mag_min": jnp.min(jnp.where(fin, mag, _INF)),
        "mag_max": amax,
    }
    ints_ref[...] = _row([ints[c] for c in _INT_COLUMNS], jnp.int32)

    # moments of x * 2**k, |x| * 2**k < 2 for every value of the block
    k = jnp.where(amax > 0, -_floor_log2(jnp.maximum(amax, 1)), 0)
    xs = jnp.where(fin, _rescaled(mag, k), 0.0)
    xs = jnp.where(bits < 0, -xs, xs)
    nf = jnp.maximum(n_fin, 1).astype(jnp.float32)
    mean = jnp.sum(xs) / nf
    d = jnp.where(fin, xs - mean, 0.0)
    u = jnp.abs(xs)
    u2 = u * u
    u4 = u2 * u2
    moments = {
        "k": k,
        "mean": mean,
        "m2": jnp.sum(d * d) - jnp.sum(d) ** 2 / nf,
        "p1": jnp.sum(u),
        "p2": jnp.sum(u2),
        "p4": jnp.sum(u4),
        "p8": jnp.sum(u4 * u4),
    }
    moments_ref[...] = _row([moments[c] for c in _MOMENT_COLUMNS], jnp.float32)

    # exponent counts: bin 0 underflow, nbins - 1 overflow, nbins dropped (zeros, NaN, padding)
    over = valid & ~nan & ((mag > over_bits) | inf)
    under = nonzero & ~over & (mag < under_bits)
    idx = jnp.clip(_floor_log2(jnp.maximum(mag, 1)) - min_exponent + 1, 1, nbins - 2)
    idx = jnp.where(under, 0, idx)
    idx = jnp.where(over, nbins - 1, idx)
    idx = jnp.where(nonzero | over, idx, nbins)
    hi = (idx // _LOW)[:, None] == jax.lax.broadcasted_iota(jnp.int32, (BLOCK, high), 1)
    lo = (idx % _LOW)[:, None] == jax.lax.broadcasted_iota(jnp.int32, (BLOCK, _LOW), 1)
    table = jax.lax.dot_general(
        hi.astype(jnp.float32),
        lo.astype(jnp.float32),
        (((0,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )  # onehot(high)^T @ onehot(low)
    hist_ref[...] = table.astype(jnp.int32)


def _bits_of(value: float) -> int:
    with np.errstate(over="ignore", under="ignore"):
        return int(np.array(value, np.float32).view(np.int32))


@partial(jax.jit, static_argnames=("fmt", "num_counts", "interpret"))
def _summary(x: Any, fmt: NumberFormat, num_counts: int, interpret: bool) -> tuple[Any, Any]:
    nbins = num_counts
    # bins plus the dropped one, as high x _LOW with high >= 16 (Triton's smallest dot)
    high = max(16, -(-(nbins + 1) // _LOW))
    high = 1 << (high - 1).bit_length()
    flat = jnp.ravel(x)
    if np.dtype(flat.dtype) not in KERNEL_DTYPES:
        flat = flat.astype(jnp.float32)
    n = flat.shape[0]
    blocks = max(1, -(-n // BLOCK))
    kernel = partial(
        _kernel,
        n=n,
        nbins=nbins,
        high=high,
        min_exponent=fmt.min_exponent,
        under_bits=_bits_of(fmt.underflow_threshold),
        over_bits=_bits_of(fmt.overflow_threshold),
    )
    ints, hist, moments = pl.pallas_call(
        kernel,
        grid=(blocks,),
        in_specs=[pl.BlockSpec((BLOCK,), lambda i: (i,))],
        out_specs=[
            pl.BlockSpec((None, 8), lambda i: (i, 0)),
            pl.BlockSpec((None, high, _LOW), lambda i: (i, 0, 0)),
            pl.BlockSpec((None, 8), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((blocks, 8), jnp.int32),
            jax.ShapeDtypeStruct((blocks, high, _LOW), jnp.int32),
            jax.ShapeDtypeStruct((blocks, 8), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=8),
    )(flat if n else jnp.zeros(1, flat.dtype))
    return _merge_blocks(ints, hist, moments, n, nbins)


def _merge_blocks(ints: Any, hist: Any, moments: Any, n: int, nbins: int) -> tuple[Any, Any]:
    """The summary's counts and values from the per-block rows (XLA, small arrays)."""
    col = unpack_fields(ints, _INT_COLUMNS)
    mom = unpack_fields(moments, _MOMENT_COLUMNS)
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
    bins = jnp.sum(hist, axis=0).reshape(-1)[:nbins]
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
    return pack_parts(core, bins, xp=jnp)


def pallas_summary(
    x: Any, fmt: NumberFormat, num_counts: int, interpret: bool | None = None
) -> DeviceSummary:
    """The core summary of ``x`` (any float dtype but float64) for format ``fmt`` by the
    fused kernel (traceable); :func:`._summary.to_vector` of it equals
    ``tandv.stats.summarize(x, fmt)`` (counts, extrema and exponent counts exactly, moments
    to float32 rounding). Its ``values`` hold the core fields only: the caller appends
    custom statistics. ``interpret``: run Pallas's interpreter (default: on the CPU)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return DeviceSummary(*_summary(x, fmt, num_counts, interpret))
