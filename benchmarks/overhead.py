"""Overhead of the PyTorch tracker on a GPT-style decoder, on the CPU or a CUDA GPU.

Two identical models train side by side in one process; their steps are interleaved
(tracked, untracked, tracked, ...) so that machine noise hits both alike, and the
script prints the ratio of median step times (and of means, which for ``every > 1``
include the amortized cost of the scheduled steps).

On the CPU it also prints the host kernel's share of a tracked step: the wall-clock time
of its calls (``tandv.stats.host.host_summaries``, as the tracker calls it), median over
the timed tracked steps, and the elements it read per step. On this model it is about all
of what tracking adds (docs/cost-torch.md). Then the same calls (arrays of the same shapes)
made back to back outside the step, where nothing else runs: the kernel's own floor, and
the ratio it alone would give.

On a GPU (``--device cuda``) it also prints, from the same run:

- kernel launches per tracked and untracked step (torch profiler), and the extra
  launches per tracked activation or activation gradient;
- peak GPU memory of a tracked and an untracked step (``torch.cuda.max_memory_allocated``
  over one step of the same model, the other copy moved off the GPU);
- the floor: one read pass over every tensor a tracked step summarizes
  (``torch._foreach_norm``), as a ratio to the untracked step, and the fused kernel alone
  over the same tensors (one launch per dtype), with the bandwidth each reaches.

Usage::

    python benchmarks/overhead.py                                 # CPU, every=1 and every=10
    python benchmarks/overhead.py --device cuda                   # the 4-layer model on a GPU
    python benchmarks/overhead.py --device cuda --preset gpt2-small --steps 10
    python benchmarks/overhead.py --memory                        # CPU: RSS growth and close time
    python benchmarks/overhead.py --compile --every 1 10          # both models model.compile()'d
    python benchmarks/overhead.py --block-formats mxfp8_e4m3 nvfp4  # cost of block_formats
    python benchmarks/overhead.py --every 1 --moments             # the cost of moments=4
    python benchmarks/overhead.py --kernel-calls                  # CPU: the host kernel by call

With ``--block-formats`` or ``--moments`` three copies step in turn, untracked, tracked and
tracked with that option, and the script prints both tracked copies' ratios to the
untracked one and the option's ratio to the plain tracked copy, of wall-clock step times
and of the process's CPU time per step; with ``--block-formats`` on the CPU, also what each
format adds per value to the host kernel's summary of an array (one thread).

With ``--compile`` both copies are compiled in place (``model.compile()``, inductor) and
the tracker's hooks run inside the tracked copy's graph; the warm-up steps compile (a
scheduled and an unscheduled step each get a graph), and the script also prints the graph
breaks and the graphs compiled after the warm-up (both should be 0).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandv.demos.torch_gpt import GPT, GPTConfig  # noqa: E402
from tandv.track.torch import summary as torch_summary  # noqa: E402
from tandv.track.torch import track  # noqa: E402

PRESETS = {
    "small": dict(layers=4, d_model=256, heads=4, mlp=1024, vocab=512, seq=128, batch=8),
    # GPT-2 small's shape: 124M parameters, logits of 8 x 1024 x 50304
    "gpt2-small": dict(layers=12, d_model=768, heads=12, mlp=3072, vocab=50304, seq=1024, batch=8),
}


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _trainer(cfg: GPTConfig, batch: int, seed: int, device: str):
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (4, batch, cfg.seq_len + 1), generator=gen).to(device)
    return model, opt, data


def _step(model: GPT, opt: torch.optim.Optimizer, data: torch.Tensor, i: int) -> None:
    x = data[i % len(data)]
    loss = model.loss(x[:, :-1], x[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def host_kernel_clock() -> Iterator[list[Any]]:
    """Within the block, the host kernel's calls by the PyTorch tracker are timed (wall
    clock: its threads' work is what the step waits for); yields ``[seconds, elements,
    calls]``, summed since the block began or was last zeroed (``calls``: each call's
    array shapes and dtypes, layout and threads, for :func:`host_kernel_floor`). The
    kernel is put back at the end."""
    real = torch_summary.host_summaries
    total: list[Any] = [0.0, 0.0, []]

    def timed(arrays: Any, layout: Any, threads: int = 1) -> Any:
        t0 = time.perf_counter()
        try:
            return real(arrays, layout, threads)
        finally:
            total[0] += time.perf_counter() - t0
            total[1] += sum(a.size for a in arrays)
            total[2].append(([(a.shape, a.dtype) for a in arrays], layout, threads))

    torch_summary.host_summaries = timed
    try:
        yield total
    finally:
        torch_summary.host_summaries = real


def host_kernel_floor(calls: list[Any], reps: int = 5) -> float:
    """Seconds the host kernel takes for one step's ``calls`` (as
    :func:`host_kernel_clock` records them) made back to back, outside the step, on arrays
    of the same shapes and dtypes (normal values): the least of ``reps`` runs. What the
    kernel costs when nothing but it runs: against the untracked step, the lowest ratio
    tracking every tensor can reach on this machine with this kernel."""
    rng = np.random.default_rng(0)
    made = [
        ([rng.standard_normal(shape).astype(dtype) for shape, dtype in arrays], layout, threads)
        for arrays, layout, threads in calls
    ]
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        for arrays, layout, threads in made:
            torch_summary.host_summaries(arrays, layout, threads)
        best = min(best, time.perf_counter() - t0)
    return best


def overhead(
    cfg: GPTConfig,
    batch: int,
    steps: int,
    warmup: int,
    every: int,
    device: str,
    compile: bool = False,
) -> dict[str, float]:
    """Interleaved tracked/untracked step times; returns medians, means and their ratios
    (with ``compile``, also the graph breaks and the graphs compiled after the warm-up; on
    the CPU, the host kernel's median time per tracked step and its elements per step)."""
    m_a, o_a, data = _trainer(cfg, batch, 0, device)
    m_b = copy.deepcopy(m_a)
    o_b = torch.optim.AdamW(m_b.parameters(), lr=1e-3)
    if compile:
        m_a.compile()
        m_b.compile()
    tracked, plain = [], []
    kernel: list[tuple[float, float]] = []  # (seconds, elements) per tracked step
    calls: list[Any] = []  # the last tracked step's kernel calls (see host_kernel_clock)
    graphs_after_warmup = 0.0
    with tempfile.TemporaryDirectory() as tmp, host_kernel_clock() as clock:
        with track(m_a, o_a, every=every, out=Path(tmp) / "log", verbose=False) as tracker:
            for i in range(warmup + steps):
                if compile and i == warmup:
                    graphs_after_warmup = -_compile_count("unique_graphs")
                _sync(device)
                clock[:] = [0.0, 0.0, []]
                t0 = time.perf_counter()
                _step(m_a, o_a, data, i)
                tracker.step()
                _sync(device)
                t1 = time.perf_counter()
                if i >= warmup:
                    kernel.append((clock[0], clock[1]))
                    calls = clock[2] or calls
                _step(m_b, o_b, data, i)
                _sync(device)
                t2 = time.perf_counter()
                if i >= warmup:
                    tracked.append(t1 - t0)
                    plain.append(t2 - t1)
    med_t, med_p = statistics.median(tracked), statistics.median(plain)
    mean_t, mean_p = statistics.fmean(tracked), statistics.fmean(plain)
    out = {
        "median_tracked_ms": med_t * 1e3,
        "median_plain_ms": med_p * 1e3,
        "ratio_median": med_t / med_p,
        "mean_tracked_ms": mean_t * 1e3,
        "mean_plain_ms": mean_p * 1e3,
        "ratio_mean": mean_t / mean_p,
    }
    if device == "cpu":
        out["median_host_kernel_ms"] = statistics.median(k[0] for k in kernel) * 1e3
        out["host_kernel_elements_per_step"] = statistics.median(k[1] for k in kernel)
        if calls:
            out["host_kernel_floor_ms"] = host_kernel_floor(calls) * 1e3
    if compile:
        out["graphs_after_warmup"] = graphs_after_warmup + _compile_count("unique_graphs")
        out["graph_breaks"] = float(sum(_compile_counters()["graph_break"].values()))
    return out


def kernel_calls(cfg: GPTConfig, batch: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    """Where a tracked CPU step's host-kernel time goes, by kind of call: each call of
    ``host_summaries`` timed inside the step (wall clock), then made again at once on the
    same arrays, and the last step's calls made once more after the loop, on the
    tracker's own arrays (outside any step; the least of 5). One row per kind of call (the
    count of arrays and the first one's shape): its calls and elements in the last step,
    and ns per element of its calls' time per step (the median over the timed steps, and
    after the loop the last step's). The first figure against the second tells what a
    call pays for arrays not in cache; against the third, what the step around it costs
    the call."""
    model, opt, data = _trainer(cfg, batch, 0, "cpu")
    real = torch_summary.host_summaries
    Kind = tuple[int, tuple[int, ...]]
    step_calls: list[tuple[Kind, int, float, float, Any]] = []

    def timed(arrays: Any, layout: Any, threads: int = 1) -> Any:
        t0 = time.perf_counter()
        out = real(arrays, layout, threads)
        t1 = time.perf_counter()
        real(arrays, layout, threads)
        t2 = time.perf_counter()
        kind = (len(arrays), tuple(arrays[0].shape))
        call = (list(arrays), layout, threads)
        step_calls.append((kind, sum(a.size for a in arrays), t1 - t0, t2 - t1, call))
        return out

    first: dict[Kind, list[float]] = {}
    again: dict[Kind, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with track(model, opt, out=Path(tmp) / "log", verbose=False) as tracker:
            torch_summary.host_summaries = timed
            try:
                for i in range(warmup + steps):
                    step_calls.clear()
                    _step(model, opt, data, i)
                    tracker.step()
                    if i >= warmup:
                        sums: dict[Kind, list[float]] = {}
                        for kind, _, t_first, t_again, _ in step_calls:
                            got = sums.setdefault(kind, [0.0, 0.0])
                            got[0] += t_first
                            got[1] += t_again
                        for kind, (t_first, t_again) in sums.items():
                            first.setdefault(kind, []).append(t_first)
                            again.setdefault(kind, []).append(t_again)
            finally:
                torch_summary.host_summaries = real
            rows: dict[Kind, dict[str, Any]] = {}
            for kind, n, _, _, (arrays, layout, threads) in step_calls:  # the last step's
                best = math.inf  # (its gradients still held: none zeroed since)
                for _ in range(5):
                    t0 = time.perf_counter()
                    real(arrays, layout, threads)
                    best = min(best, time.perf_counter() - t0)
                row = rows.setdefault(
                    kind, {"arrays": kind[0], "shape": kind[1], "calls": 0, "elements": 0,
                           "after_s": 0.0},
                )  # fmt: skip
                row["calls"] += 1
                row["elements"] += n
                row["after_s"] += best
    for kind, row in rows.items():
        per_ns = 1e9 / row["elements"]
        row["first_ns"] = statistics.median(first[kind]) * per_ns
        row["again_ns"] = statistics.median(again[kind]) * per_ns
        row["after_ns"] = row.pop("after_s") * per_ns
    return sorted(rows.values(), key=lambda r: -r["elements"] * r["first_ns"])


def variant_cost(
    cfg: GPTConfig,
    batch: int,
    steps: int,
    warmup: int,
    every: int,
    device: str,
    **option: Any,
) -> dict[str, float]:
    """The cost of one tracking ``option`` (``block_formats=...``, ``moments=4``): three
    copies of the model step in turn (untracked, tracked, tracked with the option), so that
    machine noise hits them alike. Returns the median step times (ms) and the ratios of
    medians: each tracked copy's to the untracked one, and the option's to plain tracking;
    also the median CPU time of the process per step (all its threads) and the option's
    ratio of those to plain tracking, which a shared machine's load disturbs less than the
    wall-clock time (the option's work is CPU work on the CPU)."""
    m_u, o_u, data = _trainer(cfg, batch, 0, device)
    m_t, m_v = copy.deepcopy(m_u), copy.deepcopy(m_u)
    o_t = torch.optim.AdamW(m_t.parameters(), lr=1e-3)
    o_v = torch.optim.AdamW(m_v.parameters(), lr=1e-3)
    times: dict[str, list[float]] = {"untracked": [], "tracked": [], "variant": []}
    cpu: dict[str, list[float]] = {"untracked": [], "tracked": [], "variant": []}
    with tempfile.TemporaryDirectory() as tmp:
        t_t = track(m_t, o_t, every=every, out=Path(tmp) / "t", verbose=False)
        t_v = track(m_v, o_v, every=every, out=Path(tmp) / "v", verbose=False, **option)
        with t_t, t_v:
            runs = (("untracked", m_u, o_u, None), ("tracked", m_t, o_t, t_t))
            runs += (("variant", m_v, o_v, t_v),)
            for i in range(warmup + steps):
                for name, model, opt, tracker in runs:
                    _sync(device)
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    _step(model, opt, data, i)
                    if tracker is not None:
                        tracker.step()
                    _sync(device)
                    if i >= warmup:
                        times[name].append(time.perf_counter() - t0)
                        cpu[name].append(time.process_time() - c0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    paired = [v / t for v, t in zip(times["variant"], times["tracked"])]
    med_cpu = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    return {
        **{f"median_{k}_ms": v for k, v in med.items()},
        **{f"median_{k}_cpu_ms": v for k, v in med_cpu.items()},
        "cpu_ratio_variant_to_tracked": med_cpu["variant"] / med_cpu["tracked"],
        "ratio_tracked": med["tracked"] / med["untracked"],
        "ratio_variant": med["variant"] / med["untracked"],
        "ratio_variant_to_tracked": med["variant"] / med["tracked"],
        # the median of each iteration's ratio: the two tracked steps ran back to back
        "paired_variant_to_tracked": statistics.median(paired),
    }


def formats_per_value(formats: list[str], repeat: int = 30) -> dict[str, float]:
    """The host kernel's cost per value (ns, thread CPU time, one thread, the least of
    ``repeat`` calls) of a (1024, 256) array of float32 Gaussian values (the size of an
    activation of the small model; four chunks, 1 MiB, read from the cache after the first
    call): its summary alone (``"summary"``), and what each of ``formats`` adds to it,
    alone and all together (``"all"``), call costs included: the formats' own cost, which
    the step ratios mix with the model's and the rest of the tracker's."""
    import numpy as np

    from tandv.stats.blocks import block_extras
    from tandv.stats.host import host_summaries
    from tandv.stats.summary import Layout

    x = np.random.default_rng(0).standard_normal((1024, 256)).astype(np.float32)

    def least(extras: tuple[tuple[str, str], ...]) -> float:
        layout = Layout("float32", extras=extras)
        host_summaries([x], layout)  # compiled before it is timed
        best = float("inf")
        for _ in range(repeat):
            t0 = time.thread_time()
            host_summaries([x], layout)
            best = min(best, time.thread_time() - t0)
        return best * 1e9 / x.size

    base = least(())
    out = {"summary": base}
    for name in formats:
        out[name] = least(block_extras([name])) - base
    out["all"] = least(block_extras(formats)) - base
    return out


def variant_row(
    r: dict[str, float], formats: list[str], every: int, load: float, load_after: float
) -> dict[str, Any]:
    """The columns of a block-formats run (:func:`variant_cost`'s result ``r``) for
    ``benchmarks/results/block_formats.json``: median step times, the paired ratio of the
    step with the formats to the plain tracked one (the CPU-time ratio in parentheses),
    the machine's load average before and after, and the commit measured (uncommitted
    changes are not marked)."""
    try:  # the code measured, for before/after rows
        code = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        code = "-"
    return {
        "code": code,
        "formats": " + ".join(formats),
        "every": every,
        "load": [round(load, 1), round(load_after, 1)],
        "untracked": round(r["median_untracked_ms"], 1),
        "tracked": round(r["median_tracked_ms"], 1),
        "variant": round(r["median_variant_ms"], 1),
        "ratio": {
            "value": round(r["paired_variant_to_tracked"], 3),
            "paren": round(r["cpu_ratio_variant_to_tracked"], 3),
        },
    }


def _compile_counters() -> Any:
    from torch._dynamo.utils import counters

    return counters


def _compile_count(name: str) -> float:
    return float(_compile_counters()["stats"][name])


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``fn`` on the GPU (synchronized), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _launches(fn: Callable[[], None]) -> int:
    """CUDA kernels, memsets and copies that ``fn`` queues (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = (
        "cudaLaunchKernel",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaLaunchKernelExC",
        "cudaMemcpyAsync",
        "cudaMemsetAsync",
    )
    return sum(e.count for e in prof.key_averages() if e.key in names)


def launches_and_memory(cfg: GPTConfig, batch: int) -> dict[str, float]:
    """Kernel launches and peak memory of one tracked and one untracked step of one model
    (the only one on the GPU)."""
    model, opt, data = _trainer(cfg, batch, 0, "cuda")
    out: dict[str, float] = {}

    def peak(fn: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30

    for i in range(3):
        _step(model, opt, data, i)
    out["launches_untracked"] = _launches(lambda: _step(model, opt, data, 3))
    out["peak_gib_untracked"] = peak(lambda: _step(model, opt, data, 4))
    with tempfile.TemporaryDirectory() as tmp:
        with track(model, opt, out=Path(tmp) / "log", verbose=False) as tracker:

            def tracked(i: int) -> Callable[[], None]:
                return lambda: (_step(model, opt, data, i), tracker.step())

            for i in range(5, 8):
                tracked(i)()
            out["launches_tracked"] = _launches(tracked(8))
            out["peak_gib_tracked"] = peak(tracked(9))
            n_act = int((tracker.plan()["tensor_type"] == "Activation").sum())
    out["tracked_activations_and_grads"] = 2 * n_act
    return out


def floor(cfg: GPTConfig, batch: int, reps: int = 10) -> dict[str, float]:
    """One read pass over every tensor a tracked step summarizes, against the step."""
    from tandv.stats.summary import Layout
    from tandv.track.torch import _fused
    from tandv.track.torch._workspace import Workspace

    model, opt, data = _trainer(cfg, batch, 0, "cuda")
    for i in range(3):
        _step(model, opt, data, i)
    kept: list[torch.Tensor] = []
    handles = []
    for m in model.modules():
        if type(m).forward is torch.nn.Module.forward:
            continue

        def hook(mod: Any, args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor):
                kept.append(out.detach())
                if out.requires_grad:
                    out.register_hook(lambda g: kept.append(g.detach()))

        handles.append(m.register_forward_hook(hook))
    _step(model, opt, data, 3)
    for h in handles:
        h.remove()
    tensors = (
        kept
        + [p.detach() for p in model.parameters()]
        + [p.grad for p in model.parameters() if p.grad is not None]
        + [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    )
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    step = timed(lambda: _step(model, opt, data, 4), reps)
    read = timed(lambda: torch._foreach_norm(tensors), reps)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    ws = Workspace()

    def fused() -> None:
        for dtype, ts in by_dtype.items():
            ws.fused(
                ts,
                _fused.spec_for(dtype),
                Layout(str(dtype).removeprefix("torch.")),
                [{}] * len(ts),
            )
        ws.end_step()

    kernel = timed(fused, reps)
    return {
        "tensors": len(tensors),
        "gib": nbytes / 2**30,
        "step_ms": step * 1e3,
        "read_ms": read * 1e3,
        "floor_ratio": (step + read) / step,
        "read_gbps": nbytes / read / 1e9,
        "fused_ms": kernel * 1e3,
        "fused_ratio": (step + kernel) / step,
        "fused_gbps": nbytes / kernel / 1e9,
    }


def memory_and_close(
    cfg: GPTConfig, batch: int, long_steps: int, short_steps: int
) -> dict[str, float]:
    """RSS growth per tracked step (between 20% and 100% of a long run) and close times."""
    out: dict[str, float] = {}
    for n in (short_steps, long_steps):
        model, opt, data = _trainer(cfg, batch, 1, "cpu")
        with tempfile.TemporaryDirectory() as tmp:
            tracker = track(model, opt, out=Path(tmp) / "log", verbose=False)
            tracker.__enter__()
            mark = max(n // 5, 1)
            rss0 = 0
            for i in range(n):
                _step(model, opt, data, i)
                tracker.step()
                if i + 1 == mark:
                    gc.collect()
                    rss0 = _rss_kib()
            gc.collect()
            rss1 = _rss_kib()
            t0 = time.perf_counter()
            tracker.__exit__(None, None, None)
            out[f"close_s_after_{n}_steps"] = time.perf_counter() - t0
            if n == long_steps:
                out["rss_growth_bytes_per_step"] = (rss1 - rss0) * 1024 / (n - mark)
                out["log_mib"] = sum(f.stat().st_size for f in tracker.out_path.iterdir()) / 2**20
    return out


def config_of(size: dict[str, int]) -> GPTConfig:
    """The model of a size preset (:data:`PRESETS`' keys), for this and the host-cost
    benchmark."""
    return GPTConfig(
        vocab_size=size["vocab"],
        seq_len=size["seq"],
        d_model=size["d_model"],
        n_layers=size["layers"],
        n_heads=size["heads"],
        d_mlp=size["mlp"],
    )


def record(results: str, cfg: GPTConfig, argv: list[str] | None, measured: dict[str, Any]) -> None:
    """Add one run (untracked median step, ratio of medians with the ratio of means in
    parentheses per ``every``) as a row of ``results`` through ``benchmarks/tables.py``."""
    spec = importlib.util.spec_from_file_location(
        "bench_tables", Path(__file__).with_name("tables.py")
    )
    assert spec is not None and spec.loader is not None
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    row = {
        "model": f"{cfg.n_layers} layers, d_model {cfg.d_model} ({params / 1e6:.1f} M params)",
        "threads": str(torch.get_num_threads()),
        **measured,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["benchmarks/overhead.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    tables.append_row(results, row)


def run_variant(
    args: argparse.Namespace,
    argv: list[str] | None,
    cfg: GPTConfig,
    batch: int,
    variant: dict[str, Any],
) -> int:
    """Measures and prints the cost of a tracking option (``--block-formats``,
    ``--moments``) per ``every``; with ``--results``, adds a block-formats run's row."""
    label = ", ".join(f"{k}={v!r}" for k, v in variant.items())
    for every in args.every:
        load = os.getloadavg()[0]  # the machine's load (shared machines: say it)
        r = variant_cost(cfg, batch, args.steps, args.warmup, every, args.device, **variant)
        load_after = os.getloadavg()[0]
        print(
            f"every={every}: untracked {r['median_untracked_ms']:.1f} ms, tracked "
            f"{r['median_tracked_ms']:.1f} ms, with {label} {r['median_variant_ms']:.1f} ms "
            f"(medians); tracked / untracked {r['ratio_tracked']:.3f}, with {label} "
            f"{r['ratio_variant']:.3f}; with {label} / tracked "
            f"{r['ratio_variant_to_tracked']:.3f}",
            flush=True,
        )
        print(
            f"  CPU time of the process per step (medians): untracked "
            f"{r['median_untracked_cpu_ms']:.1f} ms, tracked {r['median_tracked_cpu_ms']:.1f}"
            f" ms, with {label} {r['median_variant_cpu_ms']:.1f} ms; with {label} / tracked "
            f"{r['cpu_ratio_variant_to_tracked']:.3f}",
            flush=True,
        )
        print(
            f"  paired (median of each step's ratio): with {label} / tracked "
            f"{r['paired_variant_to_tracked']:.3f}; 1-min load average {load:.1f} -> "
            f"{load_after:.1f}",
            flush=True,
        )
        if args.results and args.block_formats:
            record(
                args.results,
                cfg,
                argv,
                variant_row(r, args.block_formats, every, load, load_after),
            )
    if args.block_formats and args.device == "cpu":
        ns = formats_per_value(args.block_formats)
        print(
            "host kernel, a (1024, 256) float32 array, one thread (thread CPU time, ns per "
            "value): "
            f"summary {ns.pop('summary'):.3f}; the formats add "
            + ", ".join(f"{k} {v:.3f}" for k, v in ns.items()),
            flush=True,
        )
    return 0


#: ``--large-split``: tensors of this many elements or more are split its way
LARGE = 1 << 24


def large_split(
    plain: Callable[[int, int, int], tuple[int, int]], sms: int, per_sm: int
) -> Callable[[int, int, int], tuple[int, int]]:
    """The fused kernel's split (``_fused._parts``: programs and elements per program of a
    tensor of ``n`` elements) with tensors of :data:`LARGE` elements or more split among up
    to ``per_sm`` programs on each of ``sms`` SMs rather than the library's most. A trial,
    for this process only: on an H200 (Triton 3.6) the kernel alone read 16M-268M float32
    elements 2-8% faster at 3 per SM than at 2, and 4M elements 18% slower
    (docs/cost-torch.md); whether a model's step gains is what ``--large-split`` measures."""

    def parts(n: int, max_parts: int, block: int) -> tuple[int, int]:
        return plain(n, per_sm * sms if n >= LARGE else max_parts, block)

    return parts


def _parser() -> argparse.ArgumentParser:
    """The command line: the model's shape, the steps, and which measurement."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="small",
        help="model shape; the size options below override it",
    )
    for name in ("layers", "d-model", "heads", "mlp", "vocab", "seq", "batch"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--every", type=int, nargs="*", default=[1, 10])
    p.add_argument(
        "--moments",
        action="store_true",
        help="instead: the cost of track(moments=4) (skew, kurtosis) beside plain tracking",
    )
    p.add_argument(
        "--no-extras",
        action="store_true",
        help="GPU: skip launch counts, peak memory and the floor",
    )
    p.add_argument(
        "--memory", action="store_true", help="measure RSS growth and close time instead"
    )
    p.add_argument(
        "--kernel-calls",
        action="store_true",
        help="CPU, instead: the host kernel's time per kind of call, inside the tracked step, "
        "again at once, and after the loop",
    )
    p.add_argument("--long-steps", type=int, default=1000)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--block-formats",
        nargs="+",
        default=None,
        help="instead: the cost of track(block_formats=...) beside plain tracking, e.g. "
        "mxfp8_e4m3 nvfp4",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile both models in place (model.compile(), inductor)",
    )
    p.add_argument(
        "--large-split",
        type=int,
        default=None,
        metavar="PER_SM",
        help="GPU: split tensors of 2**24 elements or more among up to PER_SM programs per SM "
        "(the library's most is 2 per SM)",
    )
    p.add_argument(
        "--results",
        default=None,
        help="also add this run's ratios as a row of this results file (e.g. "
        "benchmarks/results/torch_overhead.json; benchmarks/tables.py renders it for the docs)",
    )
    return p


def _model(args: argparse.Namespace) -> tuple[GPTConfig, int]:
    """The model's shape (the preset, with the size options over it) and batch."""
    size = dict(PRESETS[args.preset])
    for name in size:
        given = getattr(args, name.replace("-", "_"))
        if given is not None:
            size[name] = given
    return config_of(size), size["batch"]


def _ratios(args: argparse.Namespace, argv: list[str] | None, cfg: GPTConfig, batch: int) -> None:
    """Tracked against untracked, for each ``--every``; with ``--results``, a row of the
    results file."""
    measured: dict[str, Any] = {}
    for every in args.every:
        r = overhead(cfg, batch, args.steps, args.warmup, every, args.device, args.compile)
        measured[f"every{every}"] = {
            "value": round(r["ratio_median"], 3),
            "paren": round(r["ratio_mean"], 3),
        }
        measured["untracked"] = round(r["median_plain_ms"], 1)
        print(
            f"every={every}: tracked {r['median_tracked_ms']:.1f} ms, untracked "
            f"{r['median_plain_ms']:.1f} ms (medians) -> ratio of medians {r['ratio_median']:.3f}; "
            f"ratio of means {r['ratio_mean']:.3f}",
            flush=True,
        )
        if r.get("host_kernel_elements_per_step"):  # (the CPU; none on unscheduled steps)
            ms, n = r["median_host_kernel_ms"], r["host_kernel_elements_per_step"]
            print(
                f"  in the host kernel: {ms:.1f} ms of the tracked step (median), "
                f"{n / 1e6:.2f} M elements, {ms * 1e6 / n:.2f} ns per element",
                flush=True,
            )
            floor, plain = r["host_kernel_floor_ms"], r["median_plain_ms"]
            print(
                f"  the same calls back to back, outside the step: {floor:.1f} ms "
                f"({floor * 1e6 / n:.2f} ns per element): a floor of "
                f"{(plain + floor) / plain:.3f} for the ratio",
                flush=True,
            )
        if args.compile:
            print(
                f"  graph breaks {r['graph_breaks']:.0f}, graphs compiled after the warm-up "
                f"{r['graphs_after_warmup']:.0f}",
                flush=True,
            )
    if args.results:
        record(args.results, cfg, argv, measured)


def _gpu_extras(cfg: GPTConfig, batch: int) -> None:
    """On a GPU: launches per step, peak memory, and the floor of one read pass."""
    gc.collect()
    torch.cuda.empty_cache()
    r = launches_and_memory(cfg, batch)
    extra = (r["launches_tracked"] - r["launches_untracked"]) / r["tracked_activations_and_grads"]
    print(
        f"launches per step: tracked {r['launches_tracked']:.0f}, untracked "
        f"{r['launches_untracked']:.0f} ({extra:.2f} extra per tracked "
        "activation or activation "
        f"gradient, {r['tracked_activations_and_grads']:.0f} of them)"
    )
    print(
        f"peak GPU memory of a step: tracked {r['peak_gib_tracked']:.3f} GiB, untracked "
        f"{r['peak_gib_untracked']:.3f} GiB -> "
        f"ratio {r['peak_gib_tracked'] / r['peak_gib_untracked']:.4f}",
        flush=True,
    )
    gc.collect()
    torch.cuda.empty_cache()
    f = floor(cfg, batch)
    print(
        f"floor: one read pass (torch._foreach_norm) over the {f['tensors']} tensors "
        "a tracked step "
        f"summarizes ({f['gib']:.2f} GiB): {f['read_ms']:.2f} ms ({f['read_gbps']:.0f} GB/s) "
        "on a "
        f"{f['step_ms']:.1f} ms step -> {f['floor_ratio']:.3f}x"
    )
    print(
        "fused kernel alone over the same tensors: "
        f"{f['fused_ms']:.2f} ms ({f['fused_gbps']:.0f} GB/s) "
        f"-> {f['fused_ratio']:.3f}x"
    )


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {os.cpu_count()} CPUs"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {where}")
    if args.large_split is not None:
        if args.device != "cuda" or args.large_split < 1:
            p.error("--large-split: a positive count of programs per SM, with --device cuda")
        from tandv.track.torch import _fused

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        _fused._parts = large_split(_fused._parts, sms, args.large_split)  # type: ignore[assignment]
        print(f"tensors of {LARGE} elements or more: up to {args.large_split} programs per SM")
    if args.memory:
        tiny = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_mlp=64)
        # +5: not a multiple of flush_every, so closing has buffered rows to write
        res = memory_and_close(tiny, 2, args.long_steps + 5, max(args.long_steps // 10, 10) + 5)
        print(f"tiny GPT {tiny}:")
        for k, v in res.items():
            print(f"  {k}: {v:.4g}")
        return 0
    cfg, batch = _model(args)
    if args.kernel_calls:
        if args.device != "cpu":
            p.error("--kernel-calls: the host kernel runs for CPU tensors (--device cpu)")
        if args.steps < 1:
            p.error(f"--kernel-calls: --steps must be at least 1 (got {args.steps})")
        print(f"{cfg}, batch {batch}, AdamW, cpu: the host kernel per kind of call")
        print("arrays  first shape       calls  M elements  ns per element: in the step, "
              "again, after the loop")  # fmt: skip
        for r in kernel_calls(cfg, batch, args.steps, args.warmup):
            print(
                f"{r['arrays']:6d}  {str(r['shape']):16s}  {r['calls']:5d}  "
                f"{r['elements'] / 1e6:10.2f}  {r['first_ns']:.3f}, {r['again_ns']:.3f}, "
                f"{r['after_ns']:.3f}"
            )
        return 0
    variant: dict[str, Any] = {}
    if args.block_formats:
        variant["block_formats"] = tuple(args.block_formats)
    if args.moments:
        variant["moments"] = 4
    print(
        f"{cfg}, batch {batch}, AdamW, {args.device}"
        + (", both compiled (model.compile())" if args.compile else "")
    )
    if variant:
        return run_variant(args, argv, cfg, batch, variant)
    _ratios(args, argv, cfg, batch)
    if args.device == "cuda" and not args.no_extras and not args.compile:
        _gpu_extras(cfg, batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
