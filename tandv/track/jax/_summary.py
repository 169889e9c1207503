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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...stats.blocks import BLOCK_COLUMNS, block_formats_of
from ...stats.summary import (
    COUNT_INDEX,
    FIELD_RULES,
    N_CORE_VALUES,
    POWERS,
    VALUE_FIELDS,
    VALUE_INDEX,
    Layout,
    append_extras,
    join_summary,
    merge_higher,
    pack_fields,
    pack_parts,
    unpack_fields,
)
from ._blocks import block_words, block_words_many, decode, with_words

__all__ = [
    "DeviceSummary",
    "summarize_jax",
    "summarize_many_jax",
    "to_vector",
    "with_custom",
    "CustomStat",
    "histogram_by_matmul",
    "histograms_by_matmul",
    "merge_jax",
    "MAX_ELEMENTS",
    "check_countable",
    "with_blocks",
]

#: A custom statistic: a traceable function of the array returning a scalar.
CustomStat = Callable[[jax.Array], Any]


class DeviceSummary(NamedTuple):
    """A summary as it leaves the device, as the two parts of
    :func:`tandv.stats.summary.split_summary`: ``counts`` (int32: the leading counts, then
    the exponent counts) and ``values`` (float: the core values, then custom statistics)."""

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

    @property
    def width(self) -> int:
        """Bits of the type."""
        return np.dtype(self.int_dtype).itemsize * 8

    def as_float(self, b: Any) -> Any:
        """The floats of the bit patterns ``b``."""
        return jax.lax.bitcast_convert_type(jnp.asarray(b, self.int_dtype), self.float_dtype)

    def order_key(self, b: Any) -> Any:
        """Involution mapping the floats' bit patterns ``b`` to integers in the floats' order
        (and back): extrema compare exactly as integers, where XLA:CPU's float comparisons
        treat subnormals as zero."""
        return b ^ ((b >> (self.width - 1)) & self.magnitude_mask)

    def floor_log2(self, m: Any) -> Any:
        """Exact ``floor(log2|x|)`` of the magnitude bits ``m`` of finite non-zero floats."""
        mb, bias = self.mantissa_bits, self.exponent_bias
        efield = m >> mb
        sub = (self.width - 1 - jax.lax.clz(m)) - (bias + mb - 1)
        return jnp.where(efield > 0, efield - bias, sub)

    def rescaled(self, m: Any, k: Any) -> Any:
        """``|x| * 2**k`` of the magnitude bits ``m``, rebuilt in the integer domain as
        ``float(mantissa) * 2**(e - mantissa_bits + k)`` (0 where that is below the
        normal range): dividing a subnormal on XLA:CPU would flush it to zero."""
        mb, bias = self.mantissa_bits, self.exponent_bias
        efield = m >> mb
        normal = efield > 0
        e_unb = jnp.where(normal, efield - bias, 1 - bias)
        m_full = jnp.where(normal, (m & ((1 << mb) - 1)) | (1 << mb), m)
        j = e_unb - mb + k
        pow2 = jnp.where(
            j < 1 - bias,
            0,
            self.as_float((jnp.clip(j, 1 - bias, bias) + bias).astype(self.int_dtype) << mb),
        )
        return m_full.astype(self.float_dtype) * pow2


_F32 = _Bits(np.float32, np.int32, 23, 127)
_F64 = _Bits(np.float64, np.int64, 52, 1023)


def _bits_for(dtype: Any) -> _Bits:
    # float64 stays float64 (only possible with jax_enable_x64); every other type
    # (bfloat16, float16, float8_*, float32, ints) is widened to float32, which holds
    # each of their values exactly.
    return _F64 if jnp.dtype(dtype) == jnp.float64 else _F32


#: The most elements one on-device summary covers: its counts are int32 (JAX runs without
#: 64-bit integers unless ``jax_enable_x64`` is set), and a larger array's would wrap. The
#: tracker summarizes larger arrays in segments (``_segments``).
MAX_ELEMENTS = 2**31 - 1


