"""The PyTorch tracker: hooks that summarize activations, gradients, weights and
optimizer state on the device, and a step boundary that moves them to the host once.

What a row at step ``k`` (counting from 0) holds:

``Activation``
    the output of each selected module in step ``k``'s training-mode forward passes,
    named by module path (the root module is named ``root_name``, default ``"root"``).
    Structured outputs are flattened: a tuple/list element ``i`` is ``<path>[i]``, a
    dict/dataclass entry ``key`` is ``<path>[key]`` (nested: ``<path>[0][logits]``).
``Gradient``
    the gradient w.r.t. each selected module's output (same names as the
    activations), from tensor hooks registered on the outputs; and each parameter's
    ``.grad`` (full parameter path, ``layers.0.attention.wq.weight``) as the optimizer
    that updates it sees it just before its update in step ``k`` (after all backward
    passes of the step, after any clipping or unscaling; several optimizers each capture
    their own parameters only); for a parameter no tracked optimizer holds, ``.grad`` at
    :meth:`Tracker.step`.
``Weight``
    each parameter as used by step ``k``'s forward pass: captured before the first
    training-mode forward of any of the model's modules in the step (the root's, or a
    submodule's when a loop calls those directly); for a compiled model, just before the
    optimizer update (or at :meth:`Tracker.step`), which dynamo need not trace.
``Optimiser_State``
    every non-scalar floating tensor in ``optimizer.state[p]`` after update ``k``,
    named ``<parameter path>.<state key>`` from the parameter's identity.

Several forward/backward passes in one step (gradient accumulation) give several
observations of a tensor; the recorder merges them into one row per tensor and step.
"""

from __future__ import annotations

import itertools
import re
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Mapping as MappingABC
from itertools import chain
from operator import attrgetter, is_, itemgetter, methodcaller
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.compiler import is_compiling, is_dynamo_compiling
from torch.nn.modules import module as _torch_module
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ...schema.columns import ACTIVATION, GRADIENT, OPTIMISER_STATE, WEIGHT
from ...stats.summary import Layout
from ..common import TensorKey
from ..common.core import TrackerCore
from ..common.custom import StatFn
from ..common.factory import signature_of
from ..common.options import ROOT_NAME, TrackKwargs, TrackOptions
from ..common.recorder import StepRecorder
from ._adapter import TorchAdapter
from ._compiled import CompiledHooks, compiled_root
from ._distributed import TorchRanks, local_part, module_type, unwrap_ddp
from ._workspace import BatchLaunch, Flight, HookLaunch, Slot, Workspace, tensor_guard
from .naming import flatten_outputs as _flatten
from .summary import fused_spec

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Tracker", "track", "StatFn"]


