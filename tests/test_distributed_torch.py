"""Distributed tracking under torch.distributed: 2 processes on the CPU (gloo, torchrun).

The ranks run tests/_dist_worker.py; their logs are checked against a single-process run
over the same global batches in this process (``_dist_worker.reference``), built so that
every tensor is bitwise the same: counts, extrema and exponent counts must then match
exactly, moments to 1e-6.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from tandv import read_parquet  # noqa: E402
from tandv.schema.columns import (  # noqa: E402
    ACTIVATION,
    EXPONENT_COUNTS,
    GRADIENT,
    METADATA,
    OPTIMISER_STATE,
    SCALAR_STATS,
    WEIGHT,
)
from tandv.stats.summary import Layout, summarize  # noqa: E402
from tandv.track.common import TensorKey  # noqa: E402
from tandv.track.common.distributed import (  # noqa: E402
    LOCAL,
    REPLICATED,
    RankMismatchError,
    Shard,
    merge_ranks,
)

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this PyTorch build",
)

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _dist_worker as worker  # noqa: E402

EXACT = ["numel", "zero_count", "nan_count", "inf_count", "min", "max", "min_abs", "max_abs"]


def launch(scenario: str, out: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [
        "--nproc_per_node",
        str(worker.WORLD),
        str(HERE / "_dist_worker.py"),
        scenario,
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def rows(df: pd.DataFrame, types: tuple[str, ...] | None = None) -> pd.DataFrame:
    meta = df[METADATA]
    keep = meta["tensor_type"].isin(types).to_numpy() if types else np.ones(len(df), bool)
    out = df[keep]
    order = np.lexsort(
        (out[METADATA]["name"].to_numpy(), out[METADATA]["tensor_type"].to_numpy(),
         out[METADATA]["step"].to_numpy())
    )  # fmt: skip
    return out.iloc[order].reset_index(drop=True)


def assert_same_rows(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Same rows: metadata, counts, extrema and exponent counts exactly, moments to 1e-6."""
    assert len(got) == len(want) > 0
    pd.testing.assert_frame_equal(got[METADATA], want[METADATA])
    gs, ws = got[SCALAR_STATS], want[SCALAR_STATS]
    assert list(gs.columns) == list(ws.columns)
    for c in gs.columns:
        if c in EXACT:
            np.testing.assert_array_equal(gs[c].to_numpy(), ws[c].to_numpy(), err_msg=c)
        else:
            np.testing.assert_allclose(gs[c], ws[c], rtol=1e-6, atol=1e-12, err_msg=c)
    pd.testing.assert_frame_equal(got[EXPONENT_COUNTS], want[EXPONENT_COUNTS])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    return read_parquet(worker.reference(tmp_path_factory.mktemp("ref") / "log"))


def has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One torchrun for the module's checks: DDP, FSDP2 (where torch has it), then a rank
    that raises (last: it breaks the process group). A launch per check started three
    processes importing torch each time."""
    out = tmp_path_factory.mktemp("dist")
    proc = launch("ddp,fsdp,fail" if has_fsdp2() else "ddp,fail", out, timeout=300)
    return out, proc.stdout + proc.stderr


@needs_gloo
def test_ddp_log_equals_one_process_over_the_global_batch(dist_run, reference):
    out, _ = dist_run
    got = read_parquet(out / "ddp")
    kinds = set(got[METADATA]["tensor_type"])
    assert kinds == {ACTIVATION, GRADIENT, WEIGHT, OPTIMISER_STATE}
    assert_same_rows(rows(got), rows(reference))
    # names are the model's own (no DDP "module." prefix); 3 steps of every row
    assert not got[METADATA]["name"].str.startswith("module").any()
    assert sorted(set(got[METADATA]["step"])) == [0, 1, 2]
    assert got.attrs["tandv"]["options"]["merged_ranks"] is True


@needs_gloo
def test_ddp_rank_logs_hold_each_ranks_own_rows(dist_run):
    out, _ = dist_run
    merged = rows(read_parquet(out / "ddp"))
    per_rank = [rows(read_parquet(out / "ddp" / f"rank{r}")) for r in range(worker.WORLD)]
    for own in per_rank:
        pd.testing.assert_frame_equal(own[METADATA], merged[METADATA])
    acts = (merged[METADATA]["tensor_type"] == ACTIVATION).to_numpy()
    stats = [own[SCALAR_STATS] for own in per_rank]
    m = merged[SCALAR_STATS]
    # activations: each rank saw its half of the batch; the merged row is their union
    np.testing.assert_array_equal(m["numel"][acts], sum(s["numel"][acts] for s in stats))
    np.testing.assert_array_equal(m["min"][acts], np.minimum(*(s["min"][acts] for s in stats)))
    np.testing.assert_array_equal(m["max"][acts], np.maximum(*(s["max"][acts] for s in stats)))
    assert (stats[0]["numel"][acts] == m["numel"][acts] // 2).all()
    # weights and optimizer state are replicated: every rank's rows are the merged rows
    rep = merged[METADATA]["tensor_type"].isin([WEIGHT, OPTIMISER_STATE]).to_numpy()
    for s in stats:
        pd.testing.assert_frame_equal(s[rep], m[rep])
    for r in range(worker.WORLD):
        record = read_parquet(out / "ddp" / f"rank{r}").attrs["tandv"]
        assert record["options"]["merged_ranks"] is False and record["rank"] == r


@needs_gloo
def test_ddp_default_out_is_one_log_written_by_rank_0(dist_run):
    out, output = dist_run
    paths = {(out / f"default_path{r}.txt").read_text() for r in range(worker.WORLD)}
    assert len(paths) == 1  # the same path on both ranks
    writes = [(out / f"writes_log{r}.txt").read_text() for r in range(worker.WORLD)]
    assert writes == ["True"] + ["False"] * (worker.WORLD - 1)
    logs = list((out / "default" / "tandv_logs").iterdir())
    assert [p.resolve() for p in logs] == [Path(paths.pop())]
    assert [p.name for p in logs[0].iterdir()] == ["part-000000.parquet"]  # no rank folders
    assert output.count("tandv: logging to") == 2  # rank 0 only, once per tracker
    assert (read_parquet(logs[0])[METADATA]["step"].max()) == worker.STEPS - 1


@needs_gloo
def test_the_tracker_destroys_its_gloo_group_when_it_closes(dist_run):
    """Each rank's tracker adds one process group (its gloo group) and destroys it at
    close: a gloo group left to the interpreter's exit can abort the process there."""
    out, _ = dist_run
    for r in range(worker.WORLD):
        before, inside, after = map(int, (out / f"groups{r}.txt").read_text().split())
        assert (inside, after) == (before + 1, before)


