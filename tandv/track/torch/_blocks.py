"""Block-scaled formats' columns from torch operations, on the tensor's device.

The torch-op path's share of :mod:`tandv.stats.blocks`: the same definitions, with the
element rounding done as the host kernel does it (float64; Veltkamp's split keeps the
element's mantissa bits of a normal value, adding and removing a power of two rounds to
the subnormal spacing; both round to nearest-even in IEEE arithmetic). Tensors whose
layout asks for block formats take this path instead of the fused Triton kernel, which
does not compute them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...stats.blocks import BlockFormat

__all__ = ["block_columns"]

_F64 = torch.float64
_F32 = torch.float32


def _round(a: torch.Tensor, mantissa: int, emin: int) -> torch.Tensor:
    """``a >= 0`` (float64) rounded to nearest-even onto the grid of an element format with
    ``mantissa`` bits and smallest normal ``2**emin`` (no saturation)."""
    g = a * (2.0 ** (52 - mantissa) + 1.0)
    normal = g - (g - a)
    k = 2.0 ** (52 + emin - mantissa)
    sub = (a + k) - k
    return torch.where(a < 2.0**emin, sub, normal)


def block_columns(x: torch.Tensor, formats: Sequence[BlockFormat]) -> torch.Tensor:
    """The five columns of each format in ``formats`` for ``x`` (any float dtype, any
    shape; blocks along the last dimension), as one float64 vector on ``x``'s device in
    the layout's order (format by format: underflow, subnormal, saturated, sq_err,
    block_range)."""
    dev = x.device
    length = x.shape[-1] if x.dim() else 1
    rows = x.detach().to(_F64).reshape(-1, length) if x.numel() else None
    out = []
    for f in formats:
        if rows is None or length == 0:
            out.append(torch.zeros(5, dtype=_F64, device=dev))
            continue
        nb = -(-length // f.block)
        padded = torch.full((rows.shape[0], nb * f.block), float("nan"), dtype=_F64, device=dev)
        padded[:, :length] = rows
        blocks = padded.view(rows.shape[0], nb, f.block)
        fin = torch.isfinite(blocks)
        v = torch.where(fin, blocks.abs(), 0.0)
        nz = v > 0
        amax = v.amax(-1, keepdim=True)
        amin = torch.where(nz, v, torch.inf).amin(-1, keepdim=True)
        ratio = torch.where(amax > 0, amax / amin, 1.0)
        block_range = torch.log2(ratio.max())
        if f.emax is not None:  # MX: a power-of-two scale per block
            e = torch.frexp(torch.where(amax > 0, amax, 1.0)).exponent - 1 - f.emax
            scale = torch.ldexp(torch.ones_like(amax), e)
            a = v / scale
        else:  # NVFP4, in float32 in the definition's order
            amax_t = v.max().to(_F32)
            s_t = torch.where(amax_t > 0, amax_t / 2688.0, 1.0)
            u = ((amax.to(_F32) / 6.0) / s_t).to(_F64).clamp(max=448.0)
            s_b = _round(torch.where(amax > 0, u, 0.0), 3, -6)
            scale32 = (s_b.to(_F32) * s_t).to(_F32)
            y = torch.where(scale32 > 0, v.to(_F32) / scale32, 0.0)
            a = y.to(_F64)
            scale = torch.where(scale32 > 0, scale32, 0.0).to(_F64)  # NaN where s_t = 0
        q = _round(a.clamp(max=f.max), f.mantissa, f.emin)
        err = torch.where(fin, (q * scale - v) ** 2, 0.0).sum()
        out.append(
            torch.stack(
                [
                    (nz & (q == 0)).sum().to(_F64),
                    (nz & (q > 0) & (q < f.smallest_normal)).sum().to(_F64),
                    (fin & (a > f.max)).sum().to(_F64),
                    err,
                    block_range,
                ]
            )
        )
    return torch.cat(out) if out else torch.zeros(0, dtype=_F64, device=dev)
