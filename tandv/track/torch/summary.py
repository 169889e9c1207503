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
    """Three reusable 8-byte scratch buffers of ``n`` elements (two float64, one int64).

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
        buf = torch.empty(3, max(n, 1 << 12), dtype=torch.float64, device=device)
        spaces[key] = buf
    return buf[0, :n], buf[1, :n], buf[2, :n].view(torch.int64)


def _key_counts(ad: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Counts of the 4096 (exponent, top mantissa bit) keys of the float64 magnitudes ``ad``
    (``key`` is an int64 scratch buffer of the same size)."""
    n = ad.numel()
    torch.bitwise_right_shift(ad.view(torch.int64), 51, out=key)
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
    f64 = torch.float64
    n = x.numel()
    if n == 0:
        out = torch.tensor(layout.empty(), dtype=f64, device=dev)
        return _put_extras(out, layout, extras, n)
    x = x.detach()
    native64 = x.dtype == f64
    xd, ad, key = _scratch(n, dev)
    xd.copy_(x.reshape(-1))
    torch.abs(xd, out=ad)
    if native64:
        bins = _exponent_counts_f64(ad, fmt)
        nan_c = torch.isnan(ad).sum()
        inf_c = torch.isinf(ad).sum()
        zero_c = (ad == 0).sum()
        counts = bins[: fmt.num_bins + 2]
    else:
        keys = _key_counts(ad, key)
        counts = torch.zeros(fmt.num_bins + 3, dtype=torch.int64, device=dev)
        counts.index_add_(0, _fold_index(fmt, dev), keys)
        counts = counts[: fmt.num_bins + 2]
        nan_c, inf_c, zero_c = keys[_NAN_KEY], keys[_INF_KEY], keys[0]
        if fmt.name != dtype_name(x.dtype) and fmt.max < 2.0 ** (fmt.max_exponent + 1):
            # Simulated format whose max is inside its top binade: values above the max
            # but below 2**(max_exponent+1) were counted in the top exponent; move them.
            over_all = (ad > fmt.max).sum()
            moved = over_all - counts[-1]
            counts = counts.clone()
            counts[-2] -= moved
            counts[-1] = over_all
    # Smallest finite magnitude: the int64 view orders non-negative floats by magnitude
    # with inf and NaN above every finite value, so amin needs no masking.
    min_abs_bits = ad.view(torch.int64).amin()
    min_abs = min_abs_bits.reshape(1).view(f64)[0]
    xc = xd.nan_to_num_(0.0, 0.0, 0.0)
    mn, mx = torch.aminmax(xc)
    nfin = (n - nan_c - inf_c).to(f64)
    has_fin = nfin > 0
    s = torch.maximum(-mn, mx)
    scale = torch.where(s > 0, s, 1.0)
    q = xc.div_(scale)  # scaled finite values, non-finite -> 0
    safe_n = torch.where(has_fin, nfin, 1.0)
    mean_q = q.sum() / safe_n
    torch.abs(q, out=ad)
    p1 = ad.sum()
    p2 = ad.square_().sum()
    p4 = ad.square_().sum()
    p8 = ad.square_().sum()
    # Centred second moment; the non-finite slots hold 0 and contributed mean_q**2 each.
    m2 = q.sub_(mean_q).square_().sum() - (n - nfin) * mean_q * mean_q
    m2 = torch.clamp(m2, min=0.0)
    # Extrema over finite values: mn/mx came from data with non-finite -> 0. They are
    # exact unless non-finite values exist and the finite ones are all > 0 (min is then
    # min_abs) or all < 0 (max is then -min_abs), or there is no finite value.
    has_nonfin = nfin < n
    real_zero = zero_c > 0
    true_min = torch.where(has_nonfin & (mn >= 0) & ~real_zero, min_abs, mn)
    true_max = torch.where(has_nonfin & (mx <= 0) & ~real_zero, -min_abs, mx)
    pos_inf = torch.full((), float("inf"), dtype=f64, device=dev)
    true_min = torch.where(has_fin, true_min, pos_inf)
    true_max = torch.where(has_fin, true_max, -pos_inf)
    min_abs = torch.where(has_fin, min_abs, pos_inf)
    head = torch.stack([
        torch.full((), float(n), dtype=f64, device=dev),
        nan_c.to(f64), inf_c.to(f64), zero_c.to(f64),
        true_min, true_max, min_abs, s,
        torch.where(has_fin, mean_q * scale, 0.0), m2,
        p1, p2, p4, p8,
    ])
    out = torch.cat([head, counts.to(f64), torch.zeros(len(layout.extras), dtype=f64, device=dev)])
    return _put_extras(out, layout, extras, n)


def _put_extras(out: torch.Tensor, layout: Layout,
                extras: Mapping[str, torch.Tensor | float] | None, n: int) -> torch.Tensor:
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