@needs_gloo
def test_fsdp2_rows_equal_the_unsharded_model(dist_run, reference):
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch>=2.6")
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    out, _ = dist_run
    log = read_parquet(out / "fsdp")
    params = {n for n, _ in worker.make_model().named_parameters()}
    is_param = log[METADATA]["name"].isin(params).to_numpy()
    got = rows(log[is_param], (WEIGHT, GRADIENT))
    want = rows(reference[reference[METADATA]["name"].isin(params).to_numpy()], (WEIGHT, GRADIENT))
    assert_same_rows(got, want)
    assert_same_rows(rows(log, (OPTIMISER_STATE,)), rows(reference, (OPTIMISER_STATE,)))
    # the same names and module classes as unsharded (FSDP2's FSDPLinear logs as Linear)
    assert set(log[METADATA]["type"]) == {"Linear", "Sequential", "Tanh"}
    # output gradients (batch-split, merged over the ranks) are exactly twice the
    # reference's (see _dist_worker.fsdp): extrema doubled, exponent counts one bin up
    out_grads = rows(log[~is_param], (GRADIENT,))
    ref = rows(reference[~reference[METADATA]["name"].isin(params).to_numpy()], (GRADIENT,))
    pd.testing.assert_frame_equal(out_grads[METADATA], ref[METADATA])
    for c in ("min", "max", "min_abs", "max_abs", "mean", "std", "rm2"):
        np.testing.assert_allclose(out_grads[SCALAR_STATS][c], 2 * ref[SCALAR_STATS][c], rtol=1e-6)
    np.testing.assert_array_equal(out_grads[SCALAR_STATS]["numel"], ref[SCALAR_STATS]["numel"])
    counts = ref[EXPONENT_COUNTS]
    exps = [c for c in counts.columns if isinstance(c, int)]
    shifted = out_grads[EXPONENT_COUNTS]
    assert counts[exps].to_numpy().sum() > 0
    for e in exps:
        up = shifted[e + 1] if e + 1 in shifted.columns else np.zeros(len(shifted), np.int64)
        np.testing.assert_array_equal(up, counts[e], err_msg=str(e))


@needs_gloo
def test_a_rank_that_stops_stepping_makes_the_other_fail_after_the_timeout(dist_run):
    out, _ = dist_run
    elapsed, message = (out / "fail0_hang.txt").read_text().split("\n", 1)
    assert "dist_timeout=5s" in message and "rank 0 of 2" in message, message
    # a step merges at the next step's end, which rank 1 never reaches: step 2 fails
    assert "step 2" in message, message
    assert 4.0 < float(elapsed) < 5.0 + 10.0  # waited for the timeout, not for ever
    log = read_parquet(out / "fail_hang")  # the steps before stay readable
    assert sorted(set(log[METADATA]["step"])) == [0, 1]


