"""Capturing module outputs and their cotangents inside traced JAX code.

Each module output is passed through :func:`tap`, a ``jax.custom_vjp`` identity. Its forward
rule summarizes the output, its backward rule the incoming cotangent, both on device, and
each hands only the small summary to the host with an unordered ``io_callback``.

Why a callback rather than returning summaries as extra outputs: the cotangents exist only
inside ``jax.grad``'s backward pass of the user's own loss, and a ``custom_vjp`` backward rule
can return nothing but cotangents, so there is no traced value to return them through without
changing the user's code (and values traced inside a user's inner ``jax.jit`` cannot escape it
either). A host callback works under ``jit``, nested ``jit``, ``vmap`` and sharding, is
never dead-code eliminated (it is an effect), and sends only the summary. It is an unordered
``io_callback`` rather than ``jax.debug.callback``: on XLA:CPU each debug callback slowed a
jitted update by milliseconds, the ``io_callback`` by nothing measurable; it runs inside the
``custom_vjp`` rules, which JAX never differentiates, so its lack of a JVP rule does not matter
(except under second-order reverse differentiation of the model).

Why no retracing: tracking is switched on with a ``jax.make_user_context`` value, which is part
of every ``jax.jit`` cache key. A jitted update is therefore traced once with taps (the context
set: tracked steps) and once without (unscheduled steps, or any call outside the tracker), and
each compiled version is reused from then on. Callbacks find their tracker through a registry
keyed by the context value.

Modules are found through Flax's own method interception for linen
(``nn.intercept_methods``) and, for nnx (which has none), by wrapping ``__call__`` of the nnx
module classes while a tracker is open; the wrapper does nothing outside an intercepted step.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax
from jax.experimental import io_callback

from ._summary import DeviceSummary

__all__ = ["TRACKING", "Probe", "tap", "register", "interception", "ROOT_NAME", "acquire_nnx", "release_nnx"]

#: The jit-cache-sensitive switch: its value is the active tracker's token, or None.
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

    def emit(self, reports: list[tuple[str, Any, DeviceSummary]]) -> None:
        """Send ``(tensor_type, dtype, summary)`` reports to the host in one callback."""
        dtypes = [(tensor_type, str(dtype)) for tensor_type, dtype, _ in reports]
        io_callback(functools.partial(_deliver, self.token, self.name, self.module_type, dtypes),
                    None, [summary for _, _, summary in reports], ordered=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def tap(probe: Probe, x: jax.Array) -> jax.Array:
    """Identity on ``x`` that reports ``x`` (forward) and its cotangent (backward) to ``probe``."""
    if probe.forward:
        probe.emit([("Activation", x.dtype, probe.summarize(x))])
    return x


def _tap_fwd(probe: Probe, x: jax.Array) -> tuple[jax.Array, Any]:
    if not probe.forward:
        return x, None
    if not probe.backward:
        probe.emit([("Activation", x.dtype, probe.summarize(x))])
        return x, None
    # Both wanted: the activation's summary rides to the backward rule as a residual and
    # leaves with the cotangent's, one callback per module instead of two (each host
    # callback costs a fraction of a millisecond on XLA:CPU). A cotangent has its primal's
    # dtype, so the cotangent's dtype names the activation's too.
    return x, probe.summarize(x)


def _tap_bwd(probe: Probe, res: Any, g: jax.Array) -> tuple[jax.Array]:
    if probe.backward:
        reports = [("Gradient", g.dtype, probe.summarize(g))]
        if res is not None:
            reports.insert(0, ("Activation", g.dtype, res))
        probe.emit(reports)
    return (g,)


tap.defvjp(_tap_fwd, _tap_bwd)


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
def interception(token: int, on_output: Callable[[str, type, Any], Any]) -> Iterator[None]:
    """While active: jit caches see the tracking context ``token``, and every linen and nnx
    module ``__call__`` output goes through ``on_output(name, module_class, output)``."""
    import flax.linen as nn

    def interceptor(next_fun: Callable, args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        module = context.module
        return on_output(".".join(str(p) for p in module.path) or ROOT_NAME, type(module), out)

    with TRACKING(token), nn.intercept_methods(interceptor), _nnx_scope(on_output):
        yield
