"""The JAX tracker over several devices and several processes: the rows are those of the
global arrays, equal to a one-device run over the same global batch, and one log is
written (by process 0).

Each run is a subprocess (tests/jax_distributed_worker.py): the number of CPU devices and
``jax.distributed`` must be set before JAX starts. The worker's values are multiples of
1/8, so the sharded and the unsharded steps compute the same bits; counts, extrema and
exponent counts must then agree exactly, moments to 1e-6 (summaries merged in another
order round differently)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")

from tandv import read_scalars  # noqa: E402
from tandv.schema import read_log  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "jax_distributed_worker.py"
EXACT = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "min_abs", "max_abs")
TYPES = {"Activation", "Gradient", "Weight", "Optimiser_State"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDV_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"  # tandv's stderr and the worker's prints in their order
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env.update(extra)
    return env


def _worker(*args: object, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"worker did not finish in {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def _run(*args: object, cwd: Path, **env: str) -> str:
    code, out = _finish(_worker(*args, cwd=cwd, env=_env(**env)))
    assert code == 0, out[-3000:]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _processes(runs: str, out: str, cwd: Path, **env: str) -> list[tuple[int, str]]:
    """Make ``runs`` in two processes of one ``jax.distributed`` run (one CPU device each)."""
    port = _free_port()
    procs = [_worker(runs, out, 1, 2, i, port, cwd=cwd, env=_env(**env)) for i in range(2)]
    return [_finish(p) for p in procs]


def _by_run(out: str, process: int) -> dict[str, str]:
    """A worker's output split by run (it prints ``tandv-worker ID: run R`` before each)."""
    parts = re.split(rf"^tandv-worker {process}: run (\S+)\n", out, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _rows(path: Path):
    df = read_log(path)
    keys = [("metadata", "name"), ("metadata", "tensor_type"), ("metadata", "step")]
    return df.set_index(keys).sort_index()


def assert_same_log(want_path: Path, got_path: Path) -> None:
    """Same rows; counts, extrema and exponent counts equal, moments to 1e-6; the logged
    loss (``log_scalars``) too."""
    want, got = _rows(want_path), _rows(got_path)
    assert set(want.index.get_level_values(1)) == TYPES
    assert list(got.index) == list(want.index)
    exact = [c for c in want.columns if c[0] == "exponent_counts" or c[1] in EXACT]
    moments = [c for c in want.columns if c[0] == "scalar_stats" and c not in exact]
    assert exact and moments
    for c in exact:
        np.testing.assert_array_equal(got[c].to_numpy(float), want[c].to_numpy(float), str(c))
    for c in moments:
        np.testing.assert_allclose(
            got[c].to_numpy(float), want[c].to_numpy(float), rtol=1e-6, atol=1e-12, err_msg=str(c)
        )
    want_loss, got_loss = read_scalars(want_path), read_scalars(got_path)
    assert len(want_loss) == 3
    np.testing.assert_allclose(got_loss["loss"], want_loss["loss"], rtol=1e-6)
    np.testing.assert_array_equal(got_loss["step"], want_loss["step"])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process with two CPU devices, one run after the other (a JAX start per run
    would cost seconds of imports each): the one-device references, with the default
    summary path (as a one-process run uses: on the CPU a host kernel with float64
    moments) in ``none`` and with XLA's summary operations (float32 moments, as the taps
    of a multi-process run use: the host kernel, a custom call, is not partitioned over
    processes) in ``none-xla``; then the runs on the 2-device mesh, in ``dp``, ``fsdp``
    and ``shard_map``."""
    root = tmp_path_factory.mktemp("one_process")
    _run("none,none:xla,dp,fsdp,shard_map", root, 2, cwd=root)
    return root


@pytest.mark.parametrize("mode", ["dp", "fsdp", "shard_map"])
def test_two_devices_of_one_process_log_the_global_arrays(one_process, mode):
    """Batch sharded over a 2-device mesh (dp), parameters and optimizer state too (fsdp),
    or split by a shard_map update (its taps report per device by callback): activations,
    gradients, weights and optimizer state equal the one-device run's."""
    assert_same_log(one_process / "none", one_process / mode)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The three modes in two jax.distributed processes, one run after the other, each
    logging to the default path in a folder of its own: the folder, and each process's
    output by run."""
    root = tmp_path_factory.mktemp("two_processes")
    (code0, out0), (code1, out1) = _processes("dp,fsdp,shard_map", "-", root)
    assert code0 == 0 and code1 == 0, out0[-3000:] + out1[-3000:]
    return root, _by_run(out0, 0), _by_run(out1, 1)


@pytest.mark.parametrize("mode", ["dp", "fsdp", "shard_map"])
def test_two_processes_log_the_global_arrays_once(one_process, two_processes, mode):
    """Two jax.distributed processes: process 0 writes one log (the default path, which
    both report) whose rows equal the one-device run's; process 1 writes and prints
    nothing of its own. Under shard_map each process's taps report its own device's part
    (LOCAL), which process 0 merges."""
    root, outs0, outs1 = two_processes
    out0, out1 = outs0[mode], outs1[mode]
    logs = list((root / mode / "tandv_logs").iterdir())
    assert len(logs) == 1, logs
    assert f"tandv-worker 0: out_path tandv_logs/{logs[0].name}" in out0
    assert f"tandv-worker 1: out_path tandv_logs/{logs[0].name}" in out1
    assert "tandv: logging to" in out0 and "tandv: logging to" not in out1
    # GSPMD partitions the taps' XLA summaries: the same float32 reductions as the
    # one-device XLA summary's. Under shard_map each device's shard is summarized apart and
    # the shards merge in float64, nearer the one-device host kernel's float64 moments.
    assert_same_log(one_process / ("none" if mode == "shard_map" else "none-xla"), logs[0])


def test_a_process_that_dies_does_not_hang_process_0(tmp_path):
    """Process 1 stops at step 2 before tracker.step() (and dies later): process 0 waits
    for its summaries of step 1 for the timeout, then raises a RankFailure that says what
    happened; step 0 is in the log. (JAX's own shutdown barrier then aborts process 0: not
    ours.)"""
    start = time.monotonic()
    (_, out0), (code1, _) = _processes(
        "dp",
        tmp_path / "log",
        tmp_path,
        DIST_TIMEOUT="4",
        DIE_AT="2",
        DIED_MARK=str(tmp_path / "died0"),
    )
    # process 1 exits by itself (3) or, once process 0 and its coordination service are
    # gone, JAX's heartbeat aborts it (SIGABRT): either way it never finished normally
    assert code1 in (3, -6)
    assert "RankFailure: tandv: rank 0 of 2: " in out0
    assert "(dist_timeout=4s): another rank raised, died" in out0
    assert time.monotonic() - start < 100
    steps = set(_rows(tmp_path / "log" / "dp").index.get_level_values(2))
    assert steps == {0}


# ----------------------------------------------------------------------------- the merge


class _TwoProcesses:
    """Process 0's side of the shared merge's collectives, process 1's data given in
    advance (what it would send for the same rows)."""

    rank, world_size, timeout = 0, 2, 1.0

    def __init__(self, header: np.ndarray, vector: np.ndarray) -> None:
        self.header, self.vector = header, vector

    def all_gather_ints(self, values):
        return np.stack([values, self.header])

    def gather(self, vector, dst):
        return [vector, self.vector]

    def broadcast_text(self, text, src):
        return text


def test_process_0_merges_each_tensor_over_the_processes(tmp_path):
    """The JAX roles in the shared merge: a tensor's per-process parts (LOCAL: this
    process's shards of a global array, several observations merged first) merge into the
    summary of the whole; a REPLICATED summary (a tap of the global array) counts once,
    process 0's."""
    from test_jax_tracker import assert_row_matches

    from tandv.stats.summary import summarize
    from tandv.track.common import StepRecorder, TensorKey
    from tandv.track.common.distributed import LOCAL, REPLICATED, RankMerger, rows_signature

    rng = np.random.default_rng(3)
    a0, a1, a2 = (rng.normal(size=n).astype(np.float32) * 4 for n in (50, 30, 20))
    glob = rng.normal(size=60).astype(np.float32)
    a2[3] = np.nan

    def key(name, tensor_type="Activation"):
        return TensorKey(name, tensor_type, "Dense", "float32")

    def vec(x):
        return summarize(x)[0]

    layout = summarize(a0)[1]
    roles = {key("a"): LOCAL, key("g"): REPLICATED}
    # process 1 holds the third part of "a"; for "g" it sends nothing (REPLICATED)
    rows1 = [(key("a"), layout, vec(a2), LOCAL), (key("g"), layout, vec(glob), REPLICATED)]
    header1 = np.array([0, 2, layout.size, rows_signature(rows1)], dtype=np.int64)
    comm = _TwoProcesses(header1, vec(a2))
    recorder = StepRecorder(tmp_path / "log", verbose=False, merger=RankMerger(comm, roles.get))
    pending = [(key("a"), layout, vec(a0)), (key("g"), layout, vec(glob))]
    pending.append((key("a"), layout, vec(a1)))
    recorder.commit(0, pending, lambda summaries: summaries)
    recorder.close()
    df = read_log(tmp_path / "log")
    assert len(df) == 2
    assert_row_matches(df, "a", "Activation", 0, np.concatenate([a0, a1, a2]))
    assert_row_matches(df, "g", "Activation", 0, glob)
