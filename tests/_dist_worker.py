"""The per-rank program of tests/test_distributed_torch.py (run under torchrun, gloo, CPU).

``python -m torch.distributed.run --nproc_per_node 2 tests/_dist_worker.py SCENARIOS OUT``
with SCENARIOS a comma-separated list, run in order in the one process group (one
torchrun for several checks: each start costs three processes importing torch), of:

``ddp``
    the model under DistributedDataParallel, tracked with ``rank_logs`` into ``OUT/ddp``;
    then again with the default ``out`` (cwd ``OUT/default``), each rank noting the path
    its tracker reports in ``OUT/default_path<rank>.txt`` and how many process groups it
    has before, inside and after the tracker in ``OUT/groups<rank>.txt``.
``fsdp``
    the model with ``fully_shard`` on each Linear and the root, tracked into ``OUT/fsdp``.
``fail``
    rank 1 fails before a step, hanging or raising (see :func:`fail`); rank 0 notes the
    error it gets and how long it took in ``OUT/fail0_<case>.txt``. It comes last.

Each rank feeds its half of the same global batches as :func:`reference` (a single
process with gradient accumulation over the two halves, loss ``mean / WORLD`` each), with
loss ``mean / WORLD`` and DDP's gradients summed over the ranks, so that every tensor is
bitwise that of the reference (under FSDP2 see :func:`fsdp`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

WORLD = 2
STEPS = 3
BATCH = 8  # global batch, split in WORLD halves


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def batch(step: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Part ``part`` of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 6, generator=g) * 3
    y = torch.randn(BATCH, 4, generator=g)
    n = BATCH // WORLD
    return x[part * n : (part + 1) * n], y[part * n : (part + 1) * n]


def train(
    model: nn.Module, opt: torch.optim.Optimizer, tracker, parts: list[int], scale: float = WORLD
) -> None:
    """``STEPS`` steps, each the backward of ``parts`` of the global batch, with the loss
    of a part ``mean / scale``."""
    for step in range(STEPS):
        for part in parts:
            x, y = batch(step, part)
            loss = (model(x) - y).square().mean() / scale
            loss.backward()
        opt.step()
        opt.zero_grad()
        tracker.step()


def reference(out: Path, **options) -> Path:
    """The single-process run over the whole global batches (both halves accumulated)."""
    from tandv.track.torch import track

    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with track(model, opt, out=out, verbose=False, **options) as tracker:
        train(model, opt, tracker, list(range(WORLD)))
    return out


def _sum_hook(state, bucket):  # DDP: sum the gradients over the ranks instead of averaging
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _groups() -> int:
    """How many process groups this process has registered (torch's private registry: no
    public call counts them)."""
    import torch.distributed.distributed_c10d as c10d

    return len(c10d._world.pg_map)


def ddp(out: Path, rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from tandv.track.torch import track

    for where in ("ddp", "default"):
        model = DistributedDataParallel(make_model())
        model.register_comm_hook(None, _sum_hook)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        if where == "ddp":
            kwargs = {"out": out / "ddp", "rank_logs": True}
        else:
            (out / "default").mkdir(exist_ok=True)
            os.chdir(out / "default")
            kwargs = {"run_name": "ddp"}
        groups = [_groups()]
        with track(model, opt, verbose=True, **kwargs) as tracker:
            groups.append(_groups())
            train(model, opt, tracker, [rank])
        groups.append(_groups())
        if where == "default":
            (out / f"groups{rank}.txt").write_text(" ".join(map(str, groups)))
            (out / f"default_path{rank}.txt").write_text(str(Path(tracker.out_path).resolve()))
            (out / f"writes_log{rank}.txt").write_text(str(tracker.writes_log))


def fsdp(out: Path, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tandv.track.torch import track

    model = make_model()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with track(model, opt, out=out / "fsdp", verbose=False) as tracker:
        # FSDP2 averages the gradients over the ranks (gloo cannot sum them with a factor):
        # each rank's loss is its part's mean, the parameters' gradients the reference's,
        # and the output gradients twice the reference's
        train(model, opt, tracker, [rank], scale=1.0)


def _await(path: Path, seconds: float) -> None:
    """Wait until ``path`` exists, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def fail(out: Path, rank: int) -> None:
    """Two tracked runs of 3 steps in which rank 1 fails before step 3, each into
    ``OUT/fail_<case>``, rank 0 noting the error it gets and how long it took in
    ``OUT/fail0_<case>.txt``:

    ``hang``: rank 1 stays in its tracker without calling ``tracker.step()`` until rank 0
    has noted its error: rank 0 must give up after ``dist_timeout`` (5 s).
    ``raise``: rank 1 raises out of its tracker (which closes it) and then waits, alive,
    until rank 0 has noted its error: rank 0 must fail at once, well before its
    ``dist_timeout`` (60 s), as the closed tracker destroyed its gloo group.
    """
    from tandv.track.torch import track

    for case, timeout in (("hang", 5.0), ("raise", 60.0)):
        noted = out / f"fail0_{case}.txt"
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        started = time.monotonic()
        try:
            with track(
                model, opt, out=out / f"fail_{case}", verbose=False, dist_timeout=timeout
            ) as tr:
                train(model, opt, tr, [rank])  # steps 0-2 merge: both ranks are there
                started = time.monotonic()
                x, y = batch(0, rank)
                (model(x) - y).square().mean().backward()
                if rank == 1:
                    if case == "hang":  # inside the tracker, for at most timeout + 5 s
                        _await(noted, timeout + 5)
                    raise KeyError("rank 1 fails before its step")
                opt.step()
                tr.step()  # rank 0 waits for rank 1 here
        except KeyError:
            if rank != 1:
                raise
            _await(noted, timeout + 5)  # alive, but gone from the run
            continue
        except RuntimeError as e:
            noted.write_text(f"{time.monotonic() - started:.3f}\n{e}")
            continue
        noted.write_text("no error")


def main() -> None:
    import torch.distributed as dist

    scenarios, out = sys.argv[1].split(","), Path(sys.argv[2]).resolve()
    if "fail" in scenarios[:-1]:
        raise SystemExit("_dist_worker.py: the ranks leave 'fail' at different times: put it last")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for scenario in scenarios:
        {"ddp": ddp, "fsdp": fsdp, "fail": fail}[scenario](out, rank)
        if scenario != "fail":
            dist.barrier()
    dist.destroy_process_group()  # tandv's failed groups are gone; the default one is sound


if __name__ == "__main__":
    main()
