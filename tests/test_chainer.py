"""The Chainer monitor's statistics: sparsity, exact percentiles, whole-model and per-group
aggregates, each against numpy on the same arrays."""

from __future__ import annotations

import numpy as np
import pytest
from viz_logs import log_from_arrays

from tandv.analysis import aggregate, sparsity
from tandv.schema import concat_logs, validate
from tandv.stats import finalize, summarize


def _arrays(seed: int = 0) -> dict:
    """Two blocks of weights and gradients over two steps, with zeros, a NaN and an inf,
    sizes and scales that differ (one block's means far from zero), and one bfloat16 tensor."""
    rng = np.random.default_rng(seed)
    out = {}
    for step in (0, 3):
        for b in range(2):
            for p, size in (("weight", 60), ("bias", 7)):
                for tt, scale in (("Weight", 3.0 ** (b + 1)), ("Gradient", 1e-4 * (step + 1))):
                    x = rng.standard_normal(size) * scale + (
                        50.0 if b == 1 and tt == "Weight" else 0.0
                    )
                    x[rng.random(size) < 0.2] = 0.0
                    out[(f"blocks.{b}.{p}", tt, step)] = x.astype(np.float32)
        out[("head.weight", "Weight", step)] = rng.standard_normal(30).astype("bfloat16")
    out[("blocks.0.weight", "Gradient", 3)][[1, 2]] = [np.nan, np.inf]
    return out


def _reference(arrays: list[np.ndarray]) -> dict:
    """The statistics of the concatenated arrays, from the numpy reference summary."""
    stats, _ = finalize(*summarize(np.concatenate([a.astype(np.float64).ravel() for a in arrays])))
    return stats


def test_sparsity_is_the_fraction_of_exact_zeros():
    arrays = _arrays()
    df = log_from_arrays(arrays)
    sp = sparsity(df)
    for (name, tt, step), x in arrays.items():
        got = sp[(sp.name == name) & (sp.tensor_type == tt) & (sp.step == step)]["sparsity"].item()
        assert got == np.mean(x.astype(np.float64) == 0)
    with pytest.raises(ValueError, match="zero_count"):
        sparsity(df.drop(columns=[("scalar_stats", "zero_count")]))


def test_aggregate_rows_equal_the_statistics_of_the_concatenated_tensors():
    arrays = _arrays()
    df = log_from_arrays(arrays)
    agg = aggregate(df, groups={"block0": r"^blocks\.0\.", "block1": r"^blocks\.1\.", "model": ""})
    assert set(agg[("metadata", "type")]) == {"aggregate"}
    checked = 0
    for _, row in agg.iterrows():
        g, tt, step = (
            row[("metadata", "name")],
            row[("metadata", "tensor_type")],
            row[("metadata", "step")],
        )
        prefix = {"block0": "blocks.0.", "block1": "blocks.1.", "model": ""}[g]
        members = [
            x for (n, t, s), x in arrays.items() if n.startswith(prefix) and t == tt and s == step
        ]
        ref = _reference(members)
        s = row["scalar_stats"]
        for k in ("numel", "zero_count", "nan_count", "inf_count"):
            assert s[k] == ref[k], (g, tt, step, k)
        for k in (
            "mean",
            "std",
            "mean_abs",
            "rm2",
            "rm4",
            "rm8",
            "min",
            "max",
            "min_abs",
            "max_abs",
        ):
            assert s[k] == pytest.approx(ref[k], rel=1e-9, abs=0), (g, tt, step, k)
        assert s["tensors"] == len(members)
        assert s["sparsity"] == pytest.approx(ref["zero_count"] / ref["numel"])
        # exponent counts: the concatenation's, counted in each member's own format
        counts = {}
        for x in members:
            v, layout = summarize(x)
            for lab, c in zip(
                ["-inf", *layout.format.exponents, "+inf"],
                v[layout.counts_start : layout.extras_start],
            ):
                counts[lab] = counts.get(lab, 0) + int(c)
        logged = row["exponent_counts"]
        assert {k: int(v) for k, v in logged.items() if v} == {k: v for k, v in counts.items() if v}
        checked += 1
    # 3 groups x 2 types x 2 steps; the bfloat16 head is in "model" only
    assert checked == 12
    model_w = agg[
        (agg[("metadata", "name")] == "model") & (agg[("metadata", "tensor_type")] == "Weight")
    ]
    assert set(model_w[("metadata", "dtype")]) == {"float32"}  # float32's range holds bfloat16's
    # aggregates are log rows: they validate and stack with the log
    validate(concat_logs([df, agg]))


