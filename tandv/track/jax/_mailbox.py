"""The mailbox arena: where taps inside a running program leave their summaries.

A mailbox is a slice of one int32 ``jax.Ref`` (a mutable array), the arena, made before the
update runs and written by the running computation: JAX makes the ref an extra aliased input
and output of the compiled program, so the summaries leave it as data, with no host
callback. :meth:`Mailboxes.read` reads and clears the arena in one jitted call after the
step; the tracker copies the words to the host with the step's other summaries in one
non-blocking transfer, and :class:`MailRead` decodes them there.

Why refs: the cotangents exist only inside ``jax.grad``'s backward pass of the user's own
loss, and a ``custom_vjp`` backward rule can return nothing but cotangents, so there is no
traced value to return them through without changing the user's code (values traced inside
a user's inner ``jax.jit`` cannot escape it either); a ref written inside the program needs
no such path.

A mailbox also counts its writes: one the computation skipped (a tap dropped by dead-code
elimination, a branch not taken) is not reported, and one outside a loop written twice in a
step is reported once (its last write), with a warning naming it unless the tap lies inside
``jax.checkpoint``, whose forward pass runs again in the backward pass. Inside a loop body
each iteration's write *merges* into its mailbox (:func:`._summary.merge_jax`), so the
mailbox ends the step with the summary of all iterations.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._sink import Report
from ._summary import DeviceSummary, merge_jax

__all__ = ["Mailboxes", "MailRead", "ProgramMailboxes"]


@dataclass(eq=False)
class _Box:
    """One traced tap's mailbox: int32 words from ``offset`` of the arena: a write counter,
    then each report's counts and values, bit for bit."""

    name: str
    module_type: str
    reports: list[tuple[str, str, Any, Any]]  # (tensor_type, dtype name, counts, values shapes)
    words: list[int]  # int32 words of each counts / values part, in order
    offset: int
    rematerialized: bool  # inside jax.checkpoint or a loop: written more than once per step


def _words(x: Any) -> Any:
    """The bits of ``x`` (4- or 8-byte elements: summaries hold int32 and float32/float64) as a
    flat int32 vector."""
    return jax.lax.bitcast_convert_type(x, jnp.int32).reshape(-1)


def _read_and_clear(arena: Any) -> Any:
    out = arena[...]
    arena[...] = jnp.zeros(arena.shape, arena.dtype)
    return out


def _write(
    arena: Any, offset: int, size: int, reports: Sequence[Report], words: list[Any], merge: Any
) -> list[Any]:
    """Write one mailbox of ``size`` words at ``offset`` of ``arena`` (traced): its write
    counter plus one, then ``words`` (the reports' bits), or, with the merge rules
    ``merge``, the reports merged into what the mailbox holds. Returns the words written."""
    times = arena[offset]
    if merge is not None:
        old = arena[offset : offset + size]
        at, words = 1, []
        for _, _, s in reports:
            parts = []
            for part in (s.counts, s.values):
                n = _words(part).shape[0]
                parts.append(_traced_unwords(old[at : at + n], part))
                at += n
            if s.counts.ndim == 2:  # an array's segments (``_segments``): row by row
                merged = jax.vmap(lambda a, b: merge_jax(a, b, merge))(DeviceSummary(*parts), s)
            else:
                merged = merge_jax(DeviceSummary(*parts), s, merge)
            words += [_words(jnp.where(times > 0, m, new)) for m, new in zip(merged, s)]
    arena[offset : offset + size] = jnp.concatenate([(times + 1).reshape(1), *words])
    return words


def _box(
    name: str,
    module_type: str,
    reports: Sequence[Report],
    words: list[Any],
    offset: int,
    remat: bool,
    merge: Any,
) -> _Box:
    """The record of a mailbox written with ``words`` (see :func:`_write`)."""
    return _Box(
        name,
        module_type,
        [
            (
                t,
                str(d),
                jax.ShapeDtypeStruct(s.counts.shape, s.counts.dtype),
                jax.ShapeDtypeStruct(s.values.shape, s.values.dtype),
            )
            for t, d, s in reports
        ],
        [w.shape[0] for w in words],
        offset,
        remat or merge is not None,
    )


