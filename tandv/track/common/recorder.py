"""Framework-neutral step bookkeeping shared by the PyTorch and JAX trackers.

An adapter hands the :class:`StepRecorder` one *device* summary vector per tensor
observation (:meth:`StepRecorder.add`); at the end of a step it passes a ``to_host``
function that moves all of them to the host in one transfer. Everything after that
(merging several observations of one tensor, finalizing statistics, building rows,
streaming them to disk) happens here, once, for both frameworks.
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
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ...schema.columns import ACTIVATION, GRADIENT
from ...schema.writer import (
    FORMATS,
    LogWriter,
    claim_log,
    open_writer,
    prepare_directory,
    release_claim,
)
from ...stats.summary import FIELD_INDEX, Layout, merge_all
from .rows import Entries, TensorKey, build_rows, row_columns
from .scalars import Capture, Pending, ScalarRecorder, check_scalar_args, plain_scalar

if TYPE_CHECKING:
    from .distributed import RankMerger

__all__ = [
    "StepRecorder",
    "resolve_out",
    "make_run_record",
    "DEFAULT_LOG_DIR",
]

#: Where logs go when a tracker is given no ``out``.
DEFAULT_LOG_DIR = Path("tandv_logs")


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


def _merged(
    step: int,
    pending: list[tuple[TensorKey, Layout, Any]],
    to_host: Callable[[list[Any]], Sequence[np.ndarray]],
) -> list[tuple[TensorKey, Layout, np.ndarray]]:
    """A step's observations on the host (one ``to_host`` call), those of the same tensor
    merged into one summary."""
    host = to_host([s for _, _, s in pending]) if pending else []
    groups: dict[TensorKey, tuple[Layout, list[np.ndarray]]] = {}
    for (key, layout, _), v in zip(pending, host):
        if key in groups and groups[key][0] != layout:
            raise ValueError(
                f"tensor {key.name!r} ({key.tensor_type}) changed its summary layout within "
                f"step {step}; it must keep one number format and one set of custom statistics"
            )
        groups.setdefault(key, (layout, []))[1].append(np.asarray(v, dtype=np.float64))
    return [
        (k, layout, merge_all(vs, layout) if len(vs) > 1 else vs[0])
        for k, (layout, vs) in groups.items()
    ]


def _merge_dtypes(
    entries: list[tuple[TensorKey, Layout, np.ndarray]],
) -> list[tuple[TensorKey, Layout, np.ndarray]]:
    """One row per tensor even when it was seen in several dtypes within a step (a shared
    module fed float32 and bfloat16): the observations merge into the layout of the widest
    format, which the row's dtype names. An observation that cannot be re-binned exactly
    (formats that do not nest, or a summary that counted values outside its own format)
    keeps a row of its own, named ``<name>@<dtype>``."""
    by_tensor: dict[tuple[str, str, str], list[int]] = {}
    for i, (key, _, _) in enumerate(entries):
        by_tensor.setdefault((key.name, key.tensor_type, key.module_type), []).append(i)
    if len(by_tensor) == len(entries):
        return entries
    out = []
    for idx in by_tensor.values():
        if len(idx) == 1:
            out.append(entries[idx[0]])
            continue
        wide = max(idx, key=lambda i: entries[i][1].format.num_bins)
        key, target, _ = entries[wide]
        merged = []
        for i in idx:
            k, layout, v = entries[i]
            moved = _rebin(v, layout, target)
            if moved is None:
                out.append(
                    (
                        TensorKey(f"{k.name}@{k.dtype}", k.tensor_type, k.module_type, k.dtype),
                        layout,
                        v,
                    )
                )
            else:
                merged.append(moved)
        out.append((key, target, merge_all(merged, target)))
    return out


def _rebin(v: np.ndarray, src: Layout, dst: Layout) -> np.ndarray | None:
    """Summary ``v`` of layout ``src`` in layout ``dst``, or ``None`` where that is not
    exact: the formats' exponent ranges must nest and ``v`` must count no underflow and no
    finite overflow of its own format."""
    if src == dst:
        return v
    f, g = src.format, dst.format
    nested = (
        src.extras == dst.extras
        and src.moments == dst.moments
        and g.min_exponent <= f.min_exponent
        and g.max_exponent >= f.max_exponent
        and g.max >= f.max
    )
    counts = v[src.exponent_counts]
    inf = v[FIELD_INDEX["inf_count"]]
    if not nested or counts[0] != 0 or counts[-1] != inf:
        return None
    out = dst.empty()
    out[: src.counts_start] = v[: src.counts_start]
    first = dst.counts_start + 1 + f.min_exponent - g.min_exponent
    out[first : first + f.num_bins] = counts[1:-1]
    out[dst.extras_start - 1] = inf
    out[dst.extra_values] = v[src.extra_values]
    out[dst.higher_values] = v[src.higher_values]  # m3, m4 (scaled by the same max)
    return out


def resolve_out(out: str | os.PathLike | None, out_format: str, run_name: str) -> Path:
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


#: Recorders not yet closed, for the SIGTERM handler.
_OPEN: weakref.WeakSet[StepRecorder] = weakref.WeakSet()
_TERM = {"installed": False, "fired": False}


def _own_open() -> list[StepRecorder]:
    """The open recorders this process made (a forked child, e.g. a data loader worker,
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


class StepRecorder:
    """Collects one step's summaries, merges and finalizes them, and streams rows to disk.

    Arguments:
        out: log path (see :func:`resolve_out`); ``None`` for the default folder.
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
        run: the record of how the log is made (a JSON-able dict: :func:`make_run_record`),
            stored with the rows and read back as ``df.attrs["tandv"]``.
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
        out: str | os.PathLike | None = None,
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
        self.inspect = inspect
        self.sinks = tuple(sinks)  # checked before anything is created
        for sink in self.sinks:
            if not callable(sink):
                raise TypeError(
                    f"sinks: expected callables taking a DataFrame of rows; got "
                    f"{type(sink).__name__}"
                )
        if not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"flush_every={flush_every!r}: expected an int >= 1")
        if not 0 < warn_pending_bytes <= max_pending_bytes:
            raise ValueError(
                f"warn_pending_bytes={warn_pending_bytes!r}, "
                f"max_pending_bytes={max_pending_bytes!r}: "
                f"expected 0 < warn_pending_bytes <= max_pending_bytes"
            )
        self.merger = merger
        #: whether this process writes the log (not so on a distributed run's other ranks)
        self.writes = merger is None or merger.is_writer
        self._rank_log: StepRecorder | None = None
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
            self._rank_log = StepRecorder(
                merger.rank_path(self.path, out_format),
                out_format,
                flush_every=flush_every,
                flush_seconds=flush_seconds,
                verbose=False,
                run=None
                if run is None
                else {**run, "options": {**run.get("options", {}), "merged_ranks": False}},
            )
        verbose = verbose and self.writes
        self.warn_pending_bytes = warn_pending_bytes
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._warned_pending = False
        self._warned_empty_step = False
        self._had_module_rows = False
        if verbose:
            print(f"tandv: logging to {self.path}", file=sys.stderr)
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self._pending: list[tuple[TensorKey, Layout, Any]] = []
        self._sizes: dict[int, tuple[Layout, int]] = {}  # bytes of a summary, by id(layout)
        # (step, merged host summaries) of the recorded steps not yet written: rows are
        # built at flush time, for all buffered steps at once; a deferred step (commit's
        # `defer`) holds the function that merges its summaries, called by the writer
        self._buffer: list[tuple[int, Entries | Callable[[], Entries]]] = []
        self._last_flush = time.monotonic()
        self._queue: queue.Queue = queue.Queue(maxsize=2)
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
            if self._rank_log is not None:
                self._rank_log.log_scalars(step, values, current, capture)
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

    def add(self, key: TensorKey, layout: Layout, summary: Any) -> None:
        """Record one observation of a tensor in the current step (a device summary).

        Raises:
            RuntimeError: when the observations waiting for the end of the step pass
                ``max_pending_bytes`` (``tracker.step()`` is not being called).
        """
        self._pending_bytes += self._bytes_of(layout)
        if self._pending_bytes > self.warn_pending_bytes:
            self._check_pending()
        self._pending.append((key, layout, summary))

    def add_many(self, entries: Sequence[tuple[TensorKey, Layout, Any]]) -> None:
        """:meth:`add` of several observations (``(key, layout, summary)`` each) at once: a
        step's parameters, gradients or optimizer state.

        Raises:
            RuntimeError: as :meth:`add`.
        """
        if not entries:
            return
        nbytes = 0
        layout: Any = None
        size = 0
        for _, lay, _ in entries:  # (a run of one layout costs one lookup)
            if lay is not layout:
                layout, size = lay, self._bytes_of(lay)
            nbytes += size
        if self._pending_bytes + nbytes > self.warn_pending_bytes:
            for entry in entries:  # one at a time: the warning and the error as with add
                self.add(*entry)
            return
        self._pending_bytes += nbytes
        self._pending.extend(entries)

    def _bytes_of(self, layout: Layout) -> int:
        """The bytes of one summary in ``layout`` (found once per layout, by identity:
        hashing the dataclass at every observation would cost more)."""
        sized = self._sizes.get(id(layout))
        if sized is None or sized[0] is not layout:
            sized = self._sizes[id(layout)] = (layout, 8 * layout.size)
        return sized[1]

    def _check_pending(self) -> None:
        n, mib = len(self._pending) + 1, self._pending_bytes / 2**20
        what = (
            f"{n} tensor observations ({mib:.0f} MiB of summaries) are waiting for the end of "
            f"a step in the log {str(self.path)!r}"
        )
        if self._pending_bytes > self.max_pending_bytes:
            raise RuntimeError(
                f"tandv: {what}, more than max_pending_bytes={self.max_pending_bytes}: "
                f"call tracker.step() once per training step, after the optimizer step"
            )
        if not self._warned_pending:
            self._warned_pending = True
            warnings.warn(
                f"tandv: {what}; is tracker.step() called once per training step, after the "
                f"optimizer step? Past max_pending_bytes={self.max_pending_bytes} this becomes an "
                f"error",
                RuntimeWarning,
                stacklevel=4,
            )

    def discard(self) -> None:
        """Drop the current step's observations (a step that will not be recorded)."""
        self._pending = []
        self._pending_bytes = 0

    @property
    def has_pending(self) -> bool:
        """Whether observations await :meth:`end_step`."""
        return bool(self._pending)

    def has_pending_type(self, tensor_type: str) -> bool:
        """Whether an observation of ``tensor_type`` awaits :meth:`end_step`."""
        return any(key.tensor_type == tensor_type for key, _, _ in self._pending)

    def end_step(self, step: int, to_host: Callable[[list[Any]], Sequence[np.ndarray]]) -> int:
        """Close step ``step``: move its summaries to the host with one ``to_host`` call,
        merge observations of the same tensor, and buffer the rows. Returns the row count."""
        return self.commit(step, self.take(), to_host)

    def take(self) -> list[tuple[TensorKey, Layout, Any]]:
        """The current step's observations, handed to the caller (who passes them to
        :meth:`commit` once their summaries can reach the host without waiting)."""
        pending, self._pending = self._pending, []
        self._pending_bytes = 0
        return pending

    def commit(
        self,
        step: int,
        pending: list[tuple[TensorKey, Layout, Any]],
        to_host: Callable[[list[Any]], Sequence[np.ndarray]],
        defer: bool = False,
        observe: Callable[[list[Any]], list[Any]] | None = None,
    ) -> int:
        """Record observations taken (:meth:`take`) at step ``step``: move their summaries
        to the host with one ``to_host`` call, merge observations of the same tensor, and
        buffer the rows. Steps must be committed in order. Returns the row count (with
        ``defer``, the number of observations). ``observe``: turns the observations taken
        into those that took place (run where ``to_host`` runs: it may read the step's
        summaries, as JAX's mailbox words, whose layout says which rows they hold).

        With ``defer`` (and no rank merge and no ``inspect``), ``to_host`` and the merging
        run later on the writer thread, with the building of the rows: the training thread
        only queues the step (``to_host`` must then be callable from another thread, later).
        An ``inspect`` (the alerts) needs the step's summaries now, so it turns ``defer`` off.

        Raises:
            RuntimeError: if writing an earlier batch failed (at the first step after it).
        """
        self._raise_writer_error()
        module_rows = any(k.tensor_type in (ACTIVATION, GRADIENT) for k, _, _ in pending)
        if self._had_module_rows and not module_rows and not self._warned_empty_step:
            self._warned_empty_step = True
            warnings.warn(
                f"tandv: step {step} observed no activation or gradient although earlier steps "
                f"did (log {str(self.path)!r}); is tracker.step() called more than once per "
                f"training step? Each call ends a step",
                RuntimeWarning,
                stacklevel=3,
            )
        self._had_module_rows |= module_rows
        if not pending and self.merger is None:
            return 0
        if defer and self.merger is None and self.inspect is None:

            def later() -> list[tuple[TensorKey, Layout, np.ndarray]]:
                observed = pending if observe is None else observe(pending)
                return _merge_dtypes(_merged(step, observed, to_host))

            self._buffer.append((step, later))
            self._buffered()
            return len(pending)
        if observe is not None:
            pending = observe(pending)
        local = _merged(step, pending, to_host)
        if self.inspect is not None:
            self.inspect(step, local)
        if self.merger is not None:
            if self._rank_log is not None:  # written whatever becomes of the merge
                self._rank_log.commit(step, local, lambda s: s)
            # before rows of several dtypes of one tensor merge: the rank merge is by key
            local = self.merger.merge(step, local)
            if not local:  # the writer's merge (on another rank), or a step with no rows
                return 0
        entries = _merge_dtypes(local)
        self._buffer.append((step, entries))
        self._buffered()
        return len(entries)

    def _buffered(self) -> None:
        """Count the step just buffered, and hand the buffer over when it is time."""
        self.steps_recorded += 1
        if (
            len(self._buffer) >= self.flush_every
            or time.monotonic() - self._last_flush >= self.flush_seconds
        ):
            self._hand_over()
            self._raise_writer_error()

    def flush(self) -> None:
        """Write buffered rows now, and wait until they are on disk."""
        self._hand_over()
        if self._thread is not None:
            self._queue.join()
        self._raise_writer_error()

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
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                if self._error is None:  # after a failure, later batches are not written
                    batch = [(step, e() if callable(e) else e) for step, e in batch]
                    rows = row_columns(
                        np.repeat(
                            np.array([step for step, _ in batch], dtype=np.int64),
                            [len(entries) for _, entries in batch],
                        ),
                        [entry for _, entries in batch for entry in entries],
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

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"tandv: writing the log to {str(self.path)!r} failed; steps from the "
                f"failed part on are not on disk"
            ) from self._error

    def close(self) -> Path:
        """Flush and finish the log (idempotent); returns its path.

        A run that recorded no step writes a valid log with no rows (default columns).

        Raises:
            RuntimeError: if writing failed (the cause attached); the log keeps the parts
                written before the failure.
        """
        if not self.closed:
            self._pending = []
            self._hand_over()
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
            self.closed = True
            if self.scalars is not None:
                self.scalars.close()
            self._raise_writer_error()
            if self._rank_log is not None:
                self._rank_log.close()
            if self.writer is not None:
                if self.writer.rows_written == 0:
                    self.writer.write(build_rows(0, []), allow_empty=True)
                self.writer.close()
            for sink in self.sinks:
                close = getattr(sink, "close", None)
                if close is not None:
                    close()
        return self.path
