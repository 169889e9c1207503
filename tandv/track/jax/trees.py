"""Naming the leaves of parameter, gradient and optimizer-state pytrees.

Parameters are named by their dotted pytree path under the ``params`` collection
(``Dense_0.kernel``, ``layers.0.attn.query.kernel``); Flax nnx ``Variable`` wrappers add a
trailing ``.value`` to the path, which is dropped. Optimizer-state leaves are named
``<parameter name>.<field>`` where ``field`` is the name of the optax state field that holds
a parameter-shaped tree (``mu``, ``nu``, ``trace``, ...); see :func:`optimizer_state_leaves`.

A public module of the JAX adapter: :mod:`tandv.snapshot.jax` names leaves with it, so that
snapshots and logs use the same names.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

__all__ = [
    "Leaf",
    "key_name",
    "param_leaves",
    "optimizer_state_leaves",
    "collection_leaves",
    "is_float_array",
]

#: The Flax linen collection whose leaves are the trainable parameters.
PARAMS_COLLECTION = "params"


@dataclass(frozen=True)
class Leaf:
    """A named, tracked leaf of a pytree: its index in ``tree_leaves`` order, its name, and
    the name of the parameter it belongs to or mirrors."""

    index: int
    name: str
    param: str


def key_name(key: Any) -> str:
    """The text of one pytree path entry (a dict key, attribute name or sequence index)."""
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def is_float_array(x: Any) -> bool:
    """Whether ``x`` is an array with a floating-point dtype (the leaves tandv summarizes)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _strip(path: Sequence[Any]) -> tuple[Any, ...]:
    path = tuple(path)
    if path and isinstance(path[-1], GetAttrKey) and path[-1].name == "value":
        path = path[:-1]  # nnx Variable wrapper
    return path


def _params_root(path: Sequence[Any]) -> int:
    """How many leading entries of ``path`` to drop: the linen ``params`` collection key."""
    return 1 if path and isinstance(path[0], DictKey) and path[0].key == PARAMS_COLLECTION else 0


def param_leaves(tree: Any) -> tuple[list[tuple[tuple[Any, ...], Leaf]], Any]:
    """The float leaves of a parameter (or gradient) pytree with their names.

    A linen variables dict ``{"params": ..., "batch_stats": ...}`` contributes only its
    ``params`` collection (names are relative to it).

    Returns:
        ``([(full_path, Leaf), ...], treedef)`` in ``jax.tree_util`` leaf order.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    has_collection = any(_params_root(p) for p, _ in flat)
    out = []
    for i, (path, leaf) in enumerate(flat):
        if has_collection and not _params_root(path):
            continue  # another linen collection (batch_stats, cache, ...)
        if not is_float_array(leaf):
            continue
        p = _strip(path)
        name = ".".join(key_name(k) for k in p[_params_root(p) :])
        out.append((tuple(path), Leaf(i, name, name)))
    return out, treedef


def _field(prefix: Sequence[Any]) -> str:
    for k in reversed(prefix):
        if (
            isinstance(k, GetAttrKey)
            and k.name != "value"
            or isinstance(k, DictKey)
            and isinstance(k.key, str)
        ):
            return key_name(k)
    return "state"


def optimizer_state_leaves(opt_state: Any, params: Any) -> list[Leaf]:
    """Name the leaves of an optax state that mirror a parameter.

    A leaf mirrors a parameter when its path *ends with* the parameter's full path (optax
    states hold copies of the parameter tree: ``mu``, ``nu``, ``trace``; masked transforms
    hold it with masked-out leaves removed; factored states such as adafactor's ``v_row`` /
    ``v_col`` hold per-parameter leaves of other shapes, which are tracked too). Its name is
    ``<parameter name>.<field>``, ``field`` being the last named entry of the path before the
    parameter tree (``mu`` in ``(0, mu, params, Dense_0, kernel)``). Only where one parameter
    has the same field at several places of the state (``chain(trace(...), trace(...))``)
    are they told apart, as ``<field>_0``, ``<field>_1``, ... in pytree order; the branches
    of ``multi_transform`` (and ``optax.contrib.muon``, built on it) hold each parameter
    once, so their names carry no branch. Leaves that mirror no parameter (step counts,
    injected hyperparameters) are left out.
    """
    by_path: dict[tuple[Any, ...], str] = {}
    p_flat, _ = jax.tree_util.tree_flatten_with_path(params)
    named = dict(param_leaves(params)[0])
    for path, _leaf in p_flat:
        if tuple(path) in named:
            by_path[_strip(path)] = named[tuple(path)].name
    flat, _ = jax.tree_util.tree_flatten_with_path(opt_state)
    found: list[tuple[int, str, tuple[Any, ...]]] = []
    for i, (path, leaf) in enumerate(flat):
        if not is_float_array(leaf):
            continue
        p = _strip(path)
        for start in range(len(p)):
            hit = by_path.get(p[start:])
            if hit is not None:
                found.append((i, hit, p[:start]))
                break
    prefixes: dict[tuple[str, str], list[tuple[Any, ...]]] = defaultdict(list)
    for _, pname, prefix in found:
        places = prefixes[pname, _field(prefix)]
        if prefix not in places:
            places.append(prefix)
    out = []
    for i, pname, prefix in found:
        field = _field(prefix)
        places = prefixes[pname, field]
        if len(places) > 1:
            field = f"{field}_{places.index(prefix)}"
        out.append(Leaf(i, f"{pname}.{field}", pname))
    return out


def collection_leaves(variables: Any) -> list[Leaf]:
    """The float leaves of a linen variables dict outside its ``params`` collection (model
    state such as ``batch_stats``), named ``<collection>.<path>``; ``param`` is the path
    without the collection (the module that owns it names its ``type``)."""
    if not isinstance(variables, Mapping) or PARAMS_COLLECTION not in variables:
        return []
    out = []
    for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(variables)[0]):
        if _params_root(path) or not is_float_array(leaf):
            continue
        p = _strip(path)
        rest = ".".join(key_name(k) for k in p[1:])
        out.append(Leaf(i, ".".join(key_name(k) for k in p), rest))
    return out
