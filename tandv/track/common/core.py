"""What every tracker does the same way, whatever the framework: :class:`TrackerCore`.

A tracker is this core holding a framework adapter (:class:`~.adapter.Adapter`); the
trackers users make (``tandv.track.torch.Tracker``, ``tandv.track.jax.JaxTracker``) are this
core with their framework's adapter and their framework's API (``step``, ``intercept``). The
core owns the lifecycle (the log opens when the ``with`` block starts, or at the first use of
a tracker used without one; ``close`` finishes it once), the step counter and the schedule,
the selection of tensors, the caches of row keys and summary layouts, the steps whose
summaries are on their way to the host (landed in order) and the log's record of how it was
made. It reads only its :class:`TrackOptions` and its adapter, which observes the
framework's tensors (their summaries go into :attr:`recorder`) and moves a step's summaries
to the host.
"""

from __future__ import annotations

import functools
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from ...stats.formats import format_name
from ...stats.formats import number_format as to_number_format
from ...stats.summary import Layout
from .adapter import Adapter, Observation, Transfer
from .alerts import AlertError, AlertWatch
from .distributed import RankMerger
from .options import TrackOptions
from .recorder import StepRecorder
from .rows import TensorKey
from .stream import make_run_record

__all__ = ["TrackerCore"]

_Self = TypeVar("_Self", bound="TrackerCore[Any]")


