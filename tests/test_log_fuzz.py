"""Damaged logs (issue 30): bit flips and truncations of parquet parts and pickles, seeded
and bounded (a few seconds). Whatever the damage, a reader either raises SchemaError or
gives back exactly the log that was written, and ``tandv validate`` exits 0 or 1: no
other exception, no crash, no altered values."""

from __future__ import annotations

import contextlib
import io
import random
import shutil
from pathlib import Path

import pandas as pd
import pytest
from logs import make_log

from tandv.cli import main
from tandv.schema import SchemaError, read_parquet, read_parquet_chunks, read_pickle

CASES = 30  # per format


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    parquet, _ = make_log(root / "log", steps=3, flush_every=1)  # three parts
    pickled, _ = make_log(root / "log.pkl", steps=3, out_format="pickle")
    return root, parquet, pickled


def _damage(data: bytes, rng: random.Random) -> bytes:
    """One bit flipped (mostly in the last 3 kB, where a parquet footer is), or the file
    cut short."""
    if rng.random() < 0.25:
        return data[: rng.randrange(len(data))]
    out = bytearray(data)
    lo = max(0, len(out) - 3000) if rng.random() < 0.7 else 0
    out[rng.randrange(lo, len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _cli_status(path: Path) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["validate", str(path), "--trust-pickle"])


def test_damaged_parquet_parts_are_refused_or_read_exactly(originals, tmp_path):
    root, want, _ = originals
    parts = sorted((root / "log").glob("*.parquet"))
    rng = random.Random(30)
    refused = 0
    for case in range(CASES):
        log = tmp_path / f"log{case}"
        shutil.copytree(root / "log", log)
        part = log / rng.choice(parts).name
        part.write_bytes(_damage(part.read_bytes(), rng))
        try:
            got = read_parquet(log)
        except SchemaError:
            refused += 1
        else:
            pd.testing.assert_frame_equal(got, want)
        with contextlib.suppress(SchemaError):
            read_parquet(log, columns=["rm2", -3], filters=[("step", ">=", 1)])
        with contextlib.suppress(SchemaError):
            list(read_parquet_chunks(log, chunk_rows=5))
        assert _cli_status(log) in (0, 1)
        shutil.rmtree(log)
    assert refused > CASES // 3  # most damage is found, not read around


def test_damaged_pickles_are_refused_or_read_exactly(originals, tmp_path):
    root, _, want = originals
    data = (root / "log.pkl").read_bytes()
    rng = random.Random(31)
    for case in range(CASES):
        path = tmp_path / f"bad{case}.pkl"
        path.write_bytes(_damage(data, rng))
        try:
            got = read_pickle(path)
        except SchemaError:
            pass
        else:
            pd.testing.assert_frame_equal(got, want)
        assert _cli_status(path) in (0, 1)
