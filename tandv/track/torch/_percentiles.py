"""``track(..., percentiles=(1, 50, 99))``: exact percentiles of each tracked tensor, on its
device, without a sync.

The tensor is sorted (``torch.sort``; NaN sort last and are left out), and each
percentile is read from the sorted values at positions computed on the device from the
count of non-NaN elements, interpolated linearly as ``np.percentile`` does. Unlike
``torch.quantile`` (limited to 2**24 elements) this has no size limit; it costs a sort of
the tensor (a sorted copy and its int64 indices held briefly), which is far slower than
the summary itself: select the tensors that need it with ``include``/``exclude``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["percentile_stat"]

_SORTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def percentile_stat(
    columns: tuple[tuple[str, float], ...],
) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """A custom statistic (``x -> {column: 0-dim float64 tensor}``) giving the percentiles
    ``columns`` (``((name, q), ...)``, q in [0, 100]) of the non-NaN elements of ``x``."""
    names = [n for n, _ in columns]
    qs = [q / 100.0 for _, q in columns]

    def percentiles(x: torch.Tensor) -> dict[str, torch.Tensor]:
        v = x.detach().reshape(-1)
        if v.dtype not in _SORTABLE:
            v = v.float()
        if v.numel() == 0:
            nan = torch.full((len(names),), float("nan"), dtype=torch.float64, device=v.device)
            return dict(zip(names, nan.unbind()))
        s = torch.sort(v).values  # NaN last
        n = (v.numel() - torch.isnan(v).sum()).to(torch.float64)  # on the device: no sync
        q = torch.tensor(qs, dtype=torch.float64, device=v.device)
        # np.percentile's "linear" method, as numpy computes it
        pos = n * q + (1.0 - q) - 1.0
        lo = pos.floor().clamp(min=0)
        hi = (lo + 1).clamp(max=(n - 1).clamp(min=0))
        t = pos - lo
        a = s[lo.long()].to(torch.float64)
        b = s[hi.long()].to(torch.float64)
        d = b - a
        out = torch.where(t >= 0.5, b - d * (1 - t), a + d * t)
        out = torch.where(t == 0, a, out)  # no inf - inf at an exact position
        out = torch.where(n > 0, out, torch.full_like(out, float("nan")))
        return dict(zip(names, out.unbind()))

    return percentiles
