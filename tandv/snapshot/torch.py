"""Snapshots of a PyTorch model: weights, gradients, optimizer state and activations.

Names are those of a tandv log: parameters by their path in ``model.named_parameters()``
(``layers.0.fc1.weight``), activations by module path (the root module is ``root``; elements
of structured outputs ``<path>[i]`` / ``<path>[key]``). Optimizer state is keyed by the
*parameter's* path (not ``<path>.<key>`` as in a log) so that it combines with weights and
gradients: ``W - lr * m / (sqrt(v) + eps)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tandv.track.torch.naming import flatten_outputs

from ._core import Snapshot
from ._ops import torch_ops

__all__ = [
    "from_weight",
    "from_grad",
    "from_optimizer_state",
    "from_activation",
    "from_state_dict",
    "from_together",
    "TORCH_OPS",
]

#: The operations a :class:`~tandv.snapshot.Snapshot` of torch tensors uses.
TORCH_OPS = torch_ops()


def _check_model(model: Any, fn: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}(model=...): expected a torch.nn.Module, got {type(model).__name__}")
    return model


def from_weight(model: nn.Module, clone: bool = False) -> Snapshot:
    """The model's parameters by path.

    Arguments:
        model: the module.
        clone: copy the tensors. Without a copy the snapshot *shares* storage with the model
            and follows it through optimizer steps; ``W0 = from_weight(model, clone=True)``
            before a step and ``from_weight(model) - W0`` after it is the update.
    """
    _check_model(model, "from_weight")
    get = (lambda p: p.detach().clone()) if clone else (lambda p: p.detach())
    return Snapshot(
        {k: get(p) for k, p in model.named_parameters()}, f"{type(model).__name__}_weights"
    )


def from_grad(model: nn.Module, clone: bool = False) -> Snapshot:
    """The ``.grad`` of each parameter that has one, by parameter path.

    Arguments:
        model: the module, after ``loss.backward()``.
        clone: copy the gradients. Without it the snapshot shares them: a later backward pass
            accumulates into them, and ``zero_grad(set_to_none=False)`` zeroes them.
    Raises:
        ValueError: no parameter has a gradient (called before ``backward`` or after
            ``zero_grad()``).
    """
    _check_model(model, "from_grad")
    get = (lambda g: g.detach().clone()) if clone else (lambda g: g.detach())
    out = {k: get(p.grad) for k, p in model.named_parameters() if p.grad is not None}
    if not out:
        raise ValueError(
            "from_grad(model): no parameter has a .grad; call it after "
            "loss.backward() and before optimizer.zero_grad()"
        )
    return Snapshot(out, f"{type(model).__name__}_grads")


def from_optimizer_state(
    optimizer: torch.optim.Optimizer, key: str, model: nn.Module | None = None, clone: bool = False
) -> Snapshot:
    """One entry of the optimizer's per-parameter state (``exp_avg``, ``exp_avg_sq``,
    ``momentum_buffer``, ...), keyed by parameter path.

    Arguments:
        optimizer: a ``torch.optim.Optimizer``.
        key: the state entry.
        model: names the parameters by their path in ``model.named_parameters()`` (matched by
            identity, so param-group order does not matter); without it, and for parameters
            the model does not hold, the name is ``param_groups.<g>.<j>``.
        clone: copy the tensors; without it the snapshot follows the optimizer's in-place
            updates.
    Raises:
        KeyError: no parameter has state ``key`` (the message lists the keys there are).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"from_optimizer_state(optimizer=...): expected a torch.optim.Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    names = (
        {id(p): k for k, p in _check_model(model, "from_optimizer_state").named_parameters()}
        if model is not None
        else {}
    )
    out, seen = {}, set()
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            state = optimizer.state.get(p, {})
            seen.update(state)
            if key in state and isinstance(state[key], torch.Tensor):
                v = state[key].detach()
                out[names.get(id(p), f"param_groups.{g}.{j}")] = v.clone() if clone else v
    if not out:
        have = sorted(str(k) for k in seen)
        raise KeyError(
            f"from_optimizer_state(key={key!r}): no parameter has this state entry; "
            + (
                f"the optimizer holds {have}"
                if have
                else "the optimizer has no state yet (take an optimizer step first)"
            )
        )
    return Snapshot(out, f"{type(optimizer).__name__}_{key}")


