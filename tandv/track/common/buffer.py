"""The step buffer: the observations of the step under way, until they are a step's entries.

An adapter hands the :class:`StepBuffer` one *device* summary vector per tensor observation
(:meth:`StepBuffer.add`), bounded by a memory guard (a loop that never ends a step is told
so). At the step's end it takes them (:meth:`StepBuffer.take`) and, once their summaries
can reach the host, commits them (:meth:`StepBuffer.commit`): one ``to_host`` call, the
observations of one tensor merged into one summary, the alerts' check, the merge over the
ranks of a distributed run, and a tensor's rows in several dtypes merged into one. The
entries go to the log stream (:class:`~tandv.track.common.stream.LogStream`), which makes
them rows on disk.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from itertools import chain
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from ...schema.columns import ACTIVATION, GRADIENT
from ...stats.summary import Layout, merge_all, rebin
from .rows import TensorKey

if TYPE_CHECKING:
    from .distributed import RankMerger
    from .stream import LogStream

__all__ = ["StepBuffer", "check_pending_bounds"]

_key_of = itemgetter(0)
_layout_of = itemgetter(1)
_summary_of = itemgetter(2)
_type_of = attrgetter("tensor_type")
#: what one row of a step is (a tensor seen in several dtypes within a step has one row)
_tensor_of = attrgetter("name", "tensor_type", "module_type")
_float64 = partial(np.asarray, dtype=np.float64)
#: the tensor types of module rows (activations and their gradients, parameter gradients)
_MODULE_ROWS = frozenset((ACTIVATION, GRADIENT))


class _KeyChecks:
    """The last list of a step's row keys found to hold no tensor twice, and the last found
    to hold no tensor in two dtypes. A step's keys are most often the same objects in the
    same order as the step before's, which a list comparison (identity first, in C) tells
    in a fraction of the time a set of them takes (hundreds of keys a step, on the log's
    writer thread).

    Each answer is a property of the list's contents alone, so a list equal to a checked
    one has it too; each is kept as one attribute, which the writer thread and the
    training thread (a step committed where it ends) may both set, either being right."""

    __slots__ = ("distinct", "one_dtype")

    def __init__(self) -> None:
        self.distinct: list[TensorKey] = []
        self.one_dtype: list[TensorKey] = []

    def all_distinct(self, keys: list[TensorKey]) -> bool:
        """Whether no key of ``keys`` is there twice."""
        if keys == self.distinct or len(set(keys)) == len(keys):
            self.distinct = keys
            return True
        return False

    def one_dtype_each(self, keys: list[TensorKey]) -> bool:
        """Whether no tensor (name, tensor type, module type) has two keys in ``keys``."""
        if keys == self.one_dtype or len(set(map(_tensor_of, keys))) == len(keys):
            self.one_dtype = keys
            return True
        return False


def _merged(
    step: int,
    pending: Sequence[tuple[TensorKey, Layout, Any]],
    to_host: Callable[[list[Any]], Sequence[np.ndarray] | np.ndarray],
    checks: _KeyChecks,
) -> list[tuple[TensorKey, Layout, np.ndarray]]:
    """A step's observations on the host (one ``to_host`` call), those of the same tensor
    merged into one summary."""
    host = to_host(list(map(_summary_of, pending))) if pending else []
    keys = list(map(_key_of, pending))
    if checks.all_distinct(keys):  # one observation per tensor (the common case)
        # (a float64 array of rows, as the fused path's to_host gives, is iterated as it
        # is: its rows are the vectors, with no conversion call per row)
        vectors = host if _float64_rows(host) else map(_float64, host)
        return list(zip(keys, map(_layout_of, pending), vectors))
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


def _float64_rows(host: Any) -> bool:
    """Whether ``host`` is a 2-D float64 numpy array (its rows are summary vectors)."""
    return type(host) is np.ndarray and host.ndim == 2 and host.dtype == np.float64


def _merge_dtypes(
    entries: list[tuple[TensorKey, Layout, np.ndarray]], checks: _KeyChecks
) -> list[tuple[TensorKey, Layout, np.ndarray]]:
    """One row per tensor even when it was seen in several dtypes within a step (a shared
    module fed float32 and bfloat16): the observations merge into the layout of the widest
    format, which the row's dtype names. An observation that cannot be re-binned exactly
    (formats that do not nest, or a summary that counted values outside its own format)
    keeps a row of its own, named ``<name>@<dtype>``."""
    if checks.one_dtype_each(list(map(_key_of, entries))):
        return entries  # one dtype per tensor (the common case)
    by_tensor: dict[tuple[str, str, str], list[int]] = {}
    for i, (key, _, _) in enumerate(entries):
        by_tensor.setdefault(_tensor_of(key), []).append(i)
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
            moved = rebin(v, layout, target)
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


def check_pending_bounds(warn_pending_bytes: int, max_pending_bytes: int) -> None:
    """Check the bounds of a :class:`StepBuffer`'s memory guard (callable before the log
    opens, so that a bad bound leaves no log behind).

    Raises:
        ValueError: unless ``0 < warn_pending_bytes <= max_pending_bytes``.
    """
    if not 0 < warn_pending_bytes <= max_pending_bytes:
        raise ValueError(
            f"warn_pending_bytes={warn_pending_bytes!r}, "
            f"max_pending_bytes={max_pending_bytes!r}: "
            f"expected 0 < warn_pending_bytes <= max_pending_bytes"
        )


class Taken(Sequence[tuple[TensorKey, Layout, Any]]):
    """A step's observations as :meth:`StepBuffer.take` hands them over, in order: the
    sequences they were added in, joined only where they are read (a deferred step's, on
    the writer thread: joining hundreds of entries at the end of the step costs the
    training thread ~5 us on the 2-core CPU), with their count and whether any of them is
    a module row."""

    __slots__ = ("chunks", "entries", "module_rows", "_joined")

    def __init__(
        self, chunks: list[Sequence[tuple[TensorKey, Layout, Any]]], module_rows: bool
    ) -> None:
        self.chunks = chunks
        self.entries = sum(map(len, chunks))
        self.module_rows = module_rows
        self._joined: list[tuple[TensorKey, Layout, Any]] | None = None

    def __len__(self) -> int:
        return self.entries

    def __iter__(self) -> Iterator[tuple[TensorKey, Layout, Any]]:
        return chain.from_iterable(self.chunks)

    @overload
    def __getitem__(self, index: int) -> tuple[TensorKey, Layout, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[TensorKey, Layout, Any]]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if self._joined is None:
            self._joined = list(self)
        return self._joined[index]


class StepBuffer:
    """The observations of the step under way, and how a committed step becomes entries of
    the log stream (see the module's documentation).

    Arguments:
        stream: the log the committed steps go to (its path names the log in warnings).
        warn_pending_bytes, max_pending_bytes: bounds on the summaries that wait for the
            end of a step (8 bytes per summary value): past the first a warning, past the
            second a RuntimeError, both saying to call ``tracker.step()`` (a training loop
            that never calls it would otherwise grow without bound).
        merger: in a distributed run, the cross-rank merge
            (:class:`~tandv.track.common.distributed.RankMerger`): each committed step's
            entries are merged over the ranks (the writer rank gets them, the others none;
            with the merger's ``rank_logs``, each rank's own entries also go to the stream's
            :attr:`~tandv.track.common.stream.LogStream.rank_log`), and every scheduled step
            takes part in the merge, even with no rows. ``None``: this process alone.
        inspect: called with ``(step, entries)`` for each committed step, once its summaries
            are on the host and merged per tensor (before a cross-rank merge): the entries
            are ``(TensorKey, Layout, host summary)``. The trackers' alerts
            (:class:`~tandv.track.common.alerts.AlertWatch`) check steps here.
    """

    def __init__(
        self,
        stream: LogStream,
        *,
        warn_pending_bytes: int = 256 * 2**20,
        max_pending_bytes: int = 2**30,
        merger: RankMerger | None = None,
        inspect: Callable[[int, list[tuple[TensorKey, Layout, np.ndarray]]], None] | None = None,
    ) -> None:
        check_pending_bounds(warn_pending_bytes, max_pending_bytes)
        self.stream = stream
        self.merger = merger
        self.inspect = inspect
        self.warn_pending_bytes = warn_pending_bytes
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._bounded = False  # whether _pending_bytes counts entries at an upper bound
        self._warned_pending = False
        self._warned_empty_step = False
        self._had_module_rows = False
        # the step's observations as the sequences they came in (add_many's, kept as they
        # are; one tuple per add): joined once, by take(). A list grown to hundreds of
        # entries would be reallocated in the hooks and the optimizer's hooks, and the first
        # allocation past Python's small-object sizes after the model's own operations
        # costs ~18 us on the 2-core CPU (the C allocator tidies what they freed)
        self._chunks: list[Sequence[tuple[TensorKey, Layout, Any]]] = []
        self._sizes: dict[int, tuple[Layout, int]] = {}  # bytes of a summary, by id(layout)
        self._bytes_by_id: dict[int, int] = {}  # the same bytes, by id(layout) alone
        self._checks = _KeyChecks()  # (the common case's answers, by the keys of a step)

    def add(self, key: TensorKey, layout: Layout, summary: Any) -> None:
        """Record one observation of a tensor in the current step (a device summary).

        Raises:
            RuntimeError: when the observations waiting for the end of the step pass
                ``max_pending_bytes`` (``tracker.step()`` is not being called).
        """
        nbytes = self._bytes_of(layout)
        if self._bounded and self._pending_bytes + nbytes > self.warn_pending_bytes:
            self._settle()
        self._pending_bytes += nbytes
        if self._pending_bytes > self.warn_pending_bytes:
            self._check_pending()
        self._chunks.append(((key, layout, summary),))

    def add_many(
        self, entries: Sequence[tuple[TensorKey, Layout, Any]], most: int | None = None
    ) -> None:
        """:meth:`add` of several observations (``(key, layout, summary)`` each) at once: a
        step's parameters, gradients or optimizer state, or the observations of its hooks.

        ``most``: bytes that no entry's summary exceeds (the tracker's largest layout).
        While the step's total stays under ``warn_pending_bytes`` even with every entry
        that large, the entries are counted at that size rather than sized one by one
        (hundreds a step, each a lookup); the total is made exact when it nears the bound.
        ``None``: the entries are sized.

        ``entries`` is kept, not copied, until the step is taken: the caller must not
        change it afterwards (the tracker passes tuples it reuses and lists it drops).

        Raises:
            RuntimeError: as :meth:`add`.
        """
        if not entries:
            return
        if most is not None:
            bound = len(entries) * most
            if self._pending_bytes + bound <= self.warn_pending_bytes:
                self._pending_bytes += bound
                self._bounded = True
                self._chunks.append(entries)
                return
        nbytes = self._nbytes(entries)
        if self._bounded and self._pending_bytes + nbytes > self.warn_pending_bytes:
            self._settle()
        if self._pending_bytes + nbytes > self.warn_pending_bytes:
            for entry in entries:  # one at a time: the warning and the error as with add
                self.add(*entry)
            return
        self._pending_bytes += nbytes
        self._chunks.append(entries)

    def _settle(self) -> None:
        """Make the step's total exact where entries were counted at an upper bound
        (``most`` of :meth:`add_many`): near ``warn_pending_bytes``, before a warning or an
        error could rest on it."""
        self._pending_bytes = self._nbytes(self.pending)
        self._bounded = False

    def _nbytes(self, entries: Sequence[tuple[TensorKey, Layout, Any]]) -> int:
        """The bytes of the summaries of ``entries``."""
        # (in passes that run in C: a step's weights, gradients and state are hundreds)
        try:
            return sum(map(self._bytes_by_id.__getitem__, map(id, map(_layout_of, entries))))
        except KeyError:  # a layout seen for the first time
            return sum(self._bytes_of(lay) for _, lay, _ in entries)

    def _bytes_of(self, layout: Layout) -> int:
        """The bytes of one summary in ``layout`` (found once per layout, by identity:
        hashing the dataclass at every observation would cost more)."""
        sized = self._sizes.get(id(layout))
        if sized is None or sized[0] is not layout:
            sized = self._sizes[id(layout)] = (layout, 8 * layout.size)
            # (by the identity alone: the layout, kept in _sizes, keeps it)
            self._bytes_by_id[id(layout)] = sized[1]
        return sized[1]

    def _check_pending(self) -> None:
        n, mib = sum(map(len, self._chunks)) + 1, self._pending_bytes / 2**20
        what = (
            f"{n} tensor observations ({mib:.0f} MiB of summaries) are waiting for the end of "
            f"a step in the log {str(self.stream.path)!r}"
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
        self._chunks = []
        self._pending_bytes = 0
        self._bounded = False

    @property
    def pending(self) -> Sequence[tuple[TensorKey, Layout, Any]]:
        """The current step's observations so far, in order (to read, not to change: the
        host-cost benchmark counts them)."""
        return list(chain.from_iterable(self._chunks))

    def has_pending_type(self, tensor_type: str) -> bool:
        """Whether an observation of ``tensor_type`` awaits the end of the step."""
        return any(
            key.tensor_type == tensor_type for key, _, _ in chain.from_iterable(self._chunks)
        )

    def take(self) -> Taken:
        """The current step's observations, handed to the caller (who passes them to
        :meth:`commit` once their summaries can reach the host without waiting)."""
        chunks, self._chunks = self._chunks, []
        # whether a module row is among them (commit warns of a step without any): told
        # by the sequences' first entries where one is (the hooks' hand over theirs), the
        # entries all read only where none is
        module_rows = not _MODULE_ROWS.isdisjoint(
            map(_type_of, map(_key_of, map(_key_of, chunks)))
        ) or not _MODULE_ROWS.isdisjoint(map(_type_of, map(_key_of, chain.from_iterable(chunks))))
        self._pending_bytes = 0
        self._bounded = False
        return Taken(chunks, module_rows)

    def commit(
        self,
        step: int,
        pending: Sequence[tuple[TensorKey, Layout, Any]],
        to_host: Callable[[list[Any]], Sequence[np.ndarray] | np.ndarray],
        defer: bool = False,
        observe: Callable[[Sequence[Any]], Sequence[Any]] | None = None,
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
        self.stream.raise_if_failed()
        module_rows = getattr(pending, "module_rows", None)
        if module_rows is None:  # (not a list take() made)
            module_rows = not _MODULE_ROWS.isdisjoint(map(_type_of, map(_key_of, pending)))
        if self._had_module_rows and not module_rows and not self._warned_empty_step:
            self._warned_empty_step = True
            warnings.warn(
                f"tandv: step {step} observed no activation or gradient although earlier steps "
                f"did (log {str(self.stream.path)!r}); is tracker.step() called more than once per "
                f"training step? Each call ends a step",
                RuntimeWarning,
                stacklevel=3,
            )
        self._had_module_rows |= module_rows
        count = len(pending)
        if not count and self.merger is None:
            return 0
        if defer and self.merger is None and self.inspect is None:
            checks = self._checks

            def later() -> list[tuple[TensorKey, Layout, np.ndarray]]:
                observed = pending if observe is None else observe(pending)
                return _merge_dtypes(_merged(step, observed, to_host, checks), checks)

            self.stream.append(step, later)
            return count
        if observe is not None:
            pending = observe(pending)
        local = _merged(step, pending, to_host, self._checks)
        if self.inspect is not None:
            self.inspect(step, local)
        if self.merger is not None:
            rank_log = self.stream.rank_log
            if rank_log is not None:  # written whatever becomes of the merge
                rank_log.raise_if_failed()
                if local:
                    rank_log.append(step, _merge_dtypes(local, self._checks))
            # before rows of several dtypes of one tensor merge: the rank merge is by key
            local = self.merger.merge(step, local)
            if not local:  # the writer's merge (on another rank), or a step with no rows
                return 0
        entries = _merge_dtypes(local, self._checks)
        self.stream.append(step, entries)
        return len(entries)
