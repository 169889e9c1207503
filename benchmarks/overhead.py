"""Overhead of the PyTorch tracker on a GPT-style decoder, on CPU.

Two identical models train side by side in one process; their steps are interleaved
(tracked, untracked, tracked, ...) so that machine noise hits both alike, and the
script prints the ratio of median step times (and of means, which for ``every > 1``
include the amortized cost of the scheduled steps).

Usage::

    python benchmarks/overhead.py                      # every=1 and every=10, small model
    python benchmarks/overhead.py --layers 8 --d-model 512 --mlp 2048 --heads 8 --steps 8
    python benchmarks/overhead.py --memory             # RSS growth and close time

Also measures (``--memory``) resident-memory growth per tracked step over a long run
of a tiny model, and the time to close the tracker after short and long runs.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandv.demos.torch_gpt import GPT, GPTConfig  # noqa: E402
from tandv.track.torch import track  # noqa: E402


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _trainer(cfg: GPTConfig, batch: int, seed: int):
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (16, batch, cfg.seq_len + 1), generator=gen)
    return model, opt, data


def _step(model: GPT, opt: torch.optim.Optimizer, data: torch.Tensor, i: int) -> None:
    x = data[i % len(data)]
    loss = model.loss(x[:, :-1], x[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def overhead(cfg: GPTConfig, batch: int, steps: int, warmup: int, every: int) -> dict[str, float]:
    """Interleaved tracked/untracked step times; returns medians, means and their ratios."""
    m_a, o_a, data = _trainer(cfg, batch, 0)
    m_b = copy.deepcopy(m_a)
    o_b = torch.optim.AdamW(m_b.parameters(), lr=1e-3)
    tracked, plain = [], []
    with tempfile.TemporaryDirectory() as tmp:
        with track(m_a, o_a, every=every, out=Path(tmp) / "log", verbose=False) as tracker:
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                _step(m_a, o_a, data, i)
                tracker.step()
                t1 = time.perf_counter()
                _step(m_b, o_b, data, i)
                t2 = time.perf_counter()
                if i >= warmup:
                    tracked.append(t1 - t0)
                    plain.append(t2 - t1)
    med_t, med_p = statistics.median(tracked), statistics.median(plain)
    mean_t, mean_p = statistics.fmean(tracked), statistics.fmean(plain)
    return {"median_tracked_ms": med_t * 1e3, "median_plain_ms": med_p * 1e3,
            "ratio_median": med_t / med_p, "mean_tracked_ms": mean_t * 1e3,
            "mean_plain_ms": mean_p * 1e3, "ratio_mean": mean_t / mean_p}


def memory_and_close(cfg: GPTConfig, batch: int, long_steps: int, short_steps: int) -> dict[str, float]:
    """RSS growth per tracked step (between 20% and 100% of a long run) and close times."""
    out: dict[str, float] = {}
    for n in (short_steps, long_steps):
        model, opt, data = _trainer(cfg, batch, 1)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--every", type=int, nargs="*", default=[1, 10])
    p.add_argument("--memory", action="store_true", help="measure RSS growth and close time instead")
    p.add_argument("--long-steps", type=int, default=1000)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    if args.memory:
        tiny = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_mlp=64)
        # +5: not a multiple of flush_every, so closing has buffered rows to write
        res = memory_and_close(tiny, 2, args.long_steps + 5, max(args.long_steps // 10, 10) + 5)
        print(f"tiny GPT {tiny}:")
        for k, v in res.items():
            print(f"  {k}: {v:.4g}")
        return 0
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                    n_layers=args.layers, n_heads=args.heads, d_mlp=args.mlp)
    print(f"{cfg}, batch {args.batch}, AdamW, CPU")
    for every in args.every:
        r = overhead(cfg, args.batch, args.steps, args.warmup, every)
        print(f"every={every}: tracked {r['median_tracked_ms']:.1f} ms, untracked "
              f"{r['median_plain_ms']:.1f} ms (medians) -> ratio of medians {r['ratio_median']:.3f}; "
              f"ratio of means {r['ratio_mean']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
