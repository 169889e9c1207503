"""HuggingFace ``transformers.Trainer``: ``Trainer(..., callbacks=[TandvCallback(every=10)])``."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback

from ..track.torch import Tracker, track
from ._runs import run_options

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

    When training raises, the tracker is closed: the log keeps every completed step and
    every hook leaves the model. (The Trainer has no event for a failure: passed through
    ``Trainer(callbacks=[...])``, the callback wraps that Trainer's ``train`` to see it; a
    callback added later is closed when ``train()`` next starts.) ``train()`` may be called
    again: each call after the first logs to ``<out>-2``, ``<out>-3``, ... when ``out`` is
    given, else to a new default path.
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
        self._runs = 0  # the train() calls tracked so far

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _constructing_trainer()
        if trainer is not None and "train" not in vars(trainer):
            trainer.train = _closing_on_error(trainer)

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
        self.close()  # a previous train() that raised past an unwrapped Trainer
        self.tracker = track(model, optimizer, **run_options(self.options, self._runs))
        self._runs += 1
        self.tracker.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracker is not None:
            self.tracker.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the tracker (idempotent): the steps ended so far are the log, the hooks
        leave the model."""
        if self.tracker is not None:
            self.tracker.close()


def _constructing_trainer() -> Any:
    """The ``Trainer`` whose ``__init__`` is calling the callbacks' ``on_init_end`` (found
    on the call stack: the event does not name it), or ``None``."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _closing_on_error(trainer: Any) -> Any:
    """``trainer.train`` that closes the Trainer's tandv callbacks when training raises."""
    original = trainer.train

    @functools.wraps(original)
    def train(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except BaseException:
            for cb in trainer.callback_handler.callbacks:
                if isinstance(cb, TandvCallback):
                    try:
                        cb.close()
                    except Exception as e:  # the training error is the one to see
                        print(f"tandv: could not finish the log: {e!r}", file=sys.stderr)
            raise

    return train
