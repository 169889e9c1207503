"""Capturing module outputs and their cotangents inside traced JAX code.

Each module output is passed through :func:`tap`: it summarizes the output and wraps it in a
``jax.custom_vjp`` identity whose backward rule summarizes the incoming cotangent, both on
device; only the small summaries leave the computation.

How they leave: through a *mailbox*, a slice of the tracker's arena, one int32 ``jax.Ref``
(a mutable array) made before the update runs and written by the running computation;
:meth:`Mailboxes.collect` reads it in one jitted call after the step. The cotangents exist
only inside ``jax.grad``'s backward pass of the user's own loss, and a ``custom_vjp``
backward rule can return nothing but cotangents, so there is no traced value to return
them through without changing the user's code (values traced inside a user's inner
``jax.jit`` cannot escape it either); a ref written inside the program needs no such path.
It replaced one unordered ``io_callback`` per tap: on XLA:CPU each callback that waits for
a value computed mid-update stalled the update (a transformer step: 44 callbacks carrying
8-element summaries cost ~90 ms of 220; the same summaries written to refs ~5 ms).

Where refs cannot serve, a tap reports by callback instead: inside a loop body
(``lax.scan``/``fori_loop``, ``nn.scan``; a ref would keep the last iteration only, and
scan's transpose cannot hold one), and when the arena is full. Under ``jax.vmap`` neither
works (a batched value cannot be written to an unbatched ref; the tracker turns JAX's error
into one that says what to do). A summary computed outside any trace (an update that is
not jitted) is handed over directly.

A mailbox also counts its writes: one the computation skipped (a tap dropped by dead-code
elimination, a branch not taken) is not reported, and one written twice in a step is
reported once (its last write), with a warning naming it unless the tap lies inside
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
import functools
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ._summary import DeviceSummary

__all__ = ["TRACKING", "Probe", "Mailboxes", "tap", "register", "interception", "ROOT_NAME", "acquire_nnx",
           "release_nnx"]

#: The jit-cache-sensitive switch: while a tracker intercepts, a tuple that starts with its
#: token; else None.
TRACKING = jax.make_user_context(None)

#: Name of the outermost module's output (the root of the module tree has an empty path,
#: as the root module does in PyTorch's ``named_modules``).
ROOT_NAME = "root"

_TRACKERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def register(token: int, tracker: Any) -> None:
    """Route callbacks carrying ``token`` to ``tracker`` (held weakly)."""
    _TRACKERS[token] = tracker


def _deliver(token: int, name: str, module_type: str, dtypes: list[tuple[str, str]],
             summaries: list[DeviceSummary]) -> None:
    tracker = _TRACKERS.get(token)
    if tracker is not None:
        for (tensor_type, dtype), summary in zip(dtypes, summaries):
            tracker._receive(name, module_type, tensor_type, dtype, summary)


#: Reports of one tap: ``(tensor_type, dtype, summary)``.
Reports = list[tuple[str, Any, DeviceSummary]]


def _traced_inside(jax_file: str) -> bool:
    """Whether the caller is being traced inside what JAX's module ``jax_file`` implements,
    read from the Python stack (a traced value does not say)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(jax_file):
            return True
        frame = frame.f_back
    return False


#: Loop bodies: ``lax.scan``, ``while_loop``, ``fori_loop`` and what is built on them
#: (``nn.scan``).
_LOOPS = "/".join(("", "lax", "control_flow", "loops.py"))
#: Rematerialized functions: ``jax.checkpoint`` (``nn.remat``).
_REMAT = "/ad_checkpoint.py"