def check_countable(x: Any, what: str = "an array") -> None:
    """Raises ``ValueError`` (at trace time: shapes are static) when ``x`` has more elements
    than one on-device summary can count, instead of summaries with wrapped counts."""
    if x.size > MAX_ELEMENTS:
        raise ValueError(
            f"tandv: {what} of shape {tuple(x.shape)} ({x.dtype}) has {x.size:,} elements; "
            f"one summary computed on the device counts at most 2**31 - 1 = {MAX_ELEMENTS:,} "
            "(int32 counts). Summarize it in segments of fewer elements and merge them on "
            "the host, as the tracker does (tandv.track.jax._segments.segmented)."
        )


#: Elements per row: arrays are reduced as rows of this many elements (NaN-padded), first
#: along each row, then rows are combined per array. One program thus serves any number of
#: arrays, and row reductions are contiguous, which XLA:CPU vectorizes.
ROW = 1024


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
            underflow/overflow thresholds; its block formats' columns (which lead its
            extras) are computed here (:func:`with_blocks`).
        custom: functions for the other ``layout.extras``, by name, in the same order;
            each maps the array to a scalar.

    Returns:
        A :class:`DeviceSummary`; :func:`to_vector` of its host copy equals
        ``tandv.stats.summarize(x, layout.format)[0]`` (counts, extrema and exponent counts
        exactly, moments to float32 rounding).
    """
    return summarize_many_jax([x], layout, custom)[0]


def summarize_many_jax(
    arrays: Sequence[Any],
    layout: Layout,
    custom: Mapping[str, CustomStat] | None = None,
) -> list[DeviceSummary]:
    """Summaries of several arrays of one dtype, computed together (traceable).

    The compiled program has the size of one summary whatever the number of arrays.
    """
    formats = block_formats_of(layout.extras)
    names = [name for name, _ in layout.extras[len(BLOCK_COLUMNS) * len(formats) :]]
    if list(custom or {}) != names:
        raise ValueError(
            f"custom statistics {sorted(custom or {})} do not match the layout's extras {names}"
        )
    arrays = [jnp.asarray(a) for a in arrays]
    if not arrays:
        return []
    fb = _bits_for(arrays[0].dtype)
    if any(_bits_for(a.dtype) != fb for a in arrays):
        raise ValueError("summarize_many_jax: arrays must share one compute dtype (float64 or not)")
    parts, row_seg, pads = [], [], []
    for i, a in enumerate(arrays):
        check_countable(a)
        rows = max(1, -(-a.size // ROW))
        pad = rows * ROW - a.size
        parts.append(a.reshape(-1).astype(fb.float_dtype))
        if pad:
            parts.append(jnp.full(pad, np.nan, fb.float_dtype))
        row_seg += [i] * rows
        pads.append(pad)
    block = (jnp.concatenate(parts) if len(parts) > 1 else parts[0]).reshape(-1, ROW)
    counts, values = _summarize_rows(
        block, np.asarray(row_seg, np.int32), np.asarray(pads, np.int32), layout, fb
    )
    # the block formats' words of all arrays together (one program's size)
    words = block_words_many(arrays, formats) if formats else None
    out = []
    for i, a in enumerate(arrays):
        got = with_custom(DeviceSummary(counts[i], values[i]), a, custom)
        if layout.num_higher:
            extra = higher_moments_jax(a, got.values).astype(got.values.dtype)
            got = DeviceSummary(got.counts, append_extras(got.values, extra, jnp))
        if words is not None:
            got = DeviceSummary(
                *with_words(got.counts, got.values, words[0][i], words[1][i], N_CORE_VALUES)
            )
        out.append(got)
    return out


def with_blocks(summary: DeviceSummary, x: Any, layout: Layout) -> DeviceSummary:
    """``summary`` (of ``x``: core values, custom statistics, ``m3``, ``m4``) with the words
    of the block formats that lead ``layout.extras``, computed by XLA operations (see
    :mod:`._blocks`; :func:`to_vector` turns them into the layout's columns); unchanged
    without block formats (traceable)."""
    formats = block_formats_of(layout.extras)
    if not formats:
        return summary
    ints, floats = block_words(x, formats)
    return DeviceSummary(*with_words(summary.counts, summary.values, ints, floats, N_CORE_VALUES))


def higher_moments_jax(x: Any, values: Any) -> jax.Array:
    """``[m3, m4]`` of ``x`` (the centred third and fourth sums of its finite elements, scaled
    by their largest magnitude like ``m2``), computed from ``x`` and the float part ``values``
    of its core summary (traceable; only for ``Layout(moments=4)``).

    The deviations are taken from the core's mean in the compute dtype (exact by Sterbenz
    where the mean dominates), and that mean's rounding is taken out with the deviations' own
    mean ``e`` (``sum((d - e)**3) = S3 - 3 e S2 + 2 n e**3``, likewise for the fourth), so
    the sums are about the exact mean of ``x``; rows of :data:`ROW` are summed first, then
    the rows (shorter rounding chains than one long sum)."""
    mean = values[VALUE_INDEX["mean"]]
    big = values[VALUE_INDEX["max_abs"]]
    s = jnp.where(big > 0, big, jnp.ones_like(big))
    v = jnp.asarray(x).reshape(-1).astype(values.dtype)
    fin = jnp.isfinite(v)
    d = jnp.where(fin, (v - mean) / s, jnp.zeros_like(v))
    pad = -d.size % ROW
    rows = jnp.pad(d, (0, pad)).reshape(-1, ROW)
    d2 = rows * rows
    s1, s2, s3, s4 = (jnp.sum(jnp.sum(p, axis=1)) for p in (rows, d2, d2 * rows, d2 * d2))
    n = jnp.sum(fin).astype(values.dtype)
    e = s1 / jnp.maximum(n, 1)
    m3 = s3 - 3 * e * s2 + 2 * n * e**3
    m4 = s4 - 4 * e * s3 + 6 * e * e * s2 - 3 * n * e**4
    return jnp.stack([m3, m4])


def with_custom(
    core: DeviceSummary, x: Any, custom: Mapping[str, CustomStat] | None
) -> DeviceSummary:
    """``core`` (the layout's core fields of ``x``, then ``m3``, ``m4`` where a kernel
    computed them for ``moments=4``) with the custom statistics of ``x`` after the core
    fields, in ``custom``'s order: the layout's order, ``m3`` and ``m4`` last (traceable)."""
    if not custom:
        return core
    extra = jnp.concatenate(
        [jnp.asarray(fn(x), core.values.dtype).reshape(1) for fn in custom.values()]
    )
    v = core.values
    extra = jnp.broadcast_to(extra, (*v.shape[:-1], extra.shape[0]))  # (on every segment's row)
    values = jnp.concatenate([v[..., :N_CORE_VALUES], extra, v[..., N_CORE_VALUES:]], axis=-1)
    return DeviceSummary(core.counts, values)


def _reduce_rows(ops: list[tuple[Any, str]]) -> list[Any]:
    """Row-wise (axis 1) sums / minima of several ``[rows, ROW]`` arrays in one variadic
    reduction (XLA:CPU runs one variadic reduce far faster than many fused ones)."""
    inits = tuple(
        np.array(0 if kind == "sum" else np.iinfo(np.dtype(a.dtype)).max, a.dtype)
        for a, kind in ops
    )
    kinds = [kind for _, kind in ops]

    def combine(x: tuple, y: tuple) -> tuple:
        return tuple(a + b if k == "sum" else jnp.minimum(a, b) for a, b, k in zip(x, y, kinds))

    return list(jax.lax.reduce(tuple(a for a, _ in ops), inits, combine, (1,)))


#: Arrays with at least this many rows are histogrammed in pairs (see :func:`_histogram`).
_PAIR_ROWS = 32


def _histogram(idx: Any, length: int) -> Any:
    """Counts of the values ``0 <= idx < length`` in ``idx`` (``[rows, ROW]``).

    XLA:CPU's scatter costs about a nanosecond per update whatever the table size, so large
    inputs are counted in pairs: one update per two elements into a ``length**2`` table of
    (first, second) combinations, whose row and column sums are the counts. That halves the
    cost; the table's size (~300 KB for float32 layouts) pays off only for large inputs."""
    if idx.shape[0] < _PAIR_ROWS or length > 512:  # small input, or a float64 layout
        return jnp.bincount(idx.reshape(-1), length=length)
    pairs = idx.reshape(-1, 2)
    table = (
        jnp.zeros(length * length, jnp.int32)
        .at[pairs[:, 0] * length + pairs[:, 1]]
        .add(1, mode="promise_in_bounds")
        .reshape(length, length)
    )
    return table.sum(0) + table.sum(1)


