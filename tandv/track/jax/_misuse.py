"""Refusing the JAX tracker's inputs whose rows would look right and be wrong.

Each check here guards a mistake that used to give plausible rows: arguments of
``tracker.step()`` in the wrong places (an optimizer state named as gradients, gradients
named as optimizer state: :class:`StepTrees`), ``jax.pmap``'s per-device copies
summarized as if they were one array (every count doubled: :func:`check_replicas`), and a
model applied twice in one update, once outside the differentiation (an EMA teacher,
merged into the training rows: :class:`Applications`). Each error names the argument or
option to change.

What they cost on steps that pass: the argument trees are checked only on a step that
names a tree not named before; the pmap check reads each array's sharding type; the
applications are noted while an update is traced, not when it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from ._scope import differentiated
from ._state import PMAP_AXIS, is_nnx_optimizer, parts_of
from .trees import is_float_array, param_leaves

__all__ = ["Applications", "StepTrees", "check_replicas", "replica_axis"]


def _names(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the float leaves of a parameter (or gradient) tree."""
    flat = jax.tree_util.tree_leaves(tree)
    return {
        leaf.name: tuple(getattr(flat[leaf.index], "shape", ()))
        for _, leaf in param_leaves(tree)[0]
    }


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class StepTrees:
    """The trees ``track()`` was given, against which ``step()``'s arguments are checked.

    - ``model_state``: its parameters must carry the same float leaves (names and shapes)
      as those given to ``track()``;
    - ``optimizer_state``: the same tree structure as the one given to ``track()``;
    - ``gradients``: every float leaf must be named like a parameter, with its shape (a
      subset is allowed: frozen parameters have no gradient).

    Swapped arguments (``step(params, grads, opt_state)``) fail these, where they used to
    write optimizer rows named ``<param>.state`` and gradient rows named ``0.mu.<param>``.
    Accepted tree structures are remembered, so a passing step compares two structures."""

    def __init__(self, params: Any, opt_state: Any) -> None:
        self._params = None if params is None else _names(params)
        self._opt = None if opt_state is None else jax.tree_util.tree_structure(opt_state)
        self._accepted: set[tuple[str, Any]] = set()
        if params is not None:
            self._accepted.add(("model_state", jax.tree_util.tree_structure(params)))

    @classmethod
    def given(cls, model_state: Any, optimizer_state: Any) -> StepTrees:
        """The trees of ``track(model_state, optimizer_state)``: the parameters, and the
        optimizer state (given apart, an ``nnx.Optimizer``'s, or a ``TrainState``'s)."""
        if model_state is None:
            return cls(None, None)
        parts = parts_of(model_state)
        if optimizer_state is None:
            return cls(parts.params, parts.opt_state)
        opt = optimizer_state.opt_state if is_nnx_optimizer(optimizer_state) else optimizer_state
        return cls(parts.params, opt)

    def check(
        self, params: Any, opt_state: Any, gradients: Any, gradients_positional: bool = False
    ) -> None:
        """Raise ``ValueError`` naming the first argument of ``step()`` whose tree is not
        what ``track()`` saw (``params``: of ``model_state``; ``opt_state``: the optimizer
        state given apart from ``model_state``; ``gradients``: the gradient tree).
        ``gradients_positional``: the gradients came as ``step()``'s second positional
        argument (``track()`` had no ``optimizer_state``), which the error then says."""
        if params is not None and self._params is not None:
            self._check_params(params)
        if opt_state is not None and self._opt is not None:
            self._check_opt(opt_state)
        if gradients is not None and self._params is not None:
            self._check_gradients(gradients, gradients_positional)

    def check_new(
        self,
        names_cache: dict[Any, Any],
        known: int,
        params: Any,
        opt_state: Any,
        gradients: Any,
        gradients_positional: bool = False,
    ) -> None:
        """:meth:`check`, where the step named a tree not named before (the tracker's cache
        of names by tree structure, ``names_cache``, holds more than its ``known`` entries
        of before the step); on a step whose trees were all named before (and so checked
        then) it costs nothing. When the check fails, the entries the step added are
        dropped, so that the same wrong call is checked again."""
        if len(names_cache) <= known:
            return
        try:
            self.check(params, opt_state, gradients, gradients_positional)
        except ValueError:
            for key in list(names_cache)[known:]:
                del names_cache[key]
            raise

    def _known(self, arg: str, tree: Any) -> tuple[bool, Any]:
        treedef = jax.tree_util.tree_structure(tree)
        return (arg, treedef) in self._accepted, treedef

    def _check_params(self, params: Any) -> None:
        known, treedef = self._known("model_state", params)
        if known:
            return
        assert self._params is not None
        got = _names(params)
        if got != self._params:
            missing = [n for n in self._params if n not in got]
            extra = [n for n in got if n not in self._params]
            reshaped = [n for n in got if n in self._params and got[n] != self._params[n]]
            what = (
                f"lacks {_few(missing)}"
                if missing
                else f"has leaves track() did not see: {_few(extra)}"
                if extra
                else f"has other shapes for {_few(reshaped)}"
            )
            raise ValueError(
                f"tracker.step(): model_state does not hold the parameters given to track(): "
                f"it {what}; pass the updated parameters (same tree as track()'s "
                f"model_state) first: tracker.step(model_state, optimizer_state, gradients)"
            )
        self._accepted.add(("model_state", treedef))

    def _check_opt(self, opt_state: Any) -> None:
        known, treedef = self._known("optimizer_state", opt_state)
        if known:
            return
        if treedef != self._opt:
            raise ValueError(
                f"tracker.step(): optimizer_state does not have the structure of the "
                f"optimizer_state given to track() (got {_brief(treedef)}, expected "
                f"{_brief(self._opt)}); pass the optimizer state after the update second: "
                f"tracker.step(model_state, optimizer_state, gradients), or by keyword"
            )
        self._accepted.add(("optimizer_state", treedef))

    def _check_gradients(self, gradients: Any, positional: bool) -> None:
        known, treedef = self._known("gradients", gradients)
        if known:
            return
        assert self._params is not None
        got = _names(gradients)
        strangers = [n for n in got if n not in self._params]
        reshaped = [n for n in got if n in self._params and got[n] != self._params[n]]
        if strangers or reshaped or not got:
            what = (
                "has no floating-point leaves"
                if not got
                else f"has leaves that name no parameter: {_few(strangers)}"
                if strangers
                else "has leaves shaped unlike their parameters: "
                + ", ".join(f"{n!r} {got[n]} (parameter {self._params[n]})" for n in reshaped[:3])
            )
            how = (
                " (it came as step()'s second positional argument, which is the gradients "
                "when track() was given no optimizer_state: pass an optimizer state to "
                "track() to track it)"
                if positional
                else ""
            )
            raise ValueError(
                f"tracker.step(): gradients {what}{how}; pass the parameter gradients (the "
                f"same tree as the parameters): tracker.step(model_state, optimizer_state, "
                f"gradients), or gradients=... by keyword"
            )
        self._accepted.add(("gradients", treedef))


