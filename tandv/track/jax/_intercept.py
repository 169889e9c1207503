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

__all__ = ["TRACKING", "interception", "Mailboxes"]

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
