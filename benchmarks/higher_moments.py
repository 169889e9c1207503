"""The cost of skewness and kurtosis (``Layout(moments=4)``) on the host kernel.

Summarizes a step's worth of float32 tensors (default: the 4-layer MLP benchmark's ~4.2M
step-time elements, as one 1M, one 2M, one 1M and two small tensors) with
:func:`tandv.stats.host.host_summaries` alone and with the extra pass of
:func:`tandv.stats.host.host_higher_moments`, alternating the two in one process, and
prints the median time of each and the median of the paired ratios.

Usage::

    python benchmarks/higher_moments.py                 # 31 pairs
    python benchmarks/higher_moments.py --repeat 101 --scale 0.25
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tandv.stats.host import host_higher_moments, host_summaries
from tandv.stats.summary import Layout

SIZES = (1_048_576, 2_097_152, 1_048_576, 4096, 512)


def run(sizes: tuple[int, ...] = SIZES, repeat: int = 31) -> dict[str, float]:
    """Times ``repeat`` alternating pairs; returns medians (seconds) and the paired ratio."""
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=31)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the sizes")
    args = parser.parse_args()
    sizes = tuple(max(1, int(n * args.scale)) for n in SIZES)
    r = run(sizes, args.repeat)
    n = r["elements"]
    print(
        f"{int(n)} float32 elements: core {r['core_s'] * 1e3:.2f} ms "
        f"({r['core_s'] / n * 1e9:.2f} ns/element), with m3/m4 {r['moments4_s'] * 1e3:.2f} ms "
        f"({r['moments4_s'] / n * 1e9:.2f} ns/element); paired ratio {r['ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
