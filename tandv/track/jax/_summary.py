"""On-device summaries of JAX arrays, matching the numpy reference :func:`tandv.stats.summarize`.

:func:`summarize_jax` is traceable: it runs inside ``jax.jit``/``jax.grad`` and returns a
:class:`DeviceSummary`, two small arrays (exact int32 counts, float32 extrema and scaled
moments). Only these leave the device; :func:`to_vector` turns a fetched one into the
float64 summary vector of :class:`tandv.stats.summary.Layout`.

JAX runs without x64 by default, so moments are computed in float32 (float64 when the input
is float64) on values scaled by the largest magnitude, exactly as the layout defines them,
and the centred second moment uses a corrected two-pass sum so the variance stays accurate
when ``|mean| >> std``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...stats.summary import CORE_FIELDS, POWERS, Layout

__all__ = ["DeviceSummary", "summarize_jax", "summarize_many_jax", "to_vector", "CustomStat"]

#: A custom statistic: a traceable function of the array returning a scalar.
CustomStat = Callable[[jax.Array], Any]

_N_INT = 4  # numel, nan_count, inf_count, zero_count lead CORE_FIELDS
_N_FLOAT = len(CORE_FIELDS) - _N_INT  # min .. p8


class DeviceSummary(NamedTuple):
    """A summary as it leaves the device: ``counts`` (int32: numel, nan, inf, zero, then the
    exponent counts) and ``values`` (float: min, max, min_abs, max_abs, mean, m2, p1, p2, p4,
    p8, then custom statistics)."""

    counts: Any
    values: Any


class _Bits(NamedTuple):
    """Bit layout of an IEEE binary float type used for exact integer-domain reductions."""

    float_dtype: Any
    int_dtype: Any
    mantissa_bits: int
    exponent_bias: int

    @property
    def magnitude_mask(self) -> int:
        return (1 << (np.dtype(self.int_dtype).itemsize * 8 - 1)) - 1

    @property
    def inf_bits(self) -> int:
        return int(np.array(np.inf, self.float_dtype).view(self.int_dtype))

    def bits_of(self, value: float) -> int:
        """Bit pattern of ``value`` rounded to this type (clamped: beyond range -> inf / 0)."""
        with np.errstate(over="ignore", under="ignore"):
            return int(np.array(value, self.float_dtype).view(self.int_dtype))


_F32 = _Bits(np.float32, np.int32, 23, 127)
_F64 = _Bits(np.float64, np.int64, 52, 1023)


def _bits_for(dtype: Any) -> _Bits:
    # float64 stays float64 (only possible with jax_enable_x64); every other type
    # (bfloat16, float16, float8_*, float32, ints) is widened to float32, which holds
    # each of their values exactly.
    return _F64 if jnp.dtype(dtype) == jnp.float64 else _F32


def summarize_jax(
    x: Any,
    layout: Layout,
    custom: Mapping[str, CustomStat] | None = None,
) -> DeviceSummary:
    """Summary of the array ``x`` for ``layout``, computed where ``x`` lives (traceable).

    Arguments:
        x: a JAX array (any float dtype; it may be sharded, the summary is that of the
            global array).
        layout: the summary layout; its format decides the exponent range and the
            underflow/overflow thresholds.
        custom: functions for ``layout.extras``, by name, in the same order; each maps the
            array to a scalar.

    Returns:
        A :class:`DeviceSummary`; :func:`to_vector` of its host copy equals
        ``tandv.stats.summarize(x, layout.format)[0]`` (counts, extrema and exponent counts
        exactly, moments to float32 rounding).
    """
    _check_custom(layout, custom)
    x = jnp.asarray(x)
    counts, values = _summarize_flat(x.reshape(-1), layout, None, 1)
    extra = [jnp.asarray(fn(x), values.dtype).reshape(1) for fn in (custom or {}).values()]
    return DeviceSummary(counts[0], jnp.concatenate([values[0], *extra]))


def summarize_many_jax(
    arrays: Sequence[Any],
    layout: Layout,
    custom: Mapping[str, CustomStat] | None = None,
) -> list[DeviceSummary]:
    """Summaries of several arrays of one dtype, computed together (traceable).

    The arrays are flattened into one vector and reduced by segment, so the compiled
    program has the size of one summary whatever the number of arrays.
    """
    _check_custom(layout, custom)
    arrays = [jnp.asarray(a) for a in arrays]
    if not arrays:
        return []
    sizes = [a.size for a in arrays]
    flat = jnp.concatenate([a.reshape(-1) for a in arrays])
    segments = jnp.asarray(np.repeat(np.arange(len(arrays), dtype=np.int32), sizes))
    counts, values = _summarize_flat(flat, layout, segments, len(arrays))
    out = []
    for i, a in enumerate(arrays):
        extra = [jnp.asarray(fn(a), values.dtype).reshape(1) for fn in (custom or {}).values()]
        out.append(DeviceSummary(counts[i], jnp.concatenate([values[i], *extra])))
    return out


def _check_custom(layout: Layout, custom: Mapping[str, CustomStat] | None) -> None:
    names = [name for name, _ in layout.extras]
    if list(custom or {}) != names:
        raise ValueError(
            f"custom statistics {sorted(custom or {})} do not match the layout's extras {names}"
        )


def _summarize_flat(flat: Any, layout: Layout, segments: Any, num: int) -> tuple[Any, Any]:
    """Counts ``[num, 4 + bins]`` and values ``[num, 10]`` of the segments of ``flat``
    (``segments=None``: one segment, reduced without scatter)."""
    fb = _bits_for(flat.dtype)
    cdt, idt = fb.float_dtype, fb.int_dtype
    width = np.dtype(idt).itemsize * 8
    mb, bias, mask = fb.mantissa_bits, fb.exponent_bias, fb.magnitude_mask
    flat = flat.astype(cdt)

    def reduce(kind: str, cols: list[Any]) -> Any:  # [num, len(cols)]
        data = jnp.stack(cols, axis=1)
        if segments is None:
            if kind == "sum":
                return jnp.sum(data, axis=0, keepdims=True)
            return jnp.min(data, axis=0, keepdims=True, initial=jnp.iinfo(data.dtype).max)
        op = {"sum": jax.ops.segment_sum, "min": jax.ops.segment_min}[kind]
        return op(data, segments, num_segments=num, indices_are_sorted=True)

    def spread(v: Any) -> Any:  # one value per segment -> one per element
        return v[0] if segments is None else v[segments]

    # Classification, extrema and exponents are computed on the bit patterns: integer
    # operations are exact where float ones are not (XLA:CPU treats subnormal inputs as
    # zero in float comparisons and arithmetic).
    bits = jax.lax.bitcast_convert_type(flat, idt)
    mag = bits & mask  # |x| as bits; for non-negative floats, integer order == float order
    inf_bits = fb.inf_bits
    nan = mag > inf_bits
    inf = mag == inf_bits
    fin = mag < inf_bits
    zero = mag == 0
    nonzero = fin & ~zero

    def as_float(b: Any) -> Any:
        return jax.lax.bitcast_convert_type(jnp.asarray(b, idt), cdt)

    def order_key(b: Any) -> Any:  # involution mapping float bits to an order-preserving int
        return b ^ ((b >> (width - 1)) & mask)

    def floor_log2(m: Any) -> Any:  # exact floor(log2|x|) of a finite non-zero magnitude
        efield = m >> mb
        sub = (width - 1 - jax.lax.clz(m)) - (bias + mb - 1)
        return jnp.where(efield > 0, efield - bias, sub)

    n_int = reduce("sum", [c.astype(jnp.int32) for c in (nan, inf, zero, fin)])
    key = order_key(bits)
    key_ninf = order_key(np.array(inf_bits | ~mask, idt))
    # Maxima as minima of the bitwise complement (exact, no overflow). Segments without a
    # finite value get the neutral extrema (+inf, -inf, +inf, 0) whatever the reduction's
    # identity element.
    neutral = jnp.array([inf_bits, ~key_ninf, inf_bits, ~0], idt)
    ext = reduce("min", [jnp.where(fin, key, neutral[0]), ~jnp.where(fin, key, key_ninf),
                         jnp.where(fin, mag, inf_bits), ~jnp.where(fin, mag, 0)])
    ext = jnp.where(n_int[:, 3:4] > 0, ext, neutral)
    vmin, vmax = as_float(order_key(ext[:, 0])), as_float(order_key(~ext[:, 1]))
    min_abs, s_mag = as_float(ext[:, 2]), ~ext[:, 3]
    s = as_float(s_mag)

    # Moments are sums over x / s. Dividing a subnormal by s on XLA:CPU would flush it to
    # zero, so x is first rescaled by 2**k (k = -floor(log2 s)) in the integer domain:
    # |x| = m * 2**(e - mb) is rebuilt as float(m) * 2**(e - mb + k), all normal numbers.
    def rescaled(m: Any, k: Any) -> Any:
        efield = m >> mb
        normal = efield > 0
        e_unb = jnp.where(normal, efield - bias, 1 - bias)
        m_full = jnp.where(normal, (m & ((1 << mb) - 1)) | (1 << mb), m)
        j = e_unb - mb + k
        pow2 = jnp.where(j < 1 - bias, 0, as_float((jnp.clip(j, 1 - bias, bias) + bias).astype(idt) << mb))
        return m_full.astype(cdt) * pow2

    k_seg = jnp.where(s_mag > 0, -floor_log2(s_mag), 0)
    s_scaled = jnp.where(s_mag > 0, rescaled(s_mag, k_seg), 1)  # s * 2**k, in [1, 2)
    xs = jnp.where(fin, rescaled(mag, spread(k_seg)), 0)
    xs = jnp.where(bits < 0, -xs, xs)  # x * 2**k
    n = jnp.maximum(n_int[:, 3], 1).astype(cdt)
    mean_k = reduce("sum", [xs])[:, 0] / n
    # Deviations are taken before dividing by s_scaled, so values close to the mean
    # subtract exactly; the corrected two-pass term removes the rounding error of mean_k.
    d = jnp.where(fin, xs - spread(mean_k), 0)
    u = jnp.abs(xs) / spread(s_scaled)  # |x| / s
    u2 = u * u
    u4 = u2 * u2
    sums = reduce("sum", [d * d, d, u, u2, u4, u4 * u4])
    m2 = (sums[:, 0] - sums[:, 1] ** 2 / n) / (s_scaled * s_scaled)
    mean = mean_k / s_scaled * s

    fmt = layout.format
    nbins = layout.num_counts
    over = ~nan & ((mag > fb.bits_of(fmt.overflow_threshold)) | inf)
    under = nonzero & ~over & (mag < fb.bits_of(fmt.underflow_threshold))
    idx = jnp.clip(floor_log2(mag) - fmt.min_exponent + 1, 1, nbins - 2)
    idx = jnp.where(under, 0, idx)
    idx = jnp.where(over, nbins - 1, idx)
    idx = jnp.where(nonzero | over, idx, nbins)  # zeros and NaN go to a dropped bin
    if segments is not None:
        idx = idx + segments * (nbins + 1)
    bins = jnp.bincount(idx.astype(jnp.int32), length=num * (nbins + 1))
    bins = bins.reshape(num, nbins + 1)[:, :nbins].astype(jnp.int32)

    sizes = n_int[:, 0] + n_int[:, 1] + n_int[:, 3]  # nan + inf + finite
    counts = jnp.concatenate([jnp.stack([sizes, n_int[:, 0], n_int[:, 1], n_int[:, 2]], axis=1), bins], axis=1)
    values = jnp.stack([vmin, vmax, min_abs, s, mean, m2, sums[:, 2], sums[:, 3], sums[:, 4], sums[:, 5]], axis=1)
    return counts, values


def to_vector(summary: DeviceSummary) -> np.ndarray:
    """The float64 summary vector (layout order) of a summary fetched to the host."""
    counts = np.asarray(summary.counts, dtype=np.float64)
    values = np.asarray(summary.values, dtype=np.float64)
    return np.concatenate([counts[:_N_INT], values[:_N_FLOAT], counts[_N_INT:], values[_N_FLOAT:]])