def from_state_dict(
    state_dict: Mapping[str, Any], clone: bool = False, name: str = "state_dict"
) -> Snapshot:
    """A snapshot of a ``state_dict`` (nnstat's ``from_state_dict``): every tensor entry by
    its key, buffers included (BatchNorm's running statistics, and its integer
    ``num_batches_tracked``, which :meth:`~tandv.snapshot.Snapshot.norm` and ``describe``
    read as float64).

    Arguments:
        state_dict: ``model.state_dict()`` or any mapping of names to tensors (entries that
            are not tensors, such as an optimizer's step counts, are left out).
        clone: copy the tensors (``model.state_dict()`` shares storage with the model).
        name: the snapshot's label.
    Raises:
        TypeError: ``state_dict`` is not a mapping; ValueError: it holds no tensor.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"from_state_dict(state_dict=...): expected a mapping of name -> tensor "
            f"(model.state_dict()), got {type(state_dict).__name__}"
        )
    get = (lambda t: t.detach().clone()) if clone else (lambda t: t.detach())
    out = {str(k): get(v) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    if not out:
        raise ValueError("from_state_dict(state_dict=...): the mapping holds no tensor")
    return Snapshot(out, name)


def from_together(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    keys: Sequence[str] = (),
    clone: bool = False,
) -> tuple[Snapshot, Snapshot, tuple[Snapshot, ...]]:
    """Weights, gradients and optimizer state of a model at once (nnstat's
    ``from_together``): ``weight, grad, (m, v) = from_together(model, opt, ["exp_avg",
    "exp_avg_sq"])``, all keyed by parameter path, so they combine per name
    (``-lr * m / (sqrt(v) + eps)``).

    The weights and state are restricted to the parameters that have a gradient (the ones
    the optimizer steps), so the three line up name for name.

    Arguments:
        model: the module, after ``backward`` (and ``optimizer.step()`` for the state).
        optimizer: its optimizer.
        keys: the optimizer-state entries to return, in order.
        clone: copy the tensors (see :func:`from_weight`).
    Raises:
        ValueError / KeyError: as :func:`from_grad` and :func:`from_optimizer_state`.
    """
    if isinstance(keys, str):
        keys = [keys]
    grad = from_grad(model, clone=clone)
    weight = from_weight(model, clone=clone).filter(include=list(grad))
    states = []
    for key in keys:
        state = from_optimizer_state(optimizer, key, model=model, clone=clone)
        missing = [k for k in grad if k not in state]
        if missing:
            raise KeyError(
                f"from_together(keys=[{key!r}, ...]): the parameters {missing[:5]} have a "
                f"gradient but no {key!r} state; take an optimizer step first"
            )
        states.append(state.filter(include=list(grad)))
    return weight, grad, tuple(states)


@contextmanager
def from_activation(model: nn.Module, clone: bool = False) -> Iterator[Snapshot]:
    """Capture the floating outputs of every module in the forward passes inside the block.

    ``with from_activation(model) as acts: model(x)``; afterwards ``acts`` holds each
    module's output by module path (``root`` for the model itself). A module called several
    times keeps its last output. Hooks are removed when the block ends.

    Arguments:
        model: the module whose submodules are observed.
        clone: copy the outputs (needed if the forward pass changes them in place later).
    """
    snap = Snapshot({}, f"{type(_check_model(model, 'from_activation')).__name__}_activations")

    def hook_for(path: str) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            found: list[tuple[str, torch.Tensor]] = []
            flatten_outputs(output, path, found)
            for name, t in found:
                snap._values[name] = t.detach().clone() if clone else t.detach()

        return hook

    handles = [
        m.register_forward_hook(hook_for(path or "root")) for path, m in model.named_modules()
    ]
    try:
        yield snap
    finally:
        for h in handles:
            h.remove()
