"""The seed systems (nnstat, the Chainer monitor, Taiyi) used as their users use them, round 2:
each check compares tandv with numpy computed from the seed system's own definition."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import tandv
from tandv.analysis import STEP_PHASES, computation_order, first_nonfinite

# -- 1. the first NaN, in the order of the step's computation --------------------------------


def _nan_run(tmp_path, track_updates: bool = True) -> pd.DataFrame:
    """A 3-step SGD run whose input holds a NaN at step 1 (``track_updates=True``)."""
    torch = pytest.importorskip("torch")
    from tandv.track.torch import track

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with track(
        model, opt, out=tmp_path / "log", track_updates=track_updates, verbose=False
    ) as tracker:
        for step in range(3):
            x = torch.randn(5, 4)
            if step == 1:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            tracker.step()
    return tandv.read_log(tmp_path / "log")


def test_first_nonfinite_names_the_activation_not_the_update_row(tmp_path):
    df = _nan_run(tmp_path)
    first = first_nonfinite(df)
    # the NaN came in with the input: fc1's (module "0") output is the first tensor holding it
    assert first.loc[0, ["name", "tensor_type", "step"]].tolist() == ["0", "Activation", 1]
    # every update row comes after its parameter's gradient and optimizer state
    pos = {(n, t): i for i, (n, t) in enumerate(zip(first["name"], first["tensor_type"]))}
    for p in ("0.weight", "0.bias", "2.weight", "2.bias"):
        upd = pos[(f"{p}.update", "Weight")]
        assert pos[(p, "Gradient")] < upd
        assert pos[(f"{p}.momentum_buffer", "Optimiser_State")] < upd
        assert pos[("0", "Activation")] < upd
    # the HTML report's red banner says the same
    from tandv.viz.report import _banner

    assert "First NaN/inf at step 1 in Activation 0 (6 NaN, 0 inf)" in _banner(df)


def test_computation_order_against_a_hand_ordered_log():
    # rows of two steps written out of order; the expected order written by hand
    rows = [
        ("w.update", "Weight", 1),
        ("w.exp_avg", "Optimiser_State", 1),
        ("fc2", "Gradient", 1),
        ("fc1", "Gradient", 1),
        ("fc1", "Activation", 1),
        ("fc2", "Activation", 1),
        ("w", "Weight", 1),
        ("w", "Weight", 0),
    ]
    df = pd.concat(
        [
            pd.DataFrame(rows, columns=["name", "tensor_type", "step"]),
            pd.DataFrame({"nan_count": [1] * len(rows), "inf_count": [0] * len(rows)}),
        ],
        axis=1,
        keys=["metadata", "scalar_stats"],
    )
    order = computation_order(df)
    assert order.tolist() == [7, 6, 4, 5, 2, 3, 1, 0]
    assert STEP_PHASES[-1] == "update"
    first = first_nonfinite(df)
    assert list(zip(first["name"], first["tensor_type"])) == [
        ("w", "Weight"),
        ("fc1", "Activation"),
        ("fc2", "Activation"),
        ("fc2", "Gradient"),
        ("fc1", "Gradient"),
        ("w.exp_avg", "Optimiser_State"),
        ("w.update", "Weight"),
    ]
    assert first["step"].tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert computation_order(df.iloc[:0]).tolist() == []


# -- 2. Taiyi's RankMe when a step has fewer samples than the layer is wide ------------------


def _taiyi_rankme(z: np.ndarray) -> float:
    """Taiyi's RankMe (Garrido et al.): the entropy of the normalised singular values of the
    output matrix Z (float64 numpy SVD: min(n, d) of them), offset by 1e-7."""
    s = np.linalg.svd(z.astype(np.float64), compute_uv=False)
    p = s / s.sum() + 1e-7
    return float(np.exp(-(p * np.log(p)).sum()))


@pytest.mark.parametrize("n, k, d", [(32, 48, 1024), (40, 48, 256), (300, 96, 64)])
def test_rankme_torch_and_jax_monitors_agree_with_numpy_when_n_is_below_d(n, k, d):
    """A Linear(k, d) layer's output over n samples, full rank min(n, d)."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")
    from tandv.taiyi.jax import Monitor as JaxMonitor
    from tandv.taiyi.torch import Monitor

    rng = np.random.default_rng(n + d)
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = (rng.standard_normal((d, k)) / 7).astype(np.float32)
    b = (rng.standard_normal(d) / 10).astype(np.float32)
    lin = torch.nn.Linear(k, d)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    mon = Monitor(lin, {torch.nn.Linear: ["RankMe"]})
    half = n // 2  # two forward passes in one step: their Gram matrices merge
    lin(torch.from_numpy(x[:half]))
    lin(torch.from_numpy(x[half:]))
    mon.track(0)
    got_torch = mon.to_dataframe()["value"].item()

    jmon = JaxMonitor({fnn.Dense: ["RankMe"]})
    dense = fnn.Dense(d)
    variables = {"params": {"kernel": jax.numpy.asarray(w.T), "bias": jax.numpy.asarray(b)}}
    _, q = jmon.apply(dense, variables, jax.numpy.asarray(x), due=jmon.due(0))
    jmon.track(q)
    got_jax = jmon.to_dataframe()["value"].item()

    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    want = _taiyi_rankme(z)
    assert got_torch == pytest.approx(want, rel=1e-7)
    assert got_jax == pytest.approx(want, rel=1e-5)  # float32 SVD on the JAX side
    assert got_jax == pytest.approx(got_torch, rel=1e-5)


