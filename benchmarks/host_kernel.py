"""The host kernel's core passes (:mod:`tandv.stats.host`), in nanoseconds per element.

The CPU trackers summarize every tensor with :func:`tandv.stats.host.host_summaries`, which
cuts arrays into items of 64K elements and runs, per item, an integer pass over the bits
(counts, extrema), a float64 pass (the sums) and the exponent counts. This script times
each pass on one item in cache (the same item again and again) and the whole item pass
out of cache (an array of 64 MB, item by item), then whole calls on arrays of the sizes
the 4-layer GPT of ``overhead.py`` summarizes most (262,144 and 1,048,576 float32
elements, and the latter in bfloat16, which is widened to float32 first), on one thread.

Times are the calling thread's CPU time (``time.thread_time_ns``), the least of
``--repeat`` runs: on a shared machine the least is the least disturbed, and CPU time
does not count the time the thread waited for a core. Prints last
``core_ns_per_element: X``, the whole item pass in cache.

Usage::

    python benchmarks/host_kernel.py                 # 64K items, a 64 MB array, 30 repeats
    python benchmarks/host_kernel.py --repeat 100
    python benchmarks/host_kernel.py --tiny          # the test suite's run: small, checked
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandv.stats import host  # noqa: E402
from tandv.stats.summary import Layout  # noqa: E402

#: The sizes of the arrays timed whole: the benchmark model's most summarized tensors.
CALLS = ((262_144, np.float32), (1_048_576, np.float32), (1_048_576, ml_dtypes.bfloat16))


def ns_per_element(run: Callable[[], object], elements: int, repeat: int) -> float:
    """The least thread CPU time of ``repeat`` calls of ``run`` (after one untimed call,
    which compiles), per element."""
    run()
    best = min(_timed(run) for _ in range(repeat))
    return best / max(elements, 1)


def _timed(run: Callable[[], object]) -> int:
    t0 = time.thread_time_ns()
    run()
    return time.thread_time_ns() - t0


def _activations(n: int, rng: np.random.Generator) -> np.ndarray:
    """float32 values spread like a layer's activations: about 20 binades in use."""
    return (rng.standard_normal(n) * 0.5).astype(np.float32)


def item_rows(
    item: int, big: int, repeat: int, rng: np.random.Generator
) -> list[tuple[str, float]]:
    """ns per element of each pass on one item of ``item`` elements in cache, and of the
    whole item pass over an array of ``big`` elements, item by item."""
    x = host._as_float32(_activations(item, rng))  # (read-only, as the kernels get it)
    bits = x.view(np.int32)
    hist = np.zeros((4, 256), np.int64)
    part = np.zeros(host._NPART)
    sub = np.zeros(host._NSUB, np.int64)
    _, _, low, _, _, _, _, amax = host._bit_reductions(bits)
    top, low = (int(amax) >> 23) & 0xFF, np.int32(low)  # (the types _item passes)
    rows = [
        ("bit reductions", ns_per_element(lambda: host._bit_reductions(bits), item, repeat)),
        ("float sums", ns_per_element(lambda: host._finite_sums(x, 0.1), item, repeat)),
        (
            "exponent counts",
            ns_per_element(lambda: host._exponent_counts(bits, hist, top, low), item, repeat),
        ),
        (
            "item pass (all three)",
            ns_per_element(lambda: host._item(x, bits, 0.1, 3.4e38, part, hist, sub), item, repeat),
        ),
    ]
    y = host._as_float32(_activations(big, rng))
    ybits = y.view(np.int32)

    def items() -> None:
        for a in range(0, big, item):
            b = min(big, a + item)
            host._item(y[a:b], ybits[a:b], 0.1, 3.4e38, part, hist, sub)

    rows.append(("item pass, out of cache", ns_per_element(items, big, max(1, repeat // 10))))
    return rows


def call_rows(
    calls: tuple[tuple[int, type], ...], repeat: int, rng: np.random.Generator
) -> list[tuple[str, float]]:
    """ns per element of whole :func:`~tandv.stats.host.host_summaries` calls, one thread."""
    layout = Layout("float32")
    rows = []
    for n, dtype in calls:
        a = _activations(n, rng).astype(dtype)
        t = ns_per_element(lambda a=a: host.host_summaries([a], layout, 1), n, repeat)
        rows.append((f"host_summaries, {n} {np.dtype(dtype).name}", t))
    return rows


def check(rng: np.random.Generator) -> None:
    """The tiny run's check: the exponent counts of the timed passes are numpy's, for an
    item counted in pairs and one whose fields are too wide for the pairs' window."""
    for scale, fill in ((1.0, 0.0), (1e30, 1e-30)):  # zeros in the window; 1e-30 outside it
        x = _activations(host._PAIRS_MIN + 3, rng) * np.float32(scale)
        x[::7] = fill
        bits = host._as_float32(x).view(np.int32)
        _, _, low, _, _, _, _, amax = host._bit_reductions(bits)
        hist = np.zeros((4, 256), np.int64)
        host._exponent_counts(bits, hist, (int(amax) >> 23) & 0xFF, np.int32(low))
        want = np.bincount(((bits >> 23) & 0xFF).astype(np.int64), minlength=256)
        if not np.array_equal(hist.sum(axis=0), want):
            raise AssertionError(f"exponent counts differ from numpy's (scale {scale})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=30, help="timed runs of each row (least kept)")
    p.add_argument("--tiny", action="store_true", help="small sizes, 2 repeats, checked")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.tiny:
        check(rng)
        item, big, repeat = host._PAIRS_MIN, 4 * host._PAIRS_MIN, 2
        calls: tuple[tuple[int, type], ...] = ((5000, np.float32), (5000, ml_dtypes.bfloat16))
    else:
        item, big, repeat, calls = host._CHUNK, 1 << 24, args.repeat, CALLS
    rows = item_rows(item, big, repeat, rng) + call_rows(calls, repeat, rng)
    print(f"host kernel, one thread, {item}-element items, least of {repeat} runs (thread CPU)")
    for name, t in rows:
        print(f"  {name:42s} {t:7.3f} ns/element")
    print(f"core_ns_per_element: {rows[3][1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