@needs_gloo
def test_a_rank_that_raises_out_of_its_tracker_makes_the_other_fail_at_once(dist_run):
    """The raising rank's tracker closes and destroys its gloo group: the other rank's
    collective fails then (while the raising process lives on), not after dist_timeout."""
    out, _ = dist_run
    elapsed, message = (out / "fail0_raise.txt").read_text().split("\n", 1)
    assert "dist_timeout=60s" in message and "rank 0 of 2" in message, message
    assert "step 3" in message, message
    assert float(elapsed) < 10.0
    log = read_parquet(out / "fail_raise")
    assert sorted(set(log[METADATA]["step"])) == [0, 1, 2]


# ---------------------------------------------------------------- the core, without processes


class FakeRanks:
    """The collectives of ``world`` simulated ranks, run one merge at a time: each rank's
    call is answered from what every rank sends (filled in by :func:`run_ranks`)."""

    def __init__(self, rank: int, world: int, sent: dict) -> None:
        self.rank, self.world_size, self.timeout, self.sent = rank, world, 1.0, sent

    def all_gather_ints(self, values: np.ndarray) -> np.ndarray:
        return np.stack(self.sent["ints"])

    def gather(self, vector: np.ndarray, dst: int) -> list[np.ndarray] | None:
        return list(self.sent["vectors"]) if self.rank == dst else None

    def broadcast_text(self, text: str | None, src: int) -> str:  # pragma: no cover
        raise AssertionError("not used")


def run_ranks(per_rank_rows: list[list]) -> list:
    """merge_ranks on every simulated rank, after a first pass that records what each
    sends (the header, the vector)."""
    world = len(per_rank_rows)
    sent: dict = {"ints": [], "vectors": []}

    class Recorder(FakeRanks):
        def all_gather_ints(self, values):
            sent["ints"].append(values)
            return np.stack([values] * world)

        def gather(self, vector, dst):
            sent["vectors"].append(vector)
            return None

    for r, rs in enumerate(per_rank_rows):
        merge_ranks(0, rs, Recorder(r, world, sent), writer=world)  # no writer: records only
    return [merge_ranks(0, rs, FakeRanks(r, world, sent)) for r, rs in enumerate(per_rank_rows)]


def test_merge_ranks_by_role_against_numpy():
    rng = np.random.default_rng(0)
    act = rng.standard_normal((4, 6)).astype(np.float32)  # split over 2 ranks by rows
    weight = rng.standard_normal((6, 3)).astype(np.float32)  # sharded over a (2, 2) mesh:
    wshards = [weight[:3], weight[3:]]  # ranks (0, 1) hold shard 0, ranks (2, 3) shard 1
    lay = summarize(act)[1]
    key_a = TensorKey("fc", ACTIVATION, "Linear", "float32")
    key_w = TensorKey("fc.weight", WEIGHT, "Linear", "float32")
    key_b = TensorKey("fc.bias", WEIGHT, "Linear", "float32")
    bias = rng.standard_normal(3).astype(np.float32)
    acts = np.array_split(act, 4)
    per_rank = [
        [
            (key_a, lay, summarize(acts[r])[0], LOCAL),
            (key_w, lay, summarize(wshards[r // 2])[0], Shard(7 + r // 2)),
            # replicated: the other ranks' (wrong) values must not be used
            (key_b, lay, summarize(bias if r == 0 else bias * 2)[0], REPLICATED),
        ]
        for r in range(4)
    ]
    out = run_ranks(per_rank)
    assert out[1] == out[2] == out[3] == []
    (ka, _, va), (kw, _, vw), (kb, _, vb) = out[0]
    assert (ka, kw, kb) == (key_a, key_w, key_b)
    for got, x in ((va, act), (vw, weight), (vb, bias)):
        want = summarize(x)[0]
        np.testing.assert_array_equal(got[:8], want[:8])  # counts and extrema
        np.testing.assert_allclose(got[8:14], want[8:14], rtol=1e-12)  # moments
        np.testing.assert_array_equal(got[14:], want[14:])  # exponent counts


def test_merge_ranks_refuses_ranks_that_disagree():
    lay = Layout("float32")
    v = summarize(np.ones(3, np.float32))[0]
    a = TensorKey("a", ACTIVATION, "Linear", "float32")
    b = TensorKey("b", ACTIVATION, "Linear", "float32")
    with pytest.raises(RankMismatchError, match="tracked different rows at step 0"):
        run_ranks([[(a, lay, v, LOCAL)], [(b, lay, v, LOCAL)]])
    with pytest.raises(RankMismatchError):  # same rows, other roles
        run_ranks([[(a, lay, v, LOCAL)], [(a, lay, v, REPLICATED)]])
    with pytest.raises(ValueError, match="role 'global'"):
        run_ranks([[(a, lay, v, "global")], [(a, lay, v, "global")]])
