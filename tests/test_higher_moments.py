"""Skewness and kurtosis as mergeable statistics (``Layout(moments=4)``): the numpy
reference, the host kernel and the torch paths against ``scipy.stats`` on float32 inputs,
merged or not, on data whose mean dominates its spread."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _benchmarks import load_benchmark

from tandv.stats.host import host_higher_moments, host_summaries
from tandv.stats.summary import (
    HIGHER_STATS,
    Layout,
    finalize,
    finalize_many,
    merge,
    merge_all,
    merge_groups,
    summarize,
    unfinalize_many,
)

stats = pytest.importorskip("scipy.stats")
RTOL = 1e-6


def _data(seed: int, mean: float, n: int = 20_000) -> np.ndarray:
    """float32 heavy-tailed, skewed values around ``mean``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(5, n) + 0.5 * rng.exponential(1.0, n) + mean
    return x.astype(np.float32)


def _want(x: np.ndarray) -> tuple[float, float]:
    """scipy's skewness and (excess, biased) kurtosis of the finite float64 values."""
    a = np.asarray(x, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    return float(stats.skew(a)), float(stats.kurtosis(a))


def _check(got: dict, x: np.ndarray) -> None:
    skew, kurt = _want(x)
    assert got["skew"] == pytest.approx(skew, rel=RTOL)
    assert got["kurtosis"] == pytest.approx(kurt, rel=RTOL)


@pytest.mark.parametrize("mean", [0.0, 300.0, 4e4])
def test_reference_exact_whole_and_merged(mean):
    x = _data(0, mean)
    v, layout = summarize(x, moments=4)
    assert layout.size == layout.extras_start + 2
    got, _ = finalize(v, layout)
    assert list(got)[-2:] == list(HIGHER_STATS)
    _check(got, x)
    # micro-batches of different sizes merged pairwise and by group
    parts = np.split(x, [10, 2000, 2001, 9000])
    vs = [summarize(p, fmt=layout.format, moments=4)[0] for p in parts]
    _check(finalize(merge_all(vs, layout), layout)[0], x)
    _check(
        finalize(merge(merge_all(vs[:2], layout), merge_all(vs[2:], layout), layout), layout)[0], x
    )
    grouped, _ = finalize_many(merge_groups(np.stack(vs), np.zeros(len(vs), int), layout), layout)
    _check({k: grouped[k][0] for k in HIGHER_STATS}, x)


def test_merge_groups_and_the_round_trip_through_a_log_row():
    xs = [_data(s, m, 3000) for s, m in ((1, 10.0), (2, -5.0), (3, 1000.0), (4, 0.0))]
    layout = Layout("float32", moments=4)
    vs = np.stack([summarize(x, fmt="float32", moments=4)[0] for x in xs])
    out, _ = finalize_many(merge_groups(vs, np.array([0, 1, 0, 1]), layout), layout)
    for g, members in ((0, (0, 2)), (1, (1, 3))):
        _check({k: out[k][g] for k in HIGHER_STATS}, np.concatenate([xs[i] for i in members]))
    # a log row's statistics give its summary back (aggregates of log rows merge them)
    st, counts = finalize_many(vs, layout)
    back = unfinalize_many(st, counts, layout)
    st2, _ = finalize_many(back, layout)
    for k in HIGHER_STATS:
        np.testing.assert_allclose(st2[k], st[k], rtol=1e-12)


def test_nonfinite_constant_and_empty_inputs():
    x = np.array([1.0, 2.0, np.nan, 4.0, np.inf, 8.0], np.float32)
    v, layout = summarize(x, moments=4)
    _check(finalize(v, layout)[0], x)
    for flat in (np.full(4, 3.0, np.float32), np.zeros(0, np.float32)):
        got, _ = finalize(*summarize(flat, moments=4))
        assert np.isnan(got["skew"]) and np.isnan(got["kurtosis"])
    with pytest.raises(ValueError, match="moments"):
        Layout("float32", moments=3)
    with pytest.raises(ValueError, match="clashes"):
        Layout("float32", (("skew", "mean"),), moments=4)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_host_kernel_matches_scipy(dtype):
    xs = [
        _data(5, 100.0).astype(dtype),
        _data(6, 0.0, 70_000).astype(dtype),
        _data(7, 0.0, 3).astype(dtype),
    ]
    layout = Layout(np.dtype(dtype).name, moments=4)
    core = host_summaries(xs, layout)
    v = np.concatenate([core, host_higher_moments(xs, core)], axis=1)
    got, _ = finalize_many(v, layout)
    for i, x in enumerate(xs):
        _check({k: got[k][i] for k in HIGHER_STATS}, x)
        ref, _ = summarize(x, moments=4)
        np.testing.assert_allclose(v[i, -2:], ref[-2:], rtol=1e-9, atol=1e-9 * abs(ref[-1]))


def test_torch_paths_match_scipy_and_merge():
    torch = pytest.importorskip("torch")
    from tandv.track.torch import summarize_torch

    x = _data(8, 2000.0)
    # float32 on the CPU takes the host kernel, float64 the torch-op path
    for t, fmt in ((torch.from_numpy(x), "float32"), (torch.from_numpy(x).double(), "float64")):
        layout = Layout(fmt, moments=4)
        v = summarize_torch(t, layout)
        assert v.shape == (layout.size,)
        _check(finalize(v.numpy(), layout)[0], x)
    # the tracker's torch-op path: raw vectors, finished on the host after the step's copy
    from tandv.track.torch.summary import finish_raw, raw_device

    layout = Layout("float32", moments=4)
    raw = torch.stack([raw_device(torch.from_numpy(c), layout) for c in np.array_split(x, 3)])
    vs = finish_raw(raw.numpy(), np)
    assert vs.shape == (3, layout.size)
    _check(finalize(merge_all(list(vs), layout), layout)[0], x)
    # micro-batches summarized apart on the op path and merged
    chunks = [torch.from_numpy(c).double() for c in np.array_split(x, 5)]
    lay64 = Layout("float64", moments=4)
    merged = merge_all([summarize_torch(c, lay64).numpy() for c in chunks], lay64)
    _check(finalize(merged, lay64)[0], x)


def test_cost_benchmark_runs_in_tiny_mode():
    bench = load_benchmark("higher_moments")
    r = bench.run((5000, 300), repeat=3)
    assert r["elements"] == 5300 and r["core_s"] > 0 and r["moments4_s"] > 0


def test_step_cost_benchmark_runs_in_tiny_mode(capsys):
    """The training step with and without moments=4 (a tiny model, 3 steps): the printed
    ratio of medians is that of the printed medians."""
    import re

    pytest.importorskip("torch")
    bench = load_benchmark("higher_moments")
    assert bench.main(["--tiny", "--steps", "3", "--warmup", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("tiny GPT on the CPU")
    nums = [float(v) for v in re.findall(r"\d+\.\d+", line.split("every=1")[1])]
    untracked, tracked, with4, paired, of_medians = nums
    assert min(untracked, tracked, with4, paired) > 0
    assert of_medians == pytest.approx(with4 / tracked, rel=0.02)


def test_log_rows_with_skew_and_kurtosis_aggregate_exactly():
    from tandv.analysis import aggregate
    from tandv.schema import concat_logs, validate
    from tandv.track.common import TensorKey, build_rows

    rows, arrays = [], {}
    for step in (0, 1):
        entries = []
        for i, mean in enumerate((0.0, 50.0, -3.0)):
            x = _data(10 * step + i, mean, 2000 + 500 * i)
            arrays[(f"l{i}.weight", step)] = x
            v, layout = summarize(x, moments=4)
            entries.append((TensorKey(f"l{i}.weight", "Weight", "Linear", "float32"), layout, v))
        rows.append(build_rows(step, entries))
    df = validate(concat_logs(rows))
    assert {("scalar_stats", k) for k in HIGHER_STATS} <= set(df.columns)
    agg = aggregate(df, tensor_types="Weight")
    for step in (0, 1):
        row = agg[agg[("metadata", "step")] == step]["scalar_stats"].iloc[0]
        x = np.concatenate([a for (n, s), a in arrays.items() if s == step])
        _check({k: row[k] for k in HIGHER_STATS}, x)
