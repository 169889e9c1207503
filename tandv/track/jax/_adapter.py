"""The JAX tracker's adapter (:class:`~tandv.track.common.adapter.Adapter`): what the tracker
core calls of JAX.

It is made of small parts, each given to it by the tracker: the observer's start and stop
(nnx module classes wrapped while the log is open; the nnx modules the tracker tagged with
their paths, untagged at the end), the transfer (:mod:`._transfer`: a step's stacks of
summaries copied to the host at once, and the mailbox words and batches that stand for many
observations expanded into rows' observations when they land), and the ranks of a run over
several processes (:mod:`._distributed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...stats.summary import Layout
from ..common.adapter import Observation
from ..common.distributed import LOCAL, RankMerger, Role
from ..common.options import TrackOptions
from ..common.rows import TensorKey
from ..common.scalars import Capture
from . import _distributed
from ._nnx import acquire_nnx, release_nnx, untag_nnx_paths
from ._segments import is_segmented
from ._summary import DeviceSummary
from ._transfer import Batch, Mail, Segments, Sent, send, to_host

__all__ = ["JaxAdapter"]


class JaxAdapter:
    """The JAX adapter of a tracker (see the module's documentation).

    Arguments:
        options: the shared options (``distributed``, ``dist_timeout``, ``rank_logs``).
        key: the row key of an observation ``(name, tensor_type, module_type, dtype)`` (the
            core's cache): a tracked program's reports are named when they land.
        layout: the summary layout of an array of a dtype (the core's cache).
        multi: whether this process is one of several (``jax.distributed``).
        device_axis: the tracker's ``device_axis`` option, for the log's record.

    Attributes:
        nnx_tagged: the nnx modules the tracker tagged with their paths; untagged by
            :meth:`stop`.
    """

    framework = "jax"
    #: a tracker used without ``with`` opens its log at its first intercept/step/log_scalars
    opens_lazily = True
    #: a recorded step's summaries are read, its mailbox words decoded and its rows built on
    #: the log's writer thread (:meth:`observed` and :meth:`to_host` are numpy and device
    #: reads)
    defers_rows = True
    #: a step is recorded when its summaries have been computed (checked at each step's end),
    #: or at the latest when this many later steps have ended (then ``step()`` waits for it):
    #: the caller's loop runs ahead of the device as it would untracked (a step in flight
    #: holds only its small summaries)
    in_flight_steps = 32

    def __init__(
        self,
        options: TrackOptions,
        key: Callable[[str, str, str, Any], TensorKey],
        layout: Callable[[Any], Layout],
        multi: bool,
        device_axis: bool | None,
    ) -> None:
        self.nnx_tagged: list[Any] = []
        self._options = options
        self._key = key
        self._layout = layout
        self._multi = multi
        self._device_axis = device_axis
        self._nnx_acquired = False  # whether this adapter holds the nnx call wrapping
        #: the role over the processes of each row of the step being recorded
        self._roles: dict[TensorKey, Role] = {}

    def run_options(self) -> dict[str, Any]:
        return {"device_axis": bool(self._device_axis)}

    def rank_merger(self) -> RankMerger | None:
        opts = self._options
        if opts.distributed is True and not self._multi:
            raise RuntimeError(
                "track(distributed=True): this JAX run has one process; call "
                "jax.distributed.initialize(...) first, or pass distributed=None"
            )
        if not self._multi or opts.distributed is False:
            return None
        comm = _distributed.KeyValueCollectives(opts.dist_timeout)
        return RankMerger(comm, lambda key: self._roles.get(key, LOCAL), rank_logs=opts.rank_logs)

    def start(self) -> None:
        # nnx module classes are wrapped from when the log opens until it closes: a
        # tracker that is made but never started patches nothing
        acquire_nnx()
        self._nnx_acquired = True

    def stop(self) -> None:
        if self._nnx_acquired:
            release_nnx()
            self._nnx_acquired = False
        untag_nnx_paths(self.nnx_tagged)
        self.nnx_tagged = []

    def send(self, pending: Sequence[Observation]) -> Sent:
        return send([p[2] for p in pending])

    def arrived(self, transfer: Sent) -> bool:
        return transfer.arrived()

    def observed(self, pending: Sequence[Observation]) -> Sequence[Observation]:
        expanded: list[Observation] = []
        for key, layout, s in pending:
            if isinstance(s, Batch):  # a step's arrays, added as one observation
                expanded += s.expand()
                continue
            if isinstance(s, Mail) and s.box < 0:  # a tracked program's words: its reports
                for box, report, name, module_type, tensor_type, dtype in s.read.reports():
                    expanded.append(
                        (
                            self._key(name, tensor_type, module_type, dtype),
                            self._layout(dtype),
                            Mail(s.read, box, report),
                        )
                    )
            else:
                expanded.append((key, layout, s))
        # a mailbox the computation did not write holds no observation
        pending = [
            (key, layout, Segments(s, layout) if _segmented(s) else s)
            for key, layout, s in expanded
            if not isinstance(s, Mail) or s.summary() is not None
        ]
        if self._multi:  # how each row merges over the processes, for the rank merger
            self._roles = {key: _distributed.role(s, Mail) for key, _, s in pending}
        return pending

    def to_host(self, summaries: list[Any], transfer: Sent) -> list[np.ndarray]:
        return to_host(summaries, transfer.stacks)

    def scalar_capture(self) -> Capture:
        from ._scalars import capture_jax

        return capture_jax


def _segmented(summary: Any) -> bool:
    """Whether a tap's summary (a :class:`Mail` report, or delivered concrete) came in
    segments (:mod:`._segments`), known from its counts' shape."""
    if isinstance(summary, Mail):
        return is_segmented(summary.read.boxes[summary.box].reports[summary.report][2].shape)
    return isinstance(summary, DeviceSummary) and is_segmented(np.shape(summary.counts))
