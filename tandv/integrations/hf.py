"""HuggingFace ``transformers.Trainer``: ``Trainer(..., callbacks=[TandvCallback(every=10)])``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..track.torch import Tracker, track

__all__ = ["TandvCallback"]


class TandvCallback(TrainerCallback):
    """Tracks the Trainer's model and optimizer during ``trainer.train()``.

    Arguments:
        **options: the keyword options of :func:`tandv.track.torch.track` (``out``,
            ``every``, ``include``, ...).

    One log step per optimizer update (``gradient_accumulation_steps`` micro-batches merge
    into it); the gradients are those the optimizer sees, after clipping. accelerate's
    optimizer wrapper is unwrapped. Only the main process (``state.is_world_process_zero``)
    tracks, its own part of the batch, unless ``distributed=None`` or ``True`` is passed:
    then every process tracks and the main one writes the log merged over the processes
    (see :func:`tandv.track.torch.track`). ``callback.tracker.out_path`` is the log's path.
    """

    def __init__(self, **options: Any) -> None:
        if "module" in options or "optimizer" in options:
            raise TypeError(
                "TandvCallback: the model and optimizer come from the Trainer; pass "
                "only track()'s keyword options (out=, every=, include=, ...)"
            )
        self.options = options
        # rank 0 alone tracks its own part (no collective), unless distributed= asks for
        # the merge over the ranks: then every rank tracks and rank 0 writes the merged log
        self._merged = options.get("distributed", False) is not False
        self.tracker: Tracker | None = None

    def _track_options(self) -> dict[str, Any]:
        return {"distributed": False, **self.options}

    @property
    def out_path(self) -> Path | None:
        """The log's path once tracking has started."""
        return None if self.tracker is None else self.tracker.out_path

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero and not self._merged:
            return
        if model is None or optimizer is None:
            raise RuntimeError(
                "TandvCallback: the Trainer passed no model or optimizer to "
                "on_train_begin; add the callback through Trainer(callbacks=[...])"
            )
        self.tracker = track(model, optimizer, **self._track_options())
        self.tracker.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracker is not None:
            self.tracker.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracker is not None:
            self.tracker.close()
