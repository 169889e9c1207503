"""Overhead of the JAX tracker on a jitted Flax MLP or transformer update (CPU by default).

Runs blocks of training steps without tracking, tracking everything every step, and
tracking everything every 10th step, interleaved round by round (in a rotating order, so
that no variant always follows another) so that machine noise hits all three alike. A
tracked block ends when its own background work has (its summaries' transfers, and the log
writer's rows for the steps it handed over): work one block leaves running is not charged
to the next block, of another variant. It reports each tracked variant's median block time
over the untracked one, and the median of its per-round ratios to the untracked block of
the same round (paired: robust to load that drifts over the run; the figure to quote for
every=10, whose tracked steps add about a tenth of every=1's overhead).

    python benchmarks/jax_overhead.py [--width 512] [--depth 4] [--batch 256] [--rounds 15]
    python benchmarks/jax_overhead.py --model transformer --rounds 5 [--by-position 4]

It prints the ratio of medians for every=1 and every=10, and per tracked step of the every=1
tracker: host callbacks (tap reports delivered by callback: none expected, loops included;
only shard_map/pmap bodies still report so), compilations after warm-up (none expected) and
device-to-host transfers (one expected); the host time until the update call returns,
untracked and intercepted, and of ``tracker.step()``; the CPU time per step of each thread
(XLA's, the main thread, tandv's log writer), untracked and every=1, read from ``/proc`` on
Linux: where a tracked step's extra work goes. Last, for the model it ran:

    python_calls_per_tracked_call: X (untracked: U)
    host_ms_per_tracked_step: Y

X: Python function calls (``sys.setprofile``) of one ``tracker.intercept(update, ...)``,
U of one untracked ``update(...)`` (a jitted update stays on JAX's C++ dispatch path);
Y: main-thread CPU milliseconds of intercept plus ``tracker.step()``, median over the
every=1 tracker's timed steps.

On a GPU (jax with CUDA, flax, optax, numba, pandas, pyarrow, ml_dtypes installed), from a
checkout:

    PYTHONPATH=. python3 benchmarks/jax_overhead.py --model transformer --rounds 3 --block 10
    PYTHONPATH=. python3 benchmarks/jax_overhead.py --model transformer --rounds 3 --block 10 \
        --summary xla

The first uses the fused Pallas kernel (compiled by Triton) for arrays of at least 2**16
elements and XLA's operations for smaller ones; ``--summary xla`` uses XLA's operations for
all (compare the two to see what the kernel buys); ``--summary pallas`` the kernel for all.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tandv.demos.jax_demo import Transformer  # noqa: E402
from tandv.track.jax import _intercept, _transfer, track  # noqa: E402


class Counters:
    """Host callbacks (tap reports delivered by callback) and XLA compilations, counted while
    ``active``."""

    def __init__(self) -> None:
        self.callbacks = 0
        self.compiles = 0
        self.active = False
        deliver = _intercept._deliver

        def counted(*args):
            if self.active:
                self.callbacks += 1
            return deliver(*args)

        _intercept._deliver = counted
        self.transfers = 0
        transfer = _transfer.Transfer
        counters = self

        class Counted(transfer):
            def __init__(self, arrays):
                if counters.active:
                    counters.transfers += 1
                super().__init__(arrays)

        _transfer.Transfer = Counted
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1


class MLP(nn.Module):
    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)


def add_model_arguments(ap: argparse.ArgumentParser, default_model: str = "mlp") -> None:
    """The options that pick the benchmarked model (shared with ``jax_gpu_probe.py``)."""
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument(
        "--model",
        choices=("mlp", "transformer"),
        default=default_model,
        help="mlp: --width/--depth/--batch; transformer: the GPT-style decoder of the "
        "PyTorch benchmark (4 layers, d_model 256, 4 heads, MLP 1024, vocab 512, "
        "seq 128, batch 8)",
    )


def setup(args: argparse.Namespace) -> tuple[str, Any, Any, Any, Any, Any]:
    """The benchmarked model of ``args`` (:func:`add_model_arguments`): what it is (in
    words), its jitted update ``update(params, opt_state, x, y) -> (params, opt_state,
    grads)``, its parameters and optimizer state, and one batch ``x, y``."""
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    if args.model == "mlp":
        model, opt = MLP(args.width, args.depth), optax.adam(1e-3)
        x = jax.random.normal(kx, (args.batch, args.width))
        y = jax.random.normal(ky, (args.batch, 1))

        def loss(p, x, y):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        what = f"jitted Flax MLP update: width {args.width}, depth {args.depth}, batch {args.batch}"
    else:
        model, opt = Transformer(vocab=512, dim=256, heads=4, depth=4), optax.adamw(1e-3)
        x = jax.random.randint(kx, (8, 128), 0, 512)
        y = jax.random.randint(ky, (8, 128), 0, 512)

        def loss(p, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

        what = "jitted Flax transformer update: 4 layers, d_model 256, 4 heads, seq 128, batch 8"
    params = model.init(kp, x)
    state = opt.init(params)

    @jax.jit
    def update(p, s, x, y):
        grads = jax.grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, grads

    n_params = sum(a.size for a in jax.tree.leaves(params))
    optimizer = "adam" if args.model == "mlp" else "adamw"
    return f"{what}, {n_params:,} parameters, {optimizer}", update, params, state, x, y


def _parser() -> argparse.ArgumentParser:
    """The command line: the model (``add_model_arguments``), the timing and the variants."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(ap)
    ap.add_argument(
        "--block", type=int, default=20, help="steps per timed block (a multiple of 10)"
    )
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--by-position",
        type=int,
        default=0,
        metavar="CYCLES",
        help="also time CYCLES cycles of 10 single steps of the every=10 tracker, each "
        "step next to an untracked one, and report the median of each position in "
        "the cycle (which steps cost what; block medians blur it)",
    )
    ap.add_argument(
        "--summary",
        choices=("auto", "xla", "pallas"),
        default="auto",
        help="the summary computation (sets TANDV_JAX_SUMMARY for the trackers): auto (the "
        "host kernel on the CPU; XLA, and the fused Pallas kernel for large arrays, "
        "on CUDA), xla (XLA's operations everywhere), pallas (the fused kernel for "
        "every array; interpreted, slowly, on the CPU)",
    )
    ap.add_argument(
        "--block-formats",
        nargs="+",
        default=(),
        metavar="FORMAT",
        help="also step a tracker (every step) with these block formats (e.g. mxfp8_e4m3 "
        "nvfp4) and print its ratio to the every=1 tracker's step (block formats' cost)",
    )
    return ap