# -- 3. nnstat's trust-ratio one-liner on a zero norm; integer buffers in a state_dict --------


def test_nnstat_trust_ratio_one_liner_gives_inf_and_nan_like_update_ratio():
    torch = pytest.importorskip("torch")
    from tandv.quantities import update_ratio
    from tandv.snapshot.torch import from_weight

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    with torch.no_grad():
        model[0].bias.zero_()  # a zero-initialised bias: ||W|| = 0, its update is not
        model[1].bias.zero_()  # frozen below: ||update|| = ||W|| = 0
    model[1].bias.requires_grad_(False)
    W0 = from_weight(model, clone=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(6, 4)).pow(3).sum().backward()
    opt.step()
    update = from_weight(model) - W0
    ratio = update.norm(2, layerwise=True) / W0.norm(2, layerwise=True)  # nnstat's one-liner
    # numpy from nnstat's definition ||W_t - W_{t-1}|| / ||W_{t-1}||, IEEE division
    with np.errstate(all="ignore"):
        want = {
            k: np.float64(np.linalg.norm(update[k].numpy().astype(np.float64)))
            / np.float64(np.linalg.norm(W0[k].numpy().astype(np.float64)))
            for k in W0
        }
    assert np.isinf(ratio["0.bias"]) and np.isnan(ratio["1.bias"])
    for k, v in want.items():
        np.testing.assert_allclose(ratio[k], v, rtol=1e-6)
    ur = update_ratio(update, W0)
    np.testing.assert_allclose(ur.to_numpy(), [ratio[k] for k in ur.index], rtol=1e-12)
    # a number divided by a zero number, or by the number 0, likewise
    assert np.isinf((W0.norm(2, layerwise=True) / 0)["0.weight"])


def test_snapshot_of_a_state_dict_with_an_integer_buffer_prints_and_reduces():
    torch = pytest.importorskip("torch")
    from tandv.snapshot import Snapshot

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    for _ in range(3):
        model(torch.randn(5, 3))  # num_batches_tracked = 3 (int64)
    sd = model.state_dict()
    snap = Snapshot(sd, "sd")
    text = str(snap)
    assert "num_batches_tracked" in text and "int64" in text
    flat = np.concatenate([v.numpy().astype(np.float64).ravel() for v in sd.values()])
    assert snap.norm() == pytest.approx(np.linalg.norm(flat), rel=1e-6)
    assert snap.norm(1) == pytest.approx(np.abs(flat).sum(), rel=1e-6)
    per = snap.norm(2, layerwise=True)
    assert per["1.num_batches_tracked"] == 3.0
    d = snap.describe(layerwise=True)
    assert d.loc["1.num_batches_tracked", "mean"] == 3.0
    assert d.loc["1.num_batches_tracked", "dtype"] == "int64"
    jnp = pytest.importorskip("jax.numpy")
    js = Snapshot({"step": jnp.arange(3), "w": jnp.ones(2)})
    assert js.norm() == pytest.approx(np.sqrt(0 + 1 + 4 + 2), rel=1e-7)
    assert "w" in str(js)


# -- 4. the Chainer monitor's whole-model percentiles ---------------------------------------

#: The Chainer monitor's percentiles (the sigma points of a normal distribution).
CHAINER_PCTS = (0.13, 2.28, 15.87, 50, 84.13, 97.72, 99.87)