@dataclass(eq=False)
class _Box:
    """One traced tap's mailbox: int32 words from ``offset`` of the arena: a write counter,
    then each report's counts and values, bit for bit."""

    name: str
    module_type: str
    reports: list[tuple[str, str, Any, Any]]  # (tensor_type, dtype name, counts, values shapes)
    words: list[int]  # int32 words of each counts / values part, in order
    offset: int
    rematerialized: bool  # inside jax.checkpoint: the forward pass runs again, writing again


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

    def post(self, name: str, module_type: str, reports: Reports, arena: Any = None) -> bool:
        """Write ``reports`` (traced) to a new mailbox; False where the arena has no room left
        (the caller then sends them by callback). ``arena``: the current arena as the traced
        function sees it, when it was passed in as an argument (by default it is closed over)."""
        words = [w for _, _, s in reports for w in (_words(s.counts), _words(s.values))]
        size = 1 + sum(w.shape[0] for w in words)
        with self._lock:
            self._wanted += size
            if self._arena is None or self._used + size > self._arena.shape[0]:
                return False
            offset = self._used
            self._used += size
            arena, generation = self._arena if arena is None else arena, self.generation
        arena[offset:offset + size] = jnp.concatenate([(arena[offset] + 1).reshape(1), *words])
        with self._lock:
            if generation == self.generation:
                self._boxes.append(_Box(name, module_type, [
                    (t, str(d), jax.ShapeDtypeStruct(s.counts.shape, s.counts.dtype),
                     jax.ShapeDtypeStruct(s.values.shape, s.values.dtype)) for t, d, s in reports],
                    [w.shape[0] for w in words], offset, _traced_inside(_REMAT)))
        return True

    def collect(self) -> list[tuple[str, str, str, str, DeviceSummary]]:
        """``(name, module_type, tensor_type, dtype, summary)`` of every mailbox written since
        the last collection (one jitted read, which waits for the computations that write)."""
        with self._lock:
            boxes, arena = list(self._boxes), self._arena
        if not boxes:
            return []
        got = jax.device_get(self._read(arena))
        out = []
        for box in boxes:
            at = box.offset
            times = int(got[at])
            if times == 0:
                continue
            if times > 1 and not box.rematerialized and box.name not in self._warned:
                self._warned.add(box.name)
                warnings.warn(f"tandv: the output of module {box.name!r} was summarized {times} times in one "
                              f"step at one place in the program (a loop tandv did not recognize?); its rows "
                              f"hold the last one", RuntimeWarning, stacklevel=3)
            at += 1
            sizes = iter(box.words)
            for tensor_type, dtype, counts, values in box.reports:
                parts = []
                for like in (counts, values):
                    n = next(sizes)
                    parts.append(_unwords(got[at:at + n], like))
                    at += n
                out.append((box.name, box.module_type, tensor_type, dtype, DeviceSummary(*parts)))
        return out


def _unwords(words: np.ndarray, like: jax.ShapeDtypeStruct) -> np.ndarray:
    """The array of ``like``'s shape and dtype whose bits :func:`_words` wrote as ``words``."""
    return words.view(np.dtype(like.dtype)).reshape(like.shape)


