"""The fused summary kernel alone: effective bandwidth per dtype and size, and launch cost.

On a CUDA GPU it times the kernel on one tensor per size and dtype, device time only (the
launches are captured in a CUDA graph and replayed, each into a row of its own), and
prints the effective bandwidth (bytes of the tensor read per second) beside ``x.sum()``
on the same tensor (one read pass: the floor). The float32 sweep runs 256 Ki to 256 Mi
elements; the target is >= 1.5 TB/s from 1 Mi elements on an H100. Then the host cost of
one hook-sized observation (Python and Triton's launch, no device wait).

``--tiny`` runs a few small tensors in Triton's interpreter on the CPU (no GPU figure:
it checks the benchmark's own path and the results against the numpy reference), as the
test suite does. ``--warps``, ``--per-thread``, ``--maxnreg`` and ``--parts`` or
``--parts-per-sm`` (the most programs per tensor) override the kernel's tile and split for
tuning.

Usage::

    PYTHONPATH=. python3 benchmarks/fused_kernel.py [--numel 268435456] [--reps 20]
    PYTHONPATH=. python3 benchmarks/fused_kernel.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _one(
    x: torch.Tensor, fused: Any, layout: Any, rows: torch.Tensor, off: int, scratch: Any, parts: int
) -> None:
    """One launch of the fused kernel on ``x`` into ``rows[off:]``."""
    fused.launch_one(x, fused.spec_for(x.dtype), layout, rows, off, scratch, parts)


def device_seconds(
    x: torch.Tensor, fused: Any, reps: int, parts: int | None = None
) -> tuple[float, float]:
    """Device seconds per call of the fused kernel and of ``x.sum()`` on ``x`` (CUDA graph
    replays of ``reps`` calls; each kernel call writes a zeroed row of its own); ``parts``:
    the most programs a tensor is split among (default: the tracker's, 2 per SM)."""
    from tandv.stats.summary import Layout
    from tandv.track.torch.summary import fused_programs

    spec = fused.spec_for(x.dtype)
    layout = Layout(str(x.dtype).removeprefix("torch."))
    size = fused.row_size(spec, layout)
    parts = parts or fused_programs(x.device)
    rows = torch.zeros(reps * size, dtype=torch.float64, device=x.device)
    scratch = torch.empty(
        max(1, fused.scratch_rows(x.numel(), parts, spec)) * fused.PART,
        dtype=torch.float64,
        device=x.device,
    )
    out = []
    for call in (
        lambda i: _one(x, fused, layout, rows, i * size, scratch, parts),
        # (8-bit floats have no CUDA sum: their bytes, read as integers, cost the same read)
        (lambda i: x.sum()) if x.element_size() > 1 else (lambda i: x.view(torch.uint8).sum()),
    ):
        call(0)  # compiles, and moves any table to the device, before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(reps):
                call(i)
        times = []
        for _ in range(3):
            rows.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
        out.append(min(times))
    return out[0], out[1]


def gpu(args: argparse.Namespace, fused: Any) -> None:
    from tandv.stats.summary import Layout
    from tandv.track.torch._workspace import Workspace

    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {fused.NUM_WARPS} warps, "
        f"{fused.PER_THREAD} elements per thread and tile, register cap {fused.MAXNREG}, "
        f"at most {args.parts or '2 per SM'} programs per tensor"
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1 << k for k in range(18, 29, 2) if (1 << k) <= args.numel]
    cases = [(torch.float32, n) for n in sizes] + [
        (d, args.numel) for d in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float64)
    ]
    for dtype, n in cases:
        x = torch.randn(n, device="cuda", generator=g).to(dtype)
        nbytes = n * x.element_size()
        t_fused, t_sum = device_seconds(x, fused, args.reps, args.parts)
        print(
            f"{str(dtype):22s} {n:>11d} elements  fused {nbytes / t_fused / 1e12:6.3f} TB/s "
            f"({t_fused * 1e6:8.1f} us)   sum {nbytes / t_sum / 1e12:6.3f} TB/s"
        )
    small = torch.randn(8 * 128 * 256, device="cuda")  # an activation of the 4-layer model
    ws = Workspace()
    layout = Layout("float32")
    ws.summaries([small], layout, [{}])
    n = 300
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        ws.summaries([small], layout, [{}])
    host = time.perf_counter() - t0
    ws.end_step()
    torch.cuda.synchronize()
    print(
        f"one hook-sized observation ({small.numel()} float32): {host / n * 1e6:.1f} us on the "
        f"host (Python and launch), {(time.perf_counter() - t0) / n * 1e6:.1f} us until the "
        f"GPU is done"
    )


def tiny(fused: Any) -> None:
    """A few small tensors through the interpreter, checked against the numpy reference."""
    from tandv.stats.summary import Layout, summarize

    g = torch.Generator().manual_seed(0)
    print("Triton interpreter on the CPU: no GPU figure, a check of the benchmark's path")
    for dtype in (torch.float32, torch.bfloat16):
        spec = fused.spec_for(dtype)
        x = torch.randn(2 * spec.block + 37, generator=g).to(dtype)
        layout = Layout(str(dtype).removeprefix("torch."))
        rows = torch.zeros(fused.row_size(spec, layout), dtype=torch.float64)
        scratch = torch.zeros(4 * fused.PART, dtype=torch.float64)
        t0 = time.perf_counter()
        _one(x, fused, layout, rows, 0, scratch, 2)
        took = time.perf_counter() - t0
        got = fused.finish_rows(rows.numpy()[None], spec, layout)[0]
        arr = x.float().numpy() if dtype == torch.float32 else x.view(torch.int16).numpy()
        if dtype == torch.bfloat16:
            import ml_dtypes

            arr = arr.view(ml_dtypes.bfloat16)
        ref, _ = summarize(arr)
        err = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)))
        print(f"{str(dtype):16s} {x.numel():6d} elements  {took * 1e3:7.1f} ms  error {err:.1e}")
        if err > 1e-5:
            raise SystemExit(f"fused kernel disagrees with the reference: {err}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1 << 28)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="the interpreter on the CPU")
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--per-thread", type=int, default=None, help="elements per thread and tile")
    p.add_argument("--maxnreg", type=int, default=None, help="register cap (0: none)")
    p.add_argument("--parts", type=int, default=None, help="most programs per tensor")
    p.add_argument(
        "--parts-per-sm",
        type=int,
        default=None,
        help="most programs per tensor, per SM of the GPU (instead of --parts)",
    )
    args = p.parse_args(argv)
    if args.parts_per_sm is not None:
        if args.parts is not None or args.parts_per_sm < 1:
            p.error("--parts-per-sm: a positive count, instead of --parts (not with it)")
        if torch.cuda.is_available():
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            args.parts = args.parts_per_sm * sms
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --tiny)")
    from tandv.track.torch import _fused

    if args.tiny and not _fused.INTERPRETED:
        p.error("--tiny needs TRITON_INTERPRET=1 before tandv's kernels are imported")
    if args.warps:
        _fused.NUM_WARPS, _fused.SLOTS, _fused.GROUP = args.warps, 32 * args.warps, 32 * args.warps
    if args.per_thread:
        _fused.PER_THREAD = args.per_thread
    if args.maxnreg is not None:
        _fused.MAXNREG = args.maxnreg or None
    _fused.clear_caches()
    if args.tiny:
        tiny(_fused)
    else:
        gpu(args, _fused)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