def _chainer_weight_percentiles(model) -> np.ndarray:
    """The Chainer monitor's ``weight_statistics`` percentiles: ``np.percentile`` of every
    layer's ``W`` (not the biases) flattened and concatenated."""
    ws = [p.detach().double().numpy().ravel() for n, p in model.named_parameters() if "weight" in n]
    return np.percentile(np.concatenate(ws), CHAINER_PCTS)


def test_whole_model_percentiles_exact_from_a_snapshot_and_bracketed_by_aggregate(tmp_path):
    torch = pytest.importorskip("torch")
    from tandv.analysis import aggregate
    from tandv.snapshot.torch import from_weight
    from tandv.track.torch import track

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.Linear(16, 3)
    )
    with torch.no_grad():
        model[2].weight.mul_(4.0)  # layers of different scales: percentiles do not average
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want, exact = {}, {}
    with track(
        model, opt, out=tmp_path / "log", percentiles=CHAINER_PCTS, every=1, verbose=False
    ) as tracker:
        for step in range(3):
            want[step] = _chainer_weight_percentiles(model)  # the weights the step reads
            exact[step] = (
                from_weight(model)
                .filter(r"\.weight$")
                .describe(percentiles=CHAINER_PCTS, include=["numel"])
            )
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            tracker.step()
    df = tandv.read_log(tmp_path / "log")
    agg = aggregate(
        df, groups={"weights": r"\.weight$", "fc1": r"^0\.weight$"}, tensor_types="Weight"
    )
    cols = [f"pct{q:g}" for q in CHAINER_PCTS]
    for step in range(3):
        # exact: the snapshot's whole-model row is numpy's percentile of the concatenation
        np.testing.assert_allclose(exact[step][cols].to_numpy()[0], want[step], rtol=1e-12)
        row = agg[(agg[("metadata", "name")] == "weights") & (agg[("metadata", "step")] == step)]
        s = row["scalar_stats"].iloc[0]
        lo = s[[c + "_lo" for c in cols]].to_numpy(np.float64)
        hi = s[[c + "_hi" for c in cols]].to_numpy(np.float64)
        est = s[cols].to_numpy(np.float64)
        tol = 1e-6 * np.abs(want[step]).max()  # the log's percentiles are float32's
        assert (lo - tol <= want[step]).all() and (want[step] <= hi + tol).all()
        assert (lo <= est).all() and (est <= hi).all()
        # a group of one tensor: its own percentiles, exact
        one = agg[(agg[("metadata", "name")] == "fc1") & (agg[("metadata", "step")] == step)]
        m = df["metadata"]
        mine = df[(m["name"] == "0.weight") & (m["tensor_type"] == "Weight") & (m["step"] == step)]
        np.testing.assert_array_equal(
            one["scalar_stats"][cols].to_numpy(), mine["scalar_stats"][cols].to_numpy()
        )


def test_merge_percentiles_bounds_hold_on_random_groups():
    from tandv.analysis import merge_percentiles

    rng = np.random.default_rng(1)
    qs = (0, *CHAINER_PCTS, 100)
    for trial in range(200):
        xs = [
            rng.standard_normal(int(rng.integers(1, 200))) * rng.uniform(0.1, 10)
            + rng.uniform(-3, 3)
            for _ in range(int(rng.integers(2, 6)))
        ]
        if trial % 3 == 0:
            xs = [np.round(x) for x in xs]  # ties
        est, lo, hi = merge_percentiles(
            np.array([np.percentile(x, qs) for x in xs]),
            qs,
            np.array([x.size for x in xs]),
            np.array([x.min() for x in xs]),
            np.array([x.max() for x in xs]),
        )
        true = np.percentile(np.concatenate(xs), qs)
        assert (lo <= true).all() and (true <= hi).all(), trial
        assert (lo <= est).all() and (est <= hi).all()
        assert est[0] == true[0] and est[-1] == true[-1]  # the extrema are exact
    nan = merge_percentiles(np.array([[1.0, np.inf]]), (50, 100), np.array([3]), [0.0], [1.0])
    assert np.isnan(nan[0]).all()


# -- 5. definitions that differ from the seeds: a keyword gives the seed's ------------------