def _brief(treedef: Any) -> str:
    text = str(treedef)
    return text if len(text) <= 80 else text[:77] + "..."


def replica_axis(x: Any) -> str | None:
    """The mesh axis along which ``x`` is laid out as ``jax.pmap`` lays out its per-device
    values (a 1-D mesh of several devices, the leading axis split over it one slice per
    device, nothing else split), else None."""
    sharding = getattr(x, "sharding", None)
    mesh: Any = getattr(sharding, "mesh", None)
    spec: Any = getattr(sharding, "spec", None)
    if mesh is None or spec is None or len(mesh.axis_names) != 1 or mesh.size < 2:
        return None
    name = mesh.axis_names[0]
    if getattr(x, "ndim", 0) < 1 or x.shape[0] != mesh.size:
        return None
    lead = spec[0] if len(spec) else None
    if lead not in (name, (name,)) or any(s is not None for s in spec[1:]):
        return None
    return str(name)


def check_replicas(arrays: Sequence[Any], device_axis: bool | None) -> None:
    """Refuse arrays that came out of ``jax.pmap`` unless ``track(..., device_axis=True)``
    says so (their rows would count every device's copy: numel and counts N times).

    Out of a ``pmap`` without ``axis_name`` an array is recognized for sure (its mesh axis
    is pmap's own). With an ``axis_name`` its layout is that of any array split along its
    leading axis, so the arrays are refused when *every* one of them that spans several
    devices is split so (a leading axis of one slice per device, over a 1-D mesh), as
    pmap's outputs are and arrays of a sharded model (whose biases and norms are not split
    that way) rarely all are; ``device_axis=False``, given explicitly, turns the check off
    for such a model."""
    if device_axis:
        return
    axes: set[str] = set()
    other = False  # an array on several devices laid out otherwise
    for x in arrays:
        sharding = getattr(x, "sharding", None)
        if sharding is None or isinstance(sharding, SingleDeviceSharding):
            continue  # the common case, told cheaply
        axis = replica_axis(x)
        if axis == PMAP_AXIS or PMAP_AXIS in getattr(
            getattr(sharding, "mesh", None), "axis_names", ()
        ):
            axes, other = {PMAP_AXIS}, False  # pmap's own axis: pmap's for sure
            break
        if axis is not None:
            axes.add(axis)
        elif len(sharding.device_set) > 1:
            other = True
    if other or len(axes) != 1 or device_axis is False and PMAP_AXIS not in axes:
        return
    axis = axes.pop()
    pmap_own = axis == PMAP_AXIS
    raise ValueError(
        "tandv: these arrays come out of jax.pmap: their leading axis holds one copy per "
        f"device (split over the {'pmap' if pmap_own else repr(axis)} axis, one slice per "
        "device), so their rows would count every copy; track(..., device_axis=True) gives "
        "the rows of the logical arrays (one replica)"
        + (
            ""
            if pmap_own
            else "; if they are arrays of a sharded model split along their leading axis, "
            "say so with track(..., device_axis=False)"
        )
    )