class ProgramMailboxes:
    """The mailboxes of one trace of a tracked program (``_intercept.TrackedProgram``): the
    arena is made *inside* the program, as zeros, and its written words leave it as an extra
    output, so the compiled program has no ref among its inputs and outputs and its calls
    keep JAX's C++ dispatch path. Word 0 of the output is the trace's ``serial``, which names
    the mailbox layout (:attr:`boxes`) the host decodes them by.

    Made while the program is traced; ``capacity`` words (a trace that wants more sends the
    rest by callback and says so by :attr:`overflowed`, and the program is traced again with
    room for all)."""

    def __init__(self, serial: int, capacity: int, merge_rules: Sequence[str] = ()) -> None:
        self.serial = serial
        self.capacity = capacity
        self._rules = list(merge_rules)  # the custom statistics', for loop bodies' merges
        self.arena = jax.new_ref(jnp.zeros(capacity, jnp.int32))
        self.boxes: list[_Box] = []
        self.used = 1  # word 0: the serial
        self.wanted = 1

    @property
    def overflowed(self) -> bool:
        """Whether some tap found no room (it reported by callback instead)."""
        return self.wanted > self.capacity

    def post(
        self,
        name: str,
        module_type: str,
        reports: Sequence[Report],
        arena: Any = None,
        remat: bool = False,
        merge: bool = False,
    ) -> bool:
        """:meth:`._sink.Mailbox.post` into this trace's arena."""
        words = [w for _, _, s in reports for w in (_words(s.counts), _words(s.values))]
        size = 1 + sum(w.shape[0] for w in words)
        self.wanted += size
        if self.used + size > self.capacity:
            return False
        offset, self.used = self.used, self.used + size
        rules = self._rules if merge else None
        words = _write(self.arena if arena is None else arena, offset, size, reports, words, rules)
        self.boxes.append(_box(name, module_type, reports, words, offset, remat, rules))
        return True

    def words(self) -> Any:
        """The words the taps wrote, with the serial in word 0 (traced: the program's extra
        output)."""
        return self.arena[: self.used].at[0].set(self.serial)


class Mailboxes:
    """The mailboxes of one tracker's taps (see the module docstring), kept in one large int32
    ref, the arena: every ref a program closes over is one more argument of each call and one
    more array to read, so a tap gets a slice of the arena rather than refs of its own.

    The arena is made outside any trace (a ref made while JAX traces a differentiated
    function becomes part of that trace). When a trace needs more room than is left, its
    remaining taps use callbacks, and the next intercepted call gets an arena large enough
    and a new :attr:`generation` (part of the jit cache key: programs are traced once more,
    now with mailboxes only)."""

    #: int32 words of the first arena (a float32 report takes ~300: room for ~200 of them).
    CAPACITY = 1 << 16

    def __init__(self, merge_rules: Sequence[str] = ()) -> None:
        self._rules = list(merge_rules)  # the custom statistics', for loop bodies' merges
        #: Bumped with every new arena; the tracker puts it in the jit cache key.
        self.generation = 0
        self._arena: Any = None
        self._devices: Any = None  # where the arena lives
        self._used = 0  # words handed out
        self._wanted = 0  # words asked for this generation, granted or not
        self._boxes: list[_Box] = []
        self._lock = threading.Lock()
        self._read = jax.jit(_read_and_clear)
        #: Modules already warned about (a mailbox written more than once per step).
        self.warned: set[str] = set()

    def prepare(self, sharding: Any) -> None:
        """Before an intercepted call (outside any trace): make the first arena, or a larger
        one when the last trace ran out of room. ``sharding``: where it lives (replicated over
        the update's devices; None: the default device)."""
        devices = None if sharding is None else tuple(d.id for d in sharding.mesh.devices.flat)
        with self._lock:
            if self._arena is not None and self._wanted <= self._used and devices == self._devices:
                return
            self._devices = devices
            size = max(self.CAPACITY, 2 * self._wanted)
            self._arena = jax.new_ref(jax.device_put(jnp.zeros(size, jnp.int32), sharding))
            self.generation += 1
            self._used = self._wanted = 0
            self._boxes = []  # their programs were traced for an older generation

    @property
    def arena(self) -> Any:
        """The current arena (a ``jax.Ref``; None before :meth:`prepare`)."""
        return self._arena

    def post(
        self,
        name: str,
        module_type: str,
        reports: Sequence[Report],
        arena: Any = None,
        remat: bool = False,
        merge: bool = False,
    ) -> bool:
        """:meth:`._sink.Mailbox.post`: write ``reports`` (traced) to a new mailbox of the
        arena (closed over unless ``arena`` is given); inside a loop body (``merge``) the
        write merges into what the mailbox holds (:func:`merge_jax`), so the mailbox ends the
        step with the summary of every iteration."""
        words = [w for _, _, s in reports for w in (_words(s.counts), _words(s.values))]
        size = 1 + sum(w.shape[0] for w in words)
        with self._lock:
            self._wanted += size
            if self._arena is None or self._used + size > self._arena.shape[0]:
                return False
            offset = self._used
            self._used += size
            arena, generation = self._arena if arena is None else arena, self.generation
        rules = self._rules if merge else None
        words = _write(arena, offset, size, reports, words, rules)
        with self._lock:
            if generation == self.generation:
                self._boxes.append(_box(name, module_type, reports, words, offset, remat, rules))
        return True

    def read(self) -> MailRead | None:
        """Read every mailbox written since the last read, and clear them, in one jitted call
        (ordered after the computations that write them; nothing waits); None when no
        mailbox was traced."""
        with self._lock:
            boxes, arena = list(self._boxes), self._arena
        if not boxes:
            return None
        return MailRead(boxes, self._read(arena), self.warned)