def test_describe_std_population_by_default_and_nnstat_unbiased_with_ddof_1():
    torch = pytest.importorskip("torch")
    from tandv.snapshot.torch import from_weight

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 1))
    W = from_weight(model)
    ours = W.describe(layerwise=True, include=["std", "var"])
    nnstat = W.describe(layerwise=True, include=["std", "var"], ddof=1)
    for name, p in model.named_parameters():
        x = p.detach().double()
        if x.numel() < 2:
            continue  # checked below
        # nnstat's layerwise std and variance: torch.std / torch.var (unbiased)
        assert nnstat.loc[name, "std"] == pytest.approx(x.std().item(), rel=1e-12)
        assert nnstat.loc[name, "var"] == pytest.approx(x.var().item(), rel=1e-12)
        assert ours.loc[name, "std"] == pytest.approx(np.std(x.numpy()), rel=1e-12)
        assert ours.loc[name, "var"] == pytest.approx(np.var(x.numpy()), rel=1e-12)
    assert np.isnan(nnstat.loc["1.bias", "std"])  # one element: no unbiased std
    flat = np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])
    whole = W.describe(include=["std", "var"], ddof=1).iloc[0]
    assert whole["std"] == pytest.approx(np.std(flat, ddof=1), rel=1e-12)
    assert whole["var"] == pytest.approx(np.var(flat, ddof=1), rel=1e-12)
    with pytest.raises(ValueError, match="ddof"):
        W.describe(ddof=-1)


def test_var_tid_biased_by_default_and_taiyi_unbiased_with_ddof_1():
    torch = pytest.importorskip("torch")
    from tandv.taiyi.torch import Monitor

    torch.manual_seed(6)
    bn = torch.nn.BatchNorm2d(3, momentum=0.3)
    mons = {d: Monitor(bn, {torch.nn.BatchNorm2d: ["VarTID"]}, ddof=d) for d in (0, 1)}
    for step in range(3):
        x = torch.randn(4, 3, 2, 2) * (1 + step) + step
        bn(x)
        xs = x.double().numpy()
        sr = np.sqrt(bn.running_var.double().numpy())
        for d, mon in mons.items():
            mon.track(step)
            # Taiyi: sigma_B = sqrt(var) per channel (unbiased for Taiyi's torch.var, ddof=1)
            sigma = xs.transpose(1, 0, 2, 3).reshape(3, -1).std(axis=1, ddof=d)
            want = np.linalg.norm(sigma - sr) / np.linalg.norm(sr)
            got = mon.to_dataframe().query("step == @step")["value"].item()
            assert got == pytest.approx(want, rel=1e-9), (d, step)
    with pytest.raises(ValueError, match="ddof"):
        Monitor(bn, {torch.nn.BatchNorm2d: ["VarTID"]}, ddof=-1)


# -- 6. nnstat's conveniences ---------------------------------------------------------------


def test_nnstat_from_state_dict_from_together_and_describe_dict():
    torch = pytest.importorskip("torch")
    from tandv.snapshot.torch import from_state_dict, from_together

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2)
    )
    model[2].bias.requires_grad_(False)  # no gradient: left out of from_together
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    model(torch.randn(7, 3)).sum().backward()
    opt.step()
    sd = from_state_dict(model.state_dict())
    assert list(sd) == list(model.state_dict())
    assert sd.norm() == pytest.approx(
        np.linalg.norm(
            np.concatenate([v.double().numpy().ravel() for v in model.state_dict().values()])
        ),
        rel=1e-6,  # torch's float32 norm
    )
    weight, grad, (m, v) = from_together(model, opt, ["exp_avg", "exp_avg_sq"])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert list(weight) == list(grad) == list(m) == list(v) == names
    lr, eps = 0.01, 1e-8
    # nnstat's recomputed Adam update (without bias correction), per name
    update = -lr * m / (v.sqrt() + eps)
    for n, p in model.named_parameters():
        if p.requires_grad:
            st = opt.state[p]
            want = -lr * st["exp_avg"].numpy() / (np.sqrt(st["exp_avg_sq"].numpy()) + eps)
            np.testing.assert_allclose(update[n].numpy(), want, rtol=1e-6)
            np.testing.assert_array_equal(grad[n].numpy(), p.grad.numpy())
    with pytest.raises(KeyError, match="momentum_buffer"):
        from_together(model, opt, ["momentum_buffer"])
    # describe(display=False): nnstat's dict of columns
    d = weight.describe(layerwise=True, include=["numel", "norm1", "sum"], display=False)
    assert d["name"] == names
    flat = {n: p.detach().double().numpy().ravel() for n, p in model.named_parameters()}
    assert d["numel"] == [flat[n].size for n in names]
    np.testing.assert_allclose(d["norm1"], [np.abs(flat[n]).sum() for n in names], rtol=1e-12)
    np.testing.assert_allclose(d["sum"], [flat[n].sum() for n in names], rtol=1e-12)


