"""Tracking activations and their gradients inside ``torch.compile``'d graphs.

A compiled model never runs the hooks of the eager tracker: dynamo traces them (and
would break the graph at every host-side call). A tracker of a compiled model instead
installs, for its whole life, forward hooks that dynamo inlines into the graph and that
do only three things:

- read the tracker's :class:`Switch` (``active``): dynamo guards on it, so a scheduled
  and an unscheduled step each run their own graph, compiled once (after both have run,
  nothing recompiles); the unscheduled graph holds no tracking at all;
- call the custom operator ``tandv::observe`` on each floating tensor of the module's
  output (an *effectful* operator: the compiler keeps it, in order, as one opaque call);
- register a gradient hook on each such tensor that calls ``tandv::observe`` on the
  gradient (dynamo traces the hook into the backward graph). A hook registered in a
  graph sees only the gradient of the tensor's later uses, so a tensor gets one, where
  it is first seen as an output (a tensor attribute marks it; a module returning its
  input, which it may have changed in place, hooks it again); a parent module that
  returns it too (the root returning a hidden state) calls the operator to record an
  *alias*, and the gradient's call summarizes it under both names, as the eager tracker
  does.

At run time the operator hands its tensor to the tracker's ordinary observation path
(:meth:`._seams.TrackerSeam.observe`): the same summaries (host kernel on the CPU, the fused Triton
kernel into the device workspace on a GPU), the same rows, the same names as in eager
mode. The operator identifies the tracker's hooks by a number and the module by its index
in their module list; tensor names are constants of the graph. The hooks know the tracker
only as a :class:`._seams.TrackerSeam`.

CUDA graphs (``mode="reduce-overhead"``) are refused: a replayed graph would not call
back into the tracker, so its rows would be silently missing.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch._higher_order_ops import effects as _effects

from ...schema.columns import ACTIVATION, GRADIENT
from .naming import flatten_outputs

if TYPE_CHECKING:
    from torch._dynamo.eval_frame import OptimizedModule

    from ._seams import TrackerSeam

__all__ = ["Switch", "CompiledHooks", "compiled_root", "observe"]

#: The hooks of live trackers of compiled models, by the number their graphs call them with
#: (held weakly: the tracker holds its hooks).
_HOOKS: dict[int, weakref.ref[CompiledHooks]] = {}
_numbers = itertools.count()


#: The ``kind`` of an :func:`observe` call that records an alias instead of a summary.
_ALIAS = "alias"


def observe(
    x: torch.Tensor,
    tracker: int,
    module: int,
    name: str,
    kind: str,
    first_module: int = -1,
    first_name: str = "",
) -> None:
    """Summarize ``x`` (the output, or its gradient, of module ``module`` of tracker
    ``tracker``; ``kind`` its tensor type) into the tracker's current step, as the eager
    hooks would; with ``kind="alias"``, record instead that the output gradient
    ``(module, name)`` is that of ``(first_module, first_name)``. The kernel of the
    operator ``tandv::observe``, which compiled graphs call."""
    ref = _HOOKS.get(tracker)
    hooks = ref() if ref is not None else None
    if hooks is not None:
        hooks.observe(x, module, name, kind, first_module, first_name)


def _observe_fake(
    x: torch.Tensor,
    tracker: int,
    module: int,
    name: str,
    kind: str,
    first_module: int = -1,
    first_name: str = "",
) -> None:
    return None


# The operator, defined by its schema and kernels rather than by torch.library.custom_op,
# whose kernel under autograd is a Python function that dispatches the call again (about
# half of an observation's host time in a compiled graph, by cProfile on the CPU). It
# returns nothing, so autograd has nothing to record: the autograd keys fall through (in C)
# to the kernel of the tensor's device, ours, or, while the graph is traced, to the fake
# kernel. Effectful: the compiler keeps the call (it returns nothing) and keeps the order.
_LIB = torch.library.Library("tandv", "DEF")
_LIB.define(
    "observe(Tensor x, int tracker, int module, str name, str kind, int first_module=-1, "
    "str first_name='') -> ()",
    tags=(torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else (),
)
_LIB.impl("observe", observe, "CompositeExplicitAutograd")
_LIB.impl("observe", torch.library.fallthrough_kernel, "Autograd")
torch.library.register_fake("tandv::observe", _observe_fake, lib=_LIB)
# (by the function Library's and custom_op's registrations call; it takes the overload in
# torch 2.11, the GPU machine's, and 2.13)
_effects._register_effectful_op(
    torch.ops.tandv.observe.default, torch._library.effects.EffectType.ORDERED
)


class Switch:
    """Whether the tracker records the current step: a compiled graph is specialized on
    ``active`` (dynamo guards on it), so flipping it selects the other cached graph."""

    def __init__(self) -> None:
        self.active = False


#: The tensor attribute that marks an output whose gradient is hooked: ``(module, name)``.
_HOOKED = "_tandv_grad_hooked"


def _is_input(t: torch.Tensor, args: Any) -> bool:
    """Whether ``t`` is one of a module's positional inputs: a module that returns its
    input (``ReLU(inplace=True)``) may have changed it in place, a new value whose
    gradient the eager tracker hooks anew (dynamo traces ``_version`` as a graph value, not
    a constant, so identity has to tell)."""
    for a in args:
        if a is t:
            return True
    return False


def _make_hook(
    number: int,
    index: int,
    name: str,
    switch: Switch,
    want_act: bool,
    want_grad: bool,
    track_eval: bool,
) -> Callable:
    """The forward hook of module ``index`` (path ``name``): traceable by dynamo, no
    host-side call but the custom operator."""

    def hook(mod: nn.Module, args: Any, output: Any) -> None:
        if not switch.active or not (mod.training or track_eval):
            return
        tensors: list[tuple[str, torch.Tensor]] = []
        flatten_outputs(output, name, tensors)
        for tname, t in tensors:
            if want_act:
                torch.ops.tandv.observe(t, number, index, tname, ACTIVATION)
            if want_grad and t.requires_grad:
                first = getattr(t, _HOOKED, None)
                if first is None or _is_input(t, args):
                    setattr(t, _HOOKED, (index, tname))
                    t.register_hook(_make_grad_hook(number, index, tname))
                else:
                    torch.ops.tandv.observe(t, number, index, tname, _ALIAS, first[0], first[1])

    return hook


def _make_grad_hook(number: int, index: int, name: str) -> Callable:
    def grad_hook(g: torch.Tensor) -> None:
        if g is not None and g.is_floating_point():
            torch.ops.tandv.observe(g, number, index, name, GRADIENT)

    return grad_hook


class CompiledHooks:
    """The forward hooks of a tracker of a compiled model, installed for its whole life
    (:meth:`remove` takes them away). Installing and removing make dynamo drop the code
    it compiled before: with its default ``skip_nnmodule_hook_guards`` it does not notice
    hooks that come or go, and would keep running graphs without (or with stale) hooks."""

    def __init__(self, tracker: TrackerSeam, wrapper: nn.Module | None) -> None:
        self.number = next(_numbers)
        self._tracker = tracker
        self.switch = Switch()
        #: ``(module, name)`` of an output gradient -> the ``(module, name)`` whose hook sees it
        self.aliases: dict[tuple[int, str], tuple[int, str]] = {}
        #: the inverse: whose hook sees a gradient -> the outputs it is also the gradient of
        #: (an ordered set), so a gradient's observation finds its aliases without a scan
        self.followers: dict[tuple[int, str], dict[tuple[int, str], None]] = {}
        _HOOKS[self.number] = weakref.ref(self)
        want_act, want_grad = tracker.kinds[ACTIVATION], tracker.kinds[GRADIENT]
        #: the hooked modules, by the index their graphs name them with
        self._owners: list[nn.Module] = []
        self._handles = []
        if want_act or want_grad:
            for index, (name, m) in enumerate(tracker.hooked_modules()):
                self._owners.append(m)
                self._handles.append(
                    m.register_forward_hook(
                        _make_hook(
                            self.number,
                            index,
                            name,
                            self.switch,
                            want_act,
                            want_grad,
                            tracker.track_eval,
                        )
                    )
                )
        # Dynamo does not trace the call of the compiled module itself (a frame of
        # torch.nn): it would run that module's hooks outside its graph, each a graph of
        # its own. Its ``wrap_top_frame`` option makes the call traced, hooks and all;
        # the compiled calls are remade with it while the hooks are installed.
        # compiled_root's wrapper is an OptimizedModule (found by name: a private class)
        self._wrapper = cast("OptimizedModule | None", wrapper if self._handles else None)
        self._in_place: list[tuple[nn.Module, Callable]] = []
        if self._handles:
            from torch._dynamo import config

            with config.patch(wrap_top_frame=True):
                if self._wrapper is not None:
                    self._wrapper._initialize()
                self._in_place = _recompile_in_place(tracker.module)
            _drop_compiled_code()

    def observe(
        self,
        x: torch.Tensor,
        module: int,
        name: str,
        kind: str,
        first_module: int,
        first_name: str,
    ) -> None:
        """The work of one :func:`observe` call (see there) while the tracker records."""
        tracker = self._tracker
        if not tracker.recording:
            return
        if kind == _ALIAS:
            self.alias((module, name), (first_module, first_name))
            return
        # Compiled kernels write buffers in place without bumping their version counter:
        # the eager path's reuse of the last summary for the same tensor object is unsafe.
        tracker.observe(name, kind, self._owners[module], x, fresh=True)
        if kind == GRADIENT:  # the same tensor, output of other modules too
            for alias_module, alias in self.followers.get((module, name), ()):
                tracker.observe(alias, kind, self._owners[alias_module], x)

    def alias(self, output: tuple[int, str], first: tuple[int, str]) -> None:
        """Record that the gradient of ``output`` is the one ``first``'s hook sees."""
        old = self.aliases.get(output)
        if old == first:
            return
        if old is not None:
            self.followers[old].pop(output, None)
        self.aliases[output] = first
        self.followers.setdefault(first, {})[output] = None

    def remove(self) -> None:
        """Remove the hooks (idempotent); the model compiles again without them."""
        if self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []
            if self._wrapper is not None:
                self._wrapper._initialize()
                self._wrapper = None
            for m, impl in self._in_place:
                m._compiled_call_impl = impl
            self._in_place = []
            _drop_compiled_code()
        self.switch.active = False
        _HOOKS.pop(self.number, None)


