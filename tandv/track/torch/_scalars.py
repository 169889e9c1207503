"""``tracker.log_scalars`` for torch tensors: a device scalar is copied to pinned host
memory without waiting (``copy_(non_blocking=True)`` and an event), read once it has
arrived."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["capture_torch"]


class _InFlight:
    """A CUDA scalar's non-blocking copy into pinned host memory."""

    __slots__ = ("host", "event")

    def __init__(self, x: torch.Tensor) -> None:
        self.host = torch.empty((), dtype=x.dtype, pin_memory=True)
        self.host.copy_(x, non_blocking=True)  # ordered after the kernels that compute x
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        return self.event.query()

    def get(self) -> float:
        self.event.synchronize()
        return float(self.host)


def capture_torch(name: str, value: Any) -> float | _InFlight | None:
    """A float, or a copy under way, for a one-element torch tensor; ``None`` for other values.

    A CPU tensor is read at once (no device to wait for, and a later in-place change
    must not alter what was logged); a CUDA tensor is copied without a sync; a tensor on
    another device (MPS, XLA) is read with ``.item()``, which waits for it."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.numel() != 1:
        raise ValueError(
            f"log_scalars({name}=...): expected one number; got a tensor of shape "
            f"{tuple(value.shape)} (reduce it first, e.g. loss.mean())"
        )
    if value.is_complex():
        raise ValueError(
            f"log_scalars({name}=...): expected a real number; got a {value.dtype} tensor"
        )
    x = value.detach().reshape(())
    if x.device.type == "cuda":
        with torch.cuda.device(x.device):
            return _InFlight(x)
    return float(x.item())
