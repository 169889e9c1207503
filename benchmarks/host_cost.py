"""Host (CPU) cost of the PyTorch tracker's GPU path, measured on a machine without a GPU.

On a GPU a small model's step is short and host-bound: what the tracker spends on the
host per hook and per step decides its overhead there. This script measures that time on
the CPU. It trains the 4-layer GPT of ``benchmarks/overhead.py`` (d_model 256, seq 128,
batch 8, AdamW) on CPU tensors with the fused path forced (as the tests force it:
``TRITON_INTERPRET=1`` and ``summary.cpu_path("fused")``),
and with the two Triton kernels replaced by no-ops called with the same arguments: every
other thing tandv does (reserving rows, the launch code in ``_fused``, its custom
statistics, the end-of-step copy and zeroing of the rows, finishing rows, merging, building
the log's rows and writing them) runs for real.

It times tandv's own entry points with the thread's CPU clock (``time.thread_time_ns``,
less what a clock pair reads around an empty call): the forward hooks and output-gradient
hooks (together, per hook call: ``host_us_per_observation``; in this model each call
observes one activation or activation gradient), and, per step, everything else on the
training thread (the global forward pre-hook that captures weights, the optimizer's
pre- and post-hooks, ``tracker.step()``). The clock is read once before each reading starts, so that
its own first-call cost on cold caches is not charged to tandv. Not included: torch's cost
of calling a Python hook at all (``Module.__call__``'s hook loop, autograd's call into
Python), which any hook pays. The writer thread's CPU time per step is printed beside them,
and the training thread's time per step not running (its wall time less its CPU time):
the time it waited for the interpreter while the writer thread held it (on a GPU host,
where cores are plenty, what the writer costs the step), or, on a busy machine, for a
core.

Python's cyclic garbage collector is paused during the timed steps: a collection runs in
whatever code allocates when it falls due, and a full one walks every object of the
process (the imports of torch, Triton and pandas alone make ~230,000), so left on it would
charge a random hook with tens of milliseconds. What tandv adds to the collector's work is
printed instead: the garbage-collected objects each hook call leaves alive (its row's slot
and entry, kept for the end of the step).

Between hooks the model's own operations run, so a hook runs on cold caches: it costs
several times (on a shared 2-core VM, 10-20 times) what the same hook costs called in a
tight loop, and about in proportion to the Python frames and objects it touches, each
fetched anew. Other processes on the machine make that cost vary from step to step, so
each figure is a median over the timed steps: of each step's mean time per hook call, and
of each step's time outside the hooks (the means over all steps are printed beside them;
one slow step, as when the writer thread or another process took the core, moves a mean
over 20 steps by several microseconds).

``--difference`` checks the per-hook figure another way: an untracked copy of the model
steps beside the tracked one (in turn, which of the pair goes first alternating), and the
hooks' cost is also printed as the tracked forward and backward passes' CPU time, less the
copy's, less the weights' capture timed inside them, per hook call (median over steps).
That figure includes what the clock's figure leaves out (torch's calls of the hooks, and
whatever the hooks cost the model's own operations after them, such as the caches they
take), and varies more (it is the difference of two passes each hundreds of times longer
than the hooks). Stepping the copy between the tracked steps changes what the caches hold
when the tracked step runs, so the other figures of such a run are not those of a plain one.

The launch path per call: in a subprocess without the interpreter, the single-tensor
kernel is compiled for sm_90 (no GPU needed) and launched through ``launch_one`` (tandv's
launch code, then the prebuilt launcher it keeps after a variant's first call) with only
Triton's final C launcher (which packs the arguments and calls ``cuLaunchKernel``) replaced
by a no-op; the time per call is that Python launch path, not the driver's. It also times
a hook's launch (``HookLaunch.summarize``: a row reserved, then the compiled kernel called
directly) and a batch's (``BatchLaunch.summarize`` of 53 tensors whose guard has passed).
``--no-triton`` skips them.

``--floor`` runs the same model three times more with tandv's forward hooks replaced by
stand-ins (:data:`FLOOR_HOOKS`): an empty hook; one that asks its output the seven
questions tandv's fast path asks of every tensor and does nothing else; and one that also
adds an output-gradient hook as tandv does, which asks its gradient the same (what
tandv's hooks do before they reserve a row and launch, with tandv's number of hook calls).
Then once more untracked, with stand-ins at tandv's per-step points that gather the step's
weights, gradients and optimizer state and ask each tensor its address and size
(:func:`per_step_floor`), and again asking each what tandv's batches ask of every tensor
at every step (a guard's check of what a ``.data`` assignment can change, then the
address). Their figures are what such work costs at these sites on this machine's caches
now, so the tracker's figures can be read against them in one run (machines, and one
machine from hour to hour, differ by 2-3 times in all of them).

``--host-only`` makes every figure that of a run whose model computes nothing
(:class:`NoCompute`): the host's side of a GPU step, whose caches the model's data never
passes through.

Usage::

    PYTHONPATH=. python benchmarks/host_cost.py            # 30 steps after 12 of warm-up
    PYTHONPATH=. python benchmarks/host_cost.py --tiny     # seconds: the tests' mode
    PYTHONPATH=. python benchmarks/host_cost.py --no-triton --difference  # the cross-check
    PYTHONPATH=. python benchmarks/host_cost.py --no-triton --floor  # and its floors here
    PYTHONPATH=. python benchmarks/host_cost.py --no-triton --floor --host-only  # a GPU host's

The last two lines are ``host_us_per_observation: X`` and ``host_us_fixed_per_step: Y``.
"""

