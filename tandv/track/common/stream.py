"""The log stream: a log being written, from a step's entries to rows on disk.

A :class:`LogStream` opens the log (:func:`resolve_out`, the same path on every rank of a
distributed run), keeps the committed steps' entries until the flush policy hands them to
its writer thread (every ``flush_every`` steps or ``flush_seconds``), which builds their
rows (:func:`~tandv.track.common.rows.row_columns`), writes them and passes them to the
sinks. The training scalars are written beside the log. A SIGTERM closes the open logs of
this process, so the steps recorded are on disk.
"""

from __future__ import annotations

import atexit
import os
import platform
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ...schema.writer import (
    FORMATS,
    LogWriter,
    claim_log,
    open_writer,
    prepare_directory,
    release_claim,
)
from .rows import Entries, Scratch, build_rows, row_columns
from .scalars import Capture, Pending, ScalarRecorder, check_scalar_args, plain_scalar

if TYPE_CHECKING:
    from .distributed import RankMerger

__all__ = ["LogStream", "resolve_out", "make_run_record", "DEFAULT_LOG_DIR"]

#: Where logs go when a tracker is given no ``out``.
DEFAULT_LOG_DIR = Path("tandv_logs")

#: Steps handed to the writer thread at once: (step, its entries, or for a deferred step the
#: function that gives them) each.
_Batch = list[tuple[int, "Entries | Callable[[], Entries]"]]


