"""What a framework gives the tracker core: the :class:`Adapter` protocol.

A tracker is a :class:`~.core.TrackerCore` holding one adapter. The core owns everything
that is the same in every framework (the log's lifecycle, the step counter and schedule, the
steps in flight, the rows); the adapter owns what needs the framework: observing its
tensors (hooks, taps), and moving a step's summaries to the host. The core calls the
adapter's methods below and nothing else of it; an adapter reads nothing of the core but
what it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ...stats.summary import Layout
from .distributed import RankMerger
from .rows import TensorKey
from .scalars import Capture

__all__ = ["Adapter", "Observation", "Transfer"]

#: What an adapter's :meth:`Adapter.send` returns for a step (its summaries' way to the
#: host), handed back to its :meth:`Adapter.arrived` and :meth:`Adapter.to_host`.
Transfer = TypeVar("Transfer")
#: One observation: its row's key, its summary's layout, and the summary (where it lies).
Observation = tuple[TensorKey, Layout, Any]


class Adapter(Protocol[Transfer]):
    """A framework's part of a tracker, as the core calls it.

    The facts below are read by the core (plain attributes of the adapter do); the methods
    are called by the core at the points each one's documentation names, on the training
    thread unless it says otherwise.
    """

    @property
    def framework(self) -> str:
        """The framework's name for the log's record (``"torch"``, ``"jax"``)."""
        ...

    @property
    def opens_lazily(self) -> bool:
        """Whether a tracker used without ``with`` opens its log at its first use; otherwise
        such a use is an error (PyTorch's hooks must be in place before the step's forward
        pass, so a first use is too late)."""
        ...

    @property
    def defers_rows(self) -> bool:
        """Whether a recorded step's :meth:`observed` and :meth:`to_host` run later, on the
        log's writer thread, off the training thread (they must then be safe there: numpy
        and device reads, no framework state that the loop changes). A run over several
        ranks calls them on the training thread regardless."""
        ...

    @property
    def in_flight_steps(self) -> int:
        """How many ended steps may stay in flight, their transfer not arrived, before the
        core waits for the oldest (over several ranks, or with alerts, always 0)."""
        ...

    def run_options(self) -> dict[str, Any]:
        """The framework's own options (and facts about the run) for the log's record,
        beside the shared ones. Called once, when the log opens."""
        ...

    def rank_merger(self) -> RankMerger | None:
        """In a run over several ranks (processes), the merger that combines each recorded
        step's summaries over them before rank 0 writes (``None``: one process). Called
        once, when the log opens, before :meth:`start`; it may be a collective (every rank
        enters it), and it raises when the options ask for ranks that are not there."""
        ...

    def start(self) -> None:
        """Start observing (install hooks, wrap calls), once the log is open. When it
        raises, the core closes the tracker (so :meth:`stop` runs) and re-raises."""
        ...

    def stop(self) -> None:
        """Stop observing and release what the adapter holds (hooks, patches). Called once,
        by ``close``, also when :meth:`start` failed or never ran; it must not raise for a
        start that did not happen."""
        ...

    def send(self, pending: Sequence[Observation]) -> Transfer:
        """Start moving the summaries of a recorded step's observations to the host, and
        return at once: no host synchronization, no waiting for the device (the loop runs
        on while the copy lands). Called at the step's end, on the training thread."""
        ...

    def arrived(self, transfer: Transfer) -> bool:
        """Whether ``transfer`` (from :meth:`send`) has reached the host, so the step's rows
        can be built without waiting. It must not wait itself; ``False`` leaves the step
        to a later step's end (or ``close``), which then waits in :meth:`to_host`."""
        ...

    def observed(self, pending: Sequence[Observation]) -> Sequence[Observation]:
        """Those of a step's observations that took place, as the rows' observations
        (an adapter may stand one placeholder for many, or drop what was not computed);
        called where :meth:`to_host` is, just before it."""
        ...

    def to_host(
        self, summaries: list[Any], transfer: Transfer
    ) -> Sequence[np.ndarray] | np.ndarray:
        """The host summary vectors of ``summaries`` (from :meth:`observed`), read from their
        ``transfer``, waiting for it where it has not arrived: a sequence of vectors, or a
        2-D float64 array of them (one row each). With :attr:`defers_rows` called on the
        log's writer thread."""
        ...

    def scalar_capture(self) -> Capture | None:
        """How ``log_scalars`` reads a value of the framework (a tensor); ``None``: plain
        Python and numpy numbers only."""
        ...