from __future__ import annotations

import os
import sys

# the fused kernels run in Triton's interpreter on CPU tensors (set before tandv's kernels
# are imported), except in the subprocess that compiles one for a GPU
if "--triton-worker" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import operator  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import OrderedDict  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    _disable_current_modes,
)
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import PRESETS, _trainer, config_of  # noqa: E402

from tandv.demos.torch_gpt import GPTConfig  # noqa: E402
from tandv.track.torch import summary as kernel  # noqa: E402
from tandv.track.torch import track  # noqa: E402
from tandv.track.torch._workspace import tensor_guard  # noqa: E402
from tandv.track.torch.tracker import Tracker  # noqa: E402

#: A function of C that takes any arguments and does nothing with them: the kernels'
#: stand-in in timed runs, whose own call then costs next to nothing (no Python frame), so
#: that what the clock reads is tandv's (the launch's own cost is the separate launch-path
#: figure).
_NO_OP: Callable[..., Any] = "".format
#: A tensor's dtype, asked as tandv's batches ask it (one pass of C over a list).
_dtype_of = operator.attrgetter("dtype")


class NoLaunch:
    """Stands for a Triton kernel: ``kernel[grid](*args, **kwargs)`` takes the launch's
    arguments and does nothing (no device work, on the CPU or anywhere). With
    ``counting``, the launches are counted (by a Python function, whose frame a timed run
    would charge to tandv's hooks); else the launch is :data:`_NO_OP`."""

    def __init__(self, name: str, counting: bool = False) -> None:
        self.__name__ = name
        self.calls = 0
        self.counting = counting

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return self.launch if self.counting else _NO_OP

    def launch(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1


def _shape_key(a: Any) -> Any:
    """What of an operation's argument decides its outputs' shapes: a tensor's size,
    strides, dtype and device; any other argument itself."""
    if isinstance(a, torch.Tensor):
        return (a.shape, a.stride(), a.dtype, a.device)
    return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else repr(a)


class NoCompute(TorchDispatchMode):
    """The model's operations with their arithmetic left out (``--host-only``): as on a GPU
    host, where they are kernels the device runs, the host dispatches each operation and
    allocates its outputs, and touches none of the data, so what the caches hold when a
    hook runs is what dispatching left there, not the model's tensors.

    Each operation returns tensors of its outputs' sizes, strides and dtypes, allocated
    and never written (found once per operation and argument shapes, on meta tensors);
    an in-place operation returns its argument as it was. Run for real: views (they
    compute nothing), operations on tensors of at most one element (the optimizer's step
    count and the scalars read from it) and any an output of which meta tensors cannot
    tell. The values are garbage from the first step, which the host path never reads
    (the benchmark's kernels are no-ops too). tandv's own entry points run outside the
    mode (see :func:`instrumented`)."""

    def __init__(self) -> None:
        super().__init__()
        # (operation, argument shapes) -> the outputs' (size, stride, dtype) and structure,
        # or None: run for real
        self.outputs: dict[Any, Any] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if func.is_view or all(t.numel() <= 1 for t in tensors):
            return func(*args, **kwargs)
        schema = func._schema
        if schema.is_mutable:  # in place (or into out=): the written arguments, unchanged
            written = [
                args[i] if i < len(args) else kwargs[a.name]
                for i, a in enumerate(schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write and
                (i < len(args) or a.name in kwargs)
            ]  # fmt: skip
            if not schema.returns:
                return None
            return written[0] if len(schema.returns) == 1 else tuple(written)
        key = (func, tuple(map(_shape_key, flat)))
        if key not in self.outputs:
            self.outputs[key] = self._meta_outputs(func, args, kwargs)
        found = self.outputs[key]
        if found is None:
            return func(*args, **kwargs)
        leaves, spec = found
        device = tensors[0].device
        return tree_unflatten(
            [
                torch.empty_strided(size, stride, dtype=dtype, device=device)
                if size is not None else value
                for size, stride, dtype, value in leaves
            ],
            spec,
        )  # fmt: skip

    @staticmethod
    def _meta_outputs(func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        """The outputs' sizes, strides and dtypes (or the value, for an output that is not
        a tensor) and their structure, from the operation run on meta tensors; None where
        that fails."""

        def meta(a: Any) -> Any:
            return a.to("meta") if isinstance(a, torch.Tensor) else a

        try:
            out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
        except Exception:  # (no meta kernel, or a data-dependent output size)
            return None
        leaves, spec = tree_flatten(out)
        if not any(isinstance(t, torch.Tensor) for t in leaves):
            return None
        return [
            (t.shape, t.stride(), t.dtype, None)
            if isinstance(t, torch.Tensor) else (None, None, None, t)
            for t in leaves
        ], spec  # fmt: skip


class Clock:
    """CPU time of the training thread in tandv's entry points, by kind, and the
    garbage-collected objects they leave behind (made and not freed by the call: what
    tandv keeps for the end of the step and the writer thread)."""

    def __init__(self) -> None:
        self.reset()
        # the time a clock pair reads around an empty call, subtracted per call
        self.tare = 0.0
        f = self.timed("hook", lambda: None)
        self.on = True
        reps = 20000
        for _ in range(reps):
            f()
        self.tare = self.ns["hook"] / reps
        self.reset()

    def reset(self) -> None:
        # "fixed": per-step entry points; "inside": those of them that run inside the
        # forward pass (the weights' capture), kept apart for the difference figure
        self.ns = {"hook": 0, "fixed": 0, "inside": 0}
        self.calls = {"hook": 0, "fixed": 0, "inside": 0}
        self.kept = {"hook": 0, "fixed": 0, "inside": 0}
        self.on = False

    def timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time_ns
        count = gc.get_count

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            g0 = count()[0]
            clock()  # the clock's own first-call cost (cold caches) falls outside the reading
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = clock()
                self.ns[kind] += t1 - t0
                self.calls[kind] += 1
                self.kept[kind] += count()[0] - g0  # (the collector is paused: see host_cost)

        return wrapper

    def us(self, kind: str) -> float:
        """Microseconds in ``kind``, less the clock's own cost."""
        return (self.ns[kind] - self.tare * self.calls[kind]) / 1e3

    def snapshot(self) -> tuple[int, int, int, int, int, int]:
        """The running totals (hook time and calls, per-step time and calls, and the part
        of the latter inside the forward pass), to take one step's share by difference."""
        fixed = self.ns["fixed"] + self.ns["inside"]
        fixed_calls = self.calls["fixed"] + self.calls["inside"]
        return (
            self.ns["hook"],
            self.calls["hook"],
            fixed,
            fixed_calls,
            self.ns["inside"],
            self.calls["inside"],
        )


#: The tracker's methods :func:`instrumented` replaces (and puts back).
INSTRUMENTED = (
    "_make_forward_hook",
    "_make_grad_hook",
    "_first_forward_hook",
    "_optimizer_pre_hook",
    "_optimizer_post_hook",
)


def _outside_modes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with no dispatch mode (:class:`NoCompute`) in force: tandv's own
    operations compute, as its device work would on a GPU (outside the timed call)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def instrumented(clock: Clock, floor: str | None = None, host_only: bool = False) -> Iterator[None]:
    """Within the block, the tracker's hooks (per observation) and its per-step entry
    points are timed; with ``floor``, the forward hooks are :data:`FLOOR_HOOKS`' instead
    of tandv's (see :func:`host_cost`); with ``host_only``, each of them runs outside
    :class:`NoCompute`. The tracker's methods are put back at the block's end, so the
    next run in this process times tandv's own methods."""
    saved = {name: getattr(Tracker, name) for name in INSTRUMENTED}
    make_fwd, make_grad = saved["_make_forward_hook"], saved["_make_grad_hook"]
    outside = _outside_modes if host_only else (lambda fn: fn)

    def timed(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return outside(clock.timed(kind, fn))

    if floor is not None:
        hook = FLOOR_HOOKS[floor]
        make_fwd = lambda self, name, m: hook  # noqa: E731
        global _floor_gradient_hook
        _floor_gradient_hook = timed("hook", _gradient_queries)  # (as tandv's are wrapped)

    Tracker._make_forward_hook = lambda self, name, m: timed(  # type: ignore[method-assign]
        "hook", make_fwd(self, name, m)
    )
    Tracker._make_grad_hook = lambda self, name, m: timed(  # type: ignore[method-assign]
        "hook", make_grad(self, name, m)
    )
    Tracker._first_forward_hook = timed("inside", Tracker._first_forward_hook)  # type: ignore[method-assign]
    Tracker._optimizer_pre_hook = timed("fixed", Tracker._optimizer_pre_hook)  # type: ignore[method-assign]
    Tracker._optimizer_post_hook = timed("fixed", Tracker._optimizer_post_hook)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Tracker, name, method)


def _empty_hook(mod: Any, args: Any, output: Any) -> None:
    """A forward hook that does nothing: what any Python hook pays at these sites."""


def _queries_hook(mod: Any, args: Any, output: Any) -> None:
    """A forward hook that asks its output what tandv's fast path asks of every tensor
    (type, dtype, size, device, contiguity, negation bit, version) and does nothing else."""
    if type(output) is torch.Tensor:
        output.dtype, output.numel(), output.get_device()  # noqa: B018
        output.is_contiguous(), output.is_neg(), output._version  # noqa: B018


def _gradient_queries(g: Any) -> None:
    """The output-gradient hook of :func:`_gradient_hook`: asks its gradient the same."""
    if type(g) is torch.Tensor:
        g.dtype, g.numel(), g.get_device()  # noqa: B018
        g.is_contiguous(), g.is_neg(), g._version  # noqa: B018


#: :func:`_gradient_queries`, timed by the run's clock (set by :func:`instrumented`)
_floor_gradient_hook: Callable[[Any], None] = _gradient_queries
_floor_hook_ids = itertools.count(-1, -1)


def _gradient_hook(mod: Any, args: Any, output: Any) -> None:
    """:func:`_queries_hook`, and the output-gradient hook :func:`_gradient_queries` added
    as tandv adds its own (the tensor's hook dictionary, registered with its autograd
    node): what tandv's hooks do before they reserve a row and launch, at tandv's sites
    and with tandv's number of hook calls."""
    if type(output) is torch.Tensor:
        output.dtype, output.numel(), output.get_device()  # noqa: B018
        output.is_contiguous(), output.is_neg(), output._version  # noqa: B018
        if output.requires_grad:  # (the tracker's forward hook's lines, as written there)
            hooks = output._backward_hooks
            if hooks is None:
                hooks = output._backward_hooks = OrderedDict()
                grad_fn = output.grad_fn
                if grad_fn is not None:
                    grad_fn._register_hook_dict(output)
            hooks[next(_floor_hook_ids)] = _floor_gradient_hook


#: ``--floor``'s hooks, put in place of tandv's forward hooks (no output-gradient hooks
#: then, but those the stand-in adds: tandv's forward hooks add them).
FLOOR_HOOKS: dict[str, Callable[[Any, Any, Any], None]] = {
    "empty": _empty_hook,
    "queries": _queries_hook,
    "gradient": _gradient_hook,
}


def thread_cpu_s(thread: threading.Thread | None) -> float:
    """CPU seconds of a running thread (0 when there is none)."""
    if thread is None or thread.ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _timed_step(
    model: Any, opt: Any, data: torch.Tensor, i: int, mode: NoCompute | None = None
) -> int:
    """:func:`overhead._step`, returning the thread's CPU time (ns) of its forward and
    backward passes (where the hooks run; not the optimizer's update); with ``mode``, the
    model's and the optimizer's operations compute nothing (``--host-only``)."""
    x = data[i % len(data)]
    with mode if mode is not None else contextlib.nullcontext():
        t0 = time.thread_time_ns()
        loss = model.loss(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t = time.thread_time_ns() - t0
        opt.step()
    return t


def host_cost(
    cfg: GPTConfig,
    batch: int,
    steps: int,
    warmup: int,
    difference: bool = False,
    floor: str | None = None,
    host_only: bool = False,
    count_launches: bool = False,
) -> dict[str, float]:
    """Run ``warmup + steps`` tracked steps (every step scheduled) and return tandv's host
    time per observation and per step, and the counts behind them. With ``difference``,
    an untracked copy of the model steps beside the tracked one (in turn, the first of
    the pair alternating) and the hooks' cost is also taken by difference: the tracked
    forward and backward passes' CPU time, less the untracked copy's and less the
    per-step entry points timed inside them, per hook call (see the module notes).

    With ``floor`` (a key of :data:`FLOOR_HOOKS`), the same run with the forward hooks
    replaced by that stand-in: the host time per hook call of a hook that does (nearly)
    nothing, at the same sites and on the same cold caches, to read the tracker's figure
    against on the same machine (the output-gradient hooks, which tandv's forward hooks
    add, are there only where the stand-in adds them).

    With ``host_only``, the model's and the optimizer's operations compute nothing
    (:class:`NoCompute`): the host's work and caches of a GPU step. With
    ``count_launches``, the kernels' stand-ins count their launches (``launches_per_step``;
    NaN without), at the price of a Python frame per launch in the timed figures."""
    from tandv.track.torch import _fused

    one = _fused._summarize_one = NoLaunch("_summarize_one", count_launches)  # type: ignore[assignment]
    many = _fused._summarize_many = NoLaunch("_summarize_many", count_launches)  # type: ignore[assignment]
    kernel.cpu_path("fused")  # (for the rest of the process)
    clock = Clock()
    model, opt, data = _trainer(cfg, batch, 0, "cpu")
    bare = copy.deepcopy(model) if difference else None
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-3) if bare is not None else None
    # per timed step: the tracked forward and backward less the untracked copy's and less
    # the per-step entry points timed inside them, per hook call (us)
    per_call_diff: list[float] = []
    observations = 0
    step_ms = []
    # per timed step: its hooks' time per call, and its time outside the hooks (us)
    per_call: list[float] = []
    per_step: list[float] = []
    waited: list[float] = []  # per timed step: its wall time less its CPU time (us)
    mode = NoCompute() if host_only else None
    with instrumented(clock, floor, host_only), tempfile.TemporaryDirectory() as tmp:
        with track(model, opt, out=Path(tmp) / "log", verbose=False) as tracker:
            writer0 = 0.0
            for i in range(warmup + steps):
                if i == warmup:
                    clock.reset()
                    clock.on = True
                    params = {name for name, _, _ in tracker._params}
                    gc.collect()
                    gc.disable()  # see the module notes
                    writer0 = thread_cpu_s(tracker.recorder.stream.writer_thread)  # type: ignore[union-attr]
                # (the untracked copy, first of the pair at odd steps: caches, the writer)
                bare_ns = (
                    _timed_step(bare, bare_opt, data, i, mode) if bare is not None and i % 2 else 0
                )
                t0, cpu0 = time.perf_counter(), time.thread_time_ns()
                before = clock.snapshot()
                tracked_ns = _timed_step(model, opt, data, i, mode)
                if clock.on:  # the step's activations and output (not parameter) gradients
                    observations += sum(
                        k.tensor_type == "Activation"
                        or (k.tensor_type == "Gradient" and k.name not in params)
                        for k, _, _ in tracker.recorder.buffer.pending  # type: ignore[union-attr]
                    )
                    c0 = time.thread_time_ns()
                tracker.step()
                if clock.on:
                    clock.ns["fixed"] += time.thread_time_ns() - c0
                    clock.calls["fixed"] += 1
                    ns, calls, fixed_ns, fixed_calls, in_ns, in_calls = (
                        a - b for a, b in zip(clock.snapshot(), before)
                    )
                    per_call.append((ns - clock.tare * calls) / 1e3 / max(calls, 1))
                    per_step.append((fixed_ns - clock.tare * fixed_calls) / 1e3)
                step_ms.append((time.perf_counter() - t0) * 1e3)
                if clock.on:  # the step's time not running (waiting for the interpreter)
                    waited.append(step_ms[-1] * 1e3 - (time.thread_time_ns() - cpu0) / 1e3)
                if bare is not None:
                    if not i % 2:
                        bare_ns = _timed_step(bare, bare_opt, data, i, mode)
                    if clock.on:
                        inside = in_ns - clock.tare * in_calls
                        per_call_diff.append((tracked_ns - bare_ns - inside) / 1e3 / max(calls, 1))
            writer = thread_cpu_s(tracker.recorder.stream.writer_thread) - writer0  # type: ignore[union-attr]
            clock.on = False
            gc.enable()
    launches = one.calls + many.calls if count_launches else math.nan
    return {
        "observations_per_step": observations / steps,
        "hook_calls_per_step": clock.calls["hook"] / steps,
        "host_us_per_observation": statistics.median(per_call),
        "host_us_per_observation_mean": clock.us("hook") / clock.calls["hook"],
        "objects_kept_per_hook_call": clock.kept["hook"] / clock.calls["hook"],
        "host_us_fixed_per_step": statistics.median(per_step),
        "host_us_fixed_per_step_mean": (clock.us("fixed") + clock.us("inside")) / steps,
        "writer_us_per_step": writer * 1e6 / steps,
        "waited_us_per_step": statistics.mean(waited),
        "waited_us_most": max(waited),
        "launches_per_step": launches / (warmup + steps),
        "step_ms_median": statistics.median(step_ms[warmup:]),
        "clock_tare_us": clock.tare / 1e3,
        "difference_us_per_hook_call": (
            statistics.median(per_call_diff) if per_call_diff else float("nan")
        ),
    }


#: ``--tiny``'s model (a preset's keys, as :data:`overhead.PRESETS` gives them)
TINY = dict(layers=1, d_model=32, heads=2, mlp=64, vocab=64, seq=16, batch=2)


def per_step_floor(
    cfg: GPTConfig,
    batch: int,
    steps: int,
    warmup: int,
    host_only: bool = False,
    questions: bool = False,
) -> tuple[float, int]:
    """The floor of ``host_us_fixed_per_step``: the same training, untracked, with
    stand-ins at tandv's per-step points that ask each tensor a tracker summarizes there
    its address and size (what launching a kernel that reads it needs, and nothing
    else): the weights at the step's first module call, the gradients at the optimizer's
    pre-hook, the optimizer state (its tensors of one or more dimensions, gathered from
    ``optimizer.state``) after the update. Gathering them is on the clock too (reading
    ``.grad`` makes each gradient's Python object). With ``questions``, each tensor is
    asked what tandv's batches ask of every tensor at every step, as they ask it: its
    type, dtype, device, dispatch keys, sizes and strides (what a ``.data`` assignment can
    change at the same address) by a ``tensor_guard`` of the site's tensors (made at the
    site's first call, off the clock), then its address. Returns the median over the timed
    steps of each step's thread CPU time in them (us), and the tensors asked per step."""
    model, opt, data = _trainer(cfg, batch, 0, "cpu")
    params = list(model.parameters())
    asked = [0, 0]  # (ns, tensors) in the step under way
    weights_due = [True]
    guards: dict[str, Callable[..., bool] | None] = {}  # (questions: each site's guard)

    def ask(site: str, tensors: Callable[[], list[torch.Tensor]]) -> None:
        """Gather the tensors (``tensors()``: reading each gradient makes its Python
        object) and ask each its address and size, on the clock."""
        t0 = time.thread_time_ns()
        found = tensors()
        if questions:
            if site not in guards:
                t1 = time.thread_time_ns()
                guards[site] = tensor_guard(found)
                t0 += time.thread_time_ns() - t1
            check = guards[site]
            if check is None or not check(*found):  # (what a batch asks without its guard)
                set(map(type, found)), tuple(map(_dtype_of, found))
                all(map(torch.Tensor.is_contiguous, found)), any(map(torch.Tensor.is_neg, found))
                tuple(map(torch.Tensor.numel, found))
            tuple(map(torch.Tensor.data_ptr, found))
        else:
            tuple(map(torch.Tensor.data_ptr, found)), tuple(map(torch.Tensor.numel, found))
        asked[0] += time.thread_time_ns() - t0
        asked[1] += len(found)

    def weights(mod: Any, args: Any) -> None:
        if weights_due[0]:
            weights_due[0] = False
            ask("weights", lambda: params)

    def state() -> list[torch.Tensor]:
        return [
            v
            for s in opt.state.values()
            for v in s.values()
            if type(v) is torch.Tensor and v.dim() > 0
        ]

    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(weights),
        opt.register_step_pre_hook(
            lambda o, a, k: ask("gradients", lambda: [p.grad for p in params])
        ),
    ]
    mode = NoCompute() if host_only else None
    per: list[float] = []
    count = 0
    gc.collect()
    gc.disable()  # (as in host_cost)
    try:
        for i in range(warmup + steps):
            asked[:] = [0, 0]
            _timed_step(model, opt, data, i, mode)
            ask("state", state)
            weights_due[0] = True
            if i >= warmup:
                per.append(asked[0] / 1e3)
                count = asked[1]
    finally:
        gc.enable()
        for h in handles:
            h.remove()
    return statistics.median(per), count


def triton_launch_us(reps: int) -> dict[str, float]:
    """Triton's Python launch path per call (see the module notes), measured in a
    subprocess without the interpreter; empty when Triton's CUDA backend is missing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    run = subprocess.run(
        [sys.executable, __file__, "--triton-worker", str(reps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0:
        print(f"Triton launch not measured: {run.stderr.strip()[-500:]}", file=sys.stderr)
        return {}
    return json.loads(run.stdout.splitlines()[-1])


def _bound_then_direct(launch: Callable[[], None], last: list[Any]) -> None:
    """Launch twice: at the first Triton binds the arguments itself, at the second the kept
    compiled kernel is called directly; both must hand Triton's C launcher (which keeps its
    arguments in ``last``) the same arguments, but the launch metadata and the launch hooks
    (Triton passes them as it finds them, the direct call ``None`` where no profiler set
    any)."""
    launch()
    bound = list(last)
    launch()
    assert bound[:6] + bound[9:] == last[:6] + last[9:], (bound, last)


def triton_worker(reps: int) -> None:
    """The subprocess of :func:`triton_launch_us`: compile ``_summarize_one`` and
    ``_summarize_many`` for float32 on sm_90, then time ``kernel[grid](...)``, a hook's
    launch and a batch's with the C launcher a no-op (it keeps the last call's arguments:
    a batch's later launches, which call the compiled kernel directly, must hand it what
    Triton's own binding handed it at the first)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from tandv.stats.summary import Layout
    from tandv.track.torch import _fused
    from tandv.track.torch import summary as kernel
    from tandv.track.torch._workspace import BatchLaunch, Workspace

    assert not _fused.INTERPRETED, "run without TRITON_INTERPRET"

    class NoDevice:
        """The driver's module loader, for a device that is not there."""

        def get_device_properties(self, device: int) -> dict[str, int]:
            return {"max_shared_mem": 232448, "multiprocessor_count": 132}

        def load_binary(self, *args: Any) -> tuple[int, int, int, int, int]:
            return 1, 1, 0, 0, 1024  # module, function, registers, spills, max threads

        def unload_module(self, module: Any) -> None:
            pass

    class CompileOnlyDevice:
        """What Triton's launcher asks of the active driver: it compiles for sm_90, and its
        C launcher (which packs the arguments and calls cuLaunchKernel) does nothing."""

        utils = NoDevice()

        @staticmethod
        def launcher_cls(src: Any, metadata: Any) -> Callable[..., None]:
            def launch(*args: Any) -> None:
                last[:] = args

            return launch

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

    last: list[Any] = []  # (the C launcher's last arguments)
    driver.set_active(CompileOnlyDevice())
    spec = _fused.spec_for(torch.float32)
    layout = Layout("float32")
    x = torch.zeros(262144)
    rows = torch.zeros(_fused.row_size(spec, layout) * 4, dtype=torch.float64)
    scratch = torch.zeros(
        _fused.scratch_rows(x.numel(), 64, spec) * _fused.PART, dtype=torch.float64
    )

    def launch() -> None:
        _fused.launch_one(x, spec, layout, rows, 0, scratch, 64)

    # a hook's launch (the tracker's fast path): a row reserved in a workspace, then the
    # compiled kernel called through Triton's launcher
    hook = Workspace().hook_launch(spec, layout, x.device)

    def hook_launch() -> None:
        hook.space.used = 0  # (the same row every time: the buffer does not grow)
        assert hook.summarize(x) is not None

    # a step's batch (53 tensors, as the benchmark model's weights): their sizes known
    # from the batch's guard, so only their addresses are read
    tensors = [torch.zeros(4096) for _ in range(53)]
    sizes = tuple(t.numel() for t in tensors)
    space = Workspace()._space(x.device)
    many = BatchLaunch(space, spec, layout)

    def batch_launch() -> None:
        space.used = 0
        assert many.summarize(tensors, sizes) is not None

    out = {}
    with kernel.cpu_path("fused"):  # (CPU tensors stand for a device's)
        _bound_then_direct(batch_launch, last)
        assert any(v[1] is not None for v in many.variants.values()), (
            "the batch's launch never kept its compiled kernel"
        )
        for name, fn in (
            ("triton_run_us_per_call", launch),
            ("hook_launch_us_per_call", hook_launch),
            ("batch_launch_us_per_call", batch_launch),
        ):
            for _ in range(100):  # compiles, then the prebuilt launcher serves
                fn()
            t0 = time.thread_time_ns()
            for _ in range(reps):
                fn()
            out[name] = (time.thread_time_ns() - t0) / 1e3 / reps
    assert hook.compiled != [None, None], "the hook's launch never reached the compiled kernel"
    # launch_one's prebuilt launchers are told apart by pointer alignment: a view 4 bytes
    # into the tensor gets a kernel of its own, and its later launches (the prebuilt
    # launcher) hand Triton's launcher what Triton's binding handed it at the first
    with kernel.cpu_path("fused"):
        kept, off = dict(_fused._launchers), x[1:]
        _bound_then_direct(lambda: _fused.launch_one(off, spec, layout, rows, 0, scratch, 64), last)
        added = [v for k, v in _fused._launchers.items() if k not in kept]
        assert len(added) == 1 and all(added[0] is not v for v in kept.values()), (
            "a misaligned tensor did not get a launcher of its own"
        )
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument(
        "--warmup",
        type=int,
        default=12,
        help="untimed steps (past the first flush: the buffers the writer hands back)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--tiny", action="store_true", help="a 1-layer d_model 32 GPT, 3 steps")
    p.add_argument("--no-triton", action="store_true", help="skip Triton's launch time")
    p.add_argument(
        "--difference",
        action="store_true",
        help="also step an untracked copy and print the hooks' cost by difference",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also run with the forward hooks replaced by an empty hook and by one that "
        "only asks its tensor what tandv asks: the floor of the per-hook figure here",
    )
    p.add_argument(
        "--host-only",
        action="store_true",
        help="the model's operations allocate their outputs and compute nothing, as on a "
        "GPU host (its caches between hooks): every figure is for that run",
    )
    p.add_argument("--triton-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.triton_worker is not None:
        triton_worker(args.triton_worker)
        return 0
    torch.set_num_threads(args.threads)
    size = dict(PRESETS["small"])
    if args.tiny:
        size.update(TINY)
        args.steps, args.warmup = 3, 2
    cfg = config_of(size)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, {os.cpu_count()} CPUs"
    )
    print(f"{cfg}, batch {size['batch']}, AdamW; fused path forced, kernels replaced by no-ops")
    if args.host_only:
        print(
            "host only: the model's and the optimizer's operations allocate their outputs "
            "and compute nothing (as on a GPU host)"
        )
    if not args.no_triton:
        t = triton_launch_us(200 if args.tiny else 5000)
        if t:
            print(
                "launch path per call (launch_one of a compiled sm_90 kernel through its "
                "prebuilt launcher; Triton's C launcher and cuLaunchKernel excluded): "
                f"{t['triton_run_us_per_call']:.2f} us; a hook's launch (row reserved, "
                f"compiled kernel called directly): {t['hook_launch_us_per_call']:.2f} us; "
                "a batch's launch (53 tensors whose guard passed: addresses read, rows "
                "reserved, compiled kernel called directly): "
                f"{t['batch_launch_us_per_call']:.2f} us"
            )
    r = host_cost(
        cfg, size["batch"], args.steps, args.warmup, args.difference, host_only=args.host_only
    )
    # the launches, counted in a short run of their own (the timed run's stand-ins do not
    # count: see NoLaunch)
    counted = host_cost(cfg, size["batch"], 1, 1, host_only=args.host_only, count_launches=True)
    print(
        f"{r['observations_per_step']:.0f} activation/activation-gradient observations per "
        f"step, {counted['launches_per_step']:.1f} kernel launches per step; "
        f"{r['hook_calls_per_step']:.0f} hook calls per step, each leaving "
        f"{r['objects_kept_per_hook_call']:.1f} garbage-collected objects; tracked step "
        f"{r['step_ms_median']:.1f} ms (median, the model's own CPU "
        f"{'dispatch, no compute' if args.host_only else 'compute'} included); "
        f"writer thread {r['writer_us_per_step']:.0f} us CPU per step, the training thread "
        f"not running (waiting for the interpreter the writer held, or for a core) "
        f"{r['waited_us_per_step']:.0f} us per step (mean; {r['waited_us_most']:.0f} in the "
        f"step that waited most); "
        f"clock cost {r['clock_tare_us']:.2f} us per timed call (subtracted); means over "
        f"all timed steps: {r['host_us_per_observation_mean']:.2f} us per hook call, "
        f"{r['host_us_fixed_per_step_mean']:.0f} us per step"
    )
    if args.difference:
        print(
            "by difference (tracked forward and backward CPU time less an untracked copy's "
            "and less the weights' capture, per hook call; torch's own calls of the hooks "
            f"included): {r['difference_us_per_hook_call']:.2f} us (median over steps)"
        )
    if args.floor:
        with warnings.catch_warnings():  # (the stand-ins record no activation: expected)
            warnings.filterwarnings("ignore", "tandv: step .* recorded no activation")
            floors = {
                name: host_cost(
                    cfg,
                    size["batch"],
                    args.steps,
                    args.warmup,
                    floor=name,
                    host_only=args.host_only,
                )
                for name in FLOOR_HOOKS
            }
        print(
            "floor, the same run with stand-ins for tandv's forward hooks (median per hook "
            "call, same clock): an empty hook "
            f"{floors['empty']['host_us_per_observation']:.2f} us; a hook asking its "
            "tensor's type, dtype, size, device, contiguity, negation bit and version "
            f"{floors['queries']['host_us_per_observation']:.2f} us; that hook adding an "
            "output-gradient hook as tandv does, which asks its gradient the same, "
            f"{floors['gradient']['host_us_per_observation']:.2f} us"
        )
        step_floor, tensors = per_step_floor(
            cfg, size["batch"], args.steps, args.warmup, args.host_only
        )
        print(
            "floor per step, the same training untracked with stand-ins at tandv's per-step "
            f"points asking each of the step's {tensors} weights, gradients and optimizer "
            f"state tensors its address and size (median, same clock): {step_floor:.0f} us"
        )
        asked, _ = per_step_floor(
            cfg, size["batch"], args.steps, args.warmup, args.host_only, questions=True
        )
        print(
            "floor per step asking each of them what tandv asks every step (a guard's check "
            "of their types, dtypes, devices, dispatch keys, sizes and strides, then their "
            f"addresses; median, same clock): {asked:.0f} us; tandv's step above it: "
            f"{r['host_us_fixed_per_step'] - asked:.0f} us (the machine's hour moves both)"
        )
    print(f"host_us_per_observation: {r['host_us_per_observation']:.2f}")
    print(f"host_us_fixed_per_step: {r['host_us_fixed_per_step']:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
