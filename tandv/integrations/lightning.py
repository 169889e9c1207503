"""PyTorch Lightning: ``trainer = Trainer(callbacks=[TandvCallback(every=10)])``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the older package name
        from pytorch_lightning import Callback

from ..track.torch import Tracker, track
from ._runs import run_options

__all__ = ["TandvCallback"]


class TandvCallback(Callback):
    """Tracks the ``LightningModule`` and its optimizers during ``trainer.fit``.

    Arguments:
        **options: the keyword options of :func:`tandv.track.torch.track` (``out``,
            ``every``, ``include``, ...).

    One log step per training batch that updated the model (``trainer.global_step``
    moved): with ``accumulate_grad_batches=N`` the N micro-batches' activations merge into
    the step's rows, and the gradients are those of the update (Lightning steps with a
    closure; the tracker captures after it). Under manual optimization with several
    optimizers (a GAN) a log step holds all of the batch's updates, each parameter's
    gradient the one its own optimizer used; ``global_step`` counts every optimizer's
    step, so it runs ahead of the log's step. The tracker closes when fitting ends or
    raises (the completed steps are the log, the hooks leave the model); each later
    ``fit()`` logs to ``<out>-2``, ``<out>-3``, ... when ``out`` is given. Only the
    global rank 0 process tracks, its own part of the batch, unless ``distributed=None`` or
    ``True`` is passed: then every rank tracks and rank 0 writes the log merged over the
    ranks (see :func:`tandv.track.torch.track`). ``callback.tracker.out_path`` is the
    log's path.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        if "module" in options or "optimizer" in options:
            raise TypeError(
                "TandvCallback: the model and optimizers come from the Trainer; pass "
                "only track()'s keyword options (out=, every=, include=, ...)"
            )
        self.options = options
        # rank 0 alone tracks its own part (no collective), unless distributed= asks for
        # the merge over the ranks: then every rank tracks and rank 0 writes the merged log
        self._merged = options.get("distributed", False) is not False
        self.tracker: Tracker | None = None
        self._updates = 0
        self._runs = 0  # the fit() calls tracked so far

    @property
    def out_path(self) -> Path | None:
        """The log's path once tracking has started."""
        return None if self.tracker is None else self.tracker.out_path

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != 0 and not self._merged:
            return
        self._close()
        self.tracker = track(
            pl_module, list(trainer.optimizers), **run_options(self.options, self._runs)
        )
        self._runs += 1
        self.tracker.__enter__()
        self._updates = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer updates: a batch that only accumulated leaves it
        if self.tracker is not None and trainer.global_step != self._updates:
            self._updates = trainer.global_step
            self.tracker.step()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
