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
    # the HTML report's banner says the same
    from tandv.viz.report import render_report

    html = render_report(df, "nan run")
    assert "First NaN/inf at step 1 in Activation 0 (6 NaN, 0 inf)" in html


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
