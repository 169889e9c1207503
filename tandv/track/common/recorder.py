"""Framework-neutral step bookkeeping shared by the PyTorch and JAX trackers.

An adapter hands the :class:`StepRecorder` one *device* summary vector per tensor
observation (:meth:`StepRecorder.add`); at the end of a step it passes a ``to_host``
function that moves all of them to the host in one transfer. Everything after that
(merging several observations of one tensor, finalizing statistics, building rows,
streaming them to disk) happens once, for both frameworks, in two parts the recorder
holds: the step buffer (:class:`~tandv.track.common.buffer.StepBuffer`: the step's
observations until they are entries) and the log stream
(:class:`~tandv.track.common.stream.LogStream`: entries to rows on disk).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ...stats.summary import Layout
from .buffer import StepBuffer, check_pending_bounds
from .rows import TensorKey
from .stream import LogStream

if TYPE_CHECKING:
    from .distributed import RankMerger

__all__ = ["StepRecorder"]


class StepRecorder:
    """Collects one step's summaries, merges and finalizes them, and streams rows to disk:
    a :class:`~tandv.track.common.buffer.StepBuffer` (:attr:`buffer`) committing into a
    :class:`~tandv.track.common.stream.LogStream` (:attr:`stream`).

    The step buffer's methods (:meth:`~tandv.track.common.buffer.StepBuffer.add`,
    ``add_many``, ``has_pending_type``, ``take``, ``commit``, ``discard``) and the log
    stream's ``log_scalars`` and ``flush`` are the recorder's own, bound as attributes: an
    observation costs no call more than the buffer's (the hooks add many per step).

    Arguments:
        out: log path (see :func:`~tandv.track.common.stream.resolve_out`); ``None`` for
            the default folder.
        out_format: ``"parquet"`` (a directory of part files, streamed) or ``"pickle"``
            (one file written at close).
        run_name: readable name used in the default path.
        flush_every: write buffered rows after this many recorded steps ...
        flush_seconds: ... or once this many seconds have passed since the last write.
        verbose: print the log path once when the recorder opens.
        sinks: callables that receive each batch of rows (a DataFrame) after it is written,
            on the writer thread (e.g. :class:`tandv.export.TensorBoardSink`); closed with
            the recorder when they have a ``close`` method.
        warn_pending_bytes, max_pending_bytes: bounds on the summaries that wait for the
            end of a step (8 bytes per summary value): past the first a warning, past the
            second a RuntimeError, both saying to call ``tracker.step()`` (a training loop
            that never calls it would otherwise grow without bound).
        run: the record of how the log is made (a JSON-able dict:
            :func:`~tandv.track.common.stream.make_run_record`), stored with the rows and
            read back as ``df.attrs["tandv"]``.
        merger: in a distributed run, the cross-rank merge
            (:class:`~tandv.track.common.distributed.RankMerger`): each committed step's
            rows are merged over the ranks, the writer rank alone writes (at the path it
            resolves, the same on every rank), the others write and print nothing (unless
            the merger's ``rank_logs``: then every rank also writes its own unmerged rows
            to :meth:`~tandv.track.common.distributed.RankMerger.rank_path`), and every
            scheduled step takes part in the merge, even with no rows. ``None``: this
            process alone.
        inspect: called with ``(step, entries)`` for each committed step, once its summaries
            are on the host and merged per tensor (before a cross-rank merge): the entries
            are ``(TensorKey, Layout, host summary)``. The trackers' alerts
            (:class:`~tandv.track.common.alerts.AlertWatch`) check steps here.
    """

    def __init__(
        self,
        out: str | os.PathLike[str] | None = None,
        out_format: str = "parquet",
        run_name: str = "run",
        *,
        flush_every: int = 10,
        flush_seconds: float = 30.0,
        verbose: bool = True,
        sinks: Sequence[Callable[[pd.DataFrame], Any]] = (),
        warn_pending_bytes: int = 256 * 2**20,
        max_pending_bytes: int = 2**30,
        run: dict[str, Any] | None = None,
        merger: RankMerger | None = None,
        inspect: Callable[[int, list[tuple[TensorKey, Layout, np.ndarray]]], None] | None = None,
    ) -> None:
        check_pending_bounds(warn_pending_bytes, max_pending_bytes)  # before the log opens
        #: the log being written: entries to rows on disk, the scalars beside them
        self.stream = LogStream(
            out,
            out_format,
            run_name,
            flush_every=flush_every,
            flush_seconds=flush_seconds,
            verbose=verbose,
            sinks=sinks,
            run=run,
            merger=merger,
        )
        #: the step under way: its observations, committed into :attr:`stream`
        self.buffer = StepBuffer(
            self.stream,
            warn_pending_bytes=warn_pending_bytes,
            max_pending_bytes=max_pending_bytes,
            merger=merger,
            inspect=inspect,
        )
        self.add = self.buffer.add
        self.add_many = self.buffer.add_many
        self.has_pending_type = self.buffer.has_pending_type
        self.take = self.buffer.take
        self.commit = self.buffer.commit
        self.discard = self.buffer.discard
        self.log_scalars = self.stream.log_scalars
        self.flush = self.stream.flush
        #: the log's path (the same on every rank of a distributed run)
        self.path: Path = self.stream.path
        #: whether this process writes the log (not so on a distributed run's other ranks)
        self.writes: bool = self.stream.writes
        #: the log's writer (``None`` on a distributed run's ranks that do not write)
        self.writer = self.stream.writer

    @property
    def steps_recorded(self) -> int:
        """How many steps were committed with rows (or queued, deferred) to the log."""
        return self.stream.steps_recorded

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self.stream.closed

    @property
    def flush_seconds(self) -> float:
        """The log stream's flush period (``flush_seconds``), which may be changed."""
        return self.stream.flush_seconds

    @flush_seconds.setter
    def flush_seconds(self, seconds: float) -> None:
        self.stream.flush_seconds = seconds

    def close(self) -> Path:
        """Drop the observations of a step not ended, flush and finish the log (idempotent);
        returns its path.

        A run that recorded no step writes a valid log with no rows (default columns).

        Raises:
            RuntimeError: if writing failed (the cause attached); the log keeps the parts
                written before the failure.
        """
        self.buffer.discard()
        return self.stream.close()