def test_describe_skew_and_kurtosis_match_scipy_layerwise_and_whole():
    stats = pytest.importorskip("scipy.stats")
    from tandv.snapshot import Snapshot

    rng = np.random.default_rng(3)
    values = {
        "heavy": (rng.standard_t(3, 4000) + 1000.0).astype(np.float32),  # mean dominates
        "skewed": rng.exponential(2.0, 3000).astype(np.float32),
        "small": np.array([1.0, 2.0, 4.0], np.float32),
        "flat": np.full(5, 3.0, np.float32),
    }
    snap = Snapshot(values, "v")
    cols = ["norm1", "sum", "var", "skew", "kurtosis"]
    lw = snap.describe(layerwise=True, include=cols)
    for k, x in values.items():
        x64 = x.astype(np.float64)
        want = [np.abs(x64).sum(), x64.sum(), x64.var()]
        if k == "flat":
            assert np.isnan(lw.loc[k, "skew"]) and np.isnan(lw.loc[k, "kurtosis"])
        else:
            want += [stats.skew(x64), stats.kurtosis(x64)]
        np.testing.assert_allclose(lw.loc[k, cols[: len(want)]].to_numpy(float), want, rtol=1e-9)
    # the whole row merges the per-tensor moments (Pébay): the concatenation's, exactly
    flat = np.concatenate([x.astype(np.float64) for x in values.values()])
    whole = snap.describe(include=cols).iloc[0]
    want = [np.abs(flat).sum(), flat.sum(), flat.var(), stats.skew(flat), stats.kurtosis(flat)]
    np.testing.assert_allclose(whole[cols].to_numpy(float), want, rtol=1e-9)


# -- 6. Taiyi's user-defined quantities -----------------------------------------------------


def test_taiyi_user_defined_quantities_from_input_output_gradient_and_weight(tmp_path):
    torch = pytest.importorskip("torch")
    from tandv.taiyi import UserQuantity, read_taiyi
    from tandv.taiyi.torch import Monitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    mine = [
        UserQuantity("InputAbsMax", "input", lambda x, m: x.abs().max()),
        UserQuantity("OutputZeroFrac", "output", lambda y, m: (y == 0).double().mean()),
        UserQuantity("OutputGradMax", "output_grad", lambda g, m: g.abs().max()),
        UserQuantity("WeightRows", "weight", lambda w, m: w.shape[0]),  # a Python number
    ]
    config = {
        torch.nn.Linear: ["InputAbsMax", ["OutputGradMax", "linear(2, 0)"], "WeightNorm"],
        torch.nn.ReLU: ["OutputZeroFrac"],
        "2": ["WeightRows"],
    }
    want: dict = {}
    acts: dict = {}
    hooks = [
        mod.register_forward_hook(lambda m, a, y, k=k: acts.setdefault(k, []).append((a[0], y)))
        for k, mod in (("0", model[0]), ("1", model[1]), ("2", model[2]))
    ]
    grads: dict = {}
    with Monitor(model, config, out=tmp_path / "log", quantities=mine) as mon:
        for step in range(3):
            acts.clear()
            grads.clear()
            for _ in range(2):  # two passes per step: per-pass values are averaged
                out = model(torch.randn(5, 4))
                for k in ("0", "2"):
                    y = acts[k][-1][1]
                    y.register_hook(lambda g, k=k: grads.setdefault(k, []).append(g.clone()))
                out.pow(2).sum().backward()
            mon.track()
            for k in ("0", "2"):
                want[(step, k, "InputAbsMax")] = np.mean(
                    [x.detach().abs().max().item() for x, _ in acts[k]]
                )
                if step % 2 == 0:
                    want[(step, k, "OutputGradMax")] = np.mean(
                        [g.abs().max().item() for g in grads[k]]
                    )
            want[(step, "1", "OutputZeroFrac")] = np.mean(
                [(y == 0).double().mean().item() for _, y in acts["1"]]
            )
            want[(step, "2", "WeightRows")] = 2.0
    for h in hooks:
        h.remove()
    df = read_taiyi(tmp_path / "log")  # read back from the table written beside the log
    got = {
        (int(s), m, q): v
        for s, m, q, v in zip(df["step"], df["module"], df["quantity"], df["value"])
        if q != "WeightNorm"
    }
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
    with pytest.raises(ValueError, match="built-in"):
        UserQuantity("RankMe", "output", lambda y, m: y.sum())
    with pytest.raises(ValueError, match="needs"):
        UserQuantity("X", "gradient", lambda y, m: y.sum())
    with pytest.raises(ValueError, match="Did you mean 'InputAbsMax'"):
        Monitor(model, {torch.nn.Linear: ["InputAbsMx"]}, quantities=mine)
    bad = Monitor(model, {"0": ["Vec"]}, quantities=[UserQuantity("Vec", "output", lambda y, m: y)])
    with pytest.raises(ValueError, match="one number"):
        model(torch.randn(2, 4))
    bad.close()


