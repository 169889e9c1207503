"""The gradient noise scale of a PyTorch model under gradient accumulation, per step, at
the cost of one norm per micro-batch and no copy of any gradient.

McCandlish et al. ("An Empirical Model of Large-Batch Training", 2018, appendix A) estimate
``|G|^2`` and ``tr(Sigma)`` from squared gradient norms at two batch sizes. Under gradient
accumulation both are at hand: autograd hands each backward pass's gradient to a hook before
adding it into ``.grad`` (the micro-batch, the small batch), and ``.grad`` after the last
micro-batch is the step's gradient (the big batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch import nn

from ...quantities import two_batch_estimate

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["GradientNoiseScale"]


def _sq_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of all ``tensors`` together, in float64 on their device (one
    multi-tensor norm, accumulated in float64, and no synchronisation)."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square().sum()


class GradientNoiseScale:
    """Per-step ``|G|^2`` and ``tr(Sigma)`` estimates from the micro-batches of a step.

    Usage (zero the gradients before the first micro-batch; the losses may or may not be
    divided by the number of micro-batches, the estimates' ratio does not depend on it)::

        with track(model, opt) as tracker, GradientNoiseScale(model, 8, tracker=tracker) as ns:
            for micro_batches in data:
                for x, y in micro_batches:
                    (loss_fn(model(x), y) / len(micro_batches)).backward()
                ns.step()                       # after the last backward, before zero_grad
                opt.step(); opt.zero_grad(); tracker.step()
        b = tandv.quantities.smoothed_noise_scale(tandv.read_scalars(tracker.out_path))

    Each step's ``noise_g2``, ``noise_trace`` and ``noise_b_simple`` (their single-step ratio,
    biased and noisy: smooth the two estimates over steps and divide, as
    :func:`tandv.quantities.smoothed_noise_scale` does) go to the tracker's training scalars;
    without a tracker they are kept for :meth:`history`. They stay on the device until the
    tracker copies them without waiting, so a step costs one norm per parameter per
    micro-batch (``torch._foreach_norm``) and no synchronisation.

    Arguments:
        model: the model whose trainable parameters' gradients are measured.
        micro_batch_size: examples per micro-batch (the small batch size).
        tracker: a tandv torch tracker to log the estimates to (``None``: keep them here).

    A step with one micro-batch gives no estimate (:meth:`step` raises: two batch sizes are
    needed). Under DDP the hook sees each rank's gradient before the all-reduce only when
    the rank's backward does not synchronise; this monitor is for one process.
    """

    def __init__(self, model: nn.Module, micro_batch_size: int, tracker: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"GradientNoiseScale(model=...): expected an nn.Module, got {type(model).__name__}"
            )
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(
                f"GradientNoiseScale(micro_batch_size={micro_batch_size!r}): expected "
                f"the number of examples per micro-batch, an int >= 1"
            )
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("GradientNoiseScale(model=...): the model has no trainable parameters")
        self.micro_batch_size = micro_batch_size
        self.tracker = tracker
        self._micro: list[torch.Tensor] = []  # |h_i|^2 of this step's micro-batch gradients
        self._history: list[tuple[int, torch.Tensor]] = []
        self._steps = 0
        self._handle: RemovableHandle | None = torch.autograd.graph.register_multi_grad_hook(
            self.params, self._hook, mode="all"
        )

    def _hook(self, grads: Any) -> None:
        got = [g.detach() for g in grads if g is not None]
        if got:
            self._micro.append(_sq_norm(got))

    def step(self) -> dict[str, torch.Tensor]:
        """End the step: estimate from the micro-batches since the last call and ``.grad``.

        Returns:
            ``{"noise_g2", "noise_trace", "noise_b_simple"}`` as 0-dim float64 tensors on the
            gradients' device (reading one as a number waits for the device).

        Raises:
            RuntimeError: with fewer than two backward passes since the last call.
        """
        k = len(self._micro)
        if k < 2:
            raise RuntimeError(
                f"GradientNoiseScale.step(): {k} backward pass(es) this step; the "
                f"estimate needs two or more micro-batches (gradient accumulation)"
            )
        # h_i, the gradient a backward added; g_i = k h_i is a micro-batch's mean gradient on
        # the scale where the step's gradient sum_i h_i (= .grad) is their mean.
        small = torch.stack(self._micro).mean() * (k * k)
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        big = _sq_norm(grads)
        g2, trace = two_batch_estimate(small, self.micro_batch_size, big, k * self.micro_batch_size)
        out = {"noise_g2": g2, "noise_trace": trace, "noise_b_simple": trace / g2}
        self._micro = []
        if self.tracker is not None:
            self.tracker.log_scalars(**out)
        else:
            self._history.append((self._steps, torch.stack([g2, trace])))
        self._steps += 1
        return out

    def history(self) -> pd.DataFrame:
        """The estimates of the steps so far (without a tracker): columns ``step``,
        ``noise_g2``, ``noise_trace`` (one copy to the host)."""
        if not self._history:
            return pd.DataFrame({"step": [], "noise_g2": [], "noise_trace": []})
        values = torch.stack([v for _, v in self._history]).cpu().numpy()
        return pd.DataFrame(
            {
                "step": [s for s, _ in self._history],
                "noise_g2": values[:, 0],
                "noise_trace": values[:, 1],
            }
        )

    def close(self) -> None:
        """Remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> GradientNoiseScale:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