#: Width of the low part of a bin index in :func:`histogram_by_matmul`.
_LOW = 16


def histogram_by_matmul(idx: Any, length: int) -> Any:
    """Counts of the values ``0 <= idx < length`` in ``idx`` (``[rows, ROW]``), with no
    scatter: each index is split into a high and a low part, and the counts of every
    (high, low) pair are the product of the two one-hot matrices, ``onehot(high)^T @
    onehot(low)``, one small matrix product per row, summed over rows.

    On accelerators a scatter-add histogram serializes on the few bins most values share
    (torch's ``scatter_add_`` took 71% of a GPT-2-sized step's GPU time in our
    measurements); a matrix product has no contention and runs on the matrix units. The
    one-hot factors are exact in bfloat16 and the products are accumulated in float32,
    exact for the at most ``ROW`` (< 2**24) values of a row; the row sums are int32."""
    return histograms_by_matmul(idx, np.zeros(idx.shape[0], np.int32), 1, length)[0]


def histograms_by_matmul(idx: Any, row_seg: np.ndarray, num: int, length: int) -> Any:
    """:func:`histogram_by_matmul` of each of ``num`` arrays laid out in ``idx`` (``[rows,
    ROW]``; row r belongs to array ``row_seg[r]``, sorted), ``[num, length]``: the rows'
    matrix products are one batched product for all arrays, and each array's rows are
    summed by one segment sum, so that a stack of arrays costs the kernels of one (on a
    GPU each kernel is a launch the host pays for at every call; a product per array cost
    a few launches per array)."""
    high = -(-length // _LOW)
    hi = jax.nn.one_hot(idx // _LOW, high, dtype=jnp.bfloat16)  # [rows, ROW, high]
    lo = jax.nn.one_hot(idx % _LOW, _LOW, dtype=jnp.bfloat16)  # [rows, ROW, _LOW]
    per_row = jnp.einsum("rnh,rnl->rhl", hi, lo, preferred_element_type=jnp.float32)
    per_row = per_row.astype(jnp.int32).reshape(idx.shape[0], -1)
    if num == 1:
        return per_row.sum(0, keepdims=True)[:, :length]
    seg = jnp.asarray(row_seg)
    return jax.ops.segment_sum(per_row, seg, num, indices_are_sorted=True)[:, :length]


def _scatter_histograms(idx: Any, row_seg: np.ndarray, num: int, length: int) -> Any:
    """:func:`_histogram` of each of the ``num`` arrays laid out in ``idx`` (as in
    :func:`histograms_by_matmul`), ``[num, length]``: one small histogram per array (static
    row ranges), as XLA:CPU scatters into a small histogram much faster than into one long
    histogram of all arrays."""
    starts = np.searchsorted(row_seg, np.arange(num + 1))
    return jnp.stack([_histogram(idx[starts[i] : starts[i + 1]], length) for i in range(num)])


def _platform_histograms(idx: Any, row_seg: np.ndarray, num: int, length: int) -> Any:
    """The histograms of the ``num`` arrays laid out in ``idx``: by scatters
    (:func:`_scatter_histograms`, fast on XLA:CPU) on the CPU, and by matrix products
    (:func:`histograms_by_matmul`) on every other platform, chosen when JAX lowers the
    program for the platform it runs on. Both int32 (the branches must agree: with
    ``jax_enable_x64`` a scatter counts in int64, a segment sum of products in int32)."""
    return jax.lax.platform_dependent(
        idx,
        cpu=lambda i: _scatter_histograms(i, row_seg, num, length).astype(jnp.int32),
        default=lambda i: histograms_by_matmul(i, row_seg, num, length).astype(jnp.int32),
    )


class _RowSegments(NamedTuple):
    """Which of ``num`` arrays each row of a block of rows belongs to: row ``r`` to array
    ``row_seg[r]`` (sorted; ``seg``: the same on the device)."""

    row_seg: np.ndarray
    num: int
    seg: Any

    def per_array(self, v: Any, kind: str) -> Any:
        """Per-row partials ``v`` combined into one value per array (``kind``: ``"sum"`` or
        ``"min"``)."""
        if self.num == 1:  # a plain reduction: no scatter
            return (jnp.sum if kind == "sum" else jnp.min)(v, axis=0, keepdims=True)
        op = jax.ops.segment_sum if kind == "sum" else jax.ops.segment_min
        return op(v, self.seg, num_segments=self.num, indices_are_sorted=True)

    def per_row(self, v: Any) -> Any:
        """One value per array, broadcastable against the rows."""
        return v[:, None] if self.num == 1 else v[self.seg][:, None]


class _Classes(NamedTuple):
    """The elements of a block of rows as bit patterns (``bits``), magnitude bits, and their
    class. Classification, extrema and exponents are computed on the bit patterns: integer
    operations are exact where float ones are not (XLA:CPU treats subnormal inputs as zero
    in float comparisons and arithmetic)."""

    bits: Any
    mag: Any
    nan: Any
    inf: Any
    fin: Any
    zero: Any
    nonzero: Any


def _classify(block: Any, fb: _Bits) -> _Classes:
    """The :class:`_Classes` of the elements of ``block``."""
    bits = jax.lax.bitcast_convert_type(block, fb.int_dtype)
    mag = bits & fb.magnitude_mask  # for non-negative floats, integer order == float order
    inf_bits = fb.inf_bits
    nan = mag > inf_bits
    inf = mag == inf_bits
    fin = mag < inf_bits
    zero = mag == 0
    return _Classes(bits, mag, nan, inf, fin, zero, fin & ~zero)


def _counts_and_extrema(
    v: _Classes, rows: _RowSegments, pads: np.ndarray, fb: _Bits
) -> tuple[list[Any], dict[str, Any], Any]:
    """``([nan, inf, zero, finite] counts, {min, max, min_abs, max_abs}, max_abs's bits)``
    of each array: counts summed and extrema reduced as integers (order keys, magnitude
    bits) along the rows, then per array. Arrays without a finite value get the neutral
    extrema (+inf, -inf, +inf, 0) whatever the reductions' identity elements."""
    inf_bits = fb.inf_bits
    key = fb.order_key(v.bits)
    key_ninf = fb.order_key(np.array(inf_bits | ~fb.magnitude_mask, fb.int_dtype))
    # Maxima as minima of the bitwise complement (exact, no overflow).
    one = jnp.ones((), jnp.int32)
    r_nan, r_inf, r_zero, r_kmin, r_nkmax, r_amin, r_namax = _reduce_rows(
        [
            (jnp.where(v.nan, one, 0), "sum"),
            (jnp.where(v.inf, one, 0), "sum"),
            (jnp.where(v.zero, one, 0), "sum"),
            (jnp.where(v.fin, key, inf_bits), "min"),
            (~jnp.where(v.fin, key, key_ninf), "min"),
            (jnp.where(v.fin, v.mag, inf_bits), "min"),
            (~jnp.where(v.fin, v.mag, 0), "min"),
        ]
    )
    n_nan = rows.per_array(r_nan, "sum") - jnp.asarray(pads)
    n_inf, n_zero = rows.per_array(r_inf, "sum"), rows.per_array(r_zero, "sum")
    n_fin = (
        jnp.asarray([int(c) for c in np.bincount(rows.row_seg, minlength=rows.num)], jnp.int32)
        * ROW
        - jnp.asarray(pads)
        - n_nan
        - n_inf
    )
    neutral = jnp.array([inf_bits, ~key_ninf, inf_bits, ~0], fb.int_dtype)
    ext = jnp.stack([rows.per_array(r, "min") for r in (r_kmin, r_nkmax, r_amin, r_namax)], axis=1)
    ext = jnp.where(n_fin[:, None] > 0, ext, neutral)
    extrema = {
        "min": fb.as_float(fb.order_key(ext[:, 0])),
        "max": fb.as_float(fb.order_key(~ext[:, 1])),
        "min_abs": fb.as_float(ext[:, 2]),
    }
    s_mag = ~ext[:, 3]
    extrema["max_abs"] = fb.as_float(s_mag)
    return [n_nan, n_inf, n_zero, n_fin], extrema, s_mag


def _scaled_moments(
    v: _Classes, n_fin: Any, s_mag: Any, s: Any, rows: _RowSegments, fb: _Bits
) -> dict[str, Any]:
    """Each array's mean, ``m2`` and power sums of ``|x| / s`` (``s``: its largest
    magnitude, of bits ``s_mag``), from sums over ``x * 2**k`` (``k = -floor(log2 s)``,
    :meth:`_Bits.rescaled`: no subnormal flushed to zero)."""
    k_arr = jnp.where(s_mag > 0, -fb.floor_log2(s_mag), 0)
    s_scaled = jnp.where(s_mag > 0, fb.rescaled(s_mag, k_arr), 1)  # s * 2**k, in [1, 2)
    xs = jnp.where(v.fin, fb.rescaled(v.mag, rows.per_row(k_arr)), 0)
    xs = jnp.where(v.bits < 0, -xs, xs)  # x * 2**k
    n = jnp.maximum(n_fin, 1).astype(fb.float_dtype)
    mean_k = rows.per_array(jnp.sum(xs, axis=1), "sum") / n
    # Deviations are taken before dividing by s_scaled, so values close to the mean
    # subtract exactly; the corrected two-pass term removes the rounding error of mean_k.
    d = jnp.where(v.fin, xs - rows.per_row(mean_k), 0)
    u = jnp.abs(xs) / rows.per_row(s_scaled)  # |x| / s
    sums = [
        rows.per_array(r, "sum")
        for r in _reduce_rows([(d * d, "sum"), (d, "sum"), *[(u**k, "sum") for k in POWERS]])
    ]
    m2 = (sums[0] - sums[1] ** 2 / n) / (s_scaled * s_scaled)
    return {
        "mean": mean_k / s_scaled * s,
        "m2": m2,
        **{f"p{k}": p for k, p in zip(POWERS, sums[2:])},
    }


def _exponent_counts(v: _Classes, layout: Layout, rows: _RowSegments, fb: _Bits) -> Any:
    """Each array's exponent counts (``[num, layout.num_counts]``): underflow, each
    exponent, overflow; zeros and NaN go to a dropped bin."""
    fmt = layout.format
    nbins = layout.num_counts
    over = ~v.nan & ((v.mag > fb.bits_of(fmt.overflow_threshold)) | v.inf)
    under = v.nonzero & ~over & (v.mag < fb.bits_of(fmt.underflow_threshold))
    idx = jnp.clip(fb.floor_log2(v.mag) - fmt.min_exponent + 1, 1, nbins - 2)
    idx = jnp.where(under, 0, idx)
    idx = jnp.where(over, nbins - 1, idx)
    idx = jnp.where(v.nonzero | over, idx, nbins)
    idx = idx.astype(jnp.int32)
    bins = _platform_histograms(idx, rows.row_seg, rows.num, nbins + 1)
    return bins[:, :nbins].astype(jnp.int32)


def _summarize_rows(
    block: Any, row_seg: np.ndarray, pads: np.ndarray, layout: Layout, fb: _Bits
) -> tuple[Any, Any]:
    """Counts ``[num, N_LEADING_COUNTS + bins]`` and values ``[num, N_CORE_VALUES]`` (the
    parts of :func:`tandv.stats.summary.split_summary`) of the arrays laid out in ``block``
    (``[rows, ROW]``; row r belongs to array ``row_seg[r]``, padded with ``pads`` NaNs)."""
    rows = _RowSegments(row_seg, len(pads), jnp.asarray(row_seg))
    v = _classify(block, fb)
    (n_nan, n_inf, n_zero, n_fin), extrema, s_mag = _counts_and_extrema(v, rows, pads, fb)
    moments = _scaled_moments(v, n_fin, s_mag, extrema["max_abs"], rows, fb)
    bins = _exponent_counts(v, layout, rows, fb)
    core = {
        "numel": n_fin + n_nan + n_inf,
        "nan_count": n_nan,
        "inf_count": n_inf,
        "zero_count": n_zero,
        **extrema,
        **moments,
    }
    return pack_parts(core, bins, xp=jnp)


def _merge_value(rule: str, a: Any, b: Any, fb: _Bits) -> Any:
    """Two summaries' values merged by a value-by-value ``rule`` (of
    :data:`tandv.stats.summary.FIELD_RULES` for a core field, of
    :data:`tandv.stats.summary.MERGE_RULES` but ``"mean"`` for a custom statistic):
    ``"sum"`` adds; ``"min"`` / ``"max"`` compare the values' order keys (exact where
    XLA:CPU's float comparisons treat subnormals as zero)."""
    if rule == "sum":
        return a + b
    if rule not in ("min", "max"):
        raise ValueError(f"merge_jax: merge rule {rule!r} does not merge value by value")
    pick = jnp.minimum if rule == "min" else jnp.maximum
    ka = fb.order_key(jax.lax.bitcast_convert_type(a, fb.int_dtype))
    kb = fb.order_key(jax.lax.bitcast_convert_type(b, fb.int_dtype))
    return fb.as_float(fb.order_key(pick(ka, kb)))


def _merge_counts(ca: Any, cb: Any) -> Any:
    """Two summaries' counts added (every count's rule is ``"sum"``). The counts are int32:
    a union of more than :data:`MAX_ELEMENTS` elements (a loop's iterations together) would
    wrap them. Its numel becomes -1, stays -1 through later merges, and :func:`to_vector`
    refuses it (every other count is at most numel, so numel alone can tell)."""
    numel = COUNT_INDEX["numel"]
    too_many = (ca[numel] < 0) | (cb[numel] < 0) | (ca[numel] > MAX_ELEMENTS - cb[numel])
    counts = ca + cb
    return counts.at[numel].set(jnp.where(too_many, -1, counts[numel]))


def _n_finite(counts: Any, dtype: Any) -> Any:
    """A summary's finite elements (numel less NaN and inf) from its counts, as ``dtype``."""
    c = COUNT_INDEX
    return (counts[c["numel"]] - counts[c["nan_count"]] - counts[c["inf_count"]]).astype(dtype)


def _over(s: Any, fb: _Bits) -> Callable[[Any], Any]:
    """``v -> v / s``, computed in the integer domain (``v * 2**k`` rebuilt from its bits
    over ``s * 2**k`` in ``[1, 2)``): exact for subnormal ``s`` and ``v``, which XLA:CPU's
    float division flushes to zero."""
    s_bits = jax.lax.bitcast_convert_type(s, fb.int_dtype) & fb.magnitude_mask
    k = jnp.where(s_bits > 0, -fb.floor_log2(s_bits), 0)
    s_scaled = jnp.where(s_bits > 0, fb.rescaled(s_bits, k), 1)

    def over_s(v: Any) -> Any:
        b = jax.lax.bitcast_convert_type(v, fb.int_dtype)
        r = fb.rescaled(b & fb.magnitude_mask, k) / s_scaled
        return jnp.where(b < 0, -r, r)

    return over_s


def _merge_extras(a: DeviceSummary, b: DeviceSummary, rules: Sequence[str], fb: _Bits) -> list[Any]:
    """The custom statistics of two summaries merged by their ``rules``: ``"mean"``
    weighted by each summary's numel, the others value by value (:func:`_merge_value`)."""
    va, vb = a.values, b.values
    numel = COUNT_INDEX["numel"]
    wa, wb = a.counts[numel].astype(va.dtype), b.counts[numel].astype(va.dtype)
    extras = []
    for i, rule in enumerate(rules, N_CORE_VALUES):
        if rule != "mean":
            extras.append(_merge_value(rule, va[i], vb[i], fb))
            continue
        total = wa + wb
        extras.append(
            jnp.where(total > 0, (va[i] * wa + vb[i] * wb) / jnp.where(total > 0, total, 1), 0)
        )
    return extras


def merge_jax(a: DeviceSummary, b: DeviceSummary, rules: Sequence[str] = ()) -> DeviceSummary:
    """The summary of the union of two arrays' elements from their summaries, on device
    (traceable): :func:`tandv.stats.summary.merge` in the summaries' own float type, field
    by field as :data:`tandv.stats.summary.FIELD_RULES` says.

    Counts, extrema and exponent counts merge exactly; the mean, the centred second moment
    (Chan's update) and the power sums are rescaled from each part's largest magnitude to
    the merged one. ``rules``: the merge rule of each custom statistic (``"sum"``, ``"min"``,
    ``"max"``, ``"mean"``: weighted by element count), in the values' order. Values two
    longer than the core fields and custom statistics end with ``m3``, ``m4``
    (``moments=4``), merged by Pébay's update like :func:`tandv.stats.summary.merge`.

    Why on device: a tap inside a loop body (``lax.scan``, ``nn.scan``) writes its mailbox
    once per iteration, and each write merges into what the mailbox holds, so one summary
    of all iterations leaves the program."""
    va, vb = a.values, b.values
    higher = va.shape[-1] - N_CORE_VALUES - len(rules)
    if higher not in (0, 2) or vb.shape[-1] != va.shape[-1]:
        raise ValueError(
            f"merge_jax: values of {va.shape[-1]} and {vb.shape[-1]} entries for "
            f"{len(rules)} custom statistics; expected {N_CORE_VALUES + len(rules)} "
            f"(or 2 more, m3 and m4 of moments=4) in both"
        )
    fb = _bits_for(va.dtype)
    counts = _merge_counts(a.counts, b.counts)
    na, nb = _n_finite(a.counts, va.dtype), _n_finite(b.counts, va.dtype)
    xa, xb = unpack_fields(va, VALUE_FIELDS), unpack_fields(vb, VALUE_FIELDS)
    # the extrema ("min", "max"); then the moments and power sums on the merged scale s
    core = {
        name: _merge_value(FIELD_RULES[name], xa[name], xb[name], fb)
        for name in VALUE_FIELDS
        if FIELD_RULES[name] not in ("moment", "power")
    }
    s = core["max_abs"]
    over_s = _over(s, fb)
    ra, rb = over_s(xa["max_abs"]), over_s(xb["max_abs"])
    delta = over_s(xb["mean"]) - over_s(xa["mean"])  # scaled before subtracting: no overflow
    n = na + nb
    has = n > 0
    safe = jnp.where(has, n, 1)
    ma, m2a, m2b = xa["mean"], xa["m2"] * ra**2, xb["m2"] * rb**2
    core["mean"] = jnp.where(has, ma + delta * (nb / safe) * s, ma)
    core["m2"] = jnp.where(has, m2a + m2b + delta**2 * (na * (nb / safe)), xa["m2"])
    core.update({f"p{k}": xa[f"p{k}"] * ra**k + xb[f"p{k}"] * rb**k for k in POWERS})
    extras = _merge_extras(a, b, rules, fb)
    if higher:  # Pébay's update, the sums rescaled to the merged scale like m2's
        i3 = N_CORE_VALUES + len(rules)
        a3, a4, b3, b4 = va[i3] * ra**3, va[i3 + 1] * ra**4, vb[i3] * rb**3, vb[i3 + 1] * rb**4
        m3, m4 = merge_higher(na, nb, delta, m2a, a3, a4, m2b, b3, b4)
        extras += [jnp.where(has, m3, va[i3]), jnp.where(has, m4, va[i3 + 1])]
    values = pack_fields(core, VALUE_FIELDS, jnp)
    if extras:
        values = append_extras(values, jnp.stack(extras), jnp)
    return DeviceSummary(counts, values.astype(va.dtype))


def to_vector(summary: DeviceSummary, what: str = "a summary") -> np.ndarray:
    """The float64 summary vector (layout order) of a summary fetched to the host; of a
    stack of them (parts of shape ``(k, ...)``), the ``(k, n)`` matrix of their vectors.

    Raises:
        ValueError: where :func:`merge_jax` marked it as covering more elements than its
            int32 counts hold (``what`` names it in the message).
    """
    counts = np.asarray(summary.counts)
    if (counts[..., COUNT_INDEX["numel"]] < 0).any():
        raise ValueError(
            f"tandv: {what} merges more than 2**31 - 1 = {MAX_ELEMENTS:,} elements (the "
            "iterations of a loop body together), more than its int32 counts hold. Leave "
            "it out of tracking with track(..., exclude=<a regex matching its name>)."
        )
    counts, values = decode(counts, np.asarray(summary.values), N_CORE_VALUES)
    values = np.asarray(values, dtype=np.float64)
    return join_summary(counts.astype(np.float64), values, np)