def _recompile_in_place(module: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """Compile again, with the same compiler and options (the dynamo context the compiled
    call closes over), the call of each submodule compiled in place; returns the
    ``(module, previous compiled call)`` pairs. A call whose context is not found stays:
    its module's own hooks then run as graphs of their own (correct, a little slower)."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    remade: list[tuple[nn.Module, Callable]] = []
    for m in module.modules():
        impl = getattr(m, "_compiled_call_impl", None)
        ctx = None
        for cell in getattr(impl, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, _TorchDynamoContext):
                ctx = value
                break
        if ctx is not None and impl is not None:
            m._compiled_call_impl = ctx(m._call_impl)
            remade.append((m, impl))
    return remade


def _drop_compiled_code() -> None:
    """Make dynamo recompile what it compiled so far (nothing if it compiled nothing)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset_code_caches()


def _compile_configs(module: nn.Module) -> list[tuple[str, Any]]:
    """``(where, compiler config)`` of each compiled part of ``module``: the module itself
    (``torch.compile(model)``) and every submodule compiled in place (``.compile()``)."""
    found = []
    opt_cls = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if opt_cls is not None and isinstance(module, opt_cls):
        found.append(("the module (torch.compile(model))", module.get_compiler_config()))
        module = module._orig_mod
    for path, m in module.named_modules():
        impl = getattr(m, "_compiled_call_impl", None)
        if impl is not None:
            where = f"submodule {path!r} (.compile())" if path else "the module (model.compile())"
            get = getattr(impl, "get_compiler_config", None)
            found.append((where, get() if get is not None else None))
    return found


def compiled_root(module: nn.Module, hooks: bool) -> tuple[nn.Module, bool, nn.Module | None]:
    """The module whose paths name the rows (``torch.compile(model)`` -> ``model``: the
    same names as in eager mode), whether any part of it is compiled, and the
    ``OptimizedModule`` wrapper if ``module`` is one; ``hooks``: whether the tracker will
    hook modules (activations or output gradients).

    Raises:
        ValueError: if a compiled part uses CUDA graphs (``mode="reduce-overhead"``, or
            the option ``"triton.cudagraphs"``) and ``hooks``: a replayed CUDA graph does
            not call back into the tracker, so activations would go missing.
    """
    configs = _compile_configs(module)
    for where, config in configs:
        if hooks and _uses_cudagraphs(config):
            raise ValueError(
                f"track(module=...): {where} is compiled with CUDA graphs (the option "
                f'"triton.cudagraphs", which mode="reduce-overhead" and mode="max-autotune" '
                f"turn on); a replayed CUDA graph skips tandv's activation summaries. Compile with "
                f'mode="default" or mode="max-autotune-no-cudagraphs" while tracking, or track '
                f"with track_activations=False, track_gradients=False (weights and optimizer state "
                f"need no hooks)."
            )
    opt_cls = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if opt_cls is not None and isinstance(module, opt_cls):
        return module._orig_mod, True, module
    return module, bool(configs), None


def _uses_cudagraphs(config: Any) -> bool:
    """Whether an inductor compiler config (a dict of options) turns CUDA graphs on,
    explicitly or through inductor's global default."""
    if not isinstance(config, dict):
        return False
    if "triton.cudagraphs" in config:
        return bool(config["triton.cudagraphs"])
    inductor_config = sys.modules.get("torch._inductor.config")
    return bool(inductor_config is not None and inductor_config.triton.cudagraphs)
