"""Reading a large log: seconds and peak memory of the readers and of ``tandv summary``.

Builds (once, then reused) a 5-million-row parquet log, 500 tensors x 10,000 steps in
1,000 part files, with tandv's own streaming writer (:class:`tandv.schema.writer.PartWriter`,
rows from :func:`tandv.track.common.build_rows`), then times, each in a fresh Python
process so that peak resident memory is that of the one task:

- ``arrow``: the baseline, plain ``pyarrow.dataset`` over the same parts (their schemas
  unified, every column read into one Arrow table), nothing checked;
- ``full``: ``tandv.read_parquet(LOG)``, the whole log, validated;
- ``last``: the last 1,000 steps, ``filters=[("step", ">=", 9000)]``;
- ``stat``: one statistic for every row, ``columns=["rm2"]``;
- ``summary``: ``tandv summary LOG`` (the command's ``main``, output discarded).

The summaries behind the rows are synthetic but shaped like a training run's: each
tensor has its own scale (10^-6 .. 10^1) and dtype (float32 or bfloat16), its values
span about 25 binades, and the scale drifts by one binade every 1,000 steps, so parts
hold different sets of exponent columns, as real logs do.

Each task reports seconds, peak resident memory, and *extra* memory: the peak less the
resident memory just before the task began (imports done), which is what the
``full``/``arrow`` ratios printed at the end compare.

Usage::

    python benchmarks/read_log.py                    # log in /tmp/tandv-read-bench
    python benchmarks/read_log.py --log DIR --repeat 3
    python benchmarks/read_log.py --tasks arrow,full # a subset of the tasks
    python benchmarks/read_log.py --tiny             # seconds: the test suite's run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TASKS = ("arrow", "full", "last", "stat", "summary")


def build_log(path: Path, tensors: int, steps: int, steps_per_part: int, seed: int = 0) -> None:
    """Write the benchmark log at ``path`` with tandv's part writer."""
    from tandv.schema.writer import PartWriter
    from tandv.stats import summarize
    from tandv.stats.summary import FIELD_INDEX
    from tandv.track.common import TensorKey, build_rows

    rng = np.random.default_rng(seed)
    kinds = ("Activation", "Gradient", "Weight", "Optimiser_State")
    bases = []
    for i in range(tensors):
        dtype = "bfloat16" if i % 3 == 0 else "float32"
        x = rng.standard_normal(4096) * 10.0 ** rng.uniform(-6, 1)
        x[rng.random(4096) < 0.01] = 0.0
        v, layout = summarize(x.astype(dtype))
        key = TensorKey(f"layers.{i // 8}.block{i % 8}.proj", kinds[i % 4], "Linear", dtype)
        bases.append((key, layout, v))
    extrema = [FIELD_INDEX[f] for f in ("min", "max", "min_abs", "max_abs", "mean")]
    writer = PartWriter(path)
    for first in range(0, steps, steps_per_part):
        part_steps, entries = [], []
        for step in range(first, min(steps, first + steps_per_part)):
            shift = step // 1000  # one binade per 1,000 steps
            factor = 2.0**shift * (1 + 1e-4 * (step % 1000))
            for key, layout, v in bases:
                w = v.copy()
                w[extrema] *= factor
                counts = w[layout.exponent_counts]
                # move the exponent counts up by `shift` binades (the underflow and
                # overflow counts stay where they are)
                inner = counts[1:-1]
                inner[shift:] = inner[: inner.size - shift].copy()
                inner[:shift] = 0
                part_steps.append(step)
                entries.append((key, layout, w))
        writer.write(build_rows(part_steps, entries))
    writer.close()


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mib() -> float:
    """Resident memory now (Linux: /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return _peak_mib()


def read_arrow(log: str) -> object:
    """The baseline: every part through one plain ``pyarrow.dataset``, schemas unified."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    files = sorted(str(p) for p in Path(log).glob("*.parquet"))
    schema = pa.unify_schemas([pq.read_schema(f) for f in files])
    return ds.dataset(files, schema=schema, format="parquet").to_table()