class MailRead:
    """One read of the mailboxes: the words on their way to the host, decoded on first use
    (after the next step has been queued: reading them then does not stall the device)."""

    def __init__(
        self,
        boxes: list[_Box] | None,
        words: Any,
        warned: set[str],
        layouts: Mapping[int, list[_Box]] | None = None,
    ) -> None:
        #: the mailboxes; None: those of the layout that word 0 names in ``layouts`` (the
        #: words of a tracked program, :class:`ProgramMailboxes`), known once they arrive
        self._boxes = boxes
        self._layouts = layouts
        self._host: np.ndarray | None = None
        #: The words, a device array (fetched by :meth:`fetch_from`'s function if one is set).
        self.words = words
        #: Whether the words are a global array replicated over several processes (a
        #: multi-process run's jitted update): every process reads the same summaries.
        self.replicated = isinstance(words, jax.Array) and not words.is_fully_addressable
        self._warned = warned
        self._fetch: Callable[[], np.ndarray] | None = None
        self._decoded: list[list[DeviceSummary] | None] | None = None

    @property
    def boxes(self) -> list[_Box]:
        """The mailboxes these words hold (of a tracked program: read from the words, which
        waits for them)."""
        if self._boxes is None:
            assert self._layouts is not None
            self._boxes = self._layouts[int(self._fetched()[0])]
        return self._boxes

    def _fetched(self) -> np.ndarray:
        if self._host is None:
            self._host = self._fetch() if self._fetch is not None else np.asarray(self.words)
            self.words = None
        return self._host

    def fetch_from(self, fetch: Callable[[], np.ndarray]) -> None:
        """Take the words from ``fetch()`` (the host copy of the step's one transfer)."""
        self._fetch = fetch

    def reports(self) -> list[tuple[int, int, str, str, str, str]]:
        """``(box, report, name, module_type, tensor_type, dtype)`` of every report a mailbox
        may hold (known without the words: from the trace)."""
        return [
            (i, j, box.name, box.module_type, tensor_type, dtype)
            for i, box in enumerate(self.boxes)
            for j, (tensor_type, dtype, _, _) in enumerate(box.reports)
        ]

    def summary(self, box: int, report: int) -> DeviceSummary | None:
        """The summary of report ``report`` of mailbox ``box``; None when the computation did
        not write that mailbox (a tap removed as dead code, a branch not taken)."""
        if self._decoded is None:
            self._decoded = self._decode(self._fetched())
        got = self._decoded[box]
        return None if got is None else got[report]

    def _decode(self, got: np.ndarray) -> list[list[DeviceSummary] | None]:
        out: list[list[DeviceSummary] | None] = []
        for box in self.boxes:
            at = box.offset
            times = int(got[at])
            if times == 0:
                out.append(None)
                continue
            if times > 1 and not box.rematerialized and box.name not in self._warned:
                self._warned.add(box.name)
                warnings.warn(
                    f"tandv: the output of module {box.name!r} was summarized {times} times in one "
                    f"step at one place in the program (a loop tandv did not recognize?); its rows "
                    f"hold the last one",
                    RuntimeWarning,
                    stacklevel=4,
                )
            at += 1
            sizes = iter(box.words)
            summaries = []
            for _, _, counts, values in box.reports:
                parts = []
                for like in (counts, values):
                    n = next(sizes)
                    parts.append(_unwords(got[at : at + n], like))
                    at += n
                summaries.append(DeviceSummary(*parts))
            out.append(summaries)
        return out


def _traced_unwords(words: Any, like: Any) -> Any:
    """Traced inverse of :func:`_words`: the array of ``like``'s shape and dtype."""
    dtype = jnp.dtype(like.dtype)
    if dtype.itemsize == 8:
        words = words.reshape(-1, 2)
    return jax.lax.bitcast_convert_type(words, dtype).reshape(like.shape)


def _unwords(words: np.ndarray, like: jax.ShapeDtypeStruct) -> np.ndarray:
    """The array of ``like``'s shape and dtype whose bits :func:`_words` wrote as ``words``."""
    return words.view(np.dtype(like.dtype)).reshape(like.shape)
