"""Capturing module outputs and their cotangents inside traced JAX code.

Each module output is passed through :func:`tap`: it summarizes the output and wraps it in a
``jax.custom_vjp`` identity whose backward rule summarizes the incoming cotangent, both on
device; only the small summaries leave the computation.

How they leave: through a *mailbox*, a slice of the tracker's arena, one int32 ``jax.Ref``
(a mutable array) made before the update runs and written by the running computation (JAX
makes the ref an extra aliased input and output of the compiled program: the summaries
leave it as data); :meth:`Mailboxes.read` reads and clears it in one jitted call after the
step, and the tracker copies the words to the host with the step's other summaries in one
non-blocking transfer. The cotangents exist only inside ``jax.grad``'s backward pass of the
user's own loss, and a ``custom_vjp`` backward rule can return nothing but cotangents, so
there is no traced value to return them through without changing the user's code (values
traced inside a user's inner ``jax.jit`` cannot escape it either); a ref written inside the
program needs no such path. It replaced one unordered ``io_callback`` per tap: on XLA:CPU
each callback that waits for a value computed mid-update stalled the update (a transformer
step: 44 callbacks carrying 8-element summaries cost ~90 ms of 220; the same summaries
written to refs ~5 ms).

Inside a loop body (``lax.scan``/``fori_loop``, ``nn.scan``, and the rematerialized bodies
JAX stages out again for partial evaluation, ``nn.scan(nn.remat(...))``) the arena is
passed through the tap's ``custom_vjp`` as an argument (a ref closed over by a
differentiated loop body cannot be written by its backward rule; one passed in can), and
each iteration's write *merges* into its mailbox (:func:`._summary.merge_jax`), so the
mailbox ends the step with the summary of all iterations. Where refs cannot serve, a tap
reports by ``jax.debug.callback`` instead: inside ``shard_map``/``pmap`` (no refs there;
each device reports its shard), in a loop body under ``jax.vmap`` (a merged mailbox cannot
take batched writes), and when the arena is full. Which of these encloses a tap is read
from JAX's trace chain (:func:`current_scope`). Under ``jax.vmap`` elsewhere the summary is
taken of the whole batched array, below every vmap, so it is one unbatched summary a
mailbox can hold. A summary computed outside any trace (an update that is not jitted) is
handed over directly.

A mailbox also counts its writes: one the computation skipped (a tap dropped by dead-code
elimination, a branch not taken) is not reported, and one outside a loop written twice in a
step is reported once (its last write), with a warning naming it unless the tap lies inside
``jax.checkpoint``, whose forward pass runs again in the backward pass.

Why no retracing: tracking is switched on with a ``jax.make_user_context`` value, which is part
of every ``jax.jit`` cache key. A jitted update is therefore traced once with taps (the context
set: tracked steps) and once without (unscheduled steps, or any call outside the tracker), and
each compiled version is reused from then on, with its mailboxes (a new arena comes with a
new context value: one more trace). Callbacks find their tracker through a registry keyed
by the token.

Modules are found through Flax's own method interception for linen
(``nn.intercept_methods``) and, for nnx (which has none), by wrapping ``__call__`` of the nnx
module classes while a tracker is open; the wrapper does nothing outside an intercepted step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as _config
from jax._src import core as _core
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe

from ._summary import DeviceSummary, merge_jax

__all__ = [
    "TRACKING",
    "Probe",
    "Mailboxes",
    "MailRead",
    "tap",
    "register",
    "interception",
    "ROOT_NAME",
    "acquire_nnx",
    "release_nnx",
    "tag_nnx_paths",
    "untag_nnx_paths",
    "current_scope",
    "Scope",
]

#: The jit-cache-sensitive switch: while a tracker intercepts, a tuple that starts with its
#: token; else None.
TRACKING = jax.make_user_context(None)

#: Name of the outermost module's output (the root of the module tree has an empty path,
#: as the root module does in PyTorch's ``named_modules``).
ROOT_NAME = "root"

_TRACKERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def register(token: int, tracker: Any) -> None:
    """Route callbacks carrying ``token`` to ``tracker`` (held weakly)."""
    _TRACKERS[token] = tracker


def _deliver(
    token: int,
    name: str,
    module_type: str,
    dtypes: list[tuple[str, str]],
    summaries: list[DeviceSummary],
) -> None:
    tracker = _TRACKERS.get(token)
    if tracker is not None:
        for (tensor_type, dtype), summary in zip(dtypes, summaries):
            tracker._receive(name, module_type, tensor_type, dtype, summary)


#: Reports of one tap: ``(tensor_type, dtype, summary)``.
Reports = list[tuple[str, Any, DeviceSummary]]


@dataclass(frozen=True)
class Scope:
    """The transforms enclosing the code being traced, read from JAX's own trace chain
    (each trace records what it was made for and its parent trace).

    Attributes:
        loop: inside a loop body (``lax.scan``, ``while_loop``, ``fori_loop``, and what is
            built on them: ``nn.scan``, ``nnx.scan``): a ref would keep the last iteration only.
        remat: inside ``jax.checkpoint`` (``nn.remat``, ``nnx.remat``): the forward pass runs
            again in the backward pass, and JAX may reuse the traced body in a later trace.
        manual: inside ``shard_map`` (also ``jax.pmap``, which JAX builds on it): refs are not
            available there, and each device sees its own shard.
        restaged: inside ``jax.checkpoint`` traced for partial evaluation (the
            differentiated body of a loop, e.g. ``nn.scan(nn.remat(...))``): JAX stages the
            body out again and again, and a ref closed over by one staging is unknown to the
            next.
        batched: under ``jax.vmap`` (a loop body's mailbox, merged per iteration, cannot take
            the batched writes of a vmapped loop).
    """

    loop: bool = False
    remat: bool = False
    manual: bool = False
    restaged: bool = False
    batched: bool = False


_LOOP_TRACES = frozenset({"scan", "while_body", "while_cond", "fori_loop"})
_REMAT_TRACE = "checkpoint / remat"
_MANUAL_TRACE = "shard_map"


def current_scope() -> Scope:
    """The :class:`Scope` of the code being traced now (all False outside any trace)."""
    loop = remat = manual = partial = batched = False
    trace = _core.trace_ctx.trace
    while trace is not None:
        info = getattr(getattr(trace, "frame", None), "debug_info", None)
        kind = getattr(info, "traced_for", None)
        loop |= kind in _LOOP_TRACES
        remat |= kind == _REMAT_TRACE
        manual |= kind == _MANUAL_TRACE
        partial |= isinstance(trace, _pe.JaxprTrace)
        batched |= isinstance(trace, _batching.BatchTrace)
        trace = getattr(trace, "parent_trace", None)
    return Scope(loop, remat, manual, remat and partial, batched)


def _unbatched(x: Any) -> tuple[Any, Any]:
    """``(array, trace)``: for a value batched by ``jax.vmap`` (possibly nested), the whole
    batched array (mapped axes included) and the trace below every vmap, under which it can
    be summarized as one array; else ``(x, None)``."""
    if not isinstance(x, _batching.BatchTracer):
        return x, None
    while isinstance(x, _batching.BatchTracer):
        trace = x._trace.parent_trace
        x = x.val
    return x, trace


def _manual_keep(x: Any) -> Any:
    """Inside ``shard_map``: whether this device's report of ``x`` counts (traced bool).

    Each device reports the summary of its own shard; the recorder merges the reports into
    the summary of the whole array. Over a mesh axis along which ``x`` is the same on every
    device (JAX's varying-axes types say so when the ``shard_map`` checks them), only the
    device at index 0 counts, so a replicated value is not counted once per device."""
    axes = _core.get_axis_env().axis_names()
    varying = getattr(getattr(jax.typeof(x), "mat", None), "varying", None)
    if varying is None or not _config._check_vma.value:
        return jnp.ones((), jnp.bool_)  # no varying-axes types: every shard is distinct data
    keep = jnp.ones((), jnp.bool_)
    for axis in axes:
        if axis not in varying:
            keep &= jax.lax.axis_index(axis) == 0
    return keep


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

    def __init__(self) -> None:
        #: Bumped with every new arena; the tracker puts it in the jit cache key.
        self.generation = 0
        self._arena: Any = None
        self._devices: Any = None  # where the arena lives
        self._used = 0  # words handed out
        self._wanted = 0  # words asked for this generation, granted or not
        self._boxes: list[_Box] = []
        self._lock = threading.Lock()
        self._read = jax.jit(_read_and_clear)
        self._warned: set[str] = set()

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
        reports: Reports,
        arena: Any = None,
        remat: bool = False,
        merge: Sequence[str] | None = None,
    ) -> bool:
        """Write ``reports`` (traced) to a new mailbox; False where the arena has no room left
        (the caller then sends them by callback). ``arena``: the current arena as the traced
        function sees it, when it was passed in as an argument (by default it is closed over).
        ``remat``: written inside ``jax.checkpoint`` (a second write per step is expected).
        ``merge``: inside a loop body, the write merges into what the mailbox holds
        (:func:`merge_jax`; the custom statistics' merge rules), so the mailbox ends the
        step with the summary of every iteration; else it replaces it."""
        words = [w for _, _, s in reports for w in (_words(s.counts), _words(s.values))]
        size = 1 + sum(w.shape[0] for w in words)
        with self._lock:
            self._wanted += size
            if self._arena is None or self._used + size > self._arena.shape[0]:
                return False
            offset = self._used
            self._used += size
            arena, generation = self._arena if arena is None else arena, self.generation
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
                merged = merge_jax(DeviceSummary(*parts), s, merge)
                words += [_words(jnp.where(times > 0, m, new)) for m, new in zip(merged, s)]
        arena[offset : offset + size] = jnp.concatenate([(times + 1).reshape(1), *words])
        with self._lock:
            if generation == self.generation:
                self._boxes.append(
                    _Box(
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
                )
        return True

    def read(self) -> MailRead | None:
        """Read every mailbox written since the last read, and clear them, in one jitted call
        (ordered after the computations that write them; nothing waits); None when no
        mailbox was traced."""
        with self._lock:
            boxes, arena = list(self._boxes), self._arena
        if not boxes:
            return None
        return MailRead(boxes, self._read(arena), self._warned)


class MailRead:
    """One read of the mailboxes: the words on their way to the host, decoded on first use
    (after the next step has been queued: reading them then does not stall the device)."""

    def __init__(self, boxes: list[_Box], words: Any, warned: set[str]) -> None:
        self.boxes = boxes
        #: The words, a device array (fetched by :meth:`fetch_from`'s function if one is set).
        self.words = words
        #: Whether the words are a global array replicated over several processes (a
        #: multi-process run's jitted update): every process reads the same summaries.
        self.replicated = isinstance(words, jax.Array) and not words.is_fully_addressable
        self._warned = warned
        self._fetch: Callable[[], np.ndarray] | None = None
        self._decoded: list[list[DeviceSummary] | None] | None = None

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
            self._decoded = self._decode(
                self._fetch() if self._fetch is not None else np.asarray(self.words)
            )
            self.words = None
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


@dataclass(frozen=True, eq=False)
class Probe:
    """What a tap reports: to which tracker, under which name, and what to summarize.

    Hashed by identity (it is a static argument of the ``custom_vjp``). ``manual``: the tap
    lies inside ``shard_map``/``pmap`` (see :func:`_manual_keep`)."""

    token: int
    name: str
    module_type: str
    forward: bool
    backward: bool
    summarize: Callable[[jax.Array], DeviceSummary]
    manual: bool = False

    def summary(self, x: Any, whole_batch: bool = True) -> tuple[Any, DeviceSummary, Any]:
        """``(dtype, summary, keep)`` of ``x``: under ``jax.vmap`` the summary of the whole
        batched array (the mapped axes are summarized too, as a per-example loss's
        activations form one tensor), computed below every vmap so that it is one unbatched
        summary; ``keep`` is :func:`_manual_keep` inside ``shard_map`` (else None).
        ``whole_batch=False``: the summary of ``x`` as the current trace sees it (one per
        example under vmap), for host callbacks, which vmap calls once per example."""
        whole, below = _unbatched(x) if whole_batch else (x, None)
        with contextlib.nullcontext() if below is None else _core.set_current_trace(below):
            return whole.dtype, self.summarize(whole), _manual_keep(whole) if self.manual else None

    def report(self, tensor_type: str, x: Any, arena: Any = None, remat: bool = False) -> None:
        """Summarize ``x`` and send it to the tracker (see :meth:`emit`)."""
        whole, below = _unbatched(x)
        with contextlib.nullcontext() if below is None else _core.set_current_trace(below):
            self.emit([(tensor_type, whole.dtype, self.summarize(whole))], arena, remat)

    def emit(
        self, reports: Reports, arena: Any = None, remat: bool = False, merge: bool = False
    ) -> None:
        """Send ``(tensor_type, dtype, summary)`` reports to the tracker: directly when they are
        concrete, else by mailbox (``arena``, ``merge``: see :meth:`Mailboxes.post`), else (no
        room left) by host callback."""
        tracker = _TRACKERS.get(self.token)
        if (
            _is_traced(reports)
            and tracker is not None
            and tracker._mailboxes.post(
                self.name,
                self.module_type,
                reports,
                arena,
                remat,
                [rule for _, rule in tracker._extras] if merge else None,
            )
        ):
            return
        self.send(reports)

    def send(self, reports: Reports, keep: Any = None) -> None:
        """Send reports directly when they are concrete, else by one host callback (dropped
        there when the traced bool ``keep`` is False)."""
        dtypes = [(tensor_type, str(dtype)) for tensor_type, dtype, _ in reports]
        summaries = [summary for _, _, summary in reports]
        if not _is_traced(reports):
            _deliver(self.token, self.name, self.module_type, dtypes, summaries)
            return
        tracker = _TRACKERS.get(self.token)
        if tracker is not None:
            tracker._used_callbacks = True
        deliver = functools.partial(_deliver, self.token, self.name, self.module_type, dtypes)
        # A debug callback: its effect is one JAX allows inside jax.checkpoint (an
        # io_callback's is refused there), loops and custom derivatives.
        if keep is None:
            jax.debug.callback(deliver, summaries)
        else:
            jax.debug.callback(lambda s, k: deliver(s) if bool(k) else None, summaries, keep)


def _is_traced(reports: Reports) -> bool:
    return any(isinstance(s.counts, jax.core.Tracer) for _, _, s in reports)


def tap(probe: Probe, x: jax.Array) -> jax.Array:
    """Identity on ``x`` that reports ``x`` (when ``probe.forward``) and its cotangent (when
    ``probe.backward``) to ``probe``.

    The activation is reported here, outside any ``custom_vjp``: a mailbox written inside
    its primal function (traced whenever the output is not differentiated) would be a ref
    closed over by a ``custom_vjp``, which JAX refuses. Its summary is of ``stop_gradient(x)``:
    a constant to differentiation, which a mailbox may hold.

    The cotangent is reported by a ``custom_vjp`` backward rule. Inside ``jax.checkpoint``
    the arena is handed to that rule as an argument and residual (JAX's pattern for refs
    written by backward rules; a closed-over ref's writes there are dropped); elsewhere it
    is closed over (an argument ref fails to compile when the output is not differentiated,
    which a checkpointed function rarely is).

    Inside a loop body or ``shard_map``/``pmap``, both are reported by host callbacks from
    the ``custom_vjp`` rules (see :func:`_callback_tap`); under ``jax.vmap``, summaries are
    of the whole batched array (see :meth:`Probe.summary`)."""
    scope = current_scope()
    if scope.manual:
        return _callback_tap(dataclasses.replace(probe, manual=True), x)
    if (scope.loop or scope.restaged) and (scope.batched or isinstance(x, _batching.BatchTracer)):
        return _callback_tap(probe, x)  # a vmapped loop body: by host callback
    tracker = _TRACKERS.get(probe.token)
    if scope.loop or scope.restaged:
        if tracker is None or tracker._mailboxes.arena is None:
            return _callback_tap(probe, x)
        return _loop_tap(probe, tracker._mailboxes.arena, x)
    if probe.forward:
        probe.report("Activation", jax.lax.stop_gradient(x), remat=scope.remat)
    if not probe.backward:
        return x
    if tracker is not None and tracker._mailboxes.arena is not None and scope.remat:
        return _cotangent_tap_ref(probe, tracker._mailboxes.arena, x)
    return _cotangent_tap(probe, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cotangent_tap(probe: Probe, x: jax.Array) -> jax.Array:
    """Identity on ``x`` whose backward rule reports the cotangent to ``probe``."""
    return x


def _cotangent_fwd(probe: Probe, x: jax.Array) -> tuple[jax.Array, None]:
    return x, None


def _cotangent_bwd(probe: Probe, res: None, g: jax.Array) -> tuple[jax.Array]:
    probe.report("Gradient", g)
    return (g,)


_cotangent_tap.defvjp(_cotangent_fwd, _cotangent_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cotangent_tap_ref(probe: Probe, arena: Any, x: jax.Array) -> jax.Array:
    """:func:`_cotangent_tap` writing to ``arena``, received as an argument."""
    return x


def _cotangent_ref_fwd(probe: Probe, arena: Any, x: jax.Array) -> tuple[jax.Array, Any]:
    return x, arena


def _cotangent_ref_bwd(probe: Probe, arena: Any, g: jax.Array) -> tuple[None, jax.Array]:
    probe.report("Gradient", g, arena, remat=True)
    return None, g


_cotangent_tap_ref.defvjp(_cotangent_ref_fwd, _cotangent_ref_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loop_tap(
    probe: Probe, arena: Any, x: jax.Array
) -> jax.Array:  # the primal: not differentiated
    """:func:`tap` inside a loop body: each iteration's summaries merge into a mailbox of
    ``arena`` (received as an argument: a ref closed over by a differentiated loop body
    cannot be written by its backward rule, one passed through the ``custom_vjp`` can).

    When the body is differentiated, the activation's summary rides to the backward rule as
    a residual and is written there with the cotangent's: the forward rule runs again
    where the body is rematerialized (``nn.scan(nn.remat(...))``), the backward rule once
    per iteration."""
    if probe.forward:
        dtype, summary, _ = probe.summary(x)
        probe.emit([("Activation", dtype, summary)], arena, merge=True)
    return x


def _loop_fwd(probe: Probe, arena: Any, x: jax.Array) -> tuple[jax.Array, Any]:
    return x, (arena, probe.summary(x)[1] if probe.forward else None)


def _loop_bwd(probe: Probe, res: Any, g: jax.Array) -> tuple[None, jax.Array]:
    arena, activation = res
    reports: Reports = [] if activation is None else [("Activation", g.dtype, activation)]
    if probe.backward:
        dtype, summary, _ = probe.summary(g)
        reports.append(("Gradient", dtype, summary))
    if reports:
        probe.emit(reports, arena, merge=True)
    return None, g


_loop_tap.defvjp(_loop_fwd, _loop_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _callback_tap(probe: Probe, x: jax.Array) -> jax.Array:  # the primal: not differentiated
    """:func:`tap` for loop bodies and ``shard_map``, every report by host callback from the
    rules of a ``custom_vjp``, which JAX never differentiates (a callback of the activation
    made in the differentiated body of a scan is dropped)."""
    if probe.forward:
        dtype, summary, keep = probe.summary(x, whole_batch=False)
        probe.send([("Activation", dtype, summary)], keep)
    return x


def _callback_fwd(probe: Probe, x: jax.Array) -> tuple[jax.Array, Any]:
    # The activation's summary rides to the backward rule as a residual and leaves from
    # there (with the cotangent's, when wanted): a callback made in this rule inside a
    # differentiated scan is dropped. A cotangent has its primal's dtype, which names the
    # activation's too.
    return x, probe.summary(x, whole_batch=False)[1:] if probe.forward else None


def _callback_bwd(probe: Probe, res: Any, g: jax.Array) -> tuple[jax.Array]:
    reports, keep = [], None
    if probe.backward:
        dtype, summary, keep = probe.summary(g, whole_batch=False)
        reports.append(("Gradient", dtype, summary))
    if res is not None:
        reports.insert(0, ("Activation", g.dtype, res[0]))
        keep = res[1] if keep is None else keep
    if reports:
        probe.send(reports, keep)
    return (g,)


_callback_tap.defvjp(_callback_fwd, _callback_bwd)


# ----------------------------------------------------------------------------- nnx

_nnx_local = threading.local()
_nnx_originals: dict[type, Callable] = {}  # patched class -> its own __call__
_nnx_users = 0  # open trackers; the patches stay while there is one


def _nnx_call_owners() -> list[type]:
    """Every nnx module class that defines ``__call__`` itself (subclasses inherit the wrap)."""
    from flax import nnx

    seen: set[type] = set()
    owners = []
    stack = [nnx.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                if "__call__" in sub.__dict__:
                    owners.append(sub)
    return owners


#: Attribute naming an nnx module's path in the tracked model (set by the tracker while it
#: is open): plain attributes are static data of the module's graph, so the copies nnx
#: transforms merge inside a traced function carry it too.
NNX_PATH_ATTR = "_tandv_path"
_warned_classes: set[type] = set()


def _warn_untracked(cls: type) -> None:
    if cls not in _warned_classes:
        _warned_classes.add(cls)
        warnings.warn(
            f"tandv: an nnx {cls.__name__} module called inside intercept() is not part of the "
            f"tracked model (track(model_state=...)) nor of the outermost module called; its "
            f"outputs are not tracked",
            RuntimeWarning,
            stacklevel=4,
        )


def tag_nnx_paths(model: Any) -> list[Any]:
    """Tag every module of the nnx ``model`` with its path (see :data:`NNX_PATH_ATTR`);
    returns the tagged modules, for :func:`untag_nnx_paths`."""
    from flax import nnx

    tagged = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            object.__setattr__(node, NNX_PATH_ATTR, ".".join(map(str, path)) or ROOT_NAME)
            tagged.append(node)
    return tagged


def untag_nnx_paths(modules: list[Any]) -> None:
    """Remove the tags :func:`tag_nnx_paths` set."""
    for node in modules:
        if NNX_PATH_ATTR in vars(node):
            object.__delattr__(node, NNX_PATH_ATTR)


def _wrap_nnx_call(original: Callable) -> Callable:
    from flax import nnx

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _nnx_local
        on_output = getattr(state, "on_output", None)
        if on_output is None:  # no intercepted step running: the module's own call
            return original(self, *args, **kwargs)
        depth = getattr(state, "depth", 0)
        if depth == 0:
            # The outermost call names every module below it by its graph path.
            state.paths = {
                id(node): path
                for path, node in nnx.iter_graph(self)
                if isinstance(node, nnx.Module)
            }
        state.depth = depth + 1
        try:
            out = original(self, *args, **kwargs)
        finally:
            state.depth = depth
        path = state.paths.get(id(self))
        if path is not None:
            name = ".".join(str(p) for p in path) or ROOT_NAME
        else:
            # A copy made by an nnx transform (nnx.scan, nnx.vmap, nnx.remat split the
            # module and merge a new one inside): its tag says where the original lies.
            tag: str | None = getattr(self, NNX_PATH_ATTR, None)
            if tag is None:
                _warn_untracked(type(self))
                return out
            name = tag
        return on_output(name, type(self), out)

    return __call__


def _patch_nnx_classes() -> None:
    """Wrap ``__call__`` of every nnx module class not wrapped yet (idempotent and cheap when
    nothing is new: setting class attributes is what costs, so it is done once per class)."""
    for cls in _nnx_call_owners():
        if cls not in _nnx_originals:
            original = cls.__dict__["__call__"]
            _nnx_originals[cls] = original
            cls.__call__ = _wrap_nnx_call(original)  # type: ignore[method-assign]  # on purpose


def acquire_nnx() -> None:
    """A tracker opens: nnx module calls become interceptable (wrapped until the last closes)."""
    global _nnx_users
    _nnx_users += 1
    _patch_nnx_classes()


def release_nnx() -> None:
    """A tracker closes: when it was the last, restore every wrapped ``__call__``."""
    global _nnx_users
    _nnx_users = max(0, _nnx_users - 1)
    if _nnx_users == 0:
        for cls, original in _nnx_originals.items():
            cls.__call__ = original  # type: ignore[method-assign]  # restoring the patch
        _nnx_originals.clear()


@contextlib.contextmanager
def _nnx_scope(on_output: Callable[[str, type, Any], Any]) -> Iterator[None]:
    _patch_nnx_classes()  # nnx classes defined after the tracker opened
    previous = getattr(_nnx_local, "on_output", None)
    _nnx_local.on_output = on_output
    try:
        yield
    finally:
        _nnx_local.on_output = previous


@contextlib.contextmanager
def interception(key: Any, on_output: Callable[[str, type, Any], Any]) -> Iterator[None]:
    """While active: jit caches see the tracking context ``key`` (hashable: the tracker and
    what its taps are compiled for), and every linen and nnx module ``__call__`` output goes
    through ``on_output(name, module_class, output)``."""
    import flax.linen as nn

    def interceptor(next_fun: Callable, args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        module = context.module
        return on_output(".".join(str(p) for p in module.path) or ROOT_NAME, type(module), out)

    with TRACKING(key), nn.intercept_methods(interceptor), _nnx_scope(on_output):
        yield