@dataclass(frozen=True, eq=False)
class Probe:
    """What a tap reports: to which tracker, under which name, and what to summarize.

    Hashed by identity (it is a static argument of the ``custom_vjp``)."""

    token: int
    name: str
    module_type: str
    forward: bool
    backward: bool
    summarize: Callable[[jax.Array], DeviceSummary]

    def emit(self, reports: Reports, arena: Any = None) -> None:
        """Send ``(tensor_type, dtype, summary)`` reports to the tracker: directly when they are
        concrete, else by mailbox (``arena``: see :meth:`Mailboxes.post`), else (no room left)
        by host callback."""
        tracker = _TRACKERS.get(self.token)
        if (_is_traced(reports) and tracker is not None
                and tracker._mailboxes.post(self.name, self.module_type, reports, arena)):
            return
        self.send(reports)

    def send(self, reports: Reports) -> None:
        """Send reports directly when they are concrete, else by one host callback."""
        dtypes = [(tensor_type, str(dtype)) for tensor_type, dtype, _ in reports]
        summaries = [summary for _, _, summary in reports]
        if not _is_traced(reports):
            _deliver(self.token, self.name, self.module_type, dtypes, summaries)
            return
        tracker = _TRACKERS.get(self.token)
        if tracker is not None:
            tracker._used_callbacks = True
        io_callback(functools.partial(_deliver, self.token, self.name, self.module_type, dtypes),
                    None, summaries, ordered=False)


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

    Inside a loop body, both are reported by host callbacks from the ``custom_vjp`` rules
    (see :func:`_callback_tap`)."""
    if _traced_inside(_LOOPS):
        return _callback_tap(probe, x)
    if probe.forward:
        probe.emit([("Activation", x.dtype, probe.summarize(jax.lax.stop_gradient(x)))])
    if not probe.backward:
        return x
    tracker = _TRACKERS.get(probe.token)
    if tracker is not None and tracker._mailboxes.arena is not None and _traced_inside(_REMAT):
        return _cotangent_tap_ref(probe, tracker._mailboxes.arena, x)
    return _cotangent_tap(probe, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cotangent_tap(probe: Probe, x: jax.Array) -> jax.Array:
    """Identity on ``x`` whose backward rule reports the cotangent to ``probe``."""
    return x


def _cotangent_fwd(probe: Probe, x: jax.Array) -> tuple[jax.Array, None]:
    return x, None


def _cotangent_bwd(probe: Probe, res: None, g: jax.Array) -> tuple[jax.Array]:
    probe.emit([("Gradient", g.dtype, probe.summarize(g))])
    return (g,)


_cotangent_tap.defvjp(_cotangent_fwd, _cotangent_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cotangent_tap_ref(probe: Probe, arena: Any, x: jax.Array) -> jax.Array:
    """:func:`_cotangent_tap` writing to ``arena``, received as an argument."""
    return x


def _cotangent_ref_fwd(probe: Probe, arena: Any, x: jax.Array) -> tuple[jax.Array, Any]:
    return x, arena


def _cotangent_ref_bwd(probe: Probe, arena: Any, g: jax.Array) -> tuple[None, jax.Array]:
    probe.emit([("Gradient", g.dtype, probe.summarize(g))], arena)
    return None, g


_cotangent_tap_ref.defvjp(_cotangent_ref_fwd, _cotangent_ref_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _callback_tap(probe: Probe, x: jax.Array) -> jax.Array:  # the primal: not differentiated
    """:func:`tap` for loop bodies, every report by host callback from the rules of a
    ``custom_vjp``, which JAX never differentiates (a callback of the activation made in the
    differentiated body of a scan is dropped)."""
    if probe.forward:
        probe.send([("Activation", x.dtype, probe.summarize(x))])
    return x


def _callback_fwd(probe: Probe, x: jax.Array) -> tuple[jax.Array, Any]:
    # The activation's summary rides to the backward rule as a residual and leaves from
    # there (with the cotangent's, when wanted): a callback made in this rule inside a
    # differentiated scan is dropped. A cotangent has its primal's dtype, which names the
    # activation's too.
    return x, probe.summarize(x) if probe.forward else None


def _callback_bwd(probe: Probe, res: Any, g: jax.Array) -> tuple[jax.Array]:
    reports = [("Gradient", g.dtype, probe.summarize(g))] if probe.backward else []
    if res is not None:
        reports.insert(0, ("Activation", g.dtype, res))
    if reports:
        probe.send(reports)
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
            state.paths = {id(node): path for path, node in nnx.iter_graph(self)
                           if isinstance(node, nnx.Module)}
        state.depth = depth + 1
        try:
            out = original(self, *args, **kwargs)
        finally:
            state.depth = depth
        path = state.paths.get(id(self))
        if path is None:  # a module created during the call; not part of the tree
            return out
        return on_output(".".join(str(p) for p in path) or ROOT_NAME, type(self), out)

    return __call__


def _patch_nnx_classes() -> None:
    """Wrap ``__call__`` of every nnx module class not wrapped yet (idempotent and cheap when
    nothing is new: setting class attributes is what costs, so it is done once per class)."""
    for cls in _nnx_call_owners():
        if cls not in _nnx_originals:
            original = cls.__dict__["__call__"]
            _nnx_originals[cls] = original
            cls.__call__ = _wrap_nnx_call(original)


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
            cls.__call__ = original
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
