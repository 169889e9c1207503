"""What JAX's trace state says about the code being traced: the one place that reads it.

A tap must know which transforms enclose it, because each changes how its summary can
leave the program (see ``_taps``): a loop body runs many times per step, ``jax.checkpoint``
runs its forward pass again in the backward pass, ``shard_map`` has no refs and one shard per
device, ``jax.vmap`` batches every value. JAX offers no public API for this question, so
:func:`current_scope` reads JAX's trace chain. Everything here uses JAX internals
(``jax._src``); ``tests/test_jax_scope.py`` runs each function inside the real transforms
and fails, naming the function to update, when a JAX release moves what they read.

Verified with jax 0.10.2 (:data:`VERIFIED_JAX`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import config as _config
from jax._src import core as _core
from jax._src import distributed as _distributed
from jax._src import pmap as _pmap
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe

__all__ = [
    "VERIFIED_JAX",
    "Scope",
    "current_scope",
    "is_batched",
    "differentiated",
    "unbatched",
    "manual_keep",
]

#: The JAX release whose internals this module was last checked against.
VERIFIED_JAX = "0.10.2"


def _internal(module: ModuleType, name: str) -> Any:
    """``module.name``, or an ImportError saying which function of this module to update."""
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(
            f"tandv: jax {jax.__version__} has no {module.__name__}.{name}, which "
            f"tandv/track/jax/_scope.py reads (verified with jax {VERIFIED_JAX}); update "
            f"current_scope/unbatched/manual_keep there for this JAX"
        ) from None


_trace_ctx = _internal(_core, "trace_ctx")  # .trace: the current trace
_set_current_trace = _internal(_core, "set_current_trace")
_get_axis_env = _internal(_core, "get_axis_env")
_JaxprTrace = _internal(_pe, "JaxprTrace")
_BatchTrace = _internal(_batching, "BatchTrace")
_BatchTracer = _internal(_batching, "BatchTracer")
_check_vma = _internal(_config, "_check_vma")
#: The traces of forward-mode differentiation and of linearization (``jax.grad``,
#: ``jax.vjp``, ``jax.jvp`` build on them), and their tracers.
_DIFF_TRACES = (_internal(_ad, "JVPTrace"), _internal(_ad, "LinearizeTrace"))
_DIFF_TRACERS = (_internal(_ad, "JVPTracer"), _internal(_ad, "LinearizeTracer"))


@dataclass(frozen=True)
class Scope:
    """The transforms enclosing the code being traced (all False outside any trace).

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
        pmap: the innermost ``shard_map`` is the one ``jax.pmap`` builds (which checks no
            varying axes: see :func:`manual_keep`).
        branch: inside a branch of ``lax.cond``/``lax.switch`` (``nn.cond``, ``nn.switch``,
            ``nnx.cond``): JAX's transpose of a branch keeps a ref its backward rules close
            over as a constant, which it cannot lower.
    """

    loop: bool = False
    remat: bool = False
    manual: bool = False
    restaged: bool = False
    batched: bool = False
    pmap: bool = False
    branch: bool = False


# What JAX names the function a trace is made for (``DebugInfo.traced_for``: the first
# argument of ``api_util.debug_info`` where each transform traces its body, jax 0.10.2).
#: Loop bodies: ``lax.scan``'s "scan"; ``while_loop``'s "while_body" and "while_cond";
#: ``fori_loop``'s "fori_loop" (with static bounds it runs a scan, else a while_loop; the
#: body is named after fori_loop either way).
LOOP_TRACES = frozenset({"scan", "while_body", "while_cond", "fori_loop"})
#: ``lax.cond``'s and ``lax.switch``'s branches (``jax/_src/lax/control_flow/conditionals.py``).
BRANCH_TRACES = frozenset({"cond", "switch"})
#: ``jax.checkpoint`` (``jax/_src/ad_checkpoint.py``, ``fun_remat``).
REMAT_TRACE = "checkpoint / remat"
#: ``jax.shard_map``, and ``jax.pmap`` built on it.
MANUAL_TRACE = "shard_map"
#: The source file of the function ``jax.pmap`` traces as its ``shard_map`` body (its
#: ``DebugInfo.func_src_info`` names it: ``_fun at .../jax/_src/pmap.py:410``).
PMAP_SOURCE: str = _internal(_pmap, "__file__")


def current_scope() -> Scope:
    """The :class:`Scope` of the code being traced now: the one place that recognizes loop
    bodies, ``jax.checkpoint``, ``shard_map`` and ``jax.vmap`` around a tap.

    What it looks for: JAX keeps the current trace in ``jax._src.core.trace_ctx.trace``;
    each trace links to the one it was made under (``parent_trace``). A trace that stages a
    function out into a jaxpr (``DynamicJaxprTrace``) carries a frame whose ``debug_info``
    says what the function is traced for (:data:`LOOP_TRACES`, :data:`REMAT_TRACE`,
    :data:`MANUAL_TRACE`); a ``JaxprTrace`` is partial evaluation (a differentiated body
    staged out again: ``restaged`` with ``remat``); a ``BatchTrace`` is ``jax.vmap``.

    Why this way: these are the facts JAX itself records about each trace, so they hold
    however the transform was reached (Flax's ``nn.scan``, ``nnx.remat``, a user's own
    ``lax.scan``); it replaced matching JAX's source file names on the Python stack, which
    broke whenever JAX moved a function between files. What can still break it is JAX
    renaming a ``traced_for`` label or a trace class; ``tests/test_jax_scope.py`` checks
    each answer inside the real transforms."""
    loop = remat = manual = partial = batched = pmap = branch = False
    trace = _trace_ctx.trace
    while trace is not None:
        info = getattr(getattr(trace, "frame", None), "debug_info", None)
        kind = getattr(info, "traced_for", None)
        loop |= kind in LOOP_TRACES
        branch |= kind in BRANCH_TRACES
        remat |= kind == REMAT_TRACE
        if kind == MANUAL_TRACE and not manual:  # the innermost shard_map: pmap's?
            pmap = PMAP_SOURCE in str(getattr(info, "func_src_info", ""))
        manual |= kind == MANUAL_TRACE
        partial |= isinstance(trace, _JaxprTrace)
        batched |= isinstance(trace, _BatchTrace)
        trace = getattr(trace, "parent_trace", None)
    return Scope(loop, remat, manual, remat and partial, batched, pmap, branch)


def is_batched(x: Any) -> bool:
    """Whether ``x`` is a value batched by ``jax.vmap`` (seen from inside the vmap)."""
    return isinstance(x, _BatchTracer)


@contextlib.contextmanager
def unbatched(x: Any) -> Iterator[Any]:
    """For a value batched by ``jax.vmap`` (possibly nested): yields the whole batched array
    (mapped axes included) with the trace below every vmap made current, so that operations
    in the block see one unbatched array; for any other value, yields ``x`` unchanged."""
    if not isinstance(x, _BatchTracer):
        yield x
        return
    while isinstance(x, _BatchTracer):
        trace = x._trace.parent_trace
        x = x.val
    with _set_current_trace(trace):
        yield x


def manual_keep(x: Any) -> Any:
    """Inside ``shard_map``: whether this device's report of ``x`` counts (traced bool).

    Each device reports the summary of its own shard; the recorder merges the reports into
    the summary of the whole array. Over a mesh axis along which ``x`` is the same on every
    device (JAX's varying-axes types say so when the ``shard_map`` checks them), only the
    device at index 0 counts, so a replicated value is not counted once per device.

    Without varying-axes types (``shard_map(..., check_vma=False)``) a replicated value
    cannot be told from a split one and would count once per device: refused (ValueError
    naming ``check_vma``). ``jax.pmap`` checks no varying axes either; there every device
    counts (pmap maps its inputs over the devices: only a value computed from unmapped,
    ``in_axes=None``, inputs alone would count once per device)."""
    axes = _get_axis_env().axis_names()
    varying = getattr(getattr(jax.typeof(x), "mat", None), "varying", None)
    if varying is None or not _check_vma.value:
        if not current_scope().pmap:
            raise ValueError(
                "tandv: a tracked module runs inside jax.shard_map(..., check_vma=False): "
                "without JAX's varying-axes types tandv cannot tell a value that is the same "
                "on every device from one split over them, and a value the same everywhere "
                "would count once per device; use check_vma=True (JAX's default), or track "
                "with track_activations=False, track_gradients=False"
            )
        return jnp.ones((), jnp.bool_)  # pmap: every device's value is its own data
    keep = jnp.ones((), jnp.bool_)
    for axis in axes:
        if axis not in varying:
            keep &= jax.lax.axis_index(axis) == 0
    return keep


def differentiated(x: Any) -> bool | None:
    """Whether ``x`` is differentiated by the differentiation being traced now: True for a
    value that depends on what ``jax.grad``/``jax.vjp``/``jax.jvp`` differentiates, False
    for one that does not (computed from other arrays alone), None where this cannot be
    told here: outside differentiation, and inside bodies traced on their own (``jit``,
    ``jax.checkpoint``, loop bodies, ``vmap``), whose values JAX differentiates later."""
    if not isinstance(_trace_ctx.trace, _DIFF_TRACES):
        return None
    return isinstance(x, _DIFF_TRACERS)


def distributed_client() -> Any:
    """This process's client of the ``jax.distributed`` coordination service (None where
    ``jax.distributed.initialize`` was not called): its key-value store carries the
    cross-rank merge, and JAX has no public way to it."""
    return _distributed.global_state.client
