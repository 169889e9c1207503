"""GradientNoiseScale: per-step noise-scale estimates from micro-batch gradients, against the
gradients of a least-squares problem computed independently in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import tandv
from tandv import quantities as q
from tandv.track.torch import GradientNoiseScale, track

D, B, K = 5, 8, 4  # features, micro-batch size, micro-batches per step


def _problem(seed: int) -> tuple[nn.Linear, np.ndarray, np.ndarray]:
    torch.manual_seed(seed)
    model = nn.Linear(D, 1, bias=False).double()
    rng = np.random.default_rng(seed)
    return model, rng.normal(size=(K * B, D)), rng.normal(size=(K * B, 1))


def _expected(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> q.NoiseScaleEstimate:
    # d/dw of mean((x w - y)^2) over a micro-batch: (2 / B) x^T (x w - y)
    micro = [2.0 / B * xi.T @ (xi @ w - yi) for xi, yi in zip(np.split(x, K), np.split(y, K))]
    big = np.mean(micro, axis=0)
    return q.noise_scale_from_microbatches(
        [float((g**2).sum()) for g in micro], B, float((big**2).sum())
    )


def _accumulate(model: nn.Module, x: np.ndarray, y: np.ndarray, divide: bool) -> None:
    for xi, yi in zip(np.split(x, K), np.split(y, K)):
        loss = ((model(torch.from_numpy(xi)) - torch.from_numpy(yi)) ** 2).mean()
        (loss / K if divide else loss).backward()


@pytest.mark.parametrize("divide", [True, False])
def test_estimates_match_the_micro_batch_gradients_computed_in_numpy(divide):
    model, x, y = _problem(0)
    want = _expected(model.weight.detach().numpy().T.copy(), x, y)
    with GradientNoiseScale(model, B) as ns:
        _accumulate(model, x, y, divide)
        got = ns.step()
    scale = 1.0 if divide else K * K  # an undivided loss scales both estimates alike
    assert got["noise_g2"].item() == pytest.approx(want.g2 * scale, rel=1e-9)
    assert got["noise_trace"].item() == pytest.approx(want.trace * scale, rel=1e-9)
    assert got["noise_b_simple"].item() == pytest.approx(want.b_simple, rel=1e-9)


def test_steps_are_logged_beside_the_log_and_smoothed(tmp_path):
    model, _, _ = _problem(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    expected = []
    with (
        track(model, opt, out=tmp_path / "log", include="nothing") as tracker,
        GradientNoiseScale(model, B, tracker=tracker) as ns,
    ):
        for step in range(3):
            _, x, y = _problem(10 + step)
            expected.append(_expected(model.weight.detach().numpy().T.copy(), x, y))
            _accumulate(model, x, y, divide=True)
            ns.step()
            opt.step()
            opt.zero_grad()
            tracker.step()
    scalars = tandv.read_scalars(tracker.out_path)
    assert scalars["step"].tolist() == [0, 1, 2]
    np.testing.assert_allclose(scalars["noise_g2"], [e.g2 for e in expected], rtol=1e-9)
    np.testing.assert_allclose(scalars["noise_trace"], [e.trace for e in expected], rtol=1e-9)
    ema, want = q.NoiseScaleEMA(0.5), []
    for e in expected:
        want.append(ema.update(e).b_simple)
    np.testing.assert_allclose(
        q.smoothed_noise_scale(scalars, beta=0.5).to_numpy(), want, rtol=1e-9
    )


def test_history_without_a_tracker_and_errors():
    model, x, y = _problem(2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        GradientNoiseScale(model, 0)
    ns = GradientNoiseScale(model, B)
    with pytest.raises(RuntimeError, match="two or more micro-batches"):
        ns.step()
    _accumulate(model, x, y, divide=True)
    got = ns.step()
    ns.close()
    hist = ns.history()
    assert hist["step"].tolist() == [0]
    assert hist["noise_g2"].iloc[0] == got["noise_g2"].item()
    model.zero_grad()
    _accumulate(model, x, y, divide=True)  # the hook is gone: nothing is counted
    with pytest.raises(RuntimeError, match="0 backward"):
        ns.step()
    with pytest.raises(ValueError, match="smoothed_noise_scale"):
        q.smoothed_noise_scale(hist.drop(columns="noise_trace"))
