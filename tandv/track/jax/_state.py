"""What the user hands the JAX tracker as ``model_state`` and ``gradients``, taken apart.

``model_state`` may be a parameter pytree, an nnx module, a Flax ``TrainState`` (with its
optimizer state and ``batch_stats``) or ``optax.lookahead``'s parameters; :func:`parts_of`
splits each form into what the tracker names and summarizes (:class:`Parts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "Parts",
    "parts_of",
    "gradients_of",
    "is_nnx_module",
    "is_nnx_optimizer",
]


def is_nnx_module(x: Any) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Module)


def is_nnx_optimizer(x: Any) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Optimizer)


class Parts(NamedTuple):
    """What a ``model_state`` holds, by kind: the parameters the forward pass uses, the
    optimizer state it carries (a ``TrainState``'s ``opt_state``), the model state a
    ``TrainState`` keeps beside the parameters (``batch_stats``, as a variables dict
    ``{"params": ..., "batch_stats": ...}``) and ``optax.lookahead``'s slow parameters."""

    params: Any
    opt_state: Any = None
    collections: Any = None
    slow: Any = None


def is_lookahead(x: Any) -> bool:
    import optax

    return isinstance(x, optax.LookaheadParams)


def is_train_state(x: Any) -> bool:
    """A ``flax.training.train_state.TrainState`` or any struct like it (attributes
    ``params`` and ``opt_state``)."""
    return not isinstance(x, Mapping) and hasattr(x, "params") and hasattr(x, "opt_state")


def parts_of(model_state: Any) -> Parts:
    """Split ``model_state`` into :class:`Parts` (see ``track``'s docstring for the forms)."""
    if is_nnx_module(model_state):
        from flax import nnx

        return Parts(nnx.state(model_state, nnx.Param))
    if is_train_state(model_state):
        inner = parts_of(model_state.params)
        stats = getattr(model_state, "batch_stats", None)
        collections = None if stats is None else {"params": inner.params, "batch_stats": stats}
        return Parts(inner.params, model_state.opt_state, collections, inner.slow)
    if is_lookahead(model_state):
        return Parts(model_state.fast, slow=model_state.slow)
    return Parts(model_state)


def gradients_of(gradients: Any) -> Any:
    """The parameter gradients in ``gradients`` (an nnx ``State``, a pytree, or lookahead
    parameters, whose ``fast`` part holds them)."""
    return gradients.fast if is_lookahead(gradients) else gradients


#: The mesh axis JAX names a ``jax.pmap`` without ``axis_name`` (``_misuse`` recognizes
#: pmap's outputs by it).
PMAP_AXIS = "_internal_pmap_axis_name"
