"""Logs that never lie (issue 30): one run per log path, SIGTERM, write errors, counts
beyond int64, pickle trust and damage, names escaped in figures and on the terminal."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from logs import make_log

import tandv
from tandv.schema import SchemaError, read_parquet, read_pickle, validate, write_parquet
from tandv.schema.writer import claim_file
from tandv.stats import summarize
from tandv.track.common import StepRecorder, TensorKey

ROOT = Path(__file__).resolve().parents[1]


def _record(rec: StepRecorder, step: int, name: str = "a") -> None:
    v, layout = summarize(np.arange(1, 9, dtype=np.float32) * (step + 1))
    rec.add(TensorKey(name, "Weight", "Linear", "float32"), layout, v)
    rec.commit(step, rec.take(), lambda xs: xs)


# ------------------------------------------------------------------ one run per path


@pytest.mark.parametrize("fmt, name", [("parquet", "log"), ("pickle", "log.pkl")])
def test_a_second_run_on_the_same_path_is_refused_at_once(tmp_path, fmt, name):
    path = tmp_path / name
    first = StepRecorder(path, fmt, verbose=False)
    t0 = time.monotonic()
    with pytest.raises(FileExistsError, match=r"is being written by another run \(process \d+"):
        StepRecorder(path, fmt, verbose=False)
    assert time.monotonic() - t0 < 0.1  # the second run started within 100 ms
    _record(first, 0)
    first.close()
    assert not claim_file(path, fmt).exists()  # the claim goes with the run
    df = read_parquet(path) if fmt == "parquet" else read_pickle(path)
    assert list(df[("metadata", "name")]) == ["a"]  # the first run's log, whole
    with pytest.raises(FileExistsError, match="already (holds a log|exists)"):
        StepRecorder(path, fmt, verbose=False)


@pytest.mark.parametrize("fmt, name", [("parquet", "log"), ("pickle", "log.pkl")])
def test_a_claim_is_seen_by_another_process(tmp_path, fmt, name):
    path = tmp_path / name
    rec = StepRecorder(path, fmt, verbose=False)
    code = textwrap.dedent(
        f"""
        from tandv.track.common import StepRecorder
        try:
            StepRecorder({str(path)!r}, {fmt!r}, verbose=False)
        except FileExistsError as e:
            print("refused:", e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert f"refused: log {str(path)!r} is being written by another run (process {os.getpid()}" in (
        out.stdout
    ), out.stderr
    rec.close()


def test_the_pickle_never_replaces_a_file_that_appeared(tmp_path):
    path = tmp_path / "run.pkl"
    rec = StepRecorder(path, "pickle", verbose=False)
    _record(rec, 0)
    path.write_text("someone else's file")
    with pytest.raises(RuntimeError, match=r"a file appeared at .*run\.pkl.*this run's log is in"):
        rec.close()
    assert path.read_text() == "someone else's file"
    kept = list(tmp_path.glob(".run.pkl.*.tmp"))
    assert len(kept) == 1 and list(read_pickle_bytes(kept[0])[("metadata", "name")]) == ["a"]


def read_pickle_bytes(p: Path) -> pd.DataFrame:
    renamed = p.with_name("kept.pkl")
    renamed.write_bytes(p.read_bytes())
    return read_pickle(renamed)


@pytest.mark.parametrize(
    "fmt, name, message",
    [
        ("pickle", "picklelog", r"out_format='pickle' with out=.*picklelog'.*must end in \.pkl"),
        ("parquet", "log.pkl", r"out_format='parquet' with out=.*log\.pkl'.*read as a pickle"),
    ],
)
def test_format_and_suffix_must_agree_at_start(tmp_path, fmt, name, message):
    with pytest.raises(ValueError, match=message):
        StepRecorder(tmp_path / name, fmt, verbose=False)
    assert not (tmp_path / name).exists()


# ------------------------------------------------------------------ SIGTERM, write errors

_TERM_CHILD = """
import sys, time
import numpy as np
from tandv.stats import summarize
from tandv.track.common import StepRecorder, TensorKey
rec = StepRecorder(sys.argv[1], sys.argv[2], verbose=False, flush_every=1000, flush_seconds=1e6)
for step in range(5):
    v, layout = summarize(np.arange(1, 9, dtype=np.float32))
    rec.add(TensorKey("a", "Weight", "Linear", "float32"), layout, v)
    rec.commit(step, rec.take(), lambda xs: xs)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("fmt, name", [("parquet", "log"), ("pickle", "log.pkl")])
def test_sigterm_flushes_like_sigint(tmp_path, fmt, name):
    """Five recorded steps, none flushed (flush_every=1000): SIGTERM writes them all."""
    path = tmp_path / name
    with subprocess.Popen(  # (closes its pipes on leaving: no ResourceWarning)
        [sys.executable, "-c", _TERM_CHILD, str(path), fmt],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ) as child:
        try:
            assert child.stdout.readline().strip() == "ready"
            child.send_signal(signal.SIGTERM)
            rc = child.wait(timeout=60)
        finally:
            child.kill()
        err = child.stderr.read()
    assert rc == 128 + signal.SIGTERM, err
    df = read_parquet(path) if fmt == "parquet" else read_pickle(path)
    assert sorted(df[("metadata", "step")]) == [0, 1, 2, 3, 4]


_FORK_CHILD = """
import os, signal, sys, time
import numpy as np
from tandv.stats import summarize
from tandv.track.common import StepRecorder, TensorKey
rec = StepRecorder(sys.argv[1], verbose=False, flush_every=1000, flush_seconds=1e6)
v, layout = summarize(np.arange(1, 9, dtype=np.float32))
rec.add(TensorKey("a", "Weight", "Linear", "float32"), layout, v)
rec.commit(0, rec.take(), lambda xs: xs)
pid = os.fork()
if pid == 0:  # a data loader worker, say: not the log's writer
    time.sleep(60)
    os._exit(0)
time.sleep(0.2)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
print("child", os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
rec.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sigterm_in_a_forked_child_leaves_the_parents_log_alone(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _FORK_CHILD, str(tmp_path / "log")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert out.stdout.strip() == "child True", out.stderr  # the default action: killed
    assert len(list((tmp_path / "log").glob("*.parquet"))) == 1  # the parent's part only
    assert read_parquet(tmp_path / "log")[("metadata", "step")].tolist() == [0]


def test_write_error_surfaces_at_the_next_step(tmp_path):
    rec = StepRecorder(tmp_path / "log", verbose=False, flush_every=5)

    def full(df, **kw):
        raise OSError(28, "No space left on device")

    rec.writer.write = full
    for step in range(5):  # the fifth step hands the batch to the writer thread
        _record(rec, step)
    rec.stream.wait_written()  # the write has failed by now
    with pytest.raises(RuntimeError, match="writing the log .* failed") as err:
        _record(rec, 5)
    assert isinstance(err.value.__cause__, OSError)
    with pytest.raises(RuntimeError):
        rec.close()


# ------------------------------------------------------------------ counts beyond int64


def _uint_log() -> pd.DataFrame:
    df = make_small()
    big = np.array([2**63 + 5, 1], dtype=np.uint64)
    df[("exponent_counts", 0)] = big
    return df


def make_small() -> pd.DataFrame:
    cols = pd.MultiIndex.from_tuples(
        [
            ("metadata", "name"),
            ("metadata", "type"),
            ("metadata", "tensor_type"),
            ("metadata", "step"),
            ("metadata", "dtype"),
            ("scalar_stats", "rm2"),
            ("exponent_counts", "-inf"),
            ("exponent_counts", 0),
            ("exponent_counts", "+inf"),
        ]
    )
    return pd.DataFrame(
        [
            ["a", "L", "Weight", 0, "float32", 1.0, 0, 1, 0],
            ["b", "L", "Weight", 0, "float32", 2.0, 0, 2, 0],
        ],
        columns=cols,
    ).astype({("metadata", "step"): "int64"})


def test_counts_above_int64_are_refused_at_write(tmp_path):
    df = _uint_log()
    with pytest.raises(
        SchemaError,
        match=r"\('exponent_counts', 0\): expected counts <= 9223372036854775807 .*"
        r"found 9223372036854775813 \(first at row 0",
    ):
        write_parquet(df, tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()
    df = make_small()
    df[("scalar_stats", "numel")] = np.array([1, 2**64 - 1], dtype=np.uint64)
    with pytest.raises(SchemaError, match=r"\('scalar_stats', 'numel'\): expected values <="):
        validate(df)
    df[("scalar_stats", "numel")] = np.array([1, 2**63 - 1], dtype=np.uint64)  # the largest
    write_parquet(df, tmp_path / "ok.parquet")
    assert read_parquet(tmp_path / "ok.parquet")[("scalar_stats", "numel")].tolist() == [
        1,
        2**63 - 1,
    ]


# ------------------------------------------------------------------ pickle: trust and damage


def test_nothing_unpickles_without_trust(tmp_path):
    from tandv.analysis import summarize_log
    from tandv.export import tensorboard

    df, _ = make_log(tmp_path / "log.pkl", out_format="pickle")
    for call in (
        lambda: tandv.read_log(tmp_path / "log.pkl"),
        lambda: summarize_log(tmp_path / "log.pkl"),
        lambda: tensorboard(tmp_path / "log.pkl", tmp_path / "tb"),
    ):
        with pytest.raises(ValueError, match=r"log\.pkl' is a pickle.*pass trust_pickle=True"):
            call()
    assert not (tmp_path / "tb").exists()
    assert "Weight" in summarize_log(tmp_path / "log.pkl", trust_pickle=True)
    pd.testing.assert_frame_equal(tandv.read_log(tmp_path / "log.pkl", trust_pickle=True), df)


def test_a_damaged_pickle_is_an_error_not_altered_values(tmp_path):
    make_log(tmp_path / "log.pkl", out_format="pickle")
    data = bytearray((tmp_path / "log.pkl").read_bytes())
    data[len(data) // 2] ^= 0x04  # one bit, mid-file
    (tmp_path / "bad.pkl").write_bytes(bytes(data))
    with pytest.raises(SchemaError, match=r"bad\.pkl': damaged pickle, its checksum does not"):
        read_pickle(tmp_path / "bad.pkl")
    # a pickle tandv wrote stays readable by pandas (the checksum follows the pickle)
    assert len(pd.read_pickle(tmp_path / "log.pkl")) == len(read_pickle(tmp_path / "log.pkl"))


def test_a_pickle_with_broken_internals_is_an_error_not_a_crash(tmp_path):
    """Pickles made by pandas (no checksum): column codes out of range, and an Arrow
    string array whose offsets point past its data, are refused before pandas reads them."""
    df = make_small()
    cols = df.columns
    broken = pd.MultiIndex(
        levels=cols.levels,
        codes=[cols.codes[0], [c if i != 1 else 99 for i, c in enumerate(cols.codes[1])]],
        verify_integrity=False,
    )
    odd = df.copy()
    odd.columns = broken
    (tmp_path / "codes.pkl").write_bytes(pickle.dumps(odd))
    with pytest.raises(SchemaError, match=r"codes\.pkl' is not a readable pickle: .*codes out"):
        read_pickle(tmp_path / "codes.pkl")
    strs = df.copy()
    strs[("metadata", "name")] = pd.array(["abcdefg", "hijklmnopqrs"], dtype="str")
    data = pickle.dumps(strs)
    offsets = np.array([0, 7, 19], dtype=np.int64).tobytes()
    assert data.count(offsets) == 1
    data = data.replace(offsets, np.array([0, 7, 1 << 40], dtype=np.int64).tobytes())
    (tmp_path / "offsets.pkl").write_bytes(data)
    with pytest.raises(SchemaError, match=r"offsets\.pkl' is not a readable pickle: Arrow"):
        read_pickle(tmp_path / "offsets.pkl")


# ------------------------------------------------------------------ names in figures, terminal


def _named_log(path: Path) -> None:
    rec = StepRecorder(path, verbose=False)
    for step in range(2):
        for name in ("$x^$", "evil\x1b[2J\x07"):
            v, layout = summarize(np.arange(1, 9, dtype=np.float32))
            rec.add(TensorKey(name, "Weight", "Lin$ear", "float32"), layout, v)
        rec.commit(step, rec.take(), lambda xs: xs)
    rec.close()


def test_names_are_escaped_in_the_report(tmp_path):
    from tandv.cli import main

    _named_log(tmp_path / "log")
    assert main(["report", str(tmp_path / "log"), "-o", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").stat().st_size > 1000


def test_summary_prints_no_raw_escape_sequences(tmp_path, capsys):
    from tandv.cli import main

    _named_log(tmp_path / "log")
    assert main(["summary", str(tmp_path / "log")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert r"evil\x1b[2J\x07" in out  # shown, as an escape


# ------------------------------------------------------------------ the reading benchmark


def test_read_benchmark_runs_in_its_tiny_mode():
    """benchmarks/read_log.py (the reading figures of docs/reading.md) builds a log with tandv's
    writer and times every task, each in a fresh process: it must keep working."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "read_log.py"), "--tiny"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    rows: dict[str, list[str]] = {}
    for line in lines:
        if line.split():
            rows.setdefault(line.split()[0], line.split())  # the table's row, not the ratio
    for task in ("arrow", "full", "last", "stat", "summary"):
        assert task in rows, out.stdout
    assert rows["full"][4:] == rows["arrow"][4:] == ["[960,", "58]"]  # the whole log, both ways
    assert any(line.startswith("full / arrow: seconds") for line in lines)


def test_a_full_read_allocates_about_the_frame_it_returns(tmp_path):
    """Validation on read works on the decoded columns in place: the numpy memory a full
    read allocates is about the frame's numeric columns (copying the exponent block into
    one 2-D array to check it, as before, doubled it)."""
    import tracemalloc

    rows, exps = 20_000, 64
    rng = np.random.default_rng(0)
    meta = [("metadata", c) for c in ("name", "type", "tensor_type", "step", "dtype")]
    counts = [("exponent_counts", e) for e in ("-inf", *range(-exps, 0), "+inf")]
    data: dict = {
        ("metadata", "name"): [f"t{i % 100}" for i in range(rows)],
        ("metadata", "type"): ["L"] * rows,
        ("metadata", "tensor_type"): ["Weight"] * rows,
        ("metadata", "step"): np.arange(rows) // 100,
        ("metadata", "dtype"): ["float32"] * rows,
        ("scalar_stats", "rm2"): rng.random(rows),
    }
    data.update({c: rng.integers(0, 100, rows) for c in counts})
    cols = pd.MultiIndex.from_tuples([*meta, ("scalar_stats", "rm2"), *counts])
    write_parquet(pd.DataFrame(data, columns=cols), tmp_path / "x.parquet")
    tracemalloc.start()
    try:
        got = read_parquet(tmp_path / "x.parquet")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    numeric = sum(got[c].to_numpy().nbytes for c in got.columns if got[c].dtype.kind in "if")
    assert peak < 1.4 * numeric, (peak, numeric)
