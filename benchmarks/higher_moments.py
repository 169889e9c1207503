"""The cost of skewness and kurtosis (``moments=4``): on a training step, and on the host kernel.

1. The training step (the default): the 4-layer GPT of ``overhead.py`` (its ``small``
   preset) on the CPU, three copies stepping in turn in one process (untracked, tracked,
   tracked with ``moments=4``: :func:`overhead.variant_cost`), so that machine noise hits
   them alike. Prints the median step times and the cost of ``moments=4`` as a same-run
   ratio to the plain tracked step: the median of each iteration's ratio (the two tracked
   steps ran back to back) and the ratio of the medians.
2. The host kernel alone (``--kernel``): a step's worth of float32 tensors (the same model's
   ~4.2M step-time elements, as one 1M, one 2M, one 1M and two small tensors) summarized by
   :func:`tandv.stats.host.host_summaries` alone and with the extra pass of
   :func:`tandv.stats.host.host_higher_moments`, alternating; prints the median of each and
   the median of the paired ratios.

Usage::

    python benchmarks/higher_moments.py                      # the step: 30 steps, every=1
    python benchmarks/higher_moments.py --steps 60 --every 10
    python benchmarks/higher_moments.py --kernel --repeat 101 --scale 0.25
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandv.stats.host import host_higher_moments, host_summaries  # noqa: E402
from tandv.stats.summary import Layout  # noqa: E402

SIZES = (1_048_576, 2_097_152, 1_048_576, 4096, 512)
#: A model small enough for the test suite's tiny run (``overhead.py``'s size options).
TINY = dict(layers=1, d_model=16, heads=2, mlp=32, vocab=32, seq=8, batch=2)


def run(sizes: tuple[int, ...] = SIZES, repeat: int = 31) -> dict[str, float]:
    """The host kernel: times ``repeat`` alternating pairs; returns medians (seconds) and
    the paired ratio."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    layout = Layout("float32", moments=4)
    host_higher_moments(arrays, host_summaries(arrays, layout))  # compile
    core, both = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        host_summaries(arrays, layout)
        core.append(time.perf_counter() - t)
        t = time.perf_counter()
        host_higher_moments(arrays, host_summaries(arrays, layout))
        both.append(time.perf_counter() - t)
    ratio = np.median(np.array(both) / np.array(core))
    return {
        "elements": float(sum(sizes)),
        "core_s": float(np.median(core)),
        "moments4_s": float(np.median(both)),
        "ratio": float(ratio),
    }


def _overhead() -> Any:
    """``benchmarks/overhead.py`` as a module (this directory is not a package)."""
    path = Path(__file__).with_name("overhead.py")
    spec = importlib.util.spec_from_file_location("tandv_bench_overhead", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_cost(
    size: dict[str, int] | None = None, steps: int = 30, warmup: int = 3, every: int = 1
) -> dict[str, float]:
    """The training step with and without ``moments=4`` (see the module notes): returns
    :func:`overhead.variant_cost`'s medians (ms) and ratios for the ``small`` preset (or
    ``size``), on the CPU."""
    bench = _overhead()
    size = dict(bench.PRESETS["small"] if size is None else size)
    cfg = bench.config_of(size)
    return bench.variant_cost(cfg, size["batch"], steps, warmup, every, "cpu", moments=4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernel", action="store_true", help="the host kernel alone instead")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each copy")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--every", type=int, default=1, help="track every this many steps")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (the test suite's)")
    parser.add_argument("--repeat", type=int, default=31, help="--kernel: pairs timed")
    parser.add_argument("--scale", type=float, default=1.0, help="--kernel: multiply the sizes")
    args = parser.parse_args(argv)
    if args.kernel:
        sizes = tuple(max(1, int(n * args.scale)) for n in SIZES)
        r = run(sizes, args.repeat)
        n = r["elements"]
        print(
            f"{int(n)} float32 elements: core {r['core_s'] * 1e3:.2f} ms "
            f"({r['core_s'] / n * 1e9:.2f} ns/element), with m3/m4 {r['moments4_s'] * 1e3:.2f} "
            f"ms ({r['moments4_s'] / n * 1e9:.2f} ns/element); paired ratio {r['ratio']:.2f}"
        )
        return 0
    import torch

    r = step_cost(TINY if args.tiny else None, args.steps, args.warmup, args.every)
    print(
        f"{'tiny' if args.tiny else '4-layer'} GPT on the CPU ({torch.get_num_threads()} "
        f"threads), every={args.every}, {args.steps} steps: untracked "
        f"{r['median_untracked_ms']:.2f} ms, tracked {r['median_tracked_ms']:.2f} ms, tracked "
        f"with moments=4 {r['median_variant_ms']:.2f} ms (medians); moments=4 / tracked: "
        f"paired {r['paired_variant_to_tracked']:.3f}, of medians "
        f"{r['ratio_variant_to_tracked']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