class _Run:
    """The trackers of one run beside the untracked update, each stepping its own copy of
    the parameters, and what their timed blocks of steps measured."""

    def __init__(self, args, update, params, state, x, y, tmp: Path) -> None:
        self.args, self.update, self.x, self.y = args, update, x, y
        self.t1 = track(params, state, out=tmp / "every1", verbose=False)
        self.t10 = track(params, state, out=tmp / "every10", every=10, verbose=False)
        self.variants = {"untracked": None, "every=1": self.t1, "every=10": self.t10}
        if args.block_formats:
            self.variants["blocks"] = track(
                params,
                state,
                out=tmp / "blocks",
                block_formats=tuple(args.block_formats),
                verbose=False,
            )
        self.carry = {name: (params, state) for name in self.variants}
        self.calls: dict[str, list[float]] = {name: [] for name in self.variants}
        self.steps: dict[str, list[float]] = {name: [] for name in self.variants}
        self.host: list[float] = []  # main-thread CPU seconds of intercept + step(), every=1

    def block(self, name: str) -> float:
        """Wall seconds of ``--block`` steps of variant ``name``, its summaries settled."""
        tracker = self.variants[name]
        p, s = self.carry[name]
        start = time.perf_counter()
        for _ in range(self.args.block):
            called = time.perf_counter()
            if tracker is None:
                p, s, g = self.update(p, s, self.x, self.y)
                self.calls[name].append(time.perf_counter() - called)
            else:
                cpu = time.thread_time()
                p, s, g = tracker.intercept(self.update, p, s, self.x, self.y)
                stepped = time.perf_counter()
                self.calls[name].append(stepped - called)
                tracker.step(p, s, g)
                self.steps[name].append(time.perf_counter() - stepped)
                if tracker is self.t1:
                    self.host.append(time.thread_time() - cpu)
        jax.block_until_ready(p)
        settle(tracker)
        self.carry[name] = (p, s)
        return time.perf_counter() - start

    def warm_up(self) -> None:
        """One block of each variant (compiles every version), its timings dropped."""
        for name in self.variants:
            self.block(name)
            self.calls[name].clear()
            self.steps[name].clear()
        self.host.clear()

    def python_calls(self) -> tuple[int, int]:
        """The fewest Python calls of an untracked and of a tracked update call (3 each;
        each tracked step then ended)."""
        untracked, tracked = [], []
        for _ in range(3):
            untracked.append(count_calls(self.update, *self.carry["untracked"], self.x, self.y)[0])
            n, out = count_calls(
                self.t1.intercept, self.update, *self.carry["every=1"], self.x, self.y
            )
            tracked.append(n)
            self.t1.step(*out)
        return min(untracked), min(tracked)

    def rounds(
        self, counters: Counters
    ) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
        """``--rounds`` rounds of one block per variant, the order rotated each round: the
        blocks' wall seconds and each variant's CPU seconds by thread group."""
        times: dict[str, list[float]] = {name: [] for name in self.variants}
        cpu: dict[str, dict[str, float]] = {name: {} for name in self.variants}
        order = list(self.variants)
        for r in range(self.args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                counters.active = name == "every=1"
                before = thread_cpu()
                times[name].append(self.block(name))
                drain(self.variants[name])  # this block's summaries are charged to it
                for group, seconds in thread_cpu_delta(before, thread_cpu()).items():
                    cpu[name][group] = cpu[name].get(group, 0.0) + seconds
                counters.active = False
        return times, cpu

    def close(self) -> None:
        for tracker in self.variants.values():
            if tracker is not None:
                tracker.close()


def _report_steps(args, what: str, times: dict[str, list[float]]) -> None:
    """The step times and ratios of the variants."""
    base = statistics.median(times["untracked"])
    print(
        f"{what}; {jax.devices()[0].platform}, {args.rounds} interleaved rounds of "
        f"{args.block} steps"
    )
    print(f"  untracked  median step {1e3 * base / args.block:8.3f} ms")
    for name in ("every=1", "every=10"):
        med = statistics.median(times[name])
        step_ms = 1e3 * med / args.block
        paired = statistics.median(t / u for t, u in zip(times[name], times["untracked"]))
        print(
            f"  {name:9s}  median step {step_ms:8.3f} ms   ratio of medians {med / base:.3f}"
            f"   median paired ratio {paired:.3f}"
        )
    if args.block_formats:
        med = statistics.median(times["blocks"])
        paired = statistics.median(t / u for t, u in zip(times["blocks"], times["every=1"]))
        print(
            f"  every=1 with block formats {' + '.join(args.block_formats)}: median step "
            f"{1e3 * med / args.block:8.3f} ms, to every=1: ratio of medians "
            f"{med / statistics.median(times['every=1']):.3f}, median paired ratio {paired:.3f}"
        )


def _report_host(args, run: _Run, counters: Counters, cpu: dict[str, dict[str, float]]) -> None:
    """Per tracked step: callbacks, compilations, transfers, host time, CPU by thread."""
    tracked_steps = args.rounds * args.block
    print(
        f"  every=1: {counters.callbacks / tracked_steps:.2f} host callbacks, "
        f"{counters.compiles / tracked_steps:.2f} compilations and "
        f"{counters.transfers / tracked_steps:.2f} device-to-host transfers per tracked step "
        f"(after warm-up); summaries: {args.summary}"
    )
    calls, steps = run.calls, run.steps
    print(
        "  host time until the update call returns (median; on accelerators the dispatch, "
        f"on the CPU partly the run): untracked {1e3 * statistics.median(calls['untracked']):.3f}"
        f" ms, every=1 intercept {1e3 * statistics.median(calls['every=1']):.3f} ms, then "
        f"tracker.step() {1e3 * statistics.median(steps['every=1']):.3f} ms (on accelerators "
        "a step's host work beyond the untracked call; more than the untracked step time "
        "and the device waits for the host)"
    )
    if cpu["untracked"]:
        for name in ("untracked", "every=1"):
            top = sorted(cpu[name].items(), key=lambda kv: -kv[1])
            print(
                f"  CPU per step by thread, {name}: "
                + ", ".join(
                    f"{group} {1e3 * sec / tracked_steps:.2f} ms" for group, sec in top if sec
                )
            )


def main() -> None:
    args = _parser().parse_args()
    os.environ["TANDV_JAX_SUMMARY"] = args.summary  # read by each tracker when made

    what, update, params, state, x, y = setup(args)

    with tempfile.TemporaryDirectory() as tmp:
        run = _Run(args, update, params, state, x, y, Path(tmp))
        run.warm_up()
        untracked_calls, tracked_calls = run.python_calls()
        counters = Counters()
        times, cpu = run.rounds(counters)
        positions = by_position(run.t10, update, run.carry, x, y, args.by_position)
        run.close()

    _report_steps(args, what, times)
    _report_host(args, run, counters, cpu)
    if positions:
        tracked, untracked = positions
        print(
            f"  every=10 step by step ({args.by_position} cycles), median ms by position "
            f"(untracked {1e3 * untracked:.1f}): "
            + ", ".join(f"{1e3 * t:.1f}" for t in tracked)
            + f"; sum over one cycle / 10 untracked: {sum(tracked) / (10 * untracked):.3f}"
        )
    print(f"python_calls_per_tracked_call: {tracked_calls} (untracked: {untracked_calls})")
    print(f"host_ms_per_tracked_step: {1e3 * statistics.median(run.host):.3f}")


def count_calls(fn, *args):
    """Python function calls (``sys.setprofile`` call events) made by ``fn(*args)``, and
    what it returned."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    return calls[0] - 1, out  # less the profiled call itself


def drain(tracker) -> None:
    """Wait for the summaries of ``tracker``'s steps still in flight (their programs run
    after the update's; None: nothing)."""
    if tracker is not None:
        for _, _, sent in tracker._flights:
            if sent.transfer is not None and sent.transfer._device is not None:
                jax.block_until_ready(sent.transfer._device)


def settle(tracker) -> None:
    """Wait for ``tracker``'s background work (None: nothing): its in-flight summaries
    (:func:`drain`) and the rows its log writer thread was handed (not those still buffered:
    they are handed over, and written, in a later block of the same tracker)."""
    if tracker is not None:
        drain(tracker)
        recorder = tracker.recorder
        if recorder is not None:
            recorder.stream.wait_written()


def thread_cpu() -> dict[tuple[str, str], float]:
    """CPU seconds of each thread of this process so far, keyed by (thread id, group): the
    Python thread's name (MainThread, tandv-host-kernel, tandv-writer) or, for threads that
    Python did not start (XLA's), the kernel's name for it without its number. Empty where
    ``/proc`` does not say (not Linux)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    names = {str(t.native_id): t.name.rstrip("_0123456789") for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        group = names.get(tid) or comm.rstrip("_-0123456789") or comm
        out[(tid, group)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def thread_cpu_delta(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, float]:
    """CPU seconds spent per thread group between two :func:`thread_cpu` readings."""
    spent: dict[str, float] = {}
    for key, seconds in after.items():
        spent[key[1]] = spent.get(key[1], 0.0) + seconds - before.get(key, 0.0)
    return spent


def by_position(tracker, update, carry, x, y, cycles):
    """Median time of each step position in the every=10 cycle, and the median time of an
    untracked step (``None`` when ``cycles`` is 0). Each cycle of ten tracked-schedule
    steps is followed by ten untracked ones, every step waited for; the host kernel's
    background work left at the end of a tracked cycle is waited for too and counted in its
    last step (else it would run during, and be charged to, the untracked steps)."""
    if not cycles:
        return None

    p, s = carry["every=10"]
    while tracker.step_index % 10:  # start at a tracked step
        p, s, g = tracker.intercept(update, p, s, x, y)
        tracker.step(p, s, g)
    drain(tracker)
    tracked: list[list[float]] = [[] for _ in range(10)]
    untracked = []
    q, r = p, s
    for _ in range(cycles):
        for i in range(10):
            start = time.perf_counter()
            p, s, g = tracker.intercept(update, p, s, x, y)
            tracker.step(p, s, g)
            jax.block_until_ready(p)
            if i == 9:
                drain(tracker)
            tracked[i].append(time.perf_counter() - start)
        for _ in range(10):
            start = time.perf_counter()
            q, r, _ = update(q, r, x, y)
            jax.block_until_ready(q)
            untracked.append(time.perf_counter() - start)
    return [statistics.median(t) for t in tracked], statistics.median(untracked)


if __name__ == "__main__":
    main()