class Applications:
    """The module outputs of one intercepted call, by name: whether each was seen
    differentiated and not (:func:`._scope.differentiated`).

    A tracked model applied twice in one update, once in the training pass and once
    outside the differentiation (an EMA teacher, a target network, an evaluation pass
    inside the update), names its modules' outputs alike: their Activation rows would
    merge both applications (a root of 64 values for a batch of 32). Refused: the error
    says how to keep the other application out. Calls of one module that are all
    differentiated (weight sharing, two views of a batch, micro-batches) or all not (a
    frozen backbone, a forward pass tracked alone) merge into one row, as documented."""

    def __init__(self, activations: bool) -> None:
        #: whether Activation rows are tracked (without them nothing would merge: the
        #: other application has no cotangent)
        self._active = activations
        self._seen: dict[str, set[bool]] = {}
        #: every module name output in the call (differentiated, not, or not known)
        self.names: set[str] = set()

    @property
    def trained(self) -> frozenset[str]:
        """The names output by a differentiated application in this call."""
        return frozenset(n for n, kinds in self._seen.items() if True in kinds)

    def note(self, name: str, module_type: type, out: Any) -> None:
        """Record the output ``out`` of module ``name``; ValueError when the name has now
        been output by a differentiated application and by one that is not."""
        if not self._active:
            return
        leaf = next((x for x in jax.tree_util.tree_leaves(out) if is_float_array(x)), None)
        if leaf is not None:
            self.names.add(name)
        diff = differentiated(leaf)
        if diff is None:
            return
        kinds = self._seen.setdefault(name, set())
        kinds.add(diff)
        if len(kinds) > 1:
            raise ValueError(
                f"tandv: module {name!r} ({module_type.__name__}) is output twice in one "
                f"intercepted call, once differentiated (the training pass) and once not (the "
                f"model applied again as an EMA teacher, a target network or an evaluation "
                f"pass, or another model whose modules are named alike, e.g. a frozen linen "
                f"backbone beside a trained head: each apply() names its outermost module "
                f"'root'): its Activation rows would merge both. Apply the other one outside "
                f"tracker.intercept (e.g. compute the teacher's outputs with a jitted function "
                f"of its own, called before the update, and pass them in), make the models "
                f"submodules of one parent module, or track_activations=False"
            )


class StepApplications:
    """The module outputs of one step's intercepted calls, split into those of training
    calls (some module output differentiated) and of the others (an evaluation pass, a
    teacher applied in a call of its own), by step.

    Several intercepted calls in one step merge into the step's rows, which is what
    gradient accumulation wants; an evaluation call in a training step would merge its
    Activation rows into the training pass's (a root of twice the batch). Refused, like
    a second application inside one call (:class:`Applications`). A training call whose
    model is applied only inside a nested ``jit``, ``remat`` or loop body looks like one
    that is not differentiated (JAX differentiates those bodies later): two such calls in
    a step still merge, as documented."""

    def __init__(self) -> None:
        self._step = -1
        self._trained: set[str] = set()
        self._other: set[str] = set()

    def add(self, step: int, names: frozenset[str], trained: frozenset[str]) -> None:
        """Record one intercepted call of step ``step`` (its module names, and those it
        output differentiated); ValueError when a module is now output by a training call
        and by another call of the same step."""
        if step != self._step:
            self._step, self._trained, self._other = step, set(), set()
        (self._trained if trained else self._other).update(names)
        both = self._trained & self._other
        if both:
            raise ValueError(
                f"tandv: module {min(both)!r} is output by two intercepted calls of step "
                f"{step}, one a training call (differentiated) and one not (an evaluation "
                f"pass or a teacher given to tracker.intercept in a training step): its "
                f"Activation rows would merge both. Run the other call outside "
                f"tracker.intercept (e.g. the evaluation after tracker.step(), or on a step "
                f"of its own), or track_activations=False"
            )
