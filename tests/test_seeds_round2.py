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