# -- 6. the Hessian-weighted noise scale nnstat's README defines ----------------------------


def test_hessian_weighted_noise_scale_is_unbiased_for_nnstat_definition():
    """nnstat: B_noise = tr(H Sigma) / (G^T H G). On a finite population of per-example
    gradients (sampled with replacement) the two-batch estimates of G^T H G and tr(H Sigma),
    from H-weighted squared norms, average to the exact values."""
    from tandv import quantities as q
    from tandv.snapshot import Snapshot

    rng = np.random.default_rng(0)
    n, d = 400, 6
    scale = rng.uniform(0.2, 3, d)
    per_example = rng.normal(size=(n, d)) * scale + rng.normal(size=d) * 0.5
    h = 1.0 / scale**2  # a diagonal Hessian, far from the identity
    G = per_example.mean(0)
    sigma = np.cov(per_example, rowvar=False, ddof=0)
    exact_g2, exact_trace = G @ np.diag(h) @ G, np.trace(np.diag(h) @ sigma)
    b, k, steps = 4, 4, 3000
    H = Snapshot({"w": h})
    g2s, traces = [], []
    for _ in range(steps):
        micro = [per_example[rng.integers(0, n, b)].mean(0) for _ in range(k)]
        big = np.mean(micro, axis=0)
        small = np.mean([q.hessian_sq_norm(Snapshot({"w": m}), H) for m in micro])
        est = q.noise_scale(small, b, q.hessian_sq_norm(Snapshot({"w": big}), H), b * k)
        g2s.append(est.g2)
        traces.append(est.trace)
    # standard errors of the means, from the samples themselves
    for got, want in ((g2s, exact_g2), (traces, exact_trace)):
        se = np.std(got) / np.sqrt(steps)
        assert abs(np.mean(got) - want) < 4 * se, (np.mean(got), want, se)
    b_noise = q.NoiseScaleEstimate(float(np.mean(g2s)), float(np.mean(traces))).b_simple
    assert b_noise == pytest.approx(exact_trace / exact_g2, rel=0.1)
    # B_simple (H = I) is another number here: the weighting matters
    assert abs(np.trace(sigma) / (G @ G) - exact_trace / exact_g2) > 0.2 * exact_trace / exact_g2


def test_gradient_noise_scale_hessian_option_matches_numpy_micro_batches():
    torch = pytest.importorskip("torch")
    from tandv import quantities as q
    from tandv.track.torch import GradientNoiseScale

    D, B, K = 5, 8, 4
    torch.manual_seed(0)
    model = torch.nn.Linear(D, 1, bias=False).double()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(K * B, D)), rng.normal(size=(K * B, 1))
    hdiag = np.diag(2.0 * x.T @ x / len(x))  # the least-squares Hessian's diagonal
    h = torch.from_numpy(hdiag.reshape(1, D).copy())
    w = model.weight.detach().numpy().T.copy()
    micro = [2.0 / B * xi.T @ (xi @ w - yi) for xi, yi in zip(np.split(x, K), np.split(y, K))]
    big = np.mean(micro, axis=0)
    hw = hdiag.reshape(D, 1)
    want = q.noise_scale_from_microbatches(
        [float((hw * g * g).sum()) for g in micro], B, float((hw * big * big).sum())
    )
    with GradientNoiseScale(model, B, hessian=lambda: [h]) as ns:
        for xi, yi in zip(np.split(x, K), np.split(y, K)):
            loss = ((model(torch.from_numpy(xi)) - torch.from_numpy(yi)) ** 2).mean() / K
            loss.backward()
        got = ns.step()
        hist = ns.history()
    assert got["noise_g2_h"].item() == pytest.approx(want.g2, rel=1e-9)
    assert got["noise_trace_h"].item() == pytest.approx(want.trace, rel=1e-9)
    assert got["noise_b_noise"].item() == pytest.approx(want.b_simple, rel=1e-9)
    assert hist["noise_trace_h"].tolist() == pytest.approx([want.trace], rel=1e-9)
    with GradientNoiseScale(model, B, hessian=lambda: [h[:, :2]]) as bad:
        with pytest.raises(ValueError, match="shaped like the trainable parameters"):
            model(torch.from_numpy(x[:B])).sum().backward()
        bad.close()


