"""The fused summary kernel alone on a CUDA GPU: bandwidth per dtype, and launch cost.

For each dtype it times, on one large tensor, the fused kernel (one launch, its programs
splitting the tensor), ``torch._foreach_norm`` (one read pass, the floor) and ``x.sum()``,
and prints GB/s of each. Then the cost of one hook-sized observation (a launch on a small
tensor, Python included), the figure that decides small models. ``--block`` and
``--warps`` override the kernel's tile for tuning.

Usage::

    PYTHONPATH=. python3 benchmarks/fused_kernel.py [--numel 268435456] [--block 2048 --warps 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overhead import timed  # noqa: E402  (the benchmark beside this one)

from tandv.stats.summary import Layout  # noqa: E402
from tandv.track.torch import _fused  # noqa: E402
from tandv.track.torch._workspace import Workspace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1 << 28)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--block", type=int, default=None, help="elements per block (a power of two)")
    p.add_argument("--warps", type=int, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    if args.block:
        _fused.BLOCK = args.block
        _fused.MIN_CHUNK = 8 * args.block
    if args.warps:
        _fused.NUM_WARPS = args.warps
    _fused._consts.cache_clear()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, BLOCK {_fused.BLOCK}, "
        f"{_fused.NUM_WARPS} warps"
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        x = torch.randn(args.numel, device="cuda", generator=g).to(dtype)
        nbytes = x.numel() * x.element_size()
        ws = Workspace()
        spec = _fused.spec_for(dtype)
        layout = Layout(str(dtype).removeprefix("torch."))

        def fused(ws=ws, x=x, spec=spec, layout=layout) -> None:  # bind this dtype's
            ws.fused([x], spec, layout, [{}])
            ws.end_step()

        t_fused = timed(fused, args.reps)
        t_norm = (
            timed(lambda x=x: torch._foreach_norm([x]), args.reps)
            if dtype.itemsize > 1
            else float("nan")
        )
        t_sum = timed(lambda x=x: x.sum(), args.reps) if dtype.itemsize > 1 else float("nan")
        print(
            f"{str(dtype):22s} {nbytes / 2**20:8.0f} MiB  "
            f"fused {nbytes / t_fused / 1e9:7.0f} GB/s  "
            f"foreach_norm {nbytes / t_norm / 1e9:7.0f} GB/s  sum {nbytes / t_sum / 1e9:7.0f} GB/s"
        )
    small = torch.randn(8 * 128 * 256, device="cuda")  # an activation of the 4-layer model
    ws = Workspace()
    spec = _fused.spec_for(torch.float32)
    layout = Layout("float32")
    n = 300
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        ws.summaries([small], layout, [{}])
    host = time.perf_counter() - t0
    ws.end_step()
    torch.cuda.synchronize()
    print(
        f"one hook-sized observation ({small.numel()} float32): "
        f"{host / n * 1e6:.1f} us on the host "
        f"(Python and launch), {(time.perf_counter() - t0) / n * 1e6:.1f} us until the GPU is done"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
