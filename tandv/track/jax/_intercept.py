"""Intercepting one call of the user's update: module outputs in, host callbacks out.

While :func:`interception` is active, every Flax module output (linen through Flax's own
``nn.intercept_methods``; nnx through the wrapped ``__call__`` of ``_nnx``) goes to the
tracker, which wraps it in taps (``_taps``); what the taps report comes back to the tracker
through its sink (``_sink``): by mailbox (``_mailbox``) or, where refs cannot serve, by a
host callback that lands in :func:`_deliver`. The rooms of this design:

- ``_intercept``: the jit-context switch (:data:`TRACKING`), :func:`interception`, and
  :func:`_deliver`, where every tap callback lands;
- ``_sink``: the :class:`~._sink.TapSink` protocol the tracker implements, and the registry
  from a tap's token to its sink;
- ``_scope``: which transforms enclose a tap (loops, ``jax.checkpoint``, ``shard_map``,
  ``jax.vmap``), read from JAX's trace state;
- ``_taps``: the ``custom_vjp`` taps; ``_delivery``: how a tap's summaries leave;
- ``_mailbox``: the arena of mailboxes; ``_nnx``: the nnx ``__call__`` wrapping.

Why no retracing: tracking is switched on with a ``jax.make_user_context`` value, which is
part of every ``jax.jit`` cache key. A jitted update is therefore traced once with taps (the
context set: tracked steps) and once without (unscheduled steps, or any call outside the
tracker), and each compiled version is reused from then on, with its mailboxes (a new arena
comes with a new context value: one more trace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ._mailbox import Mailboxes  # where it lived before the split (tests import it here)
from ._nnx import nnx_scope
from ._sink import ROOT_NAME, sink_of
from ._summary import DeviceSummary

__all__ = ["TRACKING", "interception", "Mailboxes", "TrackedProgram", "jitted_core"]

#: The jit-cache-sensitive switch: while a tracker intercepts, a tuple that starts with its
#: token; else None.
TRACKING = jax.make_user_context(None)


def _deliver(
    token: int,
    name: str,
    module_type: str,
    dtypes: list[tuple[str, str]],
    summaries: list[DeviceSummary],
) -> None:
    """Where a tap's concrete summaries land (a host callback's, or an eager update's):
    each ``(tensor_type, dtype)`` of ``dtypes`` with its summary goes to the sink of
    ``token``; nothing when that tracker is gone."""
    sink = sink_of(token)
    if sink is not None:
        for (tensor_type, dtype), summary in zip(dtypes, summaries):
            sink.receive(name, module_type, tensor_type, dtype, summary)


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

    with TRACKING(key), nn.intercept_methods(interceptor), nnx_scope(on_output):
        yield


#: The type of ``jax.jit``'s functions (jaxlib's ``PjitFunction``).
JIT_FUNCTION = type(jax.jit(lambda: None))
#: The type of a sharding left to XLA in a jit's options.
_UNSPECIFIED = type(jax.jit(lambda: None)._jit_info.out_shardings_leaves[0])  # type: ignore[attr-defined]


def jitted_core(f: Any) -> Any:
    """The ``jax.jit`` function that ``f`` is (or, for an ``nnx.jit`` function, the one it
    calls between its Python graph splitting and merging), when the tracker can compile a
    tracked version of it (:class:`TrackedProgram`); else None (the update is plain Python,
    possibly around several jitted functions, or uses jit options the tracked version does
    not carry over: ``device``, ``backend``, layouts, compiler options)."""
    inner = f
    if not isinstance(f, JIT_FUNCTION):
        if not type(f).__module__.startswith("flax.nnx"):
            return None
        inner = getattr(f, "jitted_fn", None)
        if not isinstance(inner, JIT_FUNCTION):
            return None
    info = getattr(inner, "_jit_info", None)
    if (
        info is None
        or info.device is not None
        or info.backend is not None
        or info.compiler_options_kvs
        or any(x is not None for x in (*info.in_layouts_leaves, *info.out_layouts_leaves))
    ):
        return None
    return inner


class TrackedProgram:
    """The tracked version of one jitted update: a ``jax.jit`` function of its own that, when
    traced, makes the mailbox arena inside the program (``_mailbox.ProgramMailboxes``),
    traces the user's jitted function with taps writing into it, and returns the user's
    outputs and the written words: ``(outputs, words)``. No ref crosses the program's
    boundary, so its calls stay on JAX's C++ dispatch path (a closed-over ref sends every
    call through Python: about 4,000 Python calls per call of a small MLP's update).

    It is compiled with the user's jit options (``static_argnums``/``static_argnames``,
    ``donate_argnums``/``donate_argnames``, ``in_shardings``, ``out_shardings``,
    ``keep_unused``) and calls the user's own function (:attr:`fun`) in place of the
    user's jitted one (a jitted function with shardings cannot take a ref: JAX does not
    discharge one into it). ``trace(program, args, kwargs)`` is the traced body (the
    tracker's: it makes the arena, intercepts, and calls :attr:`fun`; it returns
    ``(outputs, words, summaries)``, the last the summaries of the float outputs that the
    tracker computes in the same program where it can, else None)."""

    #: int32 words of a new program's arena (a float32 report takes ~300)
    CAPACITY = 1 << 16

    def __init__(
        self,
        inner: Any,
        nnx: Any,
        trace: Callable[[TrackedProgram, tuple, dict], tuple[Any, Any, Any]],
    ) -> None:
        info = inner._jit_info
        #: the user's jitted function (for nnx.jit, the inner one)
        self.inner = inner
        #: the function it compiles
        self.fun = inner._fun
        #: the nnx.jit object whose ``jitted_fn`` this replaces during a call (else None)
        self.nnx = nnx
        #: words of the arena its traces make
        self.capacity = self.CAPACITY
        #: set when a trace outgrew its arena (then the tracker builds a larger one)
        self.stale = False
        #: whether some tap of its last trace reports by host callback (shard_map bodies)
        self.callbacks = False
        #: the module names its last trace output, and those of them differentiated
        #: (``_misuse.Applications``): what a call of it adds to the step's applications
        self.applied: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())

        def tracked(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
            return trace(self, args, kwargs)

        tracked.__name__ = tracked.__qualname__ = (
            "tandv_" + getattr(info, "fun_sourceinfo", "update").split(" ")[0]
        )
        options: dict[str, Any] = dict(
            static_argnums=info.static_argnums,
            static_argnames=info.static_argnames,
            donate_argnums=info.donate_argnums,
            donate_argnames=info.donate_argnames,
            keep_unused=info.keep_unused,
        )
        if info.user_specified_in_shardings:
            options["in_shardings"] = jax.tree_util.tree_unflatten(
                info.in_shardings_treedef, info.in_shardings_leaves
            )
        out_shardings = jax.tree_util.tree_unflatten(
            info.out_shardings_treedef, info.out_shardings_leaves
        )
        if not all(isinstance(s, _UNSPECIFIED) for s in info.out_shardings_leaves):
            # the words and the outputs' summaries: where XLA puts them
            options["out_shardings"] = (out_shardings, None, None)
        #: the compiled tracked program: ``call(*args, **kwargs) -> (outputs, words,
        #: summaries)``
        self.call = jax.jit(tracked, **options)