def test_aggregate_arguments():
    df = log_from_arrays(_arrays())
    only = aggregate(df, tensor_types="Gradient")
    assert set(only[("metadata", "tensor_type")]) == {"Gradient"} and set(
        only[("metadata", "name")]
    ) == {"model"}
    with pytest.raises(ValueError, match="unknown \\['Weights'\\]"):
        aggregate(df, tensor_types=["Weights"])
    with pytest.raises(ValueError, match="bad regex"):
        aggregate(df, groups={"g": "("})
    with pytest.raises(ValueError, match="lacks the statistics \\['rm8'\\]"):
        aggregate(df.drop(columns=[("scalar_stats", "rm8")]))
    upd = log_from_arrays(
        {
            ("w", "Weight", 0): np.ones(3, np.float32),
            ("w.update", "Weight", 0): np.ones(3, np.float32),
        }
    )
    assert aggregate(upd)[("scalar_stats", "tensors")].tolist() == [
        1
    ]  # update rows are not weights
    assert aggregate(upd, exclude=None)[("scalar_stats", "tensors")].tolist() == [2]


QS = (0, 1, 12.5, 50, 99, 100)


def _pct_row(df, name, tt, step):
    m = df["metadata"]
    r = df[(m["name"] == name) & (m["tensor_type"] == tt) & (m["step"] == step)]
    return r["scalar_stats"][[f"pct{q:g}" for q in QS]].to_numpy(dtype=np.float64)[0]


def test_percentile_option_checks_its_argument():
    from tandv.track.common.custom import percentile_columns

    assert percentile_columns((1, 99.9, 50.0)) == (
        ("pct1", 1.0),
        ("pct99.9", 99.9),
        ("pct50", 50.0),
    )
    with pytest.raises(ValueError, match="101 is not a percentage"):
        percentile_columns([50, 101])
    with pytest.raises(TypeError, match="sequence of percentages"):
        percentile_columns(50)


def test_torch_percentiles_match_numpy(tmp_path):
    torch = pytest.importorskip("torch")
    from tandv import read_log
    from tandv.track.common.custom import percentile_columns
    from tandv.track.torch import track
    from tandv.track.torch._percentiles import percentile_stat

    fn = percentile_stat(percentile_columns(QS))
    rng = np.random.default_rng(1)
    for x in (
        rng.standard_normal(1001),
        rng.standard_normal(7).astype(np.float32),
        np.array([3.0]),
        np.r_[rng.standard_normal(50), np.nan, np.nan, np.inf, -np.inf],
        rng.standard_normal(64).astype(np.float16),
    ):
        got = np.array([v.item() for v in fn(torch.from_numpy(x)).values()])
        with np.errstate(invalid="ignore"):  # numpy's own inf - inf below
            expected = np.nanpercentile(x.astype(np.float64), QS)
        if np.isinf(
            x
        ).any():  # numpy's lerp makes -inf + (x - -inf) * 0 NaN; an exact position is its element
            expected[0], expected[-1] = np.nanmin(x), np.nanmax(x)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert np.isnan([v.item() for v in fn(torch.tensor([np.nan, np.nan])).values()]).all()
    assert np.isnan([v.item() for v in fn(torch.zeros(0)).values()]).all()
    # bfloat16 (sorted in its own dtype) and a tensor past torch.quantile's 2**24 limit
    b = torch.randn(300, dtype=torch.bfloat16)
    np.testing.assert_allclose(
        [v.item() for v in fn(b).values()], np.percentile(b.double().numpy(), QS), rtol=1e-12
    )
    big = torch.from_numpy(rng.standard_normal(2**24 + 3).astype(np.float32))
    np.testing.assert_allclose(
        [v.item() for v in fn(big).values()],
        np.percentile(big.numpy().astype(np.float64), QS),
        rtol=1e-12,
    )

    # through the tracker: weights (CPU host path) and activations
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU())
    x = torch.randn(9, 6)
    with track(model, out=tmp_path / "log", percentiles=QS, verbose=False) as tracker:
        out = model(x)
        out.sum().backward()
        tracker.step()
    df = read_log(tmp_path / "log")
    np.testing.assert_allclose(
        _pct_row(df, "0.weight", "Weight", 0),
        np.percentile(model[0].weight.detach().double().numpy(), QS),
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        _pct_row(df, "1", "Activation", 0),
        np.percentile(out.detach().double().numpy(), QS),
        rtol=1e-12,
    )


def test_jax_percentiles_match_numpy(tmp_path):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from tandv import read_log
    from tandv.track.jax import track

    rng = np.random.default_rng(2)
    params = {
        "a": jnp.asarray(rng.standard_normal((40, 5)), jnp.float32),
        "b": jnp.asarray(np.r_[rng.standard_normal(30), np.nan], jnp.float32),
    }
    with track(
        params,
        track_gradients=False,
        track_activations=False,
        out=tmp_path / "log",
        percentiles=QS,
        stats={"tiny": (lambda x: jnp.min(jnp.abs(x)), "min")},
        verbose=False,
    ) as tracker:
        tracker.step(params)
    df = read_log(tmp_path / "log")
    for name in ("a", "b"):
        expected = np.nanpercentile(np.asarray(params[name], np.float64), QS)
        np.testing.assert_allclose(_pct_row(df, name, "Weight", 0), expected, rtol=2e-6)
    assert ("scalar_stats", "tiny") in df.columns