def test_describe_display_true_prints_the_table(capsys):
    from tandv.snapshot import Snapshot

    snap = Snapshot({"a": np.array([1.0, -2.0, 3.0]), "b": np.zeros(2)}, "w")
    df = snap.describe(layerwise=True, include=["numel", "sum"], display=True)
    out = capsys.readouterr().out
    assert "Stats w" in out and out.count("\n") >= 3
    assert df.loc["a", "sum"] == 2.0 and df.loc["b", "numel"] == 2
    with pytest.raises(ValueError, match="unknown columns"):
        snap.describe(include=["kurt"])
    with pytest.raises(ValueError, match="percentage"):
        snap.describe(percentiles=(101,))


def test_merge_percentiles_estimate_is_close_for_normal_layers():
    """24 normal layers of different widths and scales (as a model's weights): the estimate
    is within 2% of a standard deviation of numpy's percentile of the concatenation at the
    inner sigma points (measured: 0.2%), the bounds hold it."""
    from tandv.analysis import merge_percentiles

    rng = np.random.default_rng(0)
    xs = [
        rng.standard_normal(int(rng.integers(5000, 50000))) * s for s in rng.uniform(0.02, 0.06, 24)
    ]
    est, lo, hi = merge_percentiles(
        np.array([np.percentile(x, CHAINER_PCTS) for x in xs]),
        CHAINER_PCTS,
        np.array([x.size for x in xs]),
        np.array([x.min() for x in xs]),
        np.array([x.max() for x in xs]),
    )
    flat = np.concatenate(xs)
    true = np.percentile(flat, CHAINER_PCTS)
    assert (lo <= true).all() and (true <= hi).all()
    inner = slice(1, -1)
    assert np.abs(est[inner] - true[inner]).max() < 0.02 * flat.std()


def test_taiyi_user_defined_quantities_in_the_jax_monitor():
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")
    from tandv.taiyi import UserQuantity
    from tandv.taiyi.jax import Monitor as JaxMonitor

    jnp = jax.numpy
    mine = [
        UserQuantity("OutAbsMax", "output", lambda y, m: jnp.abs(y).max()),
        UserQuantity("InMean", "input", lambda x, m: x.mean()),
        UserQuantity("KernelMax", "weight", lambda k, m: k.max()),
    ]
    dense = fnn.Dense(3)
    x = jax.random.normal(jax.random.key(0), (6, 4))
    variables = dense.init(jax.random.key(1), x)
    mon = JaxMonitor(
        {fnn.Dense: ["OutAbsMax", "InMean", "KernelMax", "WeightNorm"]}, quantities=mine
    )
    apply = jax.jit(lambda v, x, due: mon.apply(dense, v, x, due=due), static_argnums=2)
    _, q = apply(variables, x, mon.due(0))
    mon.track(q)
    got = dict(zip(mon.to_dataframe()["quantity"], mon.to_dataframe()["value"]))
    k = np.asarray(variables["params"]["kernel"], np.float64)
    xs = np.asarray(x, np.float64)
    y = xs @ k + np.asarray(variables["params"]["bias"], np.float64)
    assert got["OutAbsMax"] == pytest.approx(np.abs(y).max(), rel=1e-5)
    assert got["InMean"] == pytest.approx(xs.mean(), rel=1e-5, abs=1e-7)
    assert got["KernelMax"] == pytest.approx(k.max(), rel=1e-6)
    assert got["WeightNorm"] == pytest.approx(np.linalg.norm(k), rel=1e-5)
    with pytest.raises(ValueError, match="forward pass only"):
        JaxMonitor({}, quantities=[UserQuantity("G", "output_grad", lambda g, m: g.sum())])
