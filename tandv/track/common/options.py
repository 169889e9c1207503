"""The options both trackers share, checked once: :class:`TrackOptions`.

``track()`` takes them as keywords (``track(model, opt, every=10)``); each framework's tracker
declares only its own options and passes the rest here, so the list, the defaults, the checks
and the documentation exist once. :class:`TrackKwargs` spells the same names for type checkers
and IDEs (``**options: Unpack[TrackKwargs]``); a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ...schema.writer import FORMATS
from ...stats.blocks import block_extras, parse_block_formats
from ...stats.formats import format_name
from .alerts import check_alert_options
from .custom import StatFn, StatsSpec, parse_custom_stats, percentile_columns
from .schedule import Schedule, make_schedule
from .selection import Pattern, Selector

__all__ = ["TrackOptions", "TrackKwargs", "ROOT_NAME"]

#: The name of the root module's rows (its path is empty) unless a tracker is told otherwise.
ROOT_NAME = "root"


@dataclass(frozen=True, kw_only=True)
class TrackOptions:
    """The options of ``track()`` common to PyTorch and JAX, checked when it is called (so a
    bad option fails before training starts, with the argument's name and what to give).

    Options:
        track_activations: record module outputs (``Activation`` rows), in PyTorch from
            forward hooks, in JAX from the taps :meth:`JaxTracker.intercept` installs
            (default ``True``).
        track_gradients: record the gradient w.r.t. each module output and each parameter's
            gradient (``Gradient`` rows; default ``True``).
        track_updates: also record each parameter's update of the step (the parameters after
            minus before the update) as ``Weight`` rows named ``<parameter>.update``, with the
            same statistics (``tandv.quantities.log_update_ratio`` reads them). PyTorch keeps
            one copy of the tracked parameters across each optimizer step of a scheduled step
            and needs ``optimizer``; JAX keeps the previous parameters by reference (its arrays
            are immutable) and needs ``model_state``: an update that donates their buffers
            deletes them, which is an error. Nothing is kept on other steps (default ``False``).
        include, exclude: which tensors to record: regexes searched in tensor names, names of
            the owning module's class or its bases (``"Linear"``), or classes
            (``nn.LayerNorm``); a tensor is recorded when it matches some ``include`` entry
            (or ``include`` is empty) and no ``exclude`` entry. They apply to every tensor type.
        every: record every N-th step (0, N, 2N, ...); ignored when ``schedule`` is given.
        schedule: instead of ``every``: a callable ``step -> bool``, a string
            ``"linear(interval, offset)"``, or a collection of step numbers.
        start, end: record only steps ``start <= step < end`` (``end=None``: no end).
        stats: custom statistics: a function (or list of functions) ``tensor -> {name:
            scalar}``, or a mapping ``{name: tensor -> scalar}`` whose values may be
            ``(function, merge_rule)``; each name becomes a ``scalar_stats`` column. They run
            on the device (PyTorch: keep them there, no ``.item()``; JAX: inside the traced
            computation).
        stats_merge: ``{name: "sum" | "min" | "max" | "mean"}``: how a custom statistic of
            several observations of a tensor in one step combines (default ``"mean"``,
            weighted by element count).
        percentiles: exact percentiles to log, e.g. ``(1, 50, 99)``: columns ``pct1``,
            ``pct50``, ``pct99`` of the non-NaN elements, interpolated as ``np.percentile``,
            computed on the device without a sync. Each costs a sort of every tracked tensor
            (slow: narrow the tensors with ``include``). Exact for a tensor seen once per
            step; several observations in one step (micro-batches) log their element-weighted
            mean, an approximation.
        block_formats: block-scaled formats to simulate, any of ``"mxfp8_e4m3"``,
            ``"mxfp8_e5m2"``, ``"mxfp4_e2m1"``, ``"nvfp4"``: for each tracked tensor and format
            ``f``, the columns ``f.underflow``, ``f.subnormal``, ``f.saturated``, ``f.sq_err``
            and ``f.block_range`` say what quantizing the tensor into ``f`` (blocks along its
            last dimension) would do; definitions in :mod:`tandv.stats.blocks`, shares from
            :func:`tandv.quantities.block_shares`. Computed by the host kernel (CPU tensors)
            and the torch-op path; default none.
        moments: the highest central moment to log: 2 (default: mean and variance, ``std``)
            or 4, which adds ``skew`` and ``kurtosis`` columns (as ``scipy.stats.skew`` and
            ``scipy.stats.kurtosis`` with their defaults: biased, Fisher's excess kurtosis)
            of every tracked tensor, merged over micro-batches and processes exactly like the
            other moments. Costs one more pass over each tensor.
        number_format: the format of the exponent counts of every tensor, e.g.
            ``"float8_e4m3fn"`` to see what would underflow (``-inf``) or overflow (``+inf``)
            in it; default each tensor's own dtype.
        out: the log's path (a directory for parquet, a file for pickle); default a new folder
            ``tandv_logs/<run_name>-<timestamp>``, created when tracking starts (the ``with``
            block, or the first step of a tracker used without one).
        out_format: ``"parquet"`` (part files streamed during the run) or ``"pickle"`` (one
            file written at the end).
        run_name: a readable name for the default path (default: the PyTorch module's class
            name, lower-cased; ``"jax"`` for JAX).
        flush_every: write buffered rows to disk every N recorded steps (default 10).
        verbose: print the log's path once, when tracking starts (default ``True``).
        sinks: callables that also receive each batch of rows (a DataFrame) as it is written,
            e.g. ``[tandv.export.TensorBoardSink("runs/x")]``; closed with the tracker.
        distributed: in a run over several processes (``torch.distributed`` with more than
            one rank, or ``jax.distributed``): ``None`` (default) detects it, ``True``
            requires it. Every process must then create and enter its tracker and step it
            alike: each tracked step's summaries are merged over the processes (a header
            exchange, then one gather: activations and output gradients of the global batch,
            tensors every process holds alike counted once, shards of a sharded tensor merged
            into the full tensor's statistics) and process 0 alone writes the log, at its
            ``out``. ``False``: this process alone, as in a one-process run (e.g. tracking
            on rank 0 only).
        rank_logs: in a run over several processes, also write each process's own unmerged
            log, to ``<out>/rank<k>`` (parquet) or ``<out stem>.rank<k>.pkl`` (pickle)
            (default ``False``).
        dist_timeout: seconds a process waits for the others in tandv's exchanges before it
            raises (another process died, raised, or steps differently); default 600.
        on_nonfinite: what to do when a tracked tensor holds NaN or inf, checked when a
            step's summaries reach the host (no extra sync): ``"raise"`` writes every step up
            to that one, closes the tracker and raises ``tandv.NonFiniteError`` (naming the
            step and its first such tensor in computation order) from the next
            ``tracker.step()`` (or from leaving the ``with`` block), at most 2 steps after the
            bad one; ``"warn"`` gives a ``RuntimeWarning`` at the first such step; a callable
            is given the rows (a log frame) of each such step's tensors that hold NaN/inf, and
            an exception it raises is delivered as ``"raise"`` delivers its error; ``None``
            (default): no check. Only recorded steps are checked.
        alerts: further rules: a callable (or list of them) given each recorded step's rows
            (a log frame, in computation order) that returns a message or ``None``; a message
            is raised as ``tandv.AlertError`` with the same delivery as
            ``on_nonfinite="raise"``. Each rule costs building the step's rows on the training
            thread. In a run over several processes each process checks its own summaries,
            before they are merged.
    """

    track_activations: bool = True
    track_gradients: bool = True
    track_updates: bool = False
    include: Pattern | Sequence[Pattern] | None = None
    exclude: Pattern | Sequence[Pattern] | None = None
    every: int = 1
    schedule: Schedule | str | Collection[int] | None = None
    start: int = 0
    end: int | None = None
    stats: StatsSpec = None
    stats_merge: Mapping[str, str] | None = None
    percentiles: Sequence[float] | None = None
    block_formats: Sequence[str] | None = None
    moments: int = 2
    number_format: Any = None
    out: str | os.PathLike[str] | None = None
    out_format: str = "parquet"
    run_name: str | None = None
    flush_every: int = 10
    verbose: bool = True
    sinks: Sequence[Callable[[Any], Any]] = ()
    distributed: bool | None = None
    rank_logs: bool = False
    dist_timeout: float = 600.0
    on_nonfinite: str | Callable[[Any], Any] | None = None
    alerts: Callable[[Any], str | None] | Sequence[Callable[[Any], str | None]] | None = None

    # What the options mean, worked out once by the checks (not options themselves).
    #: the tensors ``include`` and ``exclude`` select
    selector: Selector = field(init=False, repr=False, compare=False)
    #: ``step -> bool``: whether a step is recorded (``every``/``schedule``, ``start``/``end``)
    scheduled: Schedule = field(init=False, repr=False, compare=False)
    #: the custom statistic functions of ``stats``, each ``tensor -> {name: scalar}``
    stat_fns: tuple[StatFn, ...] = field(init=False, repr=False, compare=False)
    #: the merge rule of every custom statistic given one (others merge by ``"mean"``)
    merge_rules: Mapping[str, str] = field(init=False, repr=False, compare=False)
    #: ``((column, q), ...)`` of ``percentiles`` (empty without them)
    percentile_columns: tuple[tuple[str, float], ...] = field(init=False, repr=False, compare=False)
    #: the summary extras of ``block_formats`` (``(column, merge rule)``; they lead the
    #: custom statistics in every layout)
    block_extras: tuple[tuple[str, str], ...] = field(init=False, repr=False, compare=False)
    #: the canonical name of ``number_format`` (``None``: each tensor's own dtype)
    format: str | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "track_activations",
            "track_gradients",
            "track_updates",
            "verbose",
            "rank_logs",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"track({name}={value!r}): expected True or False")
        if self.out is not None and not isinstance(self.out, (str, os.PathLike)):
            raise TypeError(
                f"track(out={self.out!r}): expected a path (str or os.PathLike), or None for "
                f"a new folder under tandv_logs/"
            )
        if self.out_format not in FORMATS:
            raise ValueError(f"out_format={self.out_format!r}: expected one of {FORMATS}")
        if self.run_name is not None and (not isinstance(self.run_name, str) or not self.run_name):
            raise ValueError(
                f"track(run_name={self.run_name!r}): expected a non-empty string, or None for "
                f"the default"
            )
        if (
            not isinstance(self.flush_every, int)
            or isinstance(self.flush_every, bool)
            or self.flush_every < 1
        ):
            raise ValueError(
                f"flush_every={self.flush_every!r}: expected an int >= 1 (write rows to disk "
                f"every N recorded steps)"
            )
        if self.distributed not in (None, True, False):
            raise ValueError(
                f"track(distributed={self.distributed!r}): expected None (detect a run over "
                f"several processes), True or False"
            )
        if (
            not isinstance(self.dist_timeout, (int, float))
            or isinstance(self.dist_timeout, bool)
            or not self.dist_timeout > 0
        ):
            raise ValueError(
                f"track(dist_timeout={self.dist_timeout!r}): expected a number of seconds > 0"
            )
        sinks = tuple(self.sinks)
        for sink in sinks:
            if not callable(sink):
                raise TypeError(
                    f"sinks: expected callables taking a DataFrame of rows; got "
                    f"{type(sink).__name__}"
                )
        if self.moments not in (2, 4) or isinstance(self.moments, bool):
            raise ValueError(
                f"track(moments={self.moments!r}): expected 2 (mean and variance, the "
                f"default) or 4 (also skewness and kurtosis: the skew and kurtosis columns)"
            )
        check_alert_options(self.on_nonfinite, self.alerts)
        fns, rules = parse_custom_stats(self.stats, self.stats_merge)
        blocks = block_extras(parse_block_formats(self.block_formats))
        clash = sorted(set(rules) & {name for name, _ in blocks})
        if clash:
            raise ValueError(
                f"custom statistic {clash[0]!r} clashes with a block_formats column; rename it"
            )
        derived = {
            "sinks": sinks,
            "selector": Selector.build(self.include, self.exclude),
            "scheduled": make_schedule(self.every, self.schedule, self.start, self.end),
            "stat_fns": fns,
            "merge_rules": rules,
            "percentile_columns": percentile_columns(self.percentiles),
            "block_extras": blocks,
            "format": None if self.number_format is None else format_name(self.number_format),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> TrackOptions:
        """The options from ``track()``'s keywords; an unknown name is a TypeError that lists
        the known ones."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = [name for name in options if name not in known]
        if unknown:
            raise TypeError(
                f"track(): unknown option {unknown[0]!r}; the shared options are "
                f"{', '.join(sorted(known))} (and the framework's own, see help(track))"
            )
        return cls(**options)

    def given(self) -> dict[str, Any]:
        """The options as they were given (for the log's record of how it was made)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def documentation(cls) -> str:
        """The "Options:" section of this class's docstring (one entry per option), for the
        ``track()`` functions' own documentation."""
        doc = cls.__doc__ or ""
        return textwrap.dedent(doc[doc.index("    Options:") :]).strip() + "\n"


class TrackKwargs(TypedDict, total=False):
    """:class:`TrackOptions`' options as ``track()`` takes them (``**options:
    Unpack[TrackKwargs]``), so that type checkers and IDEs see every name and type."""

    track_activations: bool
    track_gradients: bool
    track_updates: bool
    include: Pattern | Sequence[Pattern] | None
    exclude: Pattern | Sequence[Pattern] | None
    every: int
    schedule: Schedule | str | Collection[int] | None
    start: int
    end: int | None
    stats: StatsSpec
    stats_merge: Mapping[str, str] | None
    percentiles: Sequence[float] | None
    block_formats: Sequence[str] | None
    moments: int
    number_format: Any
    out: str | os.PathLike[str] | None
    out_format: str
    run_name: str | None
    flush_every: int
    verbose: bool
    sinks: Sequence[Callable[[Any], Any]]
    distributed: bool | None
    rank_logs: bool
    dist_timeout: float
    on_nonfinite: str | Callable[[Any], Any] | None
    alerts: Callable[[Any], str | None] | Sequence[Callable[[Any], str | None]] | None
