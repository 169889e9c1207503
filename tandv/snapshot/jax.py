"""Snapshots of JAX pytrees: Flax params, gradients, optax state and captured intermediates.

Names are those of the JAX tracker (:mod:`tandv.track.jax.trees`): parameters by their dotted
path under the ``params`` collection (``Dense_0.kernel``; nnx ``.value`` wrappers dropped),
optimizer state keyed by the parameter it mirrors (so ``mu`` and ``nu`` combine with weights),
activations by module path (``root`` for the outermost module).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from tandv.track.jax.trees import is_float_array, key_name, optimizer_state_leaves, param_leaves

from ._core import Snapshot
from ._ops import jax_ops

__all__ = ["from_weight", "from_grad", "from_optimizer_state", "from_activation", "JAX_OPS"]


#: The operations a :class:`~tandv.snapshot.Snapshot` of JAX arrays uses (arrays are
#: immutable, so a clone is the array itself).
JAX_OPS = jax_ops()


def _named(tree: Any, fn: str) -> dict[str, Any]:
    leaves = jax.tree_util.tree_leaves(tree)
    named, _ = param_leaves(tree)
    if not named:
        raise ValueError(
            f"{fn}: the pytree has no floating-point leaves (got "
            f"{type(tree).__name__}); pass the params / grads pytree"
        )
    return {leaf.name: leaves[leaf.index] for _, leaf in named}


def from_weight(params: Any) -> Snapshot:
    """The float leaves of a parameter pytree by path (a linen variables dict contributes its
    ``params`` collection; an nnx ``State`` works too)."""
    return Snapshot(_named(params, "from_weight(params)"), "weights")


def from_grad(grads: Any) -> Snapshot:
    """The float leaves of a gradient pytree (same structure as the params), by parameter
    path."""
    return Snapshot(_named(grads, "from_grad(grads)"), "grads")


def from_optimizer_state(opt_state: Any, key: str, params: Any) -> Snapshot:
    """The optax state leaves of field ``key`` (``mu``, ``nu``, ``trace``, ...), keyed by the
    parameter each mirrors.

    Arguments:
        opt_state: the optax state (any nesting of chains and wrappers).
        key: the field, as the JAX tracker names it: the last named entry of the state path
            before the parameter tree; a field found at several places of a chain is
            ``<field>_0``, ``<field>_1``, ...
        params: the parameter pytree, which names the leaves.
    Raises:
        KeyError: no leaf has that field (the message lists those there are).
    """
    leaves = jax.tree_util.tree_leaves(opt_state)
    found = optimizer_state_leaves(opt_state, params)
    out = {leaf.param: leaves[leaf.index] for leaf in found if leaf.name == f"{leaf.param}.{key}"}
    if not out:
        fields = sorted({leaf.name[len(leaf.param) + 1 :] for leaf in found})
        raise KeyError(
            f"from_optimizer_state(key={key!r}): no state leaf of that field; this "
            f"state holds {fields or 'no parameter-shaped leaves'}"
        )
    return Snapshot(out, f"opt_state_{key}")


def from_activation(intermediates: Mapping[str, Any]) -> Snapshot:
    """Module outputs captured by Flax linen's ``capture_intermediates``, by module path.

    ``y, state = model.apply(variables, x, capture_intermediates=True,
    mutable=["intermediates"])``, then ``from_activation(state["intermediates"])``. A module
    called several times keeps its last output; elements of structured outputs are named
    ``<path>[i]`` / ``<path>[key]`` as in a log.
    """
    if isinstance(intermediates, Mapping) and "intermediates" in intermediates:
        intermediates = intermediates["intermediates"]
    if not isinstance(intermediates, Mapping):
        raise TypeError(
            f"from_activation(intermediates=...): expected the 'intermediates' "
            f"collection (a mapping), got {type(intermediates).__name__}"
        )
    out: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], path: tuple[str, ...]) -> None:
        for k, v in node.items():
            if k == "__call__":
                name = ".".join(path) or "root"
                calls = tuple(v)
                if calls:
                    _flat(calls[-1], name, out)
            elif isinstance(v, Mapping):
                walk(v, (*path, str(k)))

    walk(intermediates, ())
    if not out:
        raise ValueError(
            "from_activation: the collection holds no '__call__' outputs; apply "
            "the model with capture_intermediates=True, mutable=['intermediates']"
        )
    return Snapshot(out, "activations")


def _flat(value: Any, name: str, out: dict[str, Any]) -> None:
    if is_float_array(value):
        out[name] = value
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        if is_float_array(leaf):
            out[name + "".join(f"[{key_name(k)}]" for k in path)] = leaf
