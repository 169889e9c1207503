"""Log analysis helpers and the `tandv validate` / `tandv summary` commands."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from logs import make_log

import tandv
import tandv.cli
from tandv.analysis import exponent_range, first_nonfinite, format_shares, text_summary
from tandv.cli import main


def row(df, name, tt, step):
    m = df["metadata"]
    return df[(m["name"] == name) & (m["tensor_type"] == tt) & (m["step"] == step)].iloc[0]


def test_format_shares_match_a_real_cast(tmp_path):
    df, arrays = make_log(tmp_path / "log")
    shares = format_shares(df, "float8_e4m3fn")
    for (name, tt, step), x in arrays.items():
        s = shares[(shares.name == name) & (shares.tensor_type == tt) & (shares.step == step)].iloc[
            0
        ]
        a = np.abs(x.astype(np.float64))
        fin = np.isfinite(a)
        under = ((a > 0) & (a < 2.0**-9) & fin).sum()
        # values in binades above float8_e4m3fn's top binade [256, 512) overflow
        over = (fin & (a >= 512)).sum()
        assert s.underflow == pytest.approx(under / x.size)
        assert s.overflow == pytest.approx(over / x.size)


def test_exponent_range_and_first_nonfinite(tmp_path):
    df, arrays = make_log(tmp_path / "log")
    rg = exponent_range(df)
    x = arrays[("a", "Weight", 1)]
    e = np.floor(np.log2(np.abs(x[x != 0].astype(np.float64)))).astype(int)
    r = rg[(rg.name == "a") & (rg.tensor_type == "Weight") & (rg.step == 1)].iloc[0]
    assert (r.min_exponent, r.max_exponent, r.width) == (e.min(), e.max(), e.max() - e.min() + 1)
    first = first_nonfinite(df)
    assert set(zip(first.name, first.tensor_type, first.step)) == {
        ("b", "Weight", 2),
        ("b", "Activation", 2),
    }
    assert (first.nan_count == 3).all()


def test_text_summary_mentions_what_matters(tmp_path):
    df, arrays = make_log(tmp_path / "log")
    text = text_summary(df)
    assert "Activation: 2 tensors, steps 0..3" in text
    assert "NaN/inf: first in b at step 2 (3 NaN, 0 inf)" in text
    last = {n: np.sqrt(np.mean(arrays[(n, "Weight", 3)].astype(np.float64) ** 2)) for n in "ab"}
    top = max(last, key=last.get)
    assert f"largest rm2 at step 3: {top} {last[top]:.3g}" in text
    assert "float8_e4m3fn:" in text and "bfloat16:" in text


def test_cli_validate_and_summary(tmp_path, capsys):
    make_log(tmp_path / "log")
    assert main(["validate", str(tmp_path / "log")]) == 0
    assert "valid tandv log (16 rows, 4 steps, 2 tensors)" in capsys.readouterr().out
    assert main(["summary", str(tmp_path / "log")]) == 0
    assert "Weight: 2 tensors" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path):
    (tmp_path / "bad.pkl").write_bytes(b"not a pickle")
    env = {**os.environ, "PYTHONPATH": str(Path(tandv.__file__).parents[1])}
    for args in (
        ["validate", str(tmp_path / "missing")],
        ["summary", str(tmp_path / "bad.pkl"), "--trust-pickle"],
    ):
        p = subprocess.run(
            [sys.executable, "-m", "tandv", *args], capture_output=True, text=True, env=env
        )
        assert p.returncode == 1
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tandv: error:"), p.stderr
        assert "Traceback" not in p.stderr


def test_cli_validate_reports_schema_error(tmp_path, capsys):
    df, _ = make_log(tmp_path / "log.pkl", out_format="pickle")
    df = df.drop(columns=[("exponent_counts", "+inf")])
    df.to_pickle(tmp_path / "broken.pkl")
    assert main(["validate", str(tmp_path / "broken.pkl"), "--trust-pickle"]) == 1
    assert "('exponent_counts', '+inf'): missing" in capsys.readouterr().err


# ------------------------------------------------------------------ issue 15


class _Evil:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_cli_never_unpickles_without_trust_pickle(tmp_path, capsys):
    import pickle

    marker = tmp_path / "code-ran"
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(_Evil(str(marker))))
    for cmd in ("validate", "summary", "report"):
        assert main([cmd, str(tmp_path / "evil.pkl")]) == 1
        err = capsys.readouterr().err
        assert "reading a pickle runs code stored in it; pass --trust-pickle" in err
    assert not marker.exists()
    assert (
        main(["validate", str(tmp_path / "evil.pkl"), "--trust-pickle"]) == 1
    )  # runs it, as asked
    assert marker.exists()
    assert "runs code" in tandv.cli.build_parser().format_help()


def test_suffix_decides_the_format_and_a_mismatch_is_clear(tmp_path, capsys):
    df, _ = make_log(tmp_path / "log.pkl", out_format="pickle")
    tandv.write_parquet(df, tmp_path / "really-parquet.pkl")
    with pytest.raises(
        tandv.SchemaError, match=r"really-parquet\.pkl' holds parquet data, not a pickle; rename it"
    ):
        tandv.read_log(tmp_path / "really-parquet.pkl", trust_pickle=True)
    assert main(["validate", str(tmp_path / "really-parquet.pkl"), "--trust-pickle"]) == 1
    assert "holds parquet data" in capsys.readouterr().err
    df.to_pickle(tmp_path / "pickle-without-suffix")
    with pytest.raises(
        tandv.SchemaError, match=r"holds a pickle but its name does not end in \.pkl"
    ):
        tandv.read_log(tmp_path / "pickle-without-suffix")
    assert main(["summary", str(tmp_path / "pickle-without-suffix")]) == 1
    assert "holds a pickle" in capsys.readouterr().err
    (tmp_path / "renamed.pkl").write_bytes((tmp_path / "pickle-without-suffix").read_bytes())
    pd.testing.assert_frame_equal(tandv.read_log(tmp_path / "renamed.pkl", trust_pickle=True), df)


def test_cli_reports_a_damaged_part_in_one_line(tmp_path):
    make_log(tmp_path / "log", steps=4, flush_every=1)
    part = sorted((tmp_path / "log").glob("*.parquet"))[2]
    raw = bytearray(part.read_bytes())
    raw[40:48] = b"\xff" * 8  # inside the first data page; the footer is intact
    part.write_bytes(bytes(raw))
    env = {**os.environ, "PYTHONPATH": str(Path(tandv.__file__).parents[1])}
    for cmd in ("validate", "summary", "report"):
        p = subprocess.run(
            [sys.executable, "-m", "tandv", cmd, str(tmp_path / "log")],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        assert p.returncode == 1, (cmd, p.stdout)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tandv: error:") and part.name in lines[0], (
            p.stderr
        )


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 1000])
def test_summary_in_chunks_equals_summary_of_the_whole_log(tmp_path, chunk_rows):
    from tandv.analysis import summarize_log

    df, _ = make_log(tmp_path / "log", steps=6, flush_every=2)
    assert summarize_log(tmp_path / "log", chunk_rows=chunk_rows) == text_summary(df)


def test_summary_tally_agrees_with_the_per_row_functions(tmp_path):
    """The summary's chunked tally against the per-row functions (each tested against
    numpy above): widest range per tensor type and the shares weighted by numel."""
    df, _ = make_log(tmp_path / "log", steps=5, flush_every=2)
    from tandv.analysis import summarize_log

    text = summarize_log(tmp_path / "log", chunk_rows=3)
    rg = exponent_range(df)
    for tt in ("Weight", "Activation"):
        r = rg[rg.tensor_type == tt]
        w = r.loc[r["width"].idxmax()]
        assert (
            f"widest exponent range: {w['name']} at step {w['step']}: 2^{w['min_exponent']} .. "
            f"2^{w['max_exponent']} ({w['width']} binades)"
        ) in text
        numel = df.loc[
            (df[("metadata", "tensor_type")] == tt).to_numpy(), ("scalar_stats", "numel")
        ].to_numpy()
        parts = []
        for f in ("float8_e4m3fn", "bfloat16"):
            sh = format_shares(df, f)
            sh = sh[sh.tensor_type == tt]
            parts.append(
                f"{f}: {(sh['underflow'].to_numpy() * numel).sum() / numel.sum():.2%} underflow, "
                f"{(sh['overflow'].to_numpy() * numel).sum() / numel.sum():.2%} overflow"
            )
        assert "  as " + "; ".join(parts) in text


def _tracked_log(tmp_path, name, **options):
    import torch

    from tandv.track.torch import track

    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with track(net, opt, out=tmp_path / name, verbose=False, **options) as tr:
        for _ in range(2):
            (net(torch.randn(4, 8) * 1e-4).square().sum()).backward()  # tiny values: fp8 underflow
            opt.step()
            opt.zero_grad()
            tr.step()
    return tr.out_path


@pytest.mark.parametrize("fmt, name", [("parquet", "log"), ("pickle", "log.pkl")])
def test_a_log_records_how_it_was_made(tmp_path, fmt, name):
    import torch

    import tandv
    from tandv.schema import read_log, run_record

    path = _tracked_log(tmp_path, name, out_format=fmt, number_format="float8_e4m3fn", every=1)
    rec = run_record(read_log(path, trust_pickle=True))
    assert rec["framework"] == "torch" and rec["model"] == "Linear"
    assert rec["number_format"] == "float8_e4m3fn" and rec["options"]["every"] == 1
    assert rec["options"]["optimizers"] == ["SGD"] and rec["options"]["out_format"] == fmt
    assert (
        rec["versions"]["torch"] == torch.__version__
        and rec["world_size"] == 1
        and rec["rank"] == 0
    )
    if fmt == "parquet":  # every chunk of a streamed read carries it too
        assert all(
            run_record(c) == rec for c in tandv.schema.read_parquet_chunks(path, chunk_rows=3)
        )


def test_shares_a_narrower_recorded_format_cannot_tell_are_not_invented(tmp_path):
    """A log counted as float8_e4m3fn holds values below 2**-9 without their exponents: it
    can say what underflows float8_e4m3fn but not what underflows bfloat16 (this used to
    report them all as bfloat16 underflow)."""
    from tandv.analysis import format_shares, summarize_log
    from tandv.schema import read_log

    narrow = read_log(_tracked_log(tmp_path, "fp8", number_format="float8_e4m3fn"))
    assert narrow[("exponent_counts", "-inf")].sum() > 0
    fp8 = format_shares(narrow, "float8_e4m3fn")
    assert fp8["underflow"].max() > 0 and np.isfinite(fp8["underflow"]).all()
    bf16 = format_shares(narrow, "bfloat16")
    # nor what overflows it: the log's +inf holds every value above 448
    assert bf16["underflow"].isna().all() and bf16["overflow"].isna().all()
    text = summarize_log(tmp_path / "fp8")
    assert "bfloat16: underflow not known, overflow not known" in text
    assert "exponents counted as float8_e4m3fn" in text
    # counted in each tensor's own dtype, the same run's bfloat16 shares are known (and 0)
    own = read_log(_tracked_log(tmp_path, "own"))
    assert (format_shares(own, "bfloat16")["underflow"] == 0).all()
    assert "bfloat16: 0.00% underflow" in summarize_log(tmp_path / "own")


def test_the_report_says_how_the_log_was_made(tmp_path):
    from tandv.schema import read_log
    from tandv.viz.report import write_report

    path = _tracked_log(tmp_path, "fp8", number_format="float8_e4m3fn")
    page = write_report(read_log(path), tmp_path / "r.html").read_text()
    assert (
        "Made by the torch tracker of Linear" in page
        and "exponents counted as float8_e4m3fn" in page
    )
    assert "not known" in page  # bfloat16's underflow share, which the log cannot tell