_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_weak = weakref.ref


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (a forward
    seen now is a recomputation by activation checkpointing)."""
    return _graph_task_id() != -1


#: The attribute marking tandv's output-gradient hooks (a tensor's ``_backward_hooks``).
_OUTPUT_GRAD_HOOK = "_tandv_output_gradient"


def _hooked(t: torch.Tensor, mark: tuple[int, str]) -> bool:
    """Whether ``t`` holds the output-gradient hook marked ``mark`` (tracker id, name)."""
    hooks = t._backward_hooks
    return hooks is not None and any(
        getattr(h, _OUTPUT_GRAD_HOOK, None) == mark for h in hooks.values()
    )


#: Hook observations kept at most before they are handed to the recorder in the middle of
#: a step (see Tracker.recorder), which then checks the memory they hold and keeps the list
#: as it is. 64: the list's item array stays within Python's small-object allocator (512
#: bytes); past it, each growth inside a hook asks the C allocator, whose first call after
#: the model's own operations costs ~18 us on the 2-core CPU.
_HOOK_ROWS = 64

#: Keys of the output-gradient hooks the forward hooks add: negative, so apart from torch's
#: own (``RemovableHandle`` ids count up from 0).
_hook_ids = itertools.count(-1, -1)


class _HookSite:
    """One module's activation or output gradient as its hooks see it: its name and kind,
    its row key and layout, and the fused launch of its tensors (``launch``, for tensors
    of ``dtype``; ``None`` while none is known, or where its tensors take another path:
    custom statistics, a GradScaler's scale, DTensor shards, the host path), made by the
    first tensor :meth:`Tracker._summary` summarizes."""

    __slots__ = ("name", "kind", "owner", "dtype", "key", "layout", "launch", "cuda")

    def __init__(self, name: str, kind: str, owner: nn.Module) -> None:
        self.name = name
        self.kind = kind
        self.owner = owner
        self.dtype: torch.dtype | None = None
        self.key: Any = None  # (a TensorKey and a Layout once the launch is made)
        self.layout: Any = None
        self.launch: HookLaunch | None = None
        self.cuda = False


def _grad_hook_of(hooks: dict[str, Callable], tr: Tracker, tname: str, mod: nn.Module) -> Callable:
    """The output-gradient hook of tensor ``tname`` (of module ``mod``) in ``hooks``, made
    at its first sight."""
    h = hooks.get(tname)
    if h is None:
        h = hooks[tname] = tr._make_grad_hook(tname, mod)
    return h


def _site_of(sites: dict[str, _HookSite], tr: Tracker, tname: str, mod: nn.Module) -> _HookSite:
    """The activation site of tensor ``tname`` (of module ``mod``) in ``sites``, made at its
    first sight."""
    got = sites.get(tname)
    if got is None:
        got = sites[tname] = tr._site(tname, ACTIVATION, mod)
    return got


def _other_outputs(
    name: str,
    site: _HookSite,
    grad_hook: Callable | None,
    want_act: bool,
    want_grad: bool,
) -> Callable[[Tracker, nn.Module, Any], None]:
    """What the forward hook of module ``name`` does in its other cases (a structured
    output, a tensor subclass, a forward recomputed in a backward pass): a function of the
    tracker, the module and its output. ``site`` and ``grad_hook`` are the hook's own for
    ``name``; those of the tensors inside a structured output (``name[i]``) are made at
    their first sight and kept here."""
    # per output name (``name``, or ``name[i]`` inside a structured output), made once:
    # the activation's site and the output gradient's hook
    sites: dict[str, _HookSite] = {name: site}
    grad_hooks: dict[str, Callable] = {}
    if grad_hook is not None:
        grad_hooks[name] = grad_hook

    def others(tr: Tracker, mod: nn.Module, output: Any) -> None:
        """The hook's other cases: a structured output, a tensor subclass, a forward
        recomputed in a backward pass."""
        if is_compiling():
            return
        tensors: list[tuple[str, torch.Tensor]] = []
        if type(output) is torch.Tensor:
            if output.is_floating_point():
                tensors.append((name, output))
        else:
            _flatten(output, name, tensors)
        if in_backward():
            # activation checkpointing recomputing the forward: its activations were seen
            # already. Reentrant checkpointing ran the first forward without grad, so the
            # output gradients flow through these recomputed outputs (non-reentrant
            # checkpointing never backpropagates through them: their hooks stay silent).
            # A tensor passing through the block (an input returned, as T5 returns its
            # position_bias) was hooked in the first forward: not again, neither the
            # tensor itself (non-reentrant) nor reentrant's detached copy of it (a leaf,
            # which sees only the block's share of the gradient).
            if want_grad:
                for tname, t in tensors:
                    if (
                        t.requires_grad
                        and t.grad_fn is not None
                        and not _hooked(t, (id(tr), tname))
                    ):
                        t.register_hook(_grad_hook_of(grad_hooks, tr, tname, mod))
            return
        for tname, t in tensors:
            if want_act:
                tr._observe_site(_site_of(sites, tr, tname, mod), t)
            if want_grad and t.requires_grad:
                t.register_hook(_grad_hook_of(grad_hooks, tr, tname, mod))

    return others


class _Batch:
    """The names, kinds and owners of tensors summarized together at every step (a step's
    weights, the gradients of one optimizer's parameters, the optimizer state), found once
    and kept while they stay the same, with a :class:`_Plan` per combination of the
    tensors' dtypes (see :meth:`Tracker._summaries_batch`)."""

    __slots__ = ("names", "kinds", "owners", "plans", "guard")

    def __init__(
        self,
        names: Sequence[str],
        kinds: Sequence[str],
        owners: Sequence[nn.Module],
    ) -> None:
        self.names, self.kinds, self.owners = tuple(names), tuple(kinds), tuple(owners)
        self.plans: dict[tuple[torch.dtype, ...], _Plan] = {}
        # after a batch launch took the tensors: a tensor_guard of them, the plan that took
        # them and their element counts (a later step's tensors that pass the guard are
        # taken by the same plan, and their launch reads only their addresses)
        self.guard: tuple[Callable[..., bool], _Plan, tuple[int, ...]] | None = None


class _Plan:
    """How a list of plain tensors is summarized: their row keys and layouts, the groups
    of them sharing a layout (``(layout, indices)``), what the capture check names
    (``first``), which of a batch's tensors are kept (``keep``: ``None``, all), and the last
    entries made with the summaries they hold (``raws``), returned again when the
    workspace hands back the same list of slots."""

    __slots__ = (
        "keys",
        "layouts",
        "groups",
        "first",
        "keep",
        "no_extras",
        "raws",
        "entries",
        "uniform",
        "launch",
        "prepared",
    )

    def __init__(
        self,
        keys: list[TensorKey],
        layouts: list[Layout],
        groups: list[tuple[Layout, list[int]]],
        first: str,
    ) -> None:
        self.keys, self.layouts, self.groups, self.first = keys, layouts, groups, first
        self.keep: list[int] | None = None
        self.no_extras: list[dict[str, Any]] = []
        self.raws: Any = None
        self.entries: tuple[tuple[TensorKey, Layout, Any], ...] = ()
        # the tensors are of one dtype, and the fused launch of them all (made at their
        # first summary; ``None`` where they take another path)
        self.uniform = False
        self.launch: BatchLaunch | None = None
        self.prepared = False  # (whether ``launch`` was looked for)

    def entries_for(self, raws: Any) -> tuple[tuple[TensorKey, Layout, Any], ...]:
        """The entries of the summaries ``raws`` (the last ones again where the workspace
        handed back the same slots: the same object)."""
        if raws is not self.raws:
            self.raws, self.entries = raws, tuple(zip(self.keys, self.layouts, raws))
        return self.entries


class Tracker(TrackerCore[Flight | None]):
    """Tracks one module (and optionally its optimizers) during training.

    Create it with :func:`track` (same arguments) and use it as a context manager;
    call :meth:`step` once per training step, after the optimizer update. See
    :func:`track` for the arguments.
    """

    #: the PyTorch adapter the core calls (made by :meth:`__init__`, last)
    _adapter: TorchAdapter

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        track_weights: bool = True,
        track_optimizer: bool = True,
        track_buffers: bool = False,
        root_name: str = ROOT_NAME,
        track_eval: bool = False,
        scaler: Any = None,
        **options: Unpack[TrackKwargs],
    ) -> None:
        # this framework's options as given (first statement: locals() holds just the
        # arguments), for the log's record of how it was made
        own_options = {
            k: v for k, v in locals().items() if k not in ("self", "module", "optimizer", "options")
        }
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"track(module=...): expected a torch.nn.Module; got {type(module).__name__}"
            )
        opts = TrackOptions.of(options)
        # a compiled model is tracked through its original module (same names as in eager
        # mode), its activations by hooks that dynamo compiles into the graph (._compiled)
        module, self._is_compiled, self._wrapper = compiled_root(
            module, opts.track_activations or opts.track_gradients
        )
        module = unwrap_ddp(module)  # DDP's rows carry the model's own paths
        super().__init__(
            opts,
            type(module).__name__,
            re.sub(r"[^A-Za-z0-9_.-]+", "_", type(module).__name__.lower()),
        )
        self._ranks: TorchRanks | None = None
        optimizers = _optimizers_of(optimizer)
        if not isinstance(root_name, str) or not root_name:
            raise ValueError(f"root_name={root_name!r}: expected a non-empty string")
        self.module = module
        self.optimizers = optimizers
        self.kinds = {
            ACTIVATION: opts.track_activations,
            GRADIENT: opts.track_gradients,
            WEIGHT: bool(track_weights),
            OPTIMISER_STATE: bool(track_optimizer),
        }
        self.stat_fns = opts.stat_fns
        if opts.percentile_columns:
            from ._percentiles import percentile_stat

            self.stat_fns += (percentile_stat(opts.percentile_columns),)
        self.root_name = root_name
        self.track_eval = bool(track_eval)
        self.track_buffers = bool(track_buffers)
        self.track_updates = opts.track_updates
        if self.track_updates and not optimizers:
            raise ValueError(
                "track(track_updates=True): updates are taken around the optimizer's step; "
                "pass the optimizer: track(model, optimizer, track_updates=True)"
            )
        self._take_scaler(scaler)
        self._name_tensors(module, root_name)
        self._new_caches()
        self._adapter = TorchAdapter(
            self._workspace,
            module,
            opts,
            {
                **own_options,
                "optimizers": [type(o).__name__ for o in optimizers],
                # with a GradScaler, output gradients are in loss-scaled units
                "loss_scaled_output_gradients": scaler is not None,
                "compiled": self._is_compiled,
            },
            observe=self._start_observing,
            unobserve=self._stop_observing,
        )

    def _take_scaler(self, scaler: Any) -> None:
        """Keep ``scaler`` (a GradScaler or ``None``), checked: its scale fills the
        ``loss_scale`` column of output-gradient rows, merged by its maximum."""
        if scaler is not None and not callable(getattr(scaler, "unscale_", None)):
            raise TypeError(
                f"track(scaler=...): expected a torch.amp.GradScaler (with .unscale_); "
                f"got {type(scaler).__name__}"
            )
        self.scaler = scaler
        if scaler is not None:
            if LOSS_SCALE in self._merge_rules:
                raise ValueError(
                    f"stats: {LOSS_SCALE!r} is the column the tracker fills with the "
                    f"GradScaler's scale (scaler=...); rename your statistic"
                )
            self._merge_rules[LOSS_SCALE] = "max"

    def _name_tensors(self, module: nn.Module, root_name: str) -> None:
        """Names from identity: module path -> module, parameter object -> full path, and
        the floating buffers. Found at the start, and again after the model gained or
        replaced a parameter, buffer or submodule (see :meth:`_watch_structure`)."""
        self._module_ids = frozenset(id(m) for m in module.modules())
        self._modules: list[tuple[str, nn.Module]] = []
        self._param_names: dict[int, tuple[str, nn.Module]] = {}
        homes: dict[int, tuple[dict[str, Any], str]] = {}  # the owner's dict and key
        for mpath, m in module.named_modules():
            # containers without a forward (ModuleList, ModuleDict) never produce outputs
            if type(m).forward is not nn.Module.forward:
                self._modules.append((mpath or root_name, m))
        for mpath, m in module.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if id(p) not in self._param_names:
                    full = f"{mpath}.{pname}" if mpath else pname
                    self._param_names[id(p)] = (full, m)
                    homes[id(p)] = (m._parameters, pname)
        self._params: list[tuple[str, nn.Parameter, nn.Module]] = []
        for full, p in module.named_parameters():
            owner = self._param_names[id(p)][1]
            self._params.append((full, p, owner))
        # each parameter's place in its owner's `_parameters`, in the order of _params, for
        # the check that a parameter moved (_capture_weights)
        self._param_homes = (
            [homes[id(p)][0] for _, p, _ in self._params],
            [homes[id(p)][1] for _, p, _ in self._params],
            [p for _, p, _ in self._params],
        )
        # floating buffers (BatchNorm's running statistics): (path, owner, attribute), read
        # from the owner at each capture (a module may replace a buffer tensor)
        self._buffers = [
            (f"{mpath}.{b}" if mpath else b, m, b)
            for mpath, m in module.named_modules()
            for b, v in m.named_buffers(recurse=False)
            if v is not None and v.is_floating_point()
        ]

    def _new_caches(self) -> None:
        """The tracker's state while it runs, empty: the workspace, the hooks' handles, the
        gradients and observations of the step under way, and the caches that make each
        tensor's row key, layout and launch once."""
        self._last: tuple[weakref.ref[torch.Tensor], int, Layout, np.ndarray | Slot] | None = None
        self._workspace = Workspace()
        self._handles: list[Any] = []
        # the module forward hooks in place: each module's hook dictionary and the key
        # the hook has there (see _install)
        self._module_hooks: list[tuple[dict[int, Callable], int]] = []
        self._weights_hook: int | None = None  # its key (see _hook_weights)
        self._compiled: CompiledHooks | None = None
        self._active = False
        self._weights_done = False
        #: gradients captured for the optimizer step under way, by optimizer (``None``: at
        #: :meth:`step`), one entry per parameter; recorded when that step completes
        self._grads: dict[int | None, Sequence[tuple[TensorKey, Layout, np.ndarray | Slot]]] = {}
        self._grad_rows = 0  # parameter-gradient observations recorded in the current step
        # each optimizer's parameter lists at its last gradient capture of the current step
        # (see _optimizer_sign), by its id: the parameters it updated
        self._signs: dict[int, list[int]] = {}
        #: what a scheduled step has not yet recorded although asked: checked at each
        #: scheduled step until seen once, or told once (:meth:`_tell_unseen`)
        self._unseen = {
            kind
            for kind, wanted in (
                (ACTIVATION, self.kinds[ACTIVATION]),
                (GRADIENT, self.kinds[GRADIENT]),
            )
            if wanted
        }
        self._name_caches()
        #: set when a module of the model registered a parameter, buffer or submodule
        #: (see _watch_structure): the names are found again before they are next used
        self._renamed = False
        self._rehook_due = False  # (names found again, the module hooks not yet replaced)
        self._structure_handles: list[Any] = []

    def _name_caches(self) -> None:
        """The caches made from the model's names, empty: at the start, and again whenever
        the names are found again (:meth:`_refresh_names`)."""
        # (name, kind, dtype) of a parameter, gradient or state -> its row key and its
        # layout without custom statistics: looked up once per tensor, not per step
        self._observed_keys: dict[tuple[str, str, torch.dtype], tuple[TensorKey, Layout]] = {}
        # the optimizer state's batch, what it was found from, what takes its tensors from
        # the state values (by their positions there) and the weak references to them that
        # died (see _state_batch; the references themselves are _state_refs)
        self._state_cache: (
            tuple[list[Any], _Batch, Callable[[list[Any]], Sequence[Any]], list[Any]] | None
        ) = None
        self._state_refs: list[weakref.ref[Any]] = []
        # the same for activations and output gradients, by (name, kind, dtype, on CUDA),
        # with the fused kernel's spec (None: another path)
        self._hook_keys: dict[
            tuple[str, str, torch.dtype, bool], tuple[TensorKey, Layout, Any]
        ] = {}
        self._weight_params: list[tuple[str, nn.Parameter, nn.Module]] | None = None
        self._weight_batch: _Batch | None = None  # (their batch and tensors)
        self._weight_tensors: list[nn.Parameter] = []
        #: the plans of the items _summaries_plain has seen, by their names, kinds and
        #: dtypes
        self._batch_plans: dict[tuple[Any, ...], _Plan] = {}
        # the selected parameters whose gradients are captured and their batch, by
        # optimizer (see _grad_params), with what they were found from
        self._grad_param_cache: dict[int | None, tuple[list[Any], list[torch.Tensor], _Batch]] = {}
        # the hooks' sites, by (name, kind): see _site
        self._sites: dict[tuple[str, str], _HookSite] = {}
        # each module's forward hook, made at its first install, by the module's name: the
        # module, the hook's key in its hook dictionary, the hook (see _install)
        self._forward_hook_cache: dict[str, tuple[nn.Module, int, Callable]] = {}

    # ------------------------------------------------------------------ dry run

    def plan(self) -> pd.DataFrame:
        """What would be tracked, without training: one row per (name, tensor_type, type).

        Activations and output gradients are listed by module path; a module whose output
        is a tuple/dict gets one row per floating tensor inside (``path[i]``/``path[key]``)
        once it runs, which a dry run cannot know. Optimizer state is listed for the state
        that exists now (most optimizers create it lazily at their first step)."""
        rows = []
        for name, m in self._modules:
            if self._selected(name, type(m)):
                for kind in (ACTIVATION, GRADIENT):
                    if self.kinds[kind]:
                        rows.append((name, kind, module_type(m)))
        for full, p, owner in self._params:
            if self._selected(full, type(owner)):
                for kind in (WEIGHT, GRADIENT):
                    if self.kinds[kind] and (kind == WEIGHT or p.requires_grad):
                        rows.append((full, kind, module_type(owner)))
        if self.kinds[WEIGHT] and self.track_buffers:
            rows += [
                (full, WEIGHT, module_type(owner))
                for full, owner, _ in self._buffers
                if self._selected(full, type(owner))
            ]
        if self.kinds[OPTIMISER_STATE]:
            for name, _value, owner in self._optimizer_state():
                if self._selected(name, type(owner)):
                    rows.append((name, OPTIMISER_STATE, module_type(owner)))
        return pd.DataFrame(rows, columns=["name", "tensor_type", "type"])

    # ------------------------------------------------------------------ observing

    def _summary(
        self,
        name: str,
        kind: str,
        owner: nn.Module,
        x: torch.Tensor,
        site: _HookSite | None = None,
    ) -> tuple[TensorKey, Layout, np.ndarray | Slot] | None:
        """An activation's or output gradient's summary (``None``: not tracked). ``site``:
        the hook's, given the fused launch of ``x``'s dtype where the fused kernel reads
        ``x`` with nothing else to write (no custom statistic, no loss scale, no shard)."""
        dtype, cuda = x.dtype, x.is_cuda
        known = self._hook_keys.get((name, kind, dtype, cuda))
        if known is None:  # the row key, the layout and the path, found once per tensor
            key = self._key(name, kind, module_type(owner), dtype)
            base = self._layout(dtype, ())
            known = self._hook_keys[(name, kind, dtype, cuda)] = (
                key,
                base,
                fused_spec(x, base) if type(x) is torch.Tensor else None,
            )
        key = known[0]
        if cuda and torch.cuda.is_current_stream_capturing():
            what = "output gradient" if kind == GRADIENT else "output"
            raise _capture_error(f"the {what} of module {name!r}")
        part = x  # the common case, decided without a call
        if type(x) is not torch.Tensor or self._ranks is not None:
            shard = local_part(x, key, True, self._ranks)  # a DTensor's shard; notes the role
            if shard is None:
                return None
            part = shard
        if (
            site is not None
            and known[2] is not None
            and (
                site.launch is None
                or site.dtype is not dtype
                or site.launch.space.device != x.device
            )
            and part is x
            and not self.stat_fns
            and not (kind == GRADIENT and self.scaler is not None)
        ):  # the launch of the site's later tensors (made here also when this one is reused
            # below: a container returning its child's output takes the fast path next time)
            site.dtype, site.key, site.layout, site.cuda = dtype, key, known[1], cuda
            site.launch = self._workspace.hook_launch(known[2], known[1], x.device)
        last = self._last
        if last is not None and last[0]() is x and last[1] == x._version:
            # The same tensor again, unchanged: a container returning its last child's
            # output (``mlp`` and ``mlp.fc2``, the root and its head) or the gradient both
            # receive. Reuse its summary instead of reducing it twice. The tensor is held
            # by a weak reference: the root's output (the logits) must not live on through
            # the loss and the backward pass because the tracker saw it.
            return key, last[2], last[3]
        d = part.detach()
        extras = self._extras(d) if self.stat_fns else {}
        if kind == GRADIENT and self.scaler is not None and self.scaler.is_enabled():
            scale = getattr(self.scaler, "_scale", None)  # the device tensor: no sync
            if scale is not None:  # output gradients are in loss-scaled units: log the scale
                extras[LOSS_SCALE] = scale
        lay = self._layout(d.dtype, tuple(extras)) if extras else known[1]
        spec = known[2] if part is x else fused_spec(d, lay)
        summary = self._workspace.summary(d, lay, extras, spec)
        # (a weak reference: a dead tensor cannot be seen again, and a new tensor at the
        # same address is another object)
        self._last = (weakref.ref(x), x._version, lay, summary)
        return key, lay, summary

    def _summaries(
        self, items: Sequence[tuple[str, str, nn.Module, torch.Tensor]]
    ) -> Sequence[tuple[TensorKey, Layout, np.ndarray | Slot]]:
        """:meth:`_summary` of several distinct tensors (parameters, their gradients,
        optimizer state) at once: tensors sharing a layout are reduced together (one host
        kernel call for the CPU tensors, one fused launch per device and dtype)."""
        if items and self._ranks is None and not self.stat_fns:
            fast = self._summaries_plain(items)
            if fast is not None:
                return fast
        keys: list[TensorKey] = []
        layouts: list[Layout] = []
        extras: list[dict[str, Any]] = []
        tensors: list[torch.Tensor] = []
        known_keys = self._observed_keys
        plain = self._ranks is None
        custom = bool(self.stat_fns)
        no_extras: dict[str, Any] = {}
        for name, kind, owner, x in items:
            dtype = x.dtype
            known = known_keys.get((name, kind, dtype))
            if known is None:
                key = self._key(name, kind, module_type(owner), dtype)
                known = known_keys[(name, kind, dtype)] = (key, self._layout(dtype, ()))
            key = known[0]
            part = x
            if not (plain and type(x) in _PLAIN):
                shard = local_part(x, key, False, self._ranks)  # a DTensor's local shard
                if shard is None:
                    continue
                part = shard
            if len(keys) == 0 and part.is_cuda and torch.cuda.is_current_stream_capturing():
                raise _capture_error(f"{kind} {name!r}")
            d = part.detach() if part.requires_grad else part
            keys.append(key)
            tensors.append(d)
            if custom:
                ex = self._extras(d)
                extras.append(ex)
                layouts.append(self._layout(d.dtype, tuple(ex)))
            else:
                extras.append(no_extras)
                layouts.append(known[1])
        by_layout: dict[int, tuple[Layout, list[int]]] = {}  # by identity: layouts are cached
        for i, lay in enumerate(layouts):
            by_layout.setdefault(id(lay), (lay, []))[1].append(i)
        raws: list[Any] = [None] * len(keys)
        for lay, idx in by_layout.values():
            got = self._workspace.summaries(
                [tensors[i] for i in idx], lay, [extras[i] for i in idx]
            )
            for i, raw in zip(idx, got):
                raws[i] = raw
        return list(zip(keys, layouts, raws))

    def _summaries_plain(
        self, items: Sequence[tuple[str, str, nn.Module, torch.Tensor]]
    ) -> Sequence[tuple[TensorKey, Layout, np.ndarray | Slot]] | None:
        """:meth:`_summaries` of plain tensors (no subclass) without custom statistics on
        one process, with the row keys and layouts of the items' names, kinds and dtypes
        found once (:attr:`_batch_plans`) rather than item by item at every step; ``None``
        where the items are not all plain tensors."""
        tensors = list(map(_fourth, items))
        if not set(map(type, tensors)) <= _PLAIN_TYPES:
            return None
        sig = (
            tuple(map(_first, items)),
            tuple(map(_second, items)),
            tuple(map(_dtype_of, tensors)),
        )
        plan = self._batch_plans.get(sig)
        if plan is None:
            if len(self._batch_plans) >= 64:  # (items that keep changing: found afresh)
                self._batch_plans.clear()
            plan = self._batch_plans[sig] = self._plan(
                sig[0], sig[1], tuple(map(_third, items)), sig[2]
            )
        return self._summarize_plan(plan, tensors)

    def _summaries_batch(
        self, batch: _Batch, tensors: Sequence[Any]
    ) -> Sequence[tuple[TensorKey, Layout, np.ndarray | Slot]]:
        """:meth:`_summaries` of ``batch``'s tensors, ``tensors`` (in its order; ``None``
        and tensors not floating-point are skipped): a step's weights, gradients or
        optimizer state. The items' names, kinds and owners are ``batch``'s, found once;
        per step, the tensors' types and dtypes are read in two passes that run in C (no
        Python loop per tensor), and where the rows come back the same (a training loop's
        steady state), so do the returned entries. The plan's batch launch, once made, is
        called here (:meth:`_summarize_plan` when it declines the tensors: that one makes
        it, and takes the other paths).

        Once the launch has taken the tensors, a :func:`tensor_guard` of them is kept
        with the plan: at later steps, tensors that pass it (one call of C++ that reads
        each tensor's type, dtype, device, dispatch keys, sizes and strides) go to the same
        plan's launch, which then reads their addresses alone. That spares four of the five
        questions asked of each of the step's hundreds of tensors (about 0.1 microseconds
        each on the 2-core CPU)."""
        guard = batch.guard
        sizes: tuple[int, ...] | None
        # (a guard is made only where the launch took the tensors: never with several ranks
        # or custom statistics, which a tracker keeps for its life)
        if guard is not None and guard[0](*tensors):
            plan, sizes = guard[1], guard[2]
        else:
            batch.guard = sizes = None
            found = self._batch_plan(batch, tensors)
            if found is None:
                return self._summaries(
                    [
                        (name, kind, owner, t)
                        for name, kind, owner, t in zip(
                            batch.names, batch.kinds, batch.owners, tensors
                        )
                        if t is not None and t.is_floating_point()
                    ]
                )
            plan = found
            if plan.keep is not None:
                tensors = [tensors[i] for i in plan.keep]
        launch = plan.launch
        if launch is not None:  # (of plain tensors of one dtype, two or more: one group)
            if launch.space.cuda and torch.cuda.is_current_stream_capturing():
                raise _capture_error(plan.first)
            raws = launch.summarize(tensors, sizes)
            if raws is not None:
                if sizes is None and plan.keep is None:  # (every item a tensor it took)
                    check = tensor_guard(tensors)
                    if check is not None:
                        batch.guard = (check, plan, launch.ns)
                return plan.entries_for(raws)
            batch.guard = None
        return self._summarize_plan(plan, tensors) if tensors else []

    def _batch_plan(self, batch: _Batch, tensors: Sequence[Any]) -> _Plan | None:
        """The plan of ``batch``'s ``tensors`` by their dtypes, made at their first step
        (told by two passes that run in C); ``None`` where they take the general path
        (not all plain tensors, custom statistics, several ranks)."""
        types = set(map(type, tensors))
        if self._ranks is not None or self.stat_fns or not types <= _PLAIN_TYPES:
            return None
        dtypes = tuple(map(_dtype_of, tensors))
        plan = batch.plans.get(dtypes)
        if plan is None:
            keep = [i for i, d in enumerate(dtypes) if d.is_floating_point]
            if len(batch.plans) >= 8:  # (dtypes that keep changing: found afresh)
                batch.plans.clear()
            plan = batch.plans[dtypes] = self._plan(
                tuple(batch.names[i] for i in keep),
                tuple(batch.kinds[i] for i in keep),
                tuple(batch.owners[i] for i in keep),
                tuple(dtypes[i] for i in keep),
            )
            plan.keep = None if len(keep) == len(tensors) else keep
        return plan

    def _plan(
        self,
        names: tuple[str, ...],
        kinds: tuple[str, ...],
        owners: tuple[nn.Module, ...],
        dtypes: tuple[torch.dtype, ...],
    ) -> _Plan:
        """The :class:`_Plan` of plain tensors of ``dtypes`` named ``names`` (of ``kinds``,
        owned by ``owners``)."""
        keys: list[TensorKey] = []
        layouts: list[Layout] = []
        for name, kind, owner, dtype in zip(names, kinds, owners, dtypes):
            ck = (name, kind, dtype)
            known = self._observed_keys.get(ck)
            if known is None:
                key = self._key(name, kind, module_type(owner), dtype)
                known = self._observed_keys[ck] = (key, self._layout(dtype, ()))
            keys.append(known[0])
            layouts.append(known[1])
        by_layout: dict[int, tuple[Layout, list[int]]] = {}  # (layouts are cached)
        for i, lay in enumerate(layouts):
            by_layout.setdefault(id(lay), (lay, []))[1].append(i)
        first = f"{kinds[0]} {names[0]!r}" if names else ""
        plan = _Plan(keys, layouts, list(by_layout.values()), first)
        plan.uniform = len(set(dtypes)) == 1
        return plan

    def _summarize_plan(
        self, plan: _Plan, tensors: Sequence[torch.Tensor]
    ) -> Sequence[tuple[TensorKey, Layout, np.ndarray | Slot]]:
        """The entries of ``tensors`` (plain, of ``plan``'s items). They are not detached:
        the fused kernel reads their memory, and the host and torch-op paths detach what
        they compute on."""
        if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise _capture_error(plan.first)
        keys, layouts, groups = plan.keys, plan.layouts, plan.groups
        if len(plan.no_extras) != len(tensors):
            plan.no_extras = [{}] * len(tensors)
        no_extras = plan.no_extras
        if len(groups) == 1:
            raws: Sequence[np.ndarray | Slot] | None = None
            if plan.uniform and len(tensors) > 1:  # one launch, prepared (see BatchLaunch)
                launch = plan.launch
                if not plan.prepared or (
                    launch is not None and launch.device != tensors[0].get_device()
                ):
                    launch = plan.launch = self._workspace.batch_launch(tensors[0], layouts[0])
                    plan.prepared = True
                if launch is not None:
                    raws = launch.summarize(tensors)
            if raws is None:
                raws = self._workspace.summaries(tensors, layouts[0], no_extras)
            return plan.entries_for(raws)
        merged: list[Any] = [None] * len(tensors)
        for lay, idx in groups:
            got = self._workspace.summaries([tensors[i] for i in idx], lay, no_extras[: len(idx)])
            for i, raw in zip(idx, got):
                merged[i] = raw
        return list(zip(keys, layouts, merged))

    def _extras(self, d: torch.Tensor) -> dict[str, Any]:
        """The custom statistics of ``d``, by name."""
        extras: dict[str, Any] = {}
        for fn in self.stat_fns:
            got = fn(d)
            if not isinstance(got, MappingABC):
                raise TypeError(
                    f"custom statistic {getattr(fn, '__name__', fn)!r} returned "
                    f"{type(got).__name__}; it must return a mapping name -> scalar"
                )
            extras.update(got)
        return extras

    def _observe_site(self, site: _HookSite, x: torch.Tensor) -> None:
        """The observation of a hook's tensor ``x`` at ``site``: by the site's fused launch
        when it reads ``x`` (see :class:`_HookSite`), else by :meth:`_summary`.

        The hot path of every hook: it asks ``x`` for its dtype, device, layout, size and
        version, runs no torch operation, and keeps the observation in
        :attr:`_hook_rows` (handed to the recorder before anything else reads or adds to
        it: see :attr:`recorder`)."""
        launch = site.launch
        if launch is not None and x.dtype is site.dtype and type(x) is torch.Tensor:
            last = self._last
            if last is not None and last[0]() is x and last[1] == x._version:
                # the same tensor again, unchanged (see _summary)
                entry = (site.key, last[2], last[3])
            else:
                if site.cuda and torch.cuda.is_current_stream_capturing():
                    raise _site_capture_error(site)
                slot = launch.summarize(x)
                if slot is None:  # not a tensor the launch reads
                    self._observe_slow(site, x)
                    return
                self._last = (weakref.ref(x), x._version, site.layout, slot)
                entry = (site.key, site.layout, slot)
            rows = self._hook_rows
            rows.append(entry)
            if len(rows) >= _HOOK_ROWS:  # (handed over in small lists: see _HOOK_ROWS)
                self._hand_over()
            return
        self._observe_slow(site, x)

    def _observe_slow(self, site: _HookSite, x: torch.Tensor) -> None:
        """:meth:`_observe_site` by :meth:`_summary`, which makes the site's launch where
        the fused kernel reads ``x``."""
        if x.is_floating_point():
            entry = self._summary(site.name, site.kind, site.owner, x, site)
            if entry is not None:
                self.recorder.add(*entry)  # type: ignore[union-attr]

    @property
    def recorder(self) -> StepRecorder | None:
        """The log's recorder of the steps (``None`` before the log opens). The hooks'
        fast path keeps its observations in :attr:`_hook_rows` rather than calling the
        recorder for each: every use of the recorder (adding other observations, ending
        or dropping the step, asking what it holds) hands them over first, in the order
        they came, so the recorder sees every observation in order, as if each had been
        added at once."""
        if self._hook_rows:
            self._hand_over()
        return self._recorder

    @recorder.setter
    def recorder(self, value: StepRecorder | None) -> None:
        self._recorder = value
        self._hook_rows: list[tuple[TensorKey, Layout, Any]] = []

    def _hand_over(self) -> None:
        """Add the hooks' observations kept in :attr:`_hook_rows` to the recorder."""
        rows, self._hook_rows = self._hook_rows, []
        if self._recorder is not None:
            self._recorder.add_many(rows, self._most_bytes)

    def _capture_weights(self, rehook: bool = False) -> None:
        """The step's weights (once per scheduled step, its first capture): first the
        model's changes are followed (see :meth:`_refresh_names`; ``rehook`` from the
        step's first module call, before any module's hooks run)."""
        self._weights_done = True
        # whether a parameter found at the last naming is no longer where it was: its
        # module's ``_parameters`` holds another one under its name, or none. That covers
        # what the registration hooks cannot see (``del module.weight``, a parameter put
        # straight into the dictionary, as ``Module._apply`` does in PyTorch's overwrite
        # mode), in two passes that run in C (a dictionary lookup and an identity test per
        # parameter)
        dicts, names, params = self._param_homes
        if not all(map(is_, map(dict.get, dicts, names), params)):
            self._renamed = True
        if self._renamed or (rehook and self._rehook_due):
            self._refresh_names(rehook)
        if not self.kinds[WEIGHT]:
            return
        if self._weight_params is None:  # the selection is made once
            self._weight_params = [
                (full, p, owner)
                for full, p, owner in self._params
                if self._selected(full, type(owner))
            ]
            self._weight_batch = _Batch(
                list(map(_first, self._weight_params)),
                [WEIGHT] * len(self._weight_params),
                list(map(_third, self._weight_params)),
            )
            self._weight_tensors = list(map(_second, self._weight_params))
        recorder = self.recorder
        assert recorder is not None and self._weight_batch is not None
        recorder.add_many(
            self._summaries_batch(self._weight_batch, self._weight_tensors), self._most_bytes
        )
        if self.track_buffers:
            items = [
                (full, WEIGHT, owner, getattr(owner, attr))
                for full, owner, attr in self._buffers
                if self._selected(full, type(owner)) and getattr(owner, attr, None) is not None
            ]
            recorder.add_many(self._summaries(items), self._most_bytes)

    def _capture_grads(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Summarize the current ``.grad`` of each selected parameter that ``optimizer``
        updates (``None``: of those no tracked optimizer updates), as the gradients of its
        step under way: a later capture for the same step replaces them (the last look
        before the update defines them: after unscaling and clipping, after the closure's
        last call). Returns whether there was any such parameter."""
        params, batch = self._grad_params(optimizer)
        if not params:  # (none where every parameter is an optimizer's, for ``None``)
            return False
        entries = self._summaries_batch(batch, list(map(_grad_of, params)))
        key = None if optimizer is None else id(optimizer)
        earlier = self._grads.get(key)
        if earlier:  # replaced by name, in the order first captured
            by_name = {entry[0].name: entry for entry in earlier}
            by_name.update((entry[0].name, entry) for entry in entries)
            entries = list(by_name.values())
        self._grads[key] = entries
        return True

    def _grad_params(
        self, optimizer: torch.optim.Optimizer | None
    ) -> tuple[list[torch.Tensor], _Batch]:
        """The selected parameters whose gradients :meth:`_capture_grads` reads for
        ``optimizer`` (``None``: those no tracked optimizer updates), with the batch of
        their gradients' names and owners: found again only when an optimizer's parameter
        lists change (told by :func:`_optimizer_sign`), not at every capture.

        An optimizer's lists are read at each of its captures; ``None`` (at
        ``tracker.step()``) takes each optimizer's lists as its last capture of the step
        read them (an optimizer that captured none this step: as they are now). So the
        parameters an optimizer updated this step are those left out at ``tracker.step()``,
        whatever its lists became since: a parameter group added after its update is not
        yet updated, and its gradients are captured at ``tracker.step()``; a parameter
        dropped after its update is not captured a second time. (It also spares
        ``tracker.step()`` reading the lists again.)"""
        if self._renamed:
            self._refresh_names()
        sign: list[Any]
        cache_key = None if optimizer is None else id(optimizer)
        cached = self._grad_param_cache.get(cache_key)
        if optimizer is not None:
            sign = _optimizer_sign(optimizer)
            if cached is not None and cached[0] == sign:  # (the list: no tuple made of it)
                # (the cached list itself: the None capture's key finds it by identity)
                self._signs[id(optimizer)] = cached[0]
                return cached[1], cached[2]
            self._signs[id(optimizer)] = sign
        else:  # each optimizer's sign (lists of the same objects: compared by identity)
            signs = [self._signs.get(id(opt)) or _optimizer_sign(opt) for opt in self.optimizers]
            sign = signs
            if cached is not None and cached[0] == sign:
                return cached[1], cached[2]
        params: list[tuple[str, torch.Tensor, nn.Module]]
        if optimizer is None:
            owned: set[int] = set()
            for got in signs:
                owned.update(_signed_params(got))
            params = [(full, p, owner) for full, p, owner in self._params if id(p) not in owned]
        else:
            names = self._param_names
            params = [
                (names[id(p)][0], p, names[id(p)][1])
                for p in _params_of(optimizer)
                if id(p) in names
            ]
        params = [
            (full, p, owner) for full, p, owner in params if self._selected(full, type(owner))
        ]
        tensors = list(map(_second, params))
        batch = _Batch(
            list(map(_first, params)), [GRADIENT] * len(params), list(map(_third, params))
        )
        self._grad_param_cache[cache_key] = (sign, tensors, batch)
        return tensors, batch

    def _commit_grads(self, optimizer: int | None) -> None:
        """Record the gradients captured for the step of the optimizer whose ``id`` is
        ``optimizer`` (it has updated, or the tracked step ends; ``None``: the parameters
        no tracked optimizer updates): an optimizer stepping twice in a tracked step gives
        two observations, merged like micro-batches."""
        captured = self._grads.pop(optimizer, None)
        if captured:
            recorder = self.recorder
            if recorder is not None:
                recorder.add_many(captured, self._most_bytes)
                self._grad_rows += len(captured)

    def _state_batch(self) -> tuple[_Batch, Sequence[Any]]:
        """The selected optimizer state tensors, as :meth:`_summaries_batch` takes them.

        Finding them walks every parameter's state through ``opt.state.get(p)``, which
        hashes each parameter with Python's ``Tensor.__hash__``, and tests every state
        value: the batch is kept while the optimizers hold the same state, told by the
        identities of their parameter lists (and their lengths), of the parameters that
        have state, of every state value in the order of the state dicts, and the dicts'
        lengths, read in passes that run in C, without hashing a tensor. The values'
        sequence changes with any change of which tensors the state holds or of their order
        (a value added, removed or replaced; a state dict added, removed or replaced by one
        holding other values), the parameters' and the lengths' with any change of whose
        state a value is; the dicts' keys themselves (strings, compared by identity first,
        and kept by the sign), which name the rows, with a value put back under another
        key; a dict replaced by one holding the same keys and values changes nothing the
        batch depends on, so the dicts' own identities are not read (the lengths are read
        after the values, when the dicts are in cache: read first, each dict a separate
        object, the two passes cost ~20 microseconds a step). The tensors are held by weak
        references (the tracker keeps no state alive): while they live, their identities are
        theirs, so equal identities are the same tensors at the same places, and they are
        taken from the state values by their positions there (one ``itemgetter`` call). A
        tensor's death is told by its weak reference's callback, not by asking each
        reference at each step."""
        if self._renamed:
            self._refresh_names()
        sign: list[Any] = []
        values: list[Any] = []  # every state value, in the optimizers' order
        for opt in self.optimizers:
            sign.append(-1)  # (an optimizer's boundary)
            lists = list(map(_params_key, opt.param_groups))
            sign += map(id, lists)
            sign += map(len, lists)
            sign += map(id, opt.state)
            states = list(opt.state.values())
            n = len(values)
            try:  # (dict.values, a method of C, where methodcaller costs twice its time)
                values += chain.from_iterable(map(dict.values, states))
            except TypeError:  # a state that is another mapping (from its first value again)
                del values[n:]
                values += chain.from_iterable(map(_values, states))
            sign += map(len, states)
            sign += chain.from_iterable(states)  # the keys themselves, which name the rows
        sign += map(id, values)
        cached = self._state_cache
        if cached is not None:
            try:  # (a key that is not a string, compared with another, may refuse a bool)
                same = cached[0] == sign and not cached[3]  # (no tuple made)
            except (RuntimeError, TypeError, ValueError):
                same = False
            if same:
                # the batch's tensors, where they lie among the values; the same objects as
                # those the batch was found for while those live (equal identities)
                return cached[1], cached[2](values)
        items = [
            (name, value, owner)
            for name, value, owner in self._optimizer_state()
            if self._selected(name, type(owner))
        ]
        tensors = list(map(_second, items))
        batch = _Batch(
            list(map(_first, items)),
            [OPTIMISER_STATE] * len(items),
            list(map(_third, items)),
        )
        at = {id(v): i for i, v in enumerate(values)}
        died: list[Any] = []  # (a weak reference of each tensor that died, by its callback)
        self._state_refs = [weakref.ref(t, died.append) for t in tensors]
        self._state_cache = (sign, batch, _taker([at[id(t)] for t in tensors]), died)
        return batch, tensors

    def _optimizer_state(self) -> Iterator[tuple[str, torch.Tensor, nn.Module]]:
        for oi, opt in enumerate(self.optimizers):
            # a vector over all the optimizer's parameters at once (LBFGS keeps its
            # direction and previous gradient so, under its first parameter) is state of the
            # optimizer, not of that parameter: ``optimizer<i>.<key>``
            flat = -1  # (counted when a state tensor's size differs from its parameter's)
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    state = opt.state.get(p)
                    if not state:
                        continue
                    known = self._param_names.get(id(p))
                    if known is None:
                        base, owner = f"optimizer{oi}.param_groups.{gi}.{pi}", self.module
                    else:
                        base, owner = known
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                            if v.numel() != p.numel() and flat < 0:
                                flat = sum(q.numel() for q in _params_of(opt))
                            if v.numel() == flat != p.numel():
                                yield f"optimizer{oi}.{k}", v, self.module
                            else:
                                yield f"{base}.{k}", v, owner

    def _tell_unseen(self, recorder: Any) -> None:
        """Warn, once per kind, when a scheduled step ends with no activation or no
        parameter gradient although the tracker was asked for them and has some to
        record: the loop leaves nothing where the tracker looks (rows silently absent
        otherwise)."""
        step = self.step_index
        if ACTIVATION in self._unseen and (
            recorder.has_pending_type(ACTIVATION)
            or not any(self._selected(n, type(m)) for n, m in self._modules)
        ):
            self._unseen.discard(ACTIVATION)
        elif ACTIVATION in self._unseen:
            self._unseen.discard(ACTIVATION)
            warnings.warn(
                f"tandv: step {step} recorded no activation: no training-mode forward of a "
                f"tracked module ran where the tracker's hooks see it. A module in eval mode "
                f"is skipped (track(..., track_eval=True) records it); a compiled wrapper of "
                f"the tracked module (torch.compile(model)) runs its forward inside a graph "
                f"the tracker was not given: track the compiled module, "
                f"track(torch.compile(model), ...), to record inside the graph. Said once.",
                RuntimeWarning,
                stacklevel=3,
            )
        if GRADIENT in self._unseen and (
            self._grad_rows
            or not any(p.requires_grad and self._selected(n, type(o)) for n, p, o in self._params)
        ):
            self._unseen.discard(GRADIENT)
        elif GRADIENT in self._unseen:
            self._unseen.discard(GRADIENT)
            how = (
                "no tracked optimizer stepped (a GradScaler skipping the step: pass "
                "track(..., scaler=scaler)) and no other parameter had a .grad"
                if self.optimizers
                else "no parameter had a .grad at tracker.step(): optimizer.zero_grad() "
                "before tracker.step() clears them. Pass the optimizer, track(model, "
                "optimizer), to capture them just before its update, or call "
                "tracker.step() before zero_grad()"
            )
            warnings.warn(
                f"tandv: step {step} recorded no parameter gradient: {how}. Said once.",
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ hooks

    def _site(self, name: str, kind: str, owner: nn.Module) -> _HookSite:
        """The :class:`_HookSite` of ``name``'s ``kind``: one per tracker, kept while the
        hooks come and go (they are installed anew at each scheduled step after an
        unscheduled one), so its launch is made once."""
        site = self._sites.get((name, kind))
        if site is None:
            site = self._sites[(name, kind)] = _HookSite(name, kind, owner)
        return site

    def _make_forward_hook(self, name: str, module: nn.Module) -> Callable:
        """The forward hook of module ``name``: its output's activation and output-gradient
        hook, written out for the common case (one plain tensor, in a forward pass); the
        rest goes to :func:`_other_outputs`. It holds the tracker weakly (the module's hooks
        keep it: it must not keep the tracker)."""
        want_act, want_grad = self.kinds[ACTIVATION], self.kinds[GRADIENT]
        ref = weakref.ref(self)
        site = self._site(name, ACTIVATION, module)
        grad_hook = self._make_grad_hook(name, module) if want_grad else None
        others = _other_outputs(name, site, grad_hook, want_act, want_grad)

        def hook(mod: nn.Module, args: Any, output: Any) -> None:
            # inside a graph of a compiled wrapper (see _first_forward_hook); dynamo's own
            # test first, one frame where is_compiling() takes two: the other tracings
            # is_compiling() tells (non-strict export) run on tensor subclasses, which
            # others() asks it about
            if is_dynamo_compiling():
                return
            tr = ref()
            if tr is None or not tr._active or not (mod.training or tr.track_eval):
                return
            if type(output) is not torch.Tensor or _graph_task_id() != -1:
                others(tr, mod, output)
                return
            # The common case: one plain tensor, in a forward pass. The output-gradient hook
            # is added as Tensor.register_hook adds it to a plain tensor, without the handle
            # (never used: the hook lives and dies with the tensor), and
            # Tracker._observe_site is written out: each Python frame costs microseconds on
            # the cold caches a hook runs on (see benchmarks/host_cost.py).
            if grad_hook is not None and output.requires_grad:
                hooks = output._backward_hooks
                if hooks is None:
                    hooks = output._backward_hooks = OrderedDict()
                    grad_fn = output.grad_fn
                    if grad_fn is not None:
                        grad_fn._register_hook_dict(output)
                hooks[next(_hook_ids)] = grad_hook
            if not want_act:
                return
            launch = site.launch
            if launch is None or output.dtype is not site.dtype:
                tr._observe_slow(site, output)  # (a floating one only)
                return
            last = tr._last
            if last is not None and last[0]() is output and last[1] == output._version:
                entry = (site.key, last[2], last[3])  # (see _summary)
            else:
                if site.cuda and torch.cuda.is_current_stream_capturing():
                    raise _site_capture_error(site)
                slot = launch.summarize(output)
                if slot is None:  # not a tensor the launch reads
                    tr._observe_slow(site, output)
                    return
                tr._last = (_weak(output), output._version, site.layout, slot)
                entry = (site.key, site.layout, slot)
            rows = tr._hook_rows
            rows.append(entry)
            if len(rows) >= _HOOK_ROWS:  # (see _observe_site)
                tr._hand_over()

        return hook

    def _make_grad_hook(self, name: str, module: nn.Module) -> Callable:
        ref = weakref.ref(self)  # the module's hooks keep it: it must not keep the tracker
        site = self._site(name, GRADIENT, module)

        def grad_hook(g: torch.Tensor) -> None:
            if is_dynamo_compiling():  # (see the forward hook)
                return
            tr = ref()
            if tr is None or not tr._active or g is None:
                return
            # Tracker._observe_site written out (see the forward hook)
            launch = site.launch
            if launch is not None and g.dtype is site.dtype and type(g) is torch.Tensor:
                last = tr._last
                if last is not None and last[0]() is g and last[1] == g._version:
                    entry = (site.key, last[2], last[3])  # (see _summary)
                else:
                    if site.cuda and torch.cuda.is_current_stream_capturing():
                        raise _site_capture_error(site)
                    slot = launch.summarize(g)
                    if slot is None:  # not a tensor the launch reads
                        tr._observe_slow(site, g)
                        return
                    tr._last = (_weak(g), g._version, site.layout, slot)
                    entry = (site.key, site.layout, slot)
                rows = tr._hook_rows
                rows.append(entry)
                if len(rows) >= _HOOK_ROWS:  # (see _observe_site)
                    tr._hand_over()
                return
            tr._observe_slow(site, g)  # (a floating one only)

        setattr(grad_hook, _OUTPUT_GRAD_HOOK, (id(self), name))  # what _hooked looks for
        return grad_hook

    def _first_forward_hook(self, mod: nn.Module, args: Any) -> None:
        """Global forward pre-hook (scheduled steps only): weights are captured before the
        first forward of any of the model's modules, so they are those the step used even
        when a loop never calls the root module.

        Like every module hook of an eager tracker, it does nothing while dynamo traces it
        (``torch.compile(model)`` of the tracked model): dynamo sees one constant test, no
        graph break, and none of tandv's code (host kernels, numba) gets traced. Such
        forwards leave no activation rows (the tracker says so once), and the weights are
        captured before the optimizer's update; ``track(torch.compile(model))`` records
        inside the graph instead (:mod:`._compiled`)."""
        if (
            not self._weights_done  # (first: every module's call after the first ends here)
            and self._active
            and not is_compiling()
            and id(mod) in self._module_ids
            and (mod.training or self.track_eval)
        ):
            self._capture_weights(rehook=True)
            self._unhook_weights()

    def _optimizer_pre_hook(self, opt: Any, args: Any, kwargs: Any) -> Any:
        if not self._active:
            return None
        if not self._weights_done:
            self._capture_weights()
        # ``args`` holds the optimizer itself, then ``step``'s positional arguments
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            if self.kinds[GRADIENT]:
                self._capture_grads(opt)
            return None
        # ``step(closure)``: the closure computes the gradients (PyTorch Lightning always
        # steps this way), so they are captured after it, each time the optimizer calls it
        # (the last call's gradients are those of the update).
        ref = weakref.ref(self)

        def capturing_closure() -> Any:
            loss = closure()
            tr = ref()
            if tr is not None and tr._active and tr.kinds[GRADIENT]:
                tr._capture_grads(opt)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": capturing_closure}
        return (args[0], capturing_closure, *args[2:]), kwargs

    def _optimizer_post_hook(self, opt: Any, args: Any, kwargs: Any) -> None:
        """The update is done: its gradients (those of ``opt``'s parameters alone) are
        the step's rows."""
        if self._active:
            self._commit_grads(id(opt))

    def _install(self) -> None:
        """Hooks exist only while a scheduled step runs: unscheduled steps run the user's
        own code (a module with no hooks takes PyTorch's fast call path). A compiled
        model's module hooks stay for the tracker's life instead (:mod:`._compiled`).

        A module's forward hook is made once (until the names are found again) and put
        into the module's hook dictionary as ``register_forward_hook`` puts it, under a key
        of tandv's (negative: apart from torch's handles' ids), without a
        ``RemovableHandle``: with a schedule (``every=10``) the hooks are added and removed
        around every scheduled step, and new closures and handles for each module cost
        about half a millisecond of a scheduled step on the 2-core CPU."""
        if (self.kinds[ACTIVATION] or self.kinds[GRADIENT]) and not self._is_compiled:
            cache = self._forward_hook_cache
            for name, m in self._modules:
                if self._selected(name, type(m)):
                    got = cache.get(name)
                    if got is None or got[0] is not m:
                        got = cache[name] = (m, next(_hook_ids), self._make_forward_hook(name, m))
                    hooks = m._forward_hooks
                    hooks[got[1]] = got[2]
                    self._module_hooks.append((hooks, got[1]))
        for opt in self.optimizers:
            self._handles.append(opt.register_step_pre_hook(self._optimizer_pre_hook))
            self._handles.append(opt.register_step_post_hook(self._optimizer_post_hook))
        if self.track_updates:
            from ._updates import UpdateCapture

            self._handles += [UpdateCapture(_Seam(self), opt) for opt in self.optimizers]
        if self.scaler is not None and self.kinds[GRADIENT]:
            self._handles.append(_CaptureAfterUnscale(self))

    def _remove(self) -> None:
        for hooks, key in self._module_hooks:
            hooks.pop(key, None)
        self._module_hooks = []
        for h in self._handles:
            h.remove()
        self._handles = []
        self._unhook_weights()

    def _installed(self) -> bool:
        """Whether the scheduled step's hooks are in place (:meth:`_install`)."""
        return bool(self._handles or self._module_hooks)

    def _hook_weights(self) -> None:
        """Install :meth:`_first_forward_hook` for the step under way (a scheduled one): it
        removes itself once it has captured the step's weights (:meth:`_unhook_weights`), so
        the step's other module calls do not call it. (Where the step's weights were
        captured elsewhere, as under a compiled wrapper of the model, it stays: dynamo guards
        on the global hooks, and a hook added and removed at every step would recompile the
        wrapper's graph.) A compiled model's weights are captured before the optimizer
        update instead: dynamo would trace this hook and break the graph."""
        if self.kinds[WEIGHT] and not self._is_compiled and self._weights_hook is None:
            # put into torch's dictionary of global forward pre-hooks as
            # register_module_forward_pre_hook puts it, under a key of tandv's (negative:
            # apart from torch's handles' ids), without its RemovableHandle: added and removed
            # at every scheduled step, on the training thread's clock (the handle's frames and
            # weak reference cost microseconds on the cold caches between the model's
            # operations)
            key = next(_hook_ids)
            _torch_module._global_forward_pre_hooks[key] = self._first_forward_hook
            self._weights_hook = key

    def _unhook_weights(self) -> None:
        if self._weights_hook is not None:
            _torch_module._global_forward_pre_hooks.pop(self._weights_hook, None)
            self._weights_hook = None

    # ------------------------------------------------------------------ observer

    def _watch_structure(self) -> None:
        """Notice when a module of the tracked model registers a parameter, a submodule
        or (with ``track_buffers``) a buffer: ``module.weight = nn.Parameter(...)``, a
        layer added, pruning, a parametrization. PyTorch's global registration hooks mark
        the names stale, and :meth:`_refresh_names` finds them again before their next
        use. Without it the tracker would go on summarizing a replaced parameter (and keep
        it alive) under the new one's name, and miss what was added. The hooks cost
        nothing per step: they run only when something registers. What registers nothing
        (``del module.weight``, ``module.bias = None``, a parameter put straight into
        ``_parameters``) :meth:`_capture_weights` finds."""
        ref = weakref.ref(self)  # (global hooks: they must not keep the tracker)

        def registered(module: nn.Module, name: str, value: Any) -> None:
            tr = ref()
            if tr is not None and id(module) in tr._module_ids:
                tr._renamed = True

        self._structure_handles = [
            register_module_parameter_registration_hook(registered),
            register_module_module_registration_hook(registered),
        ]
        if self.track_buffers:  # (else buffers are not tracked: a cache some modules
            # register during their forward, as rotary embeddings do, changes nothing)
            self._structure_handles.append(register_module_buffer_registration_hook(registered))

    def _refresh_names(self, rehook: bool = False) -> None:
        """After the model's structure changed (:attr:`_renamed`): its tensors named
        again and every cache made from the names dropped (the weights', gradients' and
        state's batches, the row keys, the hooks' sites). With ``rehook``, the module hooks
        of a scheduled eager step are put on the modules as they are now, once after each
        such change; it is asked for only between steps and before a step's first module
        call, never while PyTorch calls the hooks being replaced."""
        if self._renamed:
            self._renamed = False
            self._name_tensors(self.module, self.root_name)
            self._name_caches()  # (hooks in place keep their sites until they are replaced)
            self._rehook_due = True
        if rehook and self._rehook_due:
            self._rehook_due = False
            if self._installed() and not self._is_compiled:
                weights_hooked = self._weights_hook is not None
                self._remove()
                self._install()
                if weights_hooked:
                    self._hook_weights()

    def _start_observing(self) -> None:
        """The adapter's start, once the workspace is ready: the ranks of a run over several
        processes (made by the adapter as the log opened: the hooks note each row's role
        there), the compiled model's hooks, and the first step's."""
        self._ranks = self._adapter.ranks
        if self._is_compiled:
            self._compiled = CompiledHooks(_Seam(self), self._wrapper)
        self._watch_structure()
        self._begin()

    def _stop_observing(self) -> None:
        """The adapter's stop: every hook removed (also after a failed start)."""
        self._active = False
        self._last = None
        self._remove()
        for h in self._structure_handles:
            h.remove()
        self._structure_handles = []
        if self._compiled is not None:
            self._compiled.remove()

    # ------------------------------------------------------------------ steps

    def _begin(self) -> None:
        """Prepare the current step: hooks in place on a scheduled step, none otherwise."""
        self._active = self._scheduled(self.step_index)
        if self._compiled is not None:
            self._compiled.switch.active = self._active
        self._weights_done = False
        self._grads = {}
        self._grad_rows = 0
        self._signs = {}
        self._last = None
        if self._renamed or self._rehook_due:
            self._refresh_names(rehook=True)
        installed = self._installed()
        if self._active and not installed:
            self._install()
        elif not self._active and installed:
            self._remove()
        if self._active:
            self._hook_weights()
        else:
            self._unhook_weights()

    def step(self) -> None:
        """End the current training step (call it after the optimizer update).

        On a scheduled step this summarizes parameter gradients (if no optimizer
        captured them), weights (if no forward pass did), and the optimizer state, then
        starts one non-blocking copy of the step's device summaries to the host; the rows
        of a step are built once its copy has landed (at the latest at the next step, or
        when the tracker closes), so the device never waits for the host."""
        recorder = self._check_open("step")
        if self._active:
            if not self._weights_done:
                self._capture_weights()
            if self.kinds[GRADIENT]:
                # captures of steps the GradScaler skipped, then the gradients of the
                # parameters no tracked optimizer updates, as they are now
                for opt in list(self._grads):
                    self._commit_grads(opt)
                if self._capture_grads(None):
                    self._commit_grads(None)
            if self.kinds[OPTIMISER_STATE]:
                recorder.add_many(self._summaries_batch(*self._state_batch()), self._most_bytes)
            if self._unseen:
                self._tell_unseen(recorder)
        self._end_step(self._active)
        self._begin()


class _CaptureAfterUnscale:
    """Wraps the tracker's ``GradScaler.unscale_`` and ``step`` (instance attributes,
    removed by :meth:`remove`) so that a step the scaler skips (inf or NaN found) keeps
    gradient rows although it never reaches the optimizer's hooks: the gradients as
    ``scaler.step(optimizer)`` is handed them (unscaled, after any clipping between
    ``unscale_`` and ``step``), the ones the optimizer would have used. Steps that update
    are captured again by the optimizer's own hook, just before the update."""

    def __init__(self, tracker: Tracker) -> None:
        scaler = tracker.scaler
        original_unscale, original_step = type(scaler).unscale_, type(scaler).step
        ref = weakref.ref(tracker)
        unscaled: set[int] = set()  # optimizers unscaled and not yet stepped

        def capture(optimizer: Any) -> None:
            tr = ref()
            if tr is not None and tr._active and tr.kinds[GRADIENT]:
                tr._capture_grads(_unwrap_optimizer(optimizer))

        def unscale_(optimizer: Any) -> Any:
            out = original_unscale(scaler, optimizer)
            unscaled.add(id(optimizer))
            capture(optimizer)  # (unscale_ inside step: these are the gradients stepped)
            return out

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if id(optimizer) in unscaled:  # unscaled before: clipping may have come since
                capture(optimizer)
            try:
                return original_step(scaler, optimizer, *args, **kwargs)
            finally:
                unscaled.discard(id(optimizer))

        scaler.unscale_ = unscale_
        scaler.step = step
        self._scaler = scaler

    def remove(self) -> None:
        self._scaler.__dict__.pop("unscale_", None)
        self._scaler.__dict__.pop("step", None)


class _Seam:
    """The tracker as its extensions see it (:class:`._seams.TrackerSeam`): the compiled
    model's hooks and the update capture hold it, and it holds the tracker by a weak
    reference, so that they keep no tracker alive."""

    __slots__ = ("_ref",)

    def __init__(self, tracker: Tracker) -> None:
        self._ref = weakref.ref(tracker)

    def _tracker(self) -> Tracker:
        tr = self._ref()
        if tr is None:
            raise RuntimeError("tandv: the tracker of these hooks is gone")
        return tr

    @property
    def recording(self) -> bool:
        tr = self._ref()
        return tr is not None and tr._active

    @property
    def module(self) -> nn.Module:
        return self._tracker().module

    @property
    def kinds(self) -> dict[str, bool]:
        return self._tracker().kinds

    @property
    def track_eval(self) -> bool:
        return self._tracker().track_eval

    def hooked_modules(self) -> list[tuple[str, nn.Module]]:
        tr = self._tracker()
        return [(name, m) for name, m in tr._modules if tr._selected(name, type(m))]

    def parameter(self, p: torch.Tensor) -> tuple[str, nn.Module] | None:
        tr = self._tracker()
        known = tr._param_names.get(id(p))
        return known if known is not None and tr._selected(known[0], type(known[1])) else None

    def observe(
        self, name: str, kind: str, owner: nn.Module, x: torch.Tensor, *, fresh: bool = False
    ) -> None:
        tr = self._ref()
        if tr is not None:
            if fresh:
                tr._last = None
            # the eager hooks' path: the site's fused launch, made at its first tensor
            tr._observe_site(tr._site(name, kind, owner), x)

    def record(self, items: Sequence[tuple[str, str, nn.Module, torch.Tensor]]) -> None:
        tr = self._ref()
        if tr is not None and tr.recorder is not None:
            tr.recorder.add_many(tr._summaries(items), tr._most_bytes)


def _optimizer_sign(optimizer: torch.optim.Optimizer) -> list[int]:
    """What tells whether ``optimizer`` updates other parameters than before: the number of
    its parameter lists, their identities, their lengths and the identities of the
    parameters in them, in that order (in passes that run in C)."""
    lists = list(map(_params_key, optimizer.param_groups))
    sign = [len(lists)]
    sign += map(id, lists)
    sign += map(len, lists)
    sign += map(id, chain.from_iterable(lists))
    return sign


def _signed_params(sign: list[int]) -> list[int]:
    """The identities of the parameters in an :func:`_optimizer_sign` (after the lists'
    identities and lengths)."""
    return sign[1 + 2 * sign[0] :]


def _params_of(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters ``optimizer`` updates (its param groups' now)."""
    for group in optimizer.param_groups:
        yield from group["params"]


#: Tensor types that are never a DTensor (checked without a call).
_PLAIN = (torch.Tensor, nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
_first, _second, _third, _fourth = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)
_dtype_of = attrgetter("dtype")
_grad_of = attrgetter("grad")
_params_key = itemgetter("params")
_values = methodcaller("values")


def _taker(positions: list[int]) -> Callable[[list[Any]], Sequence[Any]]:
    """What takes the items at ``positions`` of a list, as a sequence: for two or more, an
    ``itemgetter`` (one call of C, no Python loop per item)."""
    if len(positions) >= 2:
        return itemgetter(*positions)
    return lambda values: tuple(values[i] for i in positions)


def _capture_error(what: str) -> RuntimeError:
    """The error of a tracked tensor (``what``: which, in words) met inside a CUDA graph
    capture."""
    return RuntimeError(
        f"tandv: {what} would be summarized inside a CUDA graph capture "
        f"(torch.cuda.graph, make_graphed_callables, or torch.compile's "
        f"mode='reduce-overhead'); a captured summary would be replayed into the rows of the "
        f"step captured, not those of the step replayed. Track outside the captured region: "
        f"exclude the captured modules (track(..., exclude=[...])), or capture an untracked "
        f"copy"
    )


def _site_capture_error(site: _HookSite) -> RuntimeError:
    """:func:`_capture_error` of a hook's tensor at ``site``."""
    what = "output gradient" if site.kind == GRADIENT else "output"
    return _capture_error(f"the {what} of module {site.name!r}")


#: The statistic column of output-gradient rows that holds a tracked GradScaler's scale.
LOSS_SCALE = "loss_scale"


def _unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` that ``opt`` is or wraps: accelerate's
    ``AcceleratedOptimizer`` (an Optimizer subclass that never initializes its hooks) and
    Lightning's ``LightningOptimizer`` hold the real one as ``optimizer``/``_optimizer``;
    hooks go on the real one, which every wrapper's ``step`` ends in."""
    seen = opt
    for _ in range(8):
        if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_pre_hooks"):
            return opt
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(opt, "_optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    raise TypeError(
        f"track(optimizer=...): expected a torch.optim.Optimizer (or a wrapper of one "
        f"holding it as .optimizer), or a list of them; got {type(seen).__name__}"
    )


def _optimizers_of(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    """``track``'s ``optimizer`` argument as a tuple of the optimizers hooks go on: none, one,
    or a sequence of them, each unwrapped (:func:`_unwrap_optimizer`)."""
    if optimizer is None:
        return ()
    if isinstance(optimizer, (list, tuple)) or (
        not hasattr(optimizer, "step") and hasattr(optimizer, "__iter__")
    ):
        return tuple(_unwrap_optimizer(o) for o in optimizer)
    return (_unwrap_optimizer(optimizer),)


@signature_of(Tracker)
def track(*args: Any, **options: Any) -> Tracker:
    """Track a PyTorch module's training numerics; use as ``with track(model, opt) as tracker:``.

    Returns:
        A :class:`Tracker`; call ``tracker.step()`` after each optimizer update.
        ``tracker.out_path`` is the log's path once the ``with`` block has started.

    Arguments:
        module: the model: eager, ``torch.compile(model)`` or compiled in place
            (``model.compile()``, whole or in parts). Compiled models are tracked inside
            their graphs with no graph break; rows carry the eager module paths. CUDA
            graphs (``mode="reduce-overhead"``) are refused while activations or output
            gradients are tracked.
        optimizer: an optimizer or a sequence of them, for ``Optimiser_State`` rows and to
            capture gradients just before each update; ``None`` tracks no optimizer state.
            Needed by ``track_updates``.
        track_weights, track_optimizer: record ``Weight`` rows (each parameter as step
            ``k``'s forward pass used it) and ``Optimiser_State`` rows (default ``True``).
        track_buffers: also record the module's floating buffers (BatchNorm's running
            mean and variance) as ``Weight`` rows named by buffer path, as the step's forward
            found them (default ``False``).
        root_name: the name of the root module's rows (default ``"root"``, as in JAX).
        track_eval: also record forwards of modules in eval mode (default ``False``).
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop: gradients are then
            also captured when it unscales them, so a step it skips (inf/NaN gradients) is
            logged as it was. Output (activation) gradients stay in loss-scaled units, and
            their rows hold the scale in a ``loss_scale`` column.
    """
    return Tracker(*args, **options)