def run_task(task: str, log: str, last_from: int) -> dict:
    """One task in this process; returns seconds, peak and extra RSS, the result's shape."""
    import io
    from contextlib import redirect_stdout

    import pyarrow.dataset  # noqa: F401  (imported before the task, as tandv imports it)

    import tandv

    before = _rss_mib()
    t0 = time.perf_counter()
    if task == "arrow":
        df = read_arrow(log)
    elif task == "full":
        df = tandv.read_parquet(log)
    elif task == "last":
        df = tandv.read_parquet(log, filters=[("step", ">=", last_from)])
    elif task == "stat":
        df = tandv.read_parquet(log, columns=["rm2"])
    elif task == "summary":
        from tandv.cli import main

        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = main(["summary", log])
        if rc != 0:
            raise SystemExit(f"tandv summary exited {rc}")
        df = None
    else:
        raise SystemExit(f"unknown task {task!r}; expected one of {TASKS}")
    seconds = time.perf_counter() - t0
    shape = None if df is None else list(df.shape)
    peak = _peak_mib()
    return {
        "task": task,
        "seconds": seconds,
        "peak_mib": peak,
        "extra_mib": peak - before,
        "shape": shape,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--log", default="/tmp/tandv-read-bench", help="log directory (built if absent)"
    )
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--steps-per-part", type=int, default=10)
    parser.add_argument(
        "--tasks", default=",".join(TASKS), help=f"comma-separated subset of {TASKS}"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each task (fresh process each)"
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild the log even if it exists")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a 960-row log of 16 tensors x 60 steps in a fresh folder (the test suite's run)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process's task
    args = parser.parse_args()
    if args.tiny:
        import tempfile

        args.tensors, args.steps, args.steps_per_part = 16, 60, 10
        args.log = tempfile.mkdtemp(prefix="tandv-read-tiny-") + "/log"
    last_from = max(0, args.steps - 1000)
    if args.one:
        print(json.dumps(run_task(args.one, args.log, last_from)))
        return
    try:
        for ratios in run(args, last_from).values():
            print(ratios)
    finally:
        if args.tiny:
            import shutil

            shutil.rmtree(Path(args.log).parent, ignore_errors=True)


def run(args: argparse.Namespace, last_from: int) -> dict[str, str]:
    """Build the log if needed and run the tasks; returns the ratio lines."""
    log = Path(args.log)
    if args.rebuild and log.exists():
        import shutil

        shutil.rmtree(log)
    if not log.exists():
        t0 = time.perf_counter()
        build_log(log, args.tensors, args.steps, args.steps_per_part)
        size = sum(p.stat().st_size for p in log.iterdir()) / 2**20
        print(
            f"built {log}: {args.tensors} tensors x {args.steps} steps, "
            f"{len(list(log.glob('*.parquet')))} parts, {size:.0f} MiB, "
            f"{time.perf_counter() - t0:.0f} s"
        )
    import tandv

    print(f"tandv from {Path(tandv.__file__).parent}, {os.cpu_count()} CPUs")
    print(f"{'task':<10}{'seconds':>10}{'peak MiB':>10}{'extra MiB':>11}  shape")
    got: dict[str, list[dict]] = {}
    for _ in range(args.repeat):  # rounds: each task once per round, interleaved
        for task in args.tasks.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "--log", str(log), "--steps", str(args.steps)]
                + ["--one", task],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                raise SystemExit(f"{task} failed:\n{out.stderr[-2000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            got.setdefault(task, []).append(r)
            print(
                f"{task:<10}{r['seconds']:>10.2f}{r['peak_mib']:>10.0f}{r['extra_mib']:>11.0f}"
                f"  {r['shape']}"
            )
    ratios = {}
    if "arrow" in got and "full" in got:  # the same round's runs, paired
        pairs = list(zip(got["full"], got["arrow"]))
        t = [f["seconds"] / a["seconds"] for f, a in pairs]
        m = [f["extra_mib"] / max(a["extra_mib"], 1.0) for f, a in pairs]
        ratios["full/arrow"] = (
            f"full / arrow: seconds {min(t):.2f}-{max(t):.2f}x, "
            f"extra memory {min(m):.2f}-{max(m):.2f}x"
        )
    return ratios


if __name__ == "__main__":
    main()
