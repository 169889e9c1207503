"""The PyTorch tracker's adapter (:class:`~tandv.track.common.adapter.Adapter`): what the
tracker core calls of PyTorch.

It is made of small parts, each given to it by the tracker: the observer's start and stop
(the tracker's hooks, installed and removed as callables), the transfer (the
:class:`~._workspace.Workspace` whose rows the hooks' kernels write, copied to the host once
per step), the ranks of a run over several processes (:class:`~._distributed.TorchRanks`,
made when the log opens; the hooks note each row's role in them), and the log's record of
the tracker's own options.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch import nn

from ..common.adapter import Observation
from ..common.distributed import RankMerger
from ..common.options import TrackOptions
from ..common.scalars import Capture
from ._distributed import TorchRanks, distributed_world
from ._workspace import Flight, Workspace, to_host

__all__ = ["TorchAdapter"]


class TorchAdapter:
    """The PyTorch adapter of a tracker (see the module's documentation).

    Arguments:
        workspace: the device rows the hooks summarize into (the tracker's own).
        module: the tracked module: its devices' workspaces are made ready at :meth:`start`.
        options: the shared options (``distributed``, ``dist_timeout``, ``rank_logs``).
        run_options: the tracker's own options and facts for the log's record.
        observe: installs the tracker's hooks (called by :meth:`start`, after the workspace
            is ready: a first hook on a device finds its rows there).
        unobserve: removes them (called by :meth:`stop`, also when ``observe`` failed).

    Attributes:
        ranks: the run's ranks once the log has opened over several processes (else
            ``None``): the hooks note each observation's role over them there.
    """

    framework = "torch"
    #: the hooks must be in place before a step's forward pass: no opening at first use
    opens_lazily = False
    #: a step's rows are finished on the writer thread (to_host is numpy and event reads)
    defers_rows = True
    #: a step is recorded at the next step's end, whether or not its copy landed earlier
    in_flight_steps = 0

    def __init__(
        self,
        workspace: Workspace,
        module: nn.Module,
        options: TrackOptions,
        run_options: dict[str, Any],
        observe: Callable[[], None],
        unobserve: Callable[[], None],
    ) -> None:
        self.workspace = workspace
        self.ranks: TorchRanks | None = None
        self._module = module
        self._options = options
        self._run_options = run_options
        self._observe = observe
        self._unobserve = unobserve

    def run_options(self) -> dict[str, Any]:
        return dict(self._run_options)

    def rank_merger(self) -> RankMerger | None:
        opts = self._options
        if opts.distributed is True and not distributed_world():
            raise RuntimeError(
                "track(distributed=True): torch.distributed is not initialized with more than "
                "one rank; call torch.distributed.init_process_group first (torchrun), or pass "
                "distributed=None"
            )
        if opts.distributed is not False and distributed_world():
            # a collective: every rank enters its tracker (see track's `distributed`)
            self.ranks = TorchRanks(opts.dist_timeout, opts.rank_logs)
            return self.ranks.merger
        return None

    def start(self) -> None:
        # the first hook on a device finds its rows and 8-bit value tables there already
        for device in {t.device for t in (*self._module.parameters(), *self._module.buffers())}:
            self.workspace.prepare(device)
        self._observe()

    def stop(self) -> None:
        self._unobserve()

    def send(self, pending: Sequence[Observation]) -> Flight | None:
        return self.workspace.end_step()

    def arrived(self, transfer: Flight | None) -> bool:
        return transfer is None or transfer.ready()

    def observed(self, pending: Sequence[Observation]) -> Sequence[Observation]:
        return pending  # every observation of a recorded step took place

    def to_host(
        self, summaries: list[Any], transfer: Flight | None
    ) -> list[np.ndarray] | np.ndarray:
        return to_host(summaries, transfer)

    def scalar_capture(self) -> Capture:
        from ._scalars import capture_torch

        return capture_torch
