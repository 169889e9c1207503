"""The gradient noise scale of a PyTorch model under gradient accumulation, per step, at
the cost of one norm per micro-batch and no copy of any gradient.

McCandlish et al. ("An Empirical Model of Large-Batch Training", 2018, appendix A) estimate
``|G|^2`` and ``tr(Sigma)`` from squared gradient norms at two batch sizes. Under gradient
accumulation both are at hand: autograd hands each backward pass's gradient to a hook before
adding it into ``.grad`` (the micro-batch, the small batch), and ``.grad`` after the last
micro-batch is the step's gradient (the big batch).

With a diagonal curvature estimate ``H`` (``hessian=``), the same two batch sizes give
nnstat's Hessian-weighted noise scale ``B_noise = tr(H Sigma) / (G^T H G)`` (McCandlish et
al.'s eq. 2.8; their ``B_simple`` is the case ``H = I``): ``E[G_B^T H G_B] = G^T H G +
tr(H Sigma) / B``, so the estimators are those of ``B_simple`` on ``H``-weighted squared
norms ``sum(h * g**2)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def _sq_norm_h(tensors: list[torch.Tensor], h: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_k sum(h_k * t_k**2)`` in float64 on the tensors' device (no synchronisation)."""
    return torch.stack([(t * t * hk).sum(dtype=torch.float64) for t, hk in zip(tensors, h)]).sum()


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
        hessian: also estimate the Hessian-weighted noise scale ``B_noise = tr(H Sigma) /
            (G^T H G)``: a callable returning the diagonal of ``H`` for the step, one tensor
            per trainable parameter (in ``model.parameters()`` order, their shapes), e.g.
            an optimizer's curvature estimate
            ``lambda: [opt.state[p]["hessian"] for p in params]`` (Sophia). It is called at
            the step's first backward pass and held for the step. The step's scalars then
            also hold ``noise_g2_h`` (``G^T H G``), ``noise_trace_h`` (``tr(H Sigma)``) and
            ``noise_b_noise`` (their single-step ratio; smooth with
            ``smoothed_noise_scale(scalars, g2="noise_g2_h", trace="noise_trace_h")``).

    A step with one micro-batch gives no estimate (:meth:`step` raises: two batch sizes are
    needed). Under DDP the hook sees each rank's gradient before the all-reduce only when
    the rank's backward does not synchronise; this monitor is for one process.
    """

    def __init__(
        self,
        model: nn.Module,
        micro_batch_size: int,
        tracker: Any = None,
        hessian: Callable[[], Sequence[torch.Tensor]] | None = None,
    ) -> None:
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
        if hessian is not None and not callable(hessian):
            raise TypeError(
                f"GradientNoiseScale(hessian=...): expected a callable returning one tensor "
                f"per trainable parameter, got {type(hessian).__name__}"
            )
        self.micro_batch_size = micro_batch_size
        self.tracker = tracker
        self.hessian = hessian
        self._h: list[torch.Tensor] | None = None  # this step's diagonal of H
        self._micro: list[torch.Tensor] = []  # |h_i|^2 of this step's micro-batch gradients
        self._micro_h: list[torch.Tensor] = []  # h_i^T H h_i
        self._history: list[tuple[int, torch.Tensor]] = []
        self._steps = 0
        self._handle: RemovableHandle | None = torch.autograd.graph.register_multi_grad_hook(
            self.params, self._hook, mode="all"
        )

    def _diag(self) -> list[torch.Tensor]:
        """The step's diagonal of H, fetched at its first backward pass and checked."""
        if self._h is None:
            assert self.hessian is not None
            h = list(self.hessian())
            if len(h) != len(self.params) or any(
                not isinstance(t, torch.Tensor) or t.shape != p.shape
                for t, p in zip(h, self.params)
            ):
                shapes = [tuple(getattr(t, "shape", ())) for t in h][:4]
                raise ValueError(
                    f"GradientNoiseScale(hessian=...): expected {len(self.params)} tensors "
                    f"shaped like the trainable parameters "
                    f"{[tuple(p.shape) for p in self.params][:4]}..., got {len(h)} "
                    f"shaped {shapes}..."
                )
            self._h = [t.detach() for t in h]
        return self._h

    def _hook(self, grads: Any) -> None:
        got = [g.detach() for g in grads if g is not None]
        if got:
            self._micro.append(_sq_norm(got))
            if self.hessian is not None:
                h = self._diag()
                pairs = [(g.detach(), hk) for g, hk in zip(grads, h) if g is not None]
                self._micro_h.append(_sq_norm_h([g for g, _ in pairs], [hk for _, hk in pairs]))

    def step(self) -> dict[str, torch.Tensor]:
        """End the step: estimate from the micro-batches since the last call and ``.grad``.

        Returns:
            ``{"noise_g2", "noise_trace", "noise_b_simple"}`` (and with ``hessian``
            ``"noise_g2_h", "noise_trace_h", "noise_b_noise"``) as 0-dim float64 tensors on
            the gradients' device (reading one as a number waits for the device).

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
        kept = [g2, trace]
        if self.hessian is not None:
            h = self._diag()
            small_h = torch.stack(self._micro_h).mean() * (k * k)
            pairs = [(p.grad.detach(), hk) for p, hk in zip(self.params, h) if p.grad is not None]
            big_h = _sq_norm_h([g for g, _ in pairs], [hk for _, hk in pairs])
            g2_h, trace_h = two_batch_estimate(
                small_h, self.micro_batch_size, big_h, k * self.micro_batch_size
            )
            out.update(noise_g2_h=g2_h, noise_trace_h=trace_h, noise_b_noise=trace_h / g2_h)
            kept += [g2_h, trace_h]
        self._micro = []
        self._micro_h = []
        self._h = None
        if self.tracker is not None:
            self.tracker.log_scalars(**out)
        else:
            self._history.append((self._steps, torch.stack(kept)))
        self._steps += 1
        return out

    def history(self) -> pd.DataFrame:
        """The estimates of the steps so far (without a tracker): columns ``step``,
        ``noise_g2``, ``noise_trace`` (and with ``hessian`` ``noise_g2_h``,
        ``noise_trace_h``), one copy to the host."""
        names = ["noise_g2", "noise_trace"]
        if self.hessian is not None:
            names += ["noise_g2_h", "noise_trace_h"]
        if not self._history:
            return pd.DataFrame({"step": [], **{n: [] for n in names}})
        values = torch.stack([v for _, v in self._history]).cpu().numpy()
        cols = {n: values[:, i] for i, n in enumerate(names)}
        return pd.DataFrame({"step": [s for s, _ in self._history], **cols})

    def close(self) -> None:
        """Remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> GradientNoiseScale:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
