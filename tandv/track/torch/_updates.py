"""``track(..., track_updates=True)``: each parameter's update as rows ``<param>.update``.

Before each optimizer step of a scheduled step, the tracked parameters that require a
gradient are copied (an optimizer step pre-hook); after it, each copy becomes the update
in place (``after - before``, written over the copy: no second buffer) and is summarized
like a weight, as a ``Weight`` row named ``<parameter path>.update``. The cost is one copy
of those parameters' memory, held from just before the optimizer step until its update
is summarized, on scheduled steps only; unscheduled steps hold and compute nothing.
An optimizer that steps several times in one tracked step gives several observations of
each update, merged like micro-batches (the statistics of all of them together).

The hooks know the tracker only as a :class:`._seams.TrackerSeam`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...schema.columns import WEIGHT

if TYPE_CHECKING:
    from ._seams import TrackerSeam

__all__ = ["UPDATE_SUFFIX", "UpdateCapture"]

#: The suffix of an update row's name (what ``tandv.quantities.log_update_ratio`` reads).
UPDATE_SUFFIX = ".update"


class UpdateCapture:
    """The pair of optimizer hooks that logs one optimizer's updates; ``remove()`` them."""

    def __init__(self, tracker: TrackerSeam, optimizer: torch.optim.Optimizer) -> None:
        self._tracker = tracker  # (it holds the tracker weakly)
        #: (name, owner, parameter) of the tracked parameters, and their copies, in one order
        self._before: list[tuple[str, torch.nn.Module, torch.Tensor]] = []
        self._copies: list[torch.Tensor] = []
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        tr = self._tracker
        self._before, self._copies = [], []
        if not tr.recording:
            return
        for group in opt.param_groups:
            for p in group["params"]:
                # (with step(closure) the gradients do not exist yet: frozen parameters,
                # requires_grad=False, are those an optimizer never moves)
                if not p.requires_grad or not p.is_floating_point():
                    continue
                known = tr.parameter(p)
                if known is not None:
                    self._before.append((known[0], known[1], p.detach()))
        if self._before:
            # one multi-tensor copy (x * 1 is exact, -0.0 and NaN included), not a launch
            # per parameter
            self._copies = list(torch._foreach_mul([p for _, _, p in self._before], 1.0))

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        tr = self._tracker
        before, self._before = self._before, []
        copies, self._copies = self._copies, []
        if not before or not tr.recording:
            return
        with torch.no_grad():  # the copies become after - before, in place
            torch._foreach_neg_(copies)
            torch._foreach_add_(copies, [p for _, _, p in before])
        items = [
            (f"{name}{UPDATE_SUFFIX}", WEIGHT, owner, d)
            for (name, owner, _), d in zip(before, copies)
        ]
        tr.record(items)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._before, self._copies = [], []
