"""The taps: identities on module outputs that report the output and its cotangent.

:func:`tap` wraps each module output in a ``jax.custom_vjp`` identity whose backward rule
summarizes the incoming cotangent; the output itself is summarized beside it. Both are
summarized on device; only the small summaries leave the computation, through the tap's
:class:`._delivery.Probe`. Which variant serves depends on the transforms around the tap
(:func:`._scope.current_scope`):

- plain code, and inside ``jax.checkpoint``: the activation reported directly, the
  cotangent from a backward rule (:func:`_cotangent_tap`, :func:`_cotangent_tap_ref`);
- a loop body (``lax.scan``/``fori_loop``, ``nn.scan``, and the rematerialized bodies JAX
  stages out again for partial evaluation, ``nn.scan(nn.remat(...))``): both from the
  rules of :func:`_loop_tap`, the arena passed through the ``custom_vjp`` as an argument
  (a ref closed over by a differentiated loop body cannot be written by its backward rule;
  one passed in can), each iteration merging into its mailbox;
- ``shard_map``/``pmap`` and vmapped loop bodies: both by host callback from the rules of
  :func:`_callback_tap`;
- a ``lax.cond``/``lax.switch`` branch: the activation as in plain code, the cotangent by
  host callback (:func:`_cotangent_tap_callback`; loops and ``jax.checkpoint`` inside a
  branch: :func:`_callback_tap`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from ._delivery import Probe
from ._scope import current_scope, is_batched
from ._sink import Report, sink_of

__all__ = ["tap"]


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

    Inside a loop body both merge into one mailbox from the rules of :func:`_loop_tap`; a
    vmapped loop body, ``shard_map``/``pmap`` and a tracker without an arena report both by
    host callbacks from the rules of :func:`_callback_tap`. Under ``jax.vmap`` elsewhere,
    summaries are of the whole batched array (see :meth:`Probe.summary`)."""
    scope = current_scope()
    if scope.manual:
        return _callback_tap(dataclasses.replace(probe, manual=True), x)
    if (scope.loop or scope.restaged) and (scope.batched or is_batched(x)):
        return _callback_tap(probe, x)  # a vmapped loop body: by host callback
    if scope.branch and (scope.loop or scope.remat):
        return _callback_tap(probe, x)  # a ref rides as a residual there: a cond refuses it
    sink = sink_of(probe.token)
    arena = None if sink is None else sink.arena
    if scope.loop or scope.restaged:
        if arena is None:
            return _callback_tap(probe, x)
        return _loop_tap(probe, arena, x)
    if probe.forward:
        probe.report("Activation", jax.lax.stop_gradient(x), remat=scope.remat)
    if not probe.backward:
        return x
    if scope.branch:
        return _cotangent_tap_callback(probe, x)
    if arena is not None and scope.remat:
        return _cotangent_tap_ref(probe, arena, x)
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
def _cotangent_tap_callback(probe: Probe, x: jax.Array) -> jax.Array:
    """:func:`_cotangent_tap` for a ``lax.cond``/``lax.switch`` branch: the cotangent is
    reported by host callback. JAX transposes a branch into a jaxpr that keeps what its
    backward rules close over as constants, and cannot lower a ref among them (``No
    constant handler``); passed in instead, the ref would be a residual, which the
    branches' joined residuals cannot hold either. A callback of the branch not taken
    does not run: the rows are those of the branch taken."""
    return x


def _cotangent_callback_bwd(probe: Probe, res: None, g: jax.Array) -> tuple[jax.Array]:
    dtype, summary, keep = probe.summary(g, whole_batch=False)
    probe.send([("Gradient", dtype, summary)], keep)
    return (g,)


_cotangent_tap_callback.defvjp(_cotangent_fwd, _cotangent_callback_bwd)


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
    reports: list[Report] = [] if activation is None else [("Activation", g.dtype, activation)]
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