def make_run_record(
    framework: str, model: str, number_format: str | None, options: Mapping[str, Any]
) -> dict[str, Any]:
    """The record of how a log is made, stored with it (``df.attrs["tandv"]`` on read): the
    tracker's framework, the model's class, the number format of the exponent counts
    (``None``: each tensor's own dtype), the tracker's options (as text where they are not
    JSON values), library versions, world size and rank, host and start time."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("tandv", framework if framework != "jax" else "jax", "numpy", "pandas"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    world, rank = 1, 0
    if framework == "torch":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
    elif framework == "jax":
        import jax

        world, rank = jax.process_count(), jax.process_index()

    def plain(v: Any) -> Any:
        if isinstance(v, (bool, int, float, str, type(None))):
            return v
        if isinstance(v, os.PathLike):
            return os.fspath(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return repr(v)

    return {
        "framework": framework,
        "model": model,
        "number_format": number_format,
        "options": {k: plain(v) for k, v in options.items()},
        "versions": versions,
        "world_size": world,
        "rank": rank,
        "host": platform.node(),
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def resolve_out(out: str | os.PathLike[str] | None, out_format: str, run_name: str) -> Path:
    """The log path: ``out`` as given, else ``tandv_logs/<run_name>-<timestamp>`` (a directory
    for parquet, a ``.pkl`` file for pickle), with ``-2``, ``-3``, ... appended when taken.

    A default path is reserved as it is chosen (the parquet directory is created, the
    pickle path claimed (:func:`~tandv.schema.writer.claim_log`), each only if absent,
    atomically), so trackers started in the same second, in one process or several, never
    share a log."""
    if out_format not in FORMATS:
        raise ValueError(f"out_format={out_format!r}: expected one of {FORMATS}")
    if out is not None:
        return Path(out)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = DEFAULT_LOG_DIR / f"{run_name}-{stamp}"
    prepare_directory(DEFAULT_LOG_DIR, base)
    k = 1
    while True:
        path = base if k == 1 else base.with_name(f"{base.name}-{k}")
        try:
            if out_format == "parquet":
                path.mkdir()
            else:
                path = path.with_suffix(".pkl")
                claim = claim_log(path, "pickle")
                if path.exists():
                    release_claim(claim)
                    raise FileExistsError(path)
            return path
        except FileExistsError:
            k += 1


#: Logs not yet closed, for the SIGTERM handler.
_OPEN: weakref.WeakSet[LogStream] = weakref.WeakSet()
_TERM = {"installed": False, "fired": False}


def _own_open() -> list[LogStream]:
    """The open logs this process made (a forked child, e.g. a data loader worker,
    inherits copies of its parent's, which are not its to write)."""
    return [r for r in list(_OPEN) if not r.closed and r._pid == os.getpid()]


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM as SIGINT is handled: an exception on the main thread, so ``with`` blocks
    close their trackers (the buffered steps are flushed), then exit status 143; trackers
    not closed by then are closed at exit. With no tracker open, the default action."""
    if not _own_open():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _TERM["fired"] = True
    raise SystemExit(128 + signum)


def _close_after_sigterm() -> None:
    if not _TERM["fired"]:
        return
    for rec in _own_open():
        try:
            rec.close()
        except Exception as e:  # at exit: say so, close the others
            print(f"tandv: closing the log {str(rec.path)!r} failed: {e}", file=sys.stderr)


def _handle_sigterm() -> None:
    """Install the SIGTERM handler once, from the main thread, unless the program has a
    handler of its own."""
    if _TERM["installed"] or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    atexit.register(_close_after_sigterm)
    _TERM["installed"] = True


class LogStream:
    """A log being written: its file or folder, the entries of the steps committed and not
    yet written, and the thread that builds their rows and writes them.

    Arguments:
        out: log path (see :func:`resolve_out`); ``None`` for the default folder.
        out_format: ``"parquet"`` (a directory of part files, streamed) or ``"pickle"``
            (one file written at close).
        run_name: readable name used in the default path.
        flush_every: write buffered rows after this many recorded steps ...
        flush_seconds: ... or once this many seconds have passed since the last write.
        verbose: print the log path once when the log opens.
        sinks: callables that receive each batch of rows (a DataFrame) after it is written,
            on the writer thread (e.g. :class:`tandv.export.TensorBoardSink`); closed with
            the log when they have a ``close`` method.
        run: the record of how the log is made (a JSON-able dict: :func:`make_run_record`),
            stored with the rows and read back as ``df.attrs["tandv"]``.
        merger: in a distributed run, the cross-rank merge
            (:class:`~tandv.track.common.distributed.RankMerger`): the writer rank alone
            writes (at the path it resolves, the same on every rank), the others write and
            print nothing, unless the merger's ``rank_logs``: then every rank also writes its
            own unmerged rows to :attr:`rank_log`. ``None``: this process alone.
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
        run: dict[str, Any] | None = None,
        merger: RankMerger | None = None,
    ) -> None:
        self.sinks = tuple(sinks)  # checked before anything is created
        for sink in self.sinks:
            if not callable(sink):
                raise TypeError(
                    f"sinks: expected callables taking a DataFrame of rows; got "
                    f"{type(sink).__name__}"
                )
        if not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"flush_every={flush_every!r}: expected an int >= 1")
        #: whether this process writes the log (not so on a distributed run's other ranks)
        self.writes = merger is None or merger.is_writer
        #: this rank's own log of its unmerged rows (a distributed run's ``rank_logs``)
        self.rank_log: LogStream | None = None
        writer: LogWriter | None = None

        def open_log() -> Path:
            nonlocal writer
            path = resolve_out(out, out_format, run_name)
            writer = open_writer(
                path,
                out_format,  # type: ignore[arg-type]
                claimed=out is None,
                run=run,
            )
            return path

        self.path = open_log() if merger is None else merger.shared_path(open_log)
        #: the log's writer (``None`` on a distributed run's ranks that do not write)
        self.writer: LogWriter | None = writer
        if merger is not None and merger.rank_logs:
            self.rank_log = LogStream(
                merger.rank_path(self.path, out_format),
                out_format,
                flush_every=flush_every,
                flush_seconds=flush_seconds,
                verbose=False,
                run=None
                if run is None
                else {**run, "options": {**run.get("options", {}), "merged_ranks": False}},
            )
        if verbose and self.writes:
            print(f"tandv: logging to {self.path}", file=sys.stderr)
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        # (step, merged host summaries) of the recorded steps not yet written: rows are
        # built at flush time, for all buffered steps at once; a deferred step (commit's
        # `defer`) holds the function that merges its summaries, called by the writer
        self._buffer: _Batch = []
        self._last_flush = time.monotonic()
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=2)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.steps_recorded = 0
        self.closed = False
        self.scalars: ScalarRecorder | None = None  # created by the first log_scalars
        self._pid = os.getpid()
        if self.writer is not None:
            _OPEN.add(self)
            _handle_sigterm()

    def log_scalars(
        self,
        step: int | None,
        values: Mapping[str, Any],
        current: int,
        capture: Capture | None = None,
    ) -> None:
        """Record training scalars (``tracker.log_scalars``) at ``step`` (``None``:
        ``current``, the tracker's step). Python and numpy numbers are taken as they are;
        other values go through the adapter's ``capture`` (a device scalar becomes a copy
        under way, read once it has arrived). Written beside the log at each flush.

        Raises:
            RuntimeError: after :meth:`close`.
            ValueError / TypeError: naming the argument that is not a single number.
        """
        if self.closed:
            raise RuntimeError(
                "tracker.log_scalars(): the tracker is closed (its `with` block has ended)"
            )
        check_scalar_args(step, values)
        if not self.writes:  # a distributed run's other rank: its own log, if any
            if self.rank_log is not None:
                self.rank_log.log_scalars(step, values, current, capture)
            return
        got: dict[str, Any] = {}
        for name, v in values.items():
            if name == "step":
                raise ValueError("log_scalars(): 'step' is the step argument, not a scalar name")
            x: float | Pending | None = plain_scalar(name, v)
            if x is None and capture is not None:
                x = capture(name, v)
            if x is None:
                raise TypeError(
                    f"log_scalars({name}=...): expected a number or a one-element tensor/array; "
                    f"got {type(v).__name__}"
                )
            got[name] = x
        if self.scalars is None:
            self.scalars = ScalarRecorder(self.path)
            self._scalars_flushed = time.monotonic()
        self.scalars.add(current if step is None else int(step), got)
        if (
            time.monotonic() - self._scalars_flushed >= self.flush_seconds
        ):  # steps no schedule records
            self._scalars_flushed = time.monotonic()
            self.scalars.flush()

    def append(self, step: int, entries: Entries | Callable[[], Entries]) -> None:
        """Buffer a committed step's entries (or, for a deferred step, the function that
        gives them on the writer thread), and hand the buffer over when it is time. Steps
        must be appended in order.

        Raises:
            RuntimeError: if writing an earlier batch failed (found at a hand-over).
        """
        self._buffer.append((step, entries))
        self._buffered()

    def _buffered(self) -> None:
        """Count the step just buffered, and hand the buffer over when it is time."""
        self.steps_recorded += 1
        if (
            len(self._buffer) >= self.flush_every
            or time.monotonic() - self._last_flush >= self.flush_seconds
        ):
            self._hand_over()
            self.raise_if_failed()

    def flush(self) -> None:
        """Write buffered rows now, and wait until they are on disk."""
        self._hand_over()
        self.wait_written()
        self.raise_if_failed()

    def wait_written(self) -> None:
        """Wait until the writer thread is done with every batch handed to it (rows still
        buffered here are not handed over); a failed write is left for
        :meth:`raise_if_failed`, so a test or benchmark can wait without it raising."""
        if self._thread is not None:
            self._queue.join()

    def _hand_over(self) -> None:
        """Pass the buffered steps to the writer thread, which builds their rows and writes
        them while training goes on (building, validating and writing a part costs tens of
        milliseconds). The queue holds at most two batches: a slow disk slows training
        down instead of filling memory."""
        if self._buffer:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._write_loop, name="tandv-writer", daemon=True
                )
                self._thread.start()
            self._queue.put(
                self._buffer
            )  # only then dropped here: an interrupted put loses nothing
            self._buffer = []
        if self.scalars is not None:
            self.scalars.flush()  # the steps whose values have arrived
        self._last_flush = time.monotonic()

    def _write_loop(self) -> None:
        scratch = Scratch()  # (the batches' summaries, stacked in the same memory each time)
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                if self._error is None:  # after a failure, later batches are not written
                    done = [(step, e() if callable(e) else e) for step, e in batch]
                    rows = row_columns(
                        np.repeat(
                            np.array([step for step, _ in done], dtype=np.int64),
                            [len(entries) for _, entries in done],
                        ),
                        [entry for _, entries in done for entry in entries],
                        scratch,
                    )
                    assert self.writer is not None  # only the writing rank buffers rows
                    self.writer.write(rows)
                    if self.sinks:
                        frame = rows.frame()
                        for sink in self.sinks:
                            sink(frame)
            except BaseException as e:  # handed to the training thread
                self._error = e
            finally:
                self._queue.task_done()

    def raise_if_failed(self) -> None:
        """Raise the error of a batch the writer thread failed to write, if any.

        Raises:
            RuntimeError: with the writer's error attached, naming the log.
        """
        if self._error is not None:
            raise RuntimeError(
                f"tandv: writing the log to {str(self.path)!r} failed; steps from the "
                f"failed part on are not on disk"
            ) from self._error

    @property
    def writer_thread(self) -> threading.Thread | None:
        """The thread that builds and writes the rows (``None`` before the first hand-over
        and once closed): what the host-cost benchmark times the writer's CPU by."""
        return self._thread

    def close(self) -> Path:
        """Flush and finish the log (idempotent); returns its path.

        A run that recorded no step writes a valid log with no rows (default columns).

        Raises:
            RuntimeError: if writing failed (the cause attached); the log keeps the parts
                written before the failure.
        """
        if not self.closed:
            self._hand_over()
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
            self.closed = True
            if self.scalars is not None:
                self.scalars.close()
            self.raise_if_failed()
            if self.rank_log is not None:
                self.rank_log.close()
            if self.writer is not None:
                if self.writer.rows_written == 0:
                    self.writer.write(build_rows(0, []), allow_empty=True)
                self.writer.close()
            for sink in self.sinks:
                close = getattr(sink, "close", None)
                if close is not None:
                    close()
        return self.path
