"""``summarize_torch``: the summary vector of a tensor, computed on the tensor's own device.

The result equals :func:`tandv.stats.summarize` (the numpy reference) applied to the
same values: counts, extrema and exponent counts exactly, moments to float64
rounding of float64 sums. Nothing here waits for the device (no ``.item()``,
``.cpu()`` or ``bool(tensor)``), so it can run inside forward and backward hooks.

How the exponent counts are built in one pass
---------------------------------------------
The tensor is converted to float64 once. Every float32, bfloat16, float16 and float8
value is a *normal* float64 (its subnormals included), so the biased float64 exponent
field ``bits >> 52`` is exactly ``floor(log2|x|) + 1023``. We take one more bit,
``bits >> 51``: the top mantissa bit, which separates ``inf`` (mantissa 0) from NaN
(the float64 conversion always yields a quiet NaN, top mantissa bit 1). One
``scatter_add_`` of these 4096 keys into a fixed-size table then gives the zero, NaN,
inf and per-exponent counts at once; a cached index folds the table into the
layout's bins (underflow, one per exponent of the format, overflow). Only two
cases need extra passes: float64 inputs (their subnormals and signalling NaNs do not
fit the trick; ``torch.frexp`` and ``isnan`` handle them) and a simulated format whose
largest value is not the top of its binade (``float8_e4m3fn``: 448 < 512), where
one comparison counts the values above the format's max.

Moments are scaled by the largest finite magnitude, as the layout documents, and
accumulated in float64; non-finite elements are replaced by 0 (neutral for the power
sums) and the extrema are repaired on the device from counts that are already known.
"""

from __future__ import annotations

import threading
from typing import Mapping

import torch

from ...stats.formats import NumberFormat, format_name
from ...stats.summary import CORE_FIELDS, Layout

__all__ = ["summarize_torch", "dtype_name"]

_I = {name: i for i, name in enumerate(CORE_FIELDS)}
_F64_BIAS = 1023
_NUM_KEYS = 4096  # (biased float64 exponent, top mantissa bit)
_INF_KEY = 2047 * 2  # exponent field all ones, top mantissa bit 0: +-inf
_NAN_KEY = 2047 * 2 + 1  # quiet NaN
#: Rows of the scatter table: the key tensor is split into this many rows so that
#: scatter_add_ runs in parallel on CPU (one row per thread), then the rows are summed.
_SCATTER_ROWS = 4

_fold_cache: dict[tuple[str, str], torch.Tensor] = {}
_ones_cache: dict[str, torch.Tensor] = {}
_workspace = threading.local()


def dtype_name(dtype: torch.dtype) -> str:
    """The log's name of a torch floating dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _fold_index(fmt: NumberFormat, device: torch.device) -> torch.Tensor:
    """Index mapping each of the 4096 keys to a layout count bin (``num_bins + 2`` is a
    discard bin for zeros and NaN)."""
    ck = (fmt.name, str(device))
    idx = _fold_cache.get(ck)
    if idx is None:
        nb = fmt.num_bins
        discard = nb + 2
        biased = torch.arange(_NUM_KEYS) // 2
        exp = biased - _F64_BIAS
        idx = torch.where(exp < fmt.min_exponent, 0, exp - fmt.min_exponent + 1)
        idx = idx.clamp(max=nb + 1)  # above max_exponent: overflow
        idx[0:2] = discard  # biased exponent 0: zeros (no float64 subnormals arise here)
        idx[_INF_KEY] = nb + 1
        idx[_NAN_KEY] = discard
        idx = idx.to(device)
        _fold_cache[ck] = idx
    return idx


def _ones(n: int, device: torch.device) -> torch.Tensor:
    """A cached int64 ones buffer of at least ``n`` elements on ``device`` (scatter source)."""
    key = str(device)
    buf = _ones_cache.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.ones(max(n, 1 << 16), dtype=torch.int64, device=device)
        _ones_cache[key] = buf
    return buf[:n]


def _scratch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reusable scratch buffers of ``n`` elements: two float32 and one float64.

    Allocating fresh multi-megabyte buffers for every tensor costs more than the
    arithmetic (page faults), so each thread keeps one growing workspace per device.
    Reuse is safe: on CPU every op has finished when it returns, and on an accelerator
    all kernels of one thread's hooks run in stream order."""
    spaces = getattr(_workspace, "spaces", None)
    if spaces is None:
        spaces = _workspace.spaces = {}
    key = str(device)
    buf = spaces.get(key)
    if buf is None or buf.shape[1] < n:
        buf = torch.empty(2, max(n, 1 << 12), dtype=torch.float64, device=device)
        spaces[key] = buf
    f32 = buf[0].view(torch.float32)
    return f32[:n], f32[n:2 * n], buf[1, :n]


