"""Where a tracked JAX step's host time goes: one command that splits it into phases.

On an H200 a tracked call of the benchmark's transformer update kept the main thread busy
13-25 ms longer than the untracked call (``benchmarks/jax_overhead.py``), with 18 Python
calls: the time is not Python's. This probe times, on whatever backend JAX has, each phase
of ``tracker.intercept`` and ``tracker.step()`` (``time.perf_counter_ns``, median over the
timed steps): the tracked program's dispatch (JAX's C++ path: flattening the arguments,
the cache lookup, launching the compiled program), the Python around it, the wait for the
device, and the parts of ``step()``. Each variant runs twice: pipelined (calls queued
behind the previous step's work, as in training) and from an idle device (the previous
step waited for first): where dispatch takes much longer pipelined, the host was waiting
for room in the device's queue (the device is the bottleneck), not working.

It also counts what each program holds: its arguments and outputs, and the instructions
of its compiled entry computation by kind (on a GPU each ``fusion``, ``custom-call``,
``copy``, ``concatenate``, scatter or dot is about one kernel launch, which costs the host
a few microseconds; on the CPU each is a thunk). Variants: ``untracked``; ``tracked``
(every module output and cotangent tapped, the outputs summarized in the program);
``outputs`` (no taps: the outputs' summaries alone). So ``tracked`` minus ``outputs`` is
what the taps cost, ``outputs`` minus ``untracked`` what the outputs' summaries cost.

    PYTHONPATH=. python3 benchmarks/jax_gpu_probe.py [--summary auto|xla|pallas] [--steps 8]
    PYTHONPATH=. python3 benchmarks/jax_gpu_probe.py --model mlp --width 16 --depth 2 --steps 2

The model options are those of ``benchmarks/jax_overhead.py`` (the transformer by default
here). The last lines are ``kernels_<variant>: N`` (instructions that launch work) for the
suite to read.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import inspect
import io
import os
import pstats
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.jax_overhead import add_model_arguments, setup  # noqa: E402
from tandv.track.jax import track  # noqa: E402

#: Compiled instructions that launch no work of their own (XLA's bookkeeping).
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


def entry_instructions(compiled_text: str) -> collections.Counter[str]:
    """Instructions of the ENTRY computation of a compiled XLA module's text, by opcode."""
    body = compiled_text.split("\nENTRY ", 1)[1].split("\n}\n", 1)[0]
    found: collections.Counter[str] = collections.Counter()
    for line in body.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(", line)
        if m:
            found[m.group(1)] += 1
    return found


def cuda_ops(tracker: Any, update: Any, args: tuple) -> collections.Counter[str]:
    """The operations of ``update`` lowered for CUDA (on any machine: no GPU is needed to
    lower), by kind (``custom_call`` by target): with a ``tracker``, its tracked program
    of ``update``, as the tracker would trace it for arrays on a GPU (the CPU's host kernel
    off). Before XLA's fusion: each reduction, scatter, dot and Triton call is at least one
    kernel, elementwise work fuses into them."""
    if tracker is None:
        text = update.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    else:
        kernels = tracker._kernels
        in_program_on = kernels.in_program_on
        kernels.in_program_on = lambda platforms: False  # the taps' choice for a GPU
        tracker._call_args = (args, {})
        traced = inspect.unwrap(tracker._programs[update].call)  # (under jit and Timer)
        fresh = jax.jit(lambda *a: traced(*a))  # a new trace: not the CPU's, cached
        try:
            text = fresh.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        finally:
            tracker._call_args = None
            kernels.in_program_on = in_program_on
    return lowered_ops(text)


#: A function's name in StableHLO text (quoted where it holds other characters).
_NAME = r'"[^"]*"|[\w$.\-]+'


def lowered_ops(text: str) -> collections.Counter[str]:
    """The StableHLO operations a call of the ``main`` function of the module ``text`` runs,
    by kind (``custom_call`` by target): each function's own operations, and those of the
    functions it calls as many times as it calls them (JAX lowers each jitted function once
    and calls it: a tap's summary is one function called by every tap of its shape). The
    body of a loop counts once."""
    own: dict[str, collections.Counter[str]] = {}
    calls: dict[str, list[str]] = {}
    name = ""
    for line in text.splitlines():
        m = re.match(rf"\s*func\.func (?:public |private )?@({_NAME})\(", line)
        if m:
            name = m.group(1)
            own[name], calls[name] = collections.Counter(), []
            continue
        if not name:
            continue
        for op in re.findall(r"stablehlo\.(\w+)", line):
            if op != "custom_call":
                own[name][op] += 1
        for target in re.findall(r"custom_call @([\w$.]+)", line):
            own[name]["custom_call " + target] += 1
        calls[name] += re.findall(rf"(?:func\.call|(?<![\w.])call) @({_NAME})\(", line)

    @functools.cache
    def total(fn: str) -> collections.Counter[str]:
        found = collections.Counter(own.get(fn, {}))
        for callee in calls.get(fn, []):
            found.update(total(callee))
        return found

    return total("main")


#: Operations of a CUDA lowering that are (at least) a kernel each.
_CUDA_KERNELS = ("reduce", "scatter", "dot_general", "concatenate", "sort", "while")


def launches(found: collections.Counter[str]) -> int:
    """Instructions of :func:`entry_instructions` that run work (about one launch each)."""
    return sum(n for op, n in found.items() if op not in _FREE)


class Timer:
    """Nanoseconds spent in methods of an object (wrapped on the instance), per call."""

    def __init__(self) -> None:
        self.spent: dict[str, list[int]] = collections.defaultdict(list)

    def wrap(self, owner: Any, name: str, label: str | None = None) -> None:
        inner = getattr(owner, name)
        spent = self.spent[label or name]

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                spent.append(time.perf_counter_ns() - start)

        setattr(owner, name, functools.wraps(inner)(timed))


def ms(ns: list[int] | list[float]) -> str:
    return f"{statistics.median(ns) / 1e6:8.3f}" if ns else "     n/a"


def _parser() -> argparse.ArgumentParser:
    """The command line: the model (``add_model_arguments``), the steps, the summary path."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(ap, default_model="transformer")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant and mode")
    ap.add_argument(
        "--summary",
        choices=("auto", "xla", "pallas"),
        default="auto",
        help="the summary path (TANDV_JAX_SUMMARY), as in benchmarks/jax_overhead.py",
    )
    ap.add_argument(
        "--cuda-ops",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also lower each tracked program for CUDA and count its kernel-making "
        "operations (default: on a machine without a GPU)",
    )
    ap.add_argument("--profile", type=int, default=12, help="cProfile lines (0: none)")
    return ap


def _print_kinds(counts: dict[str, collections.Counter[str]]) -> None:
    """The compiled entry instructions of each variant by kind, and their launches."""
    print("  compiled entry instructions by kind (about one launch each on a GPU):")
    kinds = sorted({op for c in counts.values() for op in c if op not in _FREE})
    for op in sorted(kinds, key=lambda o: -counts.get("tracked", counts["untracked"])[o]):
        print(f"    {op:22s}" + "".join(f" {name} {c[op]:6d}" for name, c in counts.items()))
    for name, c in counts.items():
        print(f"kernels_{name}: {launches(c)}")


def main() -> None:
    args = _parser().parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # (a time limit)
    os.environ["TANDV_JAX_SUMMARY"] = args.summary
    if args.cuda_ops is None:
        args.cuda_ops = jax.default_backend() == "cpu"
    what, update, params, state, x, y = setup(args)
    leaves = jax.tree_util.tree_leaves
    print(
        f"{what}; {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); "
        f"summaries: {args.summary}; jax {jax.__version__}"
    )

    counts: dict[str, collections.Counter[str]] = {}
    began = time.perf_counter()
    compiled = update.lower(params, state, x, y).compile()
    counts["untracked"] = entry_instructions(compiled.as_text())
    print(
        f"  untracked: {len(leaves((params, state, x, y)))} arguments, "
        f"{compiled.out_tree.num_leaves} outputs; compiled in {time.perf_counter() - began:.1f} s"
    )

    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("untracked", "tracked", "outputs"):
            tracker = None
            if variant != "untracked":
                tracker = track(params, state, out=Path(tmp) / variant, verbose=False)
                if variant == "outputs":  # module outputs pass through untapped
                    tracker._on_output = lambda name, cls, out: out
            probe_variant(variant, tracker, update, params, state, x, y, args, counts)
            if tracker is not None:
                tracker.close()
    _print_kinds(counts)


def probe_variant(
    variant: str,
    tracker: Any,
    update: Callable,
    params: Any,
    state: Any,
    x: Any,
    y: Any,
    args: argparse.Namespace,
    counts: dict[str, collections.Counter[str]],
) -> None:
    """Warm ``variant`` up (compiling its programs), then time its steps pipelined and from
    an idle device, and print the phases; the tracked program's counts go to ``counts``."""
    timer = Timer()

    def call(p: Any, s: Any, x: Any, y: Any) -> Any:
        return update(p, s, x, y) if tracker is None else tracker.intercept(update, p, s, x, y)

    p, s = params, state
    began = time.perf_counter()
    for _ in range(2):  # warm-up: the tracked program and the transfer's packing compile
        p, s, g = call(p, s, x, y)
        if tracker is not None:
            tracker.step(p, s, g)
    jax.block_until_ready(p)
    warm = f"warm-up {time.perf_counter() - began:.1f} s"
    if tracker is None:
        print(f"  {variant}: {warm}")
    else:
        program = tracker._programs[update]
        tracker._call_args = ((p, s, x, y), {})
        compiled = program.call.lower(p, s, x, y).compile()
        tracker._call_args = None
        counts[variant] = entry_instructions(compiled.as_text())
        out, words, made = program.call(p, s, x, y)
        stacks = [a.shape for a in jax.tree_util.tree_leaves(made)]
        print(
            f"  {variant}: {compiled.out_tree.num_leaves} outputs "
            f"({len(jax.tree_util.tree_leaves(out))} the update's, mailbox words "
            f"{words.shape[0]:,} int32, output summaries {stacks}); {warm}"
        )
        timer.wrap(program, "call", "dispatch")
        timer.wrap(tracker, "_add_words", "add_words")
        for name in ("_summarize_batch", "_collect_mailboxes", "_add_batch", "_end_step"):
            timer.wrap(tracker, name)
    for mode in ("pipelined", "idle"):
        for spent in timer.spent.values():
            spent.clear()
        called, stepped, waited = [], [], []
        for _ in range(args.steps):
            if mode == "idle":
                jax.block_until_ready((p, s))
            start = time.perf_counter_ns()
            p, s, g = call(p, s, x, y)
            returned = time.perf_counter_ns()
            called.append(returned - start)
            if tracker is not None:
                tracker.step(p, s, g)
                stepped.append(time.perf_counter_ns() - returned)
            if mode == "idle":
                begun = time.perf_counter_ns()
                jax.block_until_ready((p, s, g))
                waited.append(time.perf_counter_ns() - begun)
        jax.block_until_ready(p)
        print_phases(mode, called, stepped, waited, timer.spent)
    flat = [time.perf_counter_ns()]
    for _ in range(args.steps):
        jax.tree_util.tree_flatten(((p, s, x, y), {}))
        flat.append(time.perf_counter_ns())
    print(
        "    flattening the arguments in Python (a bound on the C++ path's): "
        f"{ms([b - a for a, b in zip(flat, flat[1:])])} ms"
    )
    if args.profile and tracker is not None:
        profile(args.profile, lambda: tracker.step(*call(p, s, x, y)))
    jax.block_until_ready(p)
    if args.cuda_ops:  # last: it traces the program anew
        ops = cuda_ops(tracker, update, (p, s, x, y))
        kernels = {k: ops[k] for k in _CUDA_KERNELS}
        kernels |= {k: n for k, n in ops.items() if k.startswith("custom_call")}
        print(
            "    lowered for CUDA (before fusion): "
            + ", ".join(f"{k} {n}" for k, n in kernels.items())
            + f"; cuda_kernels_{variant}: {sum(kernels.values())}"
        )


def print_phases(
    mode: str,
    called: list[int],
    stepped: list[int],
    waited: list[int],
    spent: dict[str, list[int]],
) -> None:
    """One line of medians: the call until it returns (split into its phases where a
    tracker timed them), ``step()`` and its parts, and the wait for the device."""
    line = f"    {mode:9s} call returns {ms(called)} ms"
    dispatch, add = spent.get("dispatch", []), spent.get("add_words", [])
    if dispatch:
        rest = [c - d - a for c, d, a in zip(called, dispatch, add)]
        line += (
            f" = dispatch {ms(dispatch)} + add_words {ms(add)} + other Python {ms(rest)}; "
            f"step() {ms(stepped)} ms (summarize_batch {ms(spent['_summarize_batch'])}, "
            f"collect_mailboxes {ms(spent['_collect_mailboxes'])}, add_batch "
            f"{ms(spent['_add_batch'])}, end_step: packing, copy start, landing "
            f"{ms(spent['_end_step'])})"
        )
    if waited:
        line += f"; then the device for {ms(waited)} ms"
    print(line)


def profile(lines: int, work: Callable[[], Any]) -> None:
    """Print the ``lines`` functions with the most own time in ``work()`` (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    work()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(lines)
    body = [line for line in text.getvalue().splitlines() if line.strip()]
    at = next(i for i, line in enumerate(body) if line.lstrip().startswith("ncalls"))
    print("    cProfile of one tracked call and step(), by own time:")
    print("\n".join("      " + line.strip() for line in body[at : at + lines + 1]))


if __name__ == "__main__":
    main()
