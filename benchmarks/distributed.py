"""Cost of the cross-rank merge of a distributed run: 2 gloo processes on the CPU, DDP.

Each rank trains the same MLP under ``DistributedDataParallel`` with a tracker on every
step (activations, output and parameter gradients, weights, Adam state). The script times
the tracker's merge of each step (:meth:`tandv.track.common.distributed.RankMerger.merge`:
the header all-gather, the one gather of the step's summaries and, on rank 0, their
merge; after a barrier, timed apart, so that waiting for a slower rank is not counted as
the merge's cost) and the whole training step (forward, backward, DDP's all-reduce, optimizer,
``tracker.step()``), and prints on rank 0 the medians and their ratio, with the rows and
bytes each rank sends per step. Run it with::

    python benchmarks/distributed.py                       # launches torchrun itself
    python benchmarks/distributed.py --layers 16 --width 1024 --steps 30

(or under ``torchrun --nproc_per_node 2 benchmarks/distributed.py --worker``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from tandv.track.common import distributed as core
    from tandv.track.torch import track

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    merge_times: list[float] = []
    sent: list[int] = []
    n_rows: list[int] = []
    original = core.RankMerger.merge

    wait_times: list[float] = []

    def timed_merge(self, step, entries):  # type: ignore[no-untyped-def]
        # the ranks reach the merge at different times (one trains faster, the OS runs the
        # other): a barrier first, timed apart, so that the merge's time is its own
        t0 = time.perf_counter()
        dist.barrier(group=self.comm.group)
        t1 = time.perf_counter()
        out = original(self, step, entries)
        merge_times.append(time.perf_counter() - t1)
        wait_times.append(t1 - t0)
        rows = [(k, lay, v, self.role_of(k)) for k, lay, v in entries]
        n_rows.append(len(rows))
        sent.append(
            sum(8 * lay.size for _, lay, _, role in rows if role != core.REPLICATED)
            + sum(8 for *_, role in rows if isinstance(role, core.Shard))
        )
        return out

    core.RankMerger.merge = timed_merge  # type: ignore[method-assign]
    from tandv.track.torch import _distributed

    comm_times: list[float] = []
    for name in ("all_gather_ints", "gather"):
        fn = getattr(_distributed.TorchCollectives, name)

        def timed(self, *a, _fn=fn):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = _fn(self, *a)
            comm_times.append(time.perf_counter() - t0)
            return out

        setattr(_distributed.TorchCollectives, name, timed)
    step_times: list[float] = []
    g = torch.Generator().manual_seed(rank)
    with tempfile.TemporaryDirectory() as tmp:
        with track(model, opt, out=Path(tmp) / "log", verbose=False) as tracker:
            for i in range(args.warmup + args.steps):
                x = torch.randn(args.batch, args.width, generator=g)
                t0 = time.perf_counter()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                tracker.step()
                if i >= args.warmup:
                    step_times.append(time.perf_counter() - t0)
    merge = statistics.median(merge_times[args.warmup :])
    wait = statistics.median(wait_times[args.warmup :])
    # per step: the header all-gather then the gather
    comm = statistics.median(
        a + b for a, b in zip(comm_times[0::2][args.warmup :], comm_times[1::2][args.warmup :])
    )
    step = statistics.median(step_times)
    if rank == 0:
        print(
            f"2 ranks (gloo, CPU), DDP MLP {args.layers}x{args.width}, batch {args.batch}/rank, "
            f"{args.steps} tracked steps after {args.warmup} warm-up\n"
            f"rows per step: {n_rows[-1]}; sent per rank per step: {sent[-1] / 1024:.1f} KiB "
            f"(activations and output gradients; replicated rows are rank 0's own)\n"
            f"median merge (header all-gather + one gather + merge on rank 0): "
            f"{1e3 * merge:.2f} ms, of which in the two collectives {1e3 * comm:.2f} ms "
            f"(after a barrier; the wait at that barrier for the other rank, not counted: "
            f"{1e3 * wait:.2f} ms)\n"
            f"median tracked step (forward, backward, optimizer, tracker.step, barrier "
            f"included): {1e3 * step:.2f} ms\n"
            f"merge / step: {merge / step:.3f}"
        )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help="run as one rank (under torchrun)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args, rest = p.parse_known_args()
    if args.worker:
        worker(args)
        return
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [__file__, "--worker", *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