def _key_counts(ad: torch.Tensor) -> torch.Tensor:
    """Counts of the 4096 (exponent, top mantissa bit) keys of the float64 magnitudes
    ``ad`` (overwritten with the keys)."""
    n = ad.numel()
    key = ad.view(torch.int64).bitwise_right_shift_(51)
    rows = _SCATTER_ROWS if n % _SCATTER_ROWS == 0 and n >= 1 << 14 else 1
    table = torch.zeros(rows, _NUM_KEYS, dtype=torch.int64, device=ad.device)
    table.scatter_add_(1, key.view(rows, -1), _ones(n, ad.device).view(rows, -1))
    return table.sum(0) if rows > 1 else table[0]


def _exponent_counts_f64(ad: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """Layout count bins of float64 magnitudes that may hold float64 subnormals or
    signalling NaNs (float64 inputs): exact via ``torch.frexp``."""
    nb = fmt.num_bins
    nan = torch.isnan(ad)
    over = ad > fmt.max  # includes inf
    exp = torch.frexp(ad).exponent.to(torch.int64) - 1
    idx = torch.where(exp < fmt.min_exponent, 0, exp - fmt.min_exponent + 1).clamp_(max=nb + 1)
    idx = torch.where(over, nb + 1, idx)
    idx = torch.where(nan | (ad == 0), nb + 2, idx)
    out = torch.zeros(nb + 3, dtype=torch.int64, device=ad.device)
    out.scatter_add_(0, idx, _ones(ad.numel(), ad.device))
    return out


def summarize_torch(
    x: torch.Tensor,
    layout: Layout,
    extras: Mapping[str, torch.Tensor | float] | None = None,
) -> torch.Tensor:
    """The float64 summary vector of ``x`` in ``layout``, on ``x``'s device.

    Arguments:
        x: a floating-point tensor of any shape, dtype and device (not modified).
        layout: the summary layout; ``layout.format`` decides the exponent bins and what
            counts as underflow/overflow, ``layout.extras`` the custom statistics.
        extras: the custom statistics' values for ``x``, one per ``layout.extras`` name
            (0-dim tensors or numbers), in any order.

    Returns:
        A 1-D float64 tensor of ``layout.size`` elements on ``x.device``.

    Raises:
        TypeError: if ``x`` is not a floating-point tensor.
        ValueError: if ``extras`` does not match ``layout.extras``.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"summarize_torch: expected a floating-point tensor; got "
                        f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of ' + str(x.dtype)}")
    fmt = layout.format
    dev = x.device
    n = x.numel()
    if n == 0:
        out = torch.tensor(layout.empty(), dtype=torch.float64, device=dev)
        return _put_extras(out, layout, extras)
    x = x.detach().reshape(-1)
    if x.dtype == torch.float64:
        out = _summarize_f64(x, layout)
    else:
        out = _summarize_f32(x, layout)
    return _put_extras(out, layout, extras)


def _summarize_f32(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Summary of a float32/bfloat16/float16/float8 vector: elementwise passes in float32
    with float32 cascade sums (relative error ~1e-7), exponent keys in float64."""
    fmt = layout.format
    dev = x.device
    n = x.numel()
    f32, f64, i32 = torch.float32, torch.float64, torch.int32
    A, B, K = _scratch(n, dev)
    if x.dtype == f32:
        src = x
    else:
        B.copy_(x)
        src = B
    torch.abs(src, out=A)
    # Smallest finite magnitude: the int view orders non-negative floats by magnitude
    # with inf and NaN above every finite value, so amin needs no masking.
    min_abs = A.view(i32).amin().reshape(1).view(f32)[0].to(f64)
    simulated = fmt.name != dtype_name(x.dtype)
    K.copy_(A)
    keys = _key_counts(K)
    if simulated and fmt.max < 2.0 ** (fmt.max_exponent + 1):
        over = (A > fmt.max).sum()
    else:
        over = None
    counts = torch.zeros(fmt.num_bins + 3, dtype=torch.int64, device=dev)
    counts.index_add_(0, _fold_index(fmt, dev), keys)
    counts = counts[: fmt.num_bins + 2]
    if over is not None:
        # Values above the format's max but below 2**(max_exponent+1) were counted in the
        # top exponent; move them to the overflow bin.
        counts[-2] -= over - counts[-1]
        counts[-1] = over
    nan_c, inf_c, zero_c = keys[_NAN_KEY], keys[_INF_KEY], keys[0]
    torch.nan_to_num(src, 0.0, 0.0, 0.0, out=B)
    mn, mx = torch.aminmax(B)
    s = torch.maximum(-mn, mx)
    # Scale by powers of two (exact): q = x / 2**e1 with 2**-e1 a finite float32, and the
    # magnitudes further to |x| / 2**e <= 1, where s < 2**e. e1 == e unless every finite
    # value is a float32 subnormal.
    e = torch.frexp(s).exponent
    e1 = e.clamp(min=-126)
    one = torch.ones((), dtype=f32, device=dev)
    q = B.mul_(torch.ldexp(one, -e1))
    torch.abs(q, out=A).mul_(torch.ldexp(one, e1 - e))
    sums = torch.stack([q.sum(dtype=f64), A.sum(), A.square_().sum(),
                        A.square_().sum(), A.square_().sum()]).to(f64)
    nonfin = (nan_c + inf_c).to(f64)
    nfin = n - nonfin
    safe_n = torch.where(nfin > 0, nfin, 1.0)
    mean_q = sums[0] / safe_n
    m32 = mean_q.to(f32)
    # Centred second moment around the float32 mean m32; the non-finite slots hold 0 and
    # each contributed m32**2; the offset of m32 from the mean adds nfin*(mean-m32)**2.
    m64 = m32.to(f64)
    m2 = q.sub_(m32).square_().sum().to(f64) - nonfin * m64 * m64 - nfin * (mean_q - m64) ** 2
    s64 = s.to(f64)
    one64 = torch.ones((), dtype=f64, device=dev)
    P1, P = torch.ldexp(one64, e1), torch.ldexp(one64, e)
    scale = torch.where(s64 > 0, s64, 1.0)
    r1, r = P1 / scale, P / scale
    moments = torch.stack([m2.clamp(min=0.0), sums[1], sums[2], sums[3], sums[4]]) * torch.stack(
        [r1 * r1, r, r * r, r ** 4, r ** 8])
    mean_q = mean_q * P1 / P
    return _assemble(layout, n, nan_c, inf_c, zero_c, mn.to(f64), mx.to(f64), min_abs, s64,
                     mean_q * P, moments, counts)


def _summarize_f64(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Summary of a float64 vector (its subnormals and signalling NaNs need ``frexp`` and
    ``isnan``; elementwise passes in float64)."""
    fmt = layout.format
    dev = x.device
    n = x.numel()
    f64 = torch.float64
    bins = _exponent_counts_f64(x.abs(), fmt)
    counts = bins[: fmt.num_bins + 2]
    nan_c = torch.isnan(x).sum()
    inf_c = torch.isinf(x).sum()
    zero_c = (x == 0).sum()
    min_abs = x.abs().view(torch.int64).amin().reshape(1).view(f64)[0]
    xc = torch.nan_to_num(x, 0.0, 0.0, 0.0)
    mn, mx = torch.aminmax(xc)
    s = torch.maximum(-mn, mx)
    scale = torch.where(s > 0, s, 1.0)
    q = xc.div_(scale)
    nonfin = (nan_c + inf_c).to(f64)
    nfin = n - nonfin
    mean_q = q.sum() / torch.where(nfin > 0, nfin, 1.0)
    a = q.abs()
    p1 = a.sum()
    p2 = a.square_().sum()
    p4 = a.square_().sum()
    p8 = a.square_().sum()
    m2 = q.sub_(mean_q).square_().sum() - nonfin * mean_q * mean_q
    moments = torch.stack([m2.clamp(min=0.0), p1, p2, p4, p8])
    return _assemble(layout, n, nan_c, inf_c, zero_c, mn, mx, min_abs, s, mean_q * scale,
                     moments, counts)


def _assemble(layout: Layout, n: int, nan_c: torch.Tensor, inf_c: torch.Tensor,
              zero_c: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, min_abs: torch.Tensor,
              max_abs: torch.Tensor, mean: torch.Tensor, moments: torch.Tensor,
              counts: torch.Tensor) -> torch.Tensor:
    """The layout vector from device scalars, repairing the extrema of inputs with
    non-finite values (``mn``/``mx`` were taken with non-finite values replaced by 0)."""
    f64 = torch.float64
    dev = mn.device
    nonfin = nan_c + inf_c
    has_fin = nonfin < n
    # mn/mx are exact unless non-finite values exist and the finite ones are all > 0 (the
    # min is then min_abs) or all < 0 (the max is then -min_abs), or none is finite.
    patched = (nonfin > 0) & (zero_c == 0)
    inf = torch.full((), float("inf"), dtype=f64, device=dev)
    true_min = torch.where(has_fin, torch.where(patched & (mn >= 0), min_abs, mn), inf)
    true_max = torch.where(has_fin, torch.where(patched & (mx <= 0), -min_abs, mx), -inf)
    head = torch.stack([
        torch.full((), float(n), dtype=f64, device=dev),
        nan_c.to(f64), inf_c.to(f64), zero_c.to(f64),
        true_min, true_max, torch.where(has_fin, min_abs, inf), max_abs,
        torch.where(has_fin, mean, 0.0),
    ])
    tail = torch.zeros(len(layout.extras), dtype=f64, device=dev)
    return torch.cat([head, moments, counts.to(f64), tail])


def _put_extras(out: torch.Tensor, layout: Layout,
                extras: Mapping[str, torch.Tensor | float] | None) -> torch.Tensor:
    names = [name for name, _ in layout.extras]
    given = dict(extras or {})
    if sorted(given) != sorted(names):
        raise ValueError(f"summarize_torch: extras {sorted(given)} do not match the layout's "
                         f"custom statistics {names}")
    if not names:
        return out
    vals = [v.detach().to(device=out.device, dtype=torch.float64).reshape(())
            if isinstance(v, torch.Tensor)
            else torch.full((), float(v), dtype=torch.float64, device=out.device)
            for v in (given[k] for k in names)]
    out[layout.extras_start:] = torch.stack(vals)
    return out
