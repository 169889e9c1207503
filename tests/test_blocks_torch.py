"""Block-scaled formats in the PyTorch tracker: every path (host kernel, torch-op, and the
fused Triton path: see also test_blocks_fused.py) against the numpy reference."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _benchmarks import load_benchmark  # noqa: E402
from test_blocks import COLS, NAMES, _random_arrays  # noqa: E402

import tandv  # noqa: E402
from tandv.stats.blocks import BLOCK_FORMATS, block_stats  # noqa: E402
from tandv.track.torch import summary as kernel  # noqa: E402
from tandv.track.torch import track  # noqa: E402
from tandv.track.torch._blocks import block_columns  # noqa: E402


def _torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _assert_columns(got: dict[str, float], ref: dict[str, float], what: object) -> None:
    for col in COLS:
        tol = 1e-6 if col == "sq_err" else 0.0
        assert got[col] == pytest.approx(ref[col], rel=tol, abs=0), (what, col, got, ref)


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_ops_equal_reference(seed: int) -> None:
    formats = [BLOCK_FORMATS[n] for n in NAMES]
    for a in _random_arrays(seed):
        got = block_columns(_torch(a), formats).numpy().reshape(len(NAMES), len(COLS))
        for name, g in zip(NAMES, got):
            _assert_columns(dict(zip(COLS, g.tolist())), block_stats(a, name), (a.shape, name))


def test_torch_ops_nvfp4_tensor_scale_underflows() -> None:
    # s_t is 0 in float32 (max |x| < 2688 * 2**-149): the scales 448 * 0 and 0 / 0 count as
    # zero, every non-zero value underflows (as in the reference)
    x = np.zeros((2, 32), np.float32)
    x[0, :5] = np.float32(2.0**-149) * np.arange(1, 6)
    x[1, 3] = 2.0**-148
    got = block_columns(_torch(x), [BLOCK_FORMATS["nvfp4"]]).numpy()
    ref = block_stats(x, "nvfp4")
    assert ref["underflow"] == 6.0
    _assert_columns(dict(zip(COLS, got.tolist())), ref, "s_t = 0")


# the fused kernel on CPU tensors: in Triton's interpreter only (tests/conftest.py sets it
# where no GPU is present); on a GPU, test_blocks_fused.py runs it on CUDA tensors
_FUSED = ["fused"] if os.environ.get("TRITON_INTERPRET") == "1" else []


@pytest.fixture(params=["host", "torch_ops", *_FUSED])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    with kernel.cpu_path("ops" if request.param == "torch_ops" else request.param):
        yield str(request.param)


def test_tracker_rows_equal_reference(path: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 31), torch.nn.Tanh(), torch.nn.Linear(31, 1))
    with torch.no_grad():
        model[0].weight[3, :5] = 0.0  # an all-zero stretch and a wide block range
        model[0].weight[4, 7] = 300.0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay as they are
    formats = ("mxfp4_e2m1", "nvfp4", "mxfp8_e5m2")
    out = tmp_path / "log"
    with track(model, opt, block_formats=formats, out=out, verbose=False) as tracker:
        x = torch.randn(5, 33)
        model(x).square().sum().backward()
        opt.step()
        tracker.step()
    df = tandv.read_parquet(out)
    weights = df[df.metadata.tensor_type == "Weight"]
    assert len(weights) == 4
    for _, row in weights.iterrows():
        w = dict(model.named_parameters())[row.metadata["name"]].detach().numpy()
        for name in formats:
            got = {c: row.scalar_stats[f"{name}.{c}"] for c in COLS}
            _assert_columns(got, block_stats(w, name), (path, row.metadata["name"], name))
    # activations too: the first layer's output, rows of 31
    act = df[(df.metadata.tensor_type == "Activation") & (df.metadata.name == "0")].iloc[0]
    ref = block_stats(model[0](x).detach().numpy(), "nvfp4")
    _assert_columns({c: act.scalar_stats[f"nvfp4.{c}"] for c in COLS}, ref, "activation")


def test_option_errors() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unknown format 'fp8'.*mxfp8_e4m3, mxfp8_e5m2"):
        track(model, block_formats=("fp8",))
    with pytest.raises(ValueError, match="clashes with a block_formats column"):
        track(model, block_formats=("nvfp4",), stats={"nvfp4.sq_err": (lambda x: x.sum(), "sum")})


def test_shares_and_report(tmp_path) -> None:
    from tandv.quantities import block_format_names, block_shares
    from tandv.viz.report import render_report

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.ReLU(), torch.nn.Linear(24, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    formats = ("mxfp4_e2m1", "mxfp8_e4m3")
    with track(model, opt, block_formats=formats, out=tmp_path / "log", verbose=False) as tr:
        for _ in range(2):
            model(torch.randn(4, 40)).sum().backward()
            opt.step()
            opt.zero_grad()
            tr.step()
    df = tandv.read_parquet(tmp_path / "log")
    assert block_format_names(df) == list(formats)
    sh = block_shares(df, "mxfp4_e2m1")
    w = model[0].weight.detach().numpy()
    got = sh[(sh["name"] == "0.weight") & (sh["tensor_type"] == "Weight")].iloc[-1]
    ref = block_stats(w, "mxfp4_e2m1")
    assert got["underflow"] == ref["underflow"] / w.size
    assert got["saturated"] == ref["saturated"] / w.size
    power = float(np.sum(w.astype(np.float64) ** 2))
    assert got["rel_err"] == pytest.approx(ref["sq_err"] / power, rel=1e-6)
    assert 0 < got["rel_err"] < 1
    with pytest.raises(ValueError, match="nvfp4"):
        block_shares(df, "nvfp4")
    page = render_report(df, "t")
    assert '<section id="blocks"><h2>Block formats</h2>' in page
    plain = df.drop(columns=[c for c in df.columns if c[0] == "scalar_stats" and "." in str(c[1])])
    assert 'id="blocks"' not in render_report(plain, "t")


def test_block_cost_benchmark_tiny_mode(tmp_path: Path) -> None:
    import json

    bench = load_benchmark("overhead")
    cfg = bench.GPTConfig(vocab_size=32, seq_len=8, d_model=32, n_layers=1, n_heads=2, d_mlp=64)
    formats = ("mxfp8_e4m3", "nvfp4")
    r = bench.variant_cost(cfg, 2, 2, 1, 1, "cpu", block_formats=formats)
    assert r["median_variant_ms"] > 0 and r["median_tracked_ms"] > 0
    assert r["ratio_variant_to_tracked"] == r["median_variant_ms"] / r["median_tracked_ms"]
    cpu = r["median_variant_cpu_ms"] / r["median_tracked_cpu_ms"]
    assert r["median_tracked_cpu_ms"] > 0 and r["cpu_ratio_variant_to_tracked"] == cpu
    # the command line, with a row added to a copy of the results file (no rows)
    root = Path(__file__).resolve().parents[1]
    table = json.loads((root / "benchmarks" / "results" / "block_formats.json").read_text())
    table["rows"] = []
    results = tmp_path / "block_formats.json"
    results.write_text(json.dumps(table))
    size = ["--layers", "1", "--d-model", "32", "--heads", "2", "--mlp", "64", "--vocab", "32"]
    size += ["--seq", "8", "--batch", "2", "--steps", "2", "--warmup", "1", "--every", "1"]
    assert bench.main([*size, "--block-formats", *formats, "--results", str(results)]) == 0
    (row,) = json.loads(results.read_text())["rows"]
    assert row["formats"] == "mxfp8_e4m3 + nvfp4" and row["every"] == 1
    assert row["variant"] > 0 and row["tracked"] > 0 and row["ratio"]["value"] > 0
    assert len(row["load"]) == 2 and "--block-formats mxfp8_e4m3 nvfp4" in row["command"]
    ns = bench.formats_per_value(list(formats), repeat=2)
    assert set(ns) == {"summary", *formats, "all"} and ns["summary"] > 0