class TrackerCore(Generic[Transfer]):
    """The framework-neutral part of a tracker (see the module's documentation).

    Attributes:
        options: the shared options, checked.
        step_index: the current step (how many :meth:`step` calls have ended one).
        out_path: the log's path, once it is open (``None`` before).
        recorder: the open log's :class:`StepRecorder` (``None`` before it opens).
    """

    #: the framework's adapter: given to the constructor, or set once by a tracker's own
    #: constructor when its parts are made (before the log can open)
    _adapter: Adapter[Transfer]

    def __init__(
        self,
        options: TrackOptions,
        model: str,
        run_name: str,
        adapter: Adapter[Transfer] | None = None,
    ) -> None:
        """``model``: the model's class name for the log's record; ``run_name``: the name of
        the default log path when ``options.run_name`` is ``None``; ``adapter``: the
        framework's adapter (``None``: the caller sets :attr:`_adapter` before any use)."""
        if adapter is not None:
            self._adapter = adapter
        self.options = options
        self._model = model
        self._run_name = options.run_name or run_name
        self.step_index = 0
        self.out_path: Path | None = None
        self.recorder: StepRecorder | None = None
        self._closed = False
        #: merge rules of the custom statistics (an adapter may add its own columns')
        self._merge_rules = dict(options.merge_rules)
        #: custom statistics every summary carries, when the adapter knows them upfront
        self._extra_names: tuple[str, ...] = ()
        self._selection: dict[tuple[str, type | None], bool] = {}
        self._layouts: dict[tuple[Any, tuple[str, ...]], Layout] = {}
        # the bytes of the largest summary of any layout made so far: every observation's
        # layout is one of _layout's, so none exceeds it (the step buffer's bound, see
        # StepBuffer.add_many)
        self._most_bytes = 0
        self._keys: dict[tuple[str, str, str, Any], TensorKey] = {}
        #: ended steps whose summaries are on their way to the host: (step, observations,
        #: the step's transfer from the adapter's ``send``), oldest first
        self._flights: deque[tuple[int, Sequence[Observation], Transfer]] = deque()
        self._merger: RankMerger | None = None
        #: the alerts of ``on_nonfinite``/``alerts`` (``None``: none asked for)
        self._watch = AlertWatch.of(options.on_nonfinite, options.alerts)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self: _Self) -> _Self:
        if self.recorder is not None or self._closed:
            raise RuntimeError("this tracker was already started; create a new one with track(...)")
        self._open()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except Exception as close_error:
            if exc is None:
                raise
            # the training loop's error is the one to see; closing's is reported beside it
            if isinstance(close_error, AlertError):  # the log is finished: only the alert
                print(close_error, file=sys.stderr)
                return
            print(
                f"tandv: could not finish the log after an error: {close_error!r}", file=sys.stderr
            )

    def _open(self) -> None:
        """Open the log (its folder is created and its path printed now) and start observing."""
        options, adapter = self.options, self._adapter
        self._merger = adapter.rank_merger()
        self.recorder = StepRecorder(
            options.out,
            options.out_format,
            self._run_name,
            flush_every=options.flush_every,
            verbose=options.verbose,
            sinks=options.sinks,
            run=make_run_record(
                adapter.framework,
                self._model,
                options.format,
                {
                    **options.given(),
                    **adapter.run_options(),
                    "merged_ranks": self._merger is not None,
                },
            ),
            merger=self._merger,
            inspect=None if self._watch is None else self._watch.inspect,
        )
        self.out_path = self.recorder.path
        if self._watch is not None:
            self._watch.path = str(self.out_path)
        try:
            adapter.start()
        except BaseException:
            self.close()  # a failed start leaves no hook behind
            raise

    def _check_open(self, method: str) -> StepRecorder:
        """The recorder, for a call of ``tracker.<method>()``: opened now if the tracker opens
        lazily and has not yet; an error once closed, or outside ``with`` otherwise."""
        if self._closed:
            raise RuntimeError(
                f"tracker.{method}() called outside the `with track(...)` block: the tracker "
                f"is closed; create a new one with track(...)"
            )
        recorder = self.recorder  # (a property on some trackers: read once)
        if recorder is None:
            if not self._adapter.opens_lazily:
                raise RuntimeError(
                    f"tracker.{method}() called outside the `with track(...)` block; use "
                    f"`with track(...) as tracker:` around the training loop"
                )
            self._open()
            recorder = self.recorder
        assert recorder is not None
        return recorder

    @property
    def writes_log(self) -> bool:
        """Whether this process writes the log: in a run over several processes only the
        writer (rank 0) does; ``True`` in one process, and before the log opens."""
        return self.recorder is None or self.recorder.writes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def close(self) -> Path | None:
        """Stop observing and finish the log (idempotent); returns its path, ``None`` when the
        tracker never started (then nothing is written). Observations of a step that was not
        ended with :meth:`step` are dropped; the steps ended are all recorded."""
        if self._closed:
            return self.out_path
        self._closed = True
        try:
            self._adapter.stop()
        finally:
            if self.recorder is not None:
                self.recorder.discard()
                try:
                    self._land(wait=True)
                finally:
                    self._flights.clear()
                    try:
                        self.out_path = self.recorder.close()
                    finally:
                        if self._merger is not None:
                            self._merger.close()
        self._raise_alert()
        return self.out_path

    def _raise_alert(self) -> None:
        """Raise the error of an alert that is due (see ``track(on_nonfinite=...)``), once
        the log holds every step up to the flagged one: the steps after it are dropped and
        the tracker is closed first."""
        if self._watch is None or self._watch.due is None:
            return
        error, self._watch.due = self._watch.due, None
        self._flights.clear()  # later steps are not recorded: the run stops at the bad one
        self.close()
        raise error

    # ------------------------------------------------------------------ steps

    def _scheduled(self, step: int) -> bool:
        """Whether step ``step`` is recorded."""
        return bool(self.options.scheduled(step))

    def _end_step(self, recorded: bool) -> None:
        """End the current step: with ``recorded``, start moving its observations to the host
        (they are recorded once there: at a later step's end, or when the tracker closes),
        else drop them. Then record the steps that have arrived and count the step."""
        recorder = self.recorder
        assert recorder is not None
        if recorded:
            pending = recorder.take()
            self._flights.append((self.step_index, pending, self._adapter.send(pending)))
        else:
            recorder.discard()
        self._land()
        self.step_index += 1
        self._raise_alert()

    def _land(self, wait: bool = False) -> None:
        """Record the steps whose summaries have reached the host, in order. A step's
        transfer is waited for only once a later step has ended (the device has that one's
        work queued, so it does not go idle), or with ``wait``. Over several ranks a step
        lands (its merge is a collective) at the same point on every rank: at the next step's
        end, whether or not its transfer arrived earlier."""
        recorder = self.recorder
        assert recorder is not None
        adapter = self._adapter
        # alerts promise their error from the next step() (docs/alerts-compare.md): with a
        # watch, a step lands at the next step's end, not up to in_flight_steps later
        lag = 0 if self._merger is not None or self._watch is not None else adapter.in_flight_steps
        while self._flights:
            step, pending, transfer = self._flights[0]
            early = self._merger is None and adapter.arrived(transfer)
            if not (wait or step < self.step_index - lag or early):
                return
            self._flights.popleft()
            recorder.commit(
                step,
                pending,
                # bound to this step's transfer (called by commit, or later on the writer
                # thread with `defers_rows`, when the loop has moved on, as `observed` is)
                functools.partial(adapter.to_host, transfer=transfer),
                defer=adapter.defers_rows,
                observe=adapter.observed,
            )
            if self._watch is not None and self._watch.due is not None:
                return  # an alert stops the run at this step: later steps are not recorded

    def log_scalars(self, step: int | None = None, **scalars: Any) -> None:
        """Log training scalars (loss, learning rate, ...) beside the log, e.g.
        ``tracker.log_scalars(loss=loss, lr=lr)``.

        Values are Python/numpy numbers or one-element tensors/arrays (JAX: not traced values,
        call it outside ``jit``); a device value's copy to the host starts at once and is
        read when it has arrived, so logging never waits for the device (a CPU tensor is read
        at once). Recorded at every call, whatever the schedule; ``step=None`` is the current
        step (the one the next :meth:`step` ends). Read back with ``tandv.read_scalars(path
        or log)``; ``viz.interactive`` and the HTML report draw them by themselves.
        """
        recorder = self._check_open("log_scalars")
        recorder.log_scalars(step, scalars, self.step_index, self._adapter.scalar_capture())

    # ------------------------------------------------------------------ names and layouts

    def _selected(self, name: str, owner: type | None) -> bool:
        """Whether the tensor ``name``, owned by a module of class ``owner`` (``None``:
        unknown), is tracked (``include``/``exclude``; cached)."""
        key = (name, owner)
        hit = self._selection.get(key)
        if hit is None:
            types = () if owner is None else owner.__mro__
            hit = self._selection[key] = self.options.selector(name, types)
        return hit

    def _layout(self, dtype: Any, extras: tuple[str, ...] | None = None) -> Layout:
        """The summary layout of a tensor of ``dtype`` with the custom statistics ``extras``
        (by default those every summary carries), after the columns of ``block_formats``:
        in ``number_format``, else in the tensor's own format, with the central moments up
        to ``moments`` (cached)."""
        extras = self._extra_names if extras is None else extras
        key = (dtype, extras)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = Layout(
                to_number_format(self.options.format or format_name(dtype)),
                self.options.block_extras
                + tuple((name, self._merge_rules.get(name, "mean")) for name in extras),
                self.options.moments,
            )
            self._most_bytes = max(self._most_bytes, 8 * layout.size)
        return layout

    def _key(self, name: str, kind: str, module_type: str, dtype: Any) -> TensorKey:
        """The row identity of an observation (cached: built once per tensor)."""
        ck = (name, kind, module_type, dtype)
        key = self._keys.get(ck)
        if key is None:
            key = self._keys[ck] = TensorKey(name, kind, module_type, format_name(dtype))
        return key
