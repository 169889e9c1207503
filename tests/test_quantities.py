"""Trust ratio, update/weight ratio and gradient noise scale (tandv.quantities) against their
definitions computed by hand, and the noise-scale estimators on a synthetic problem with a
known answer."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from tandv.quantities import (
    NoiseScaleEMA,
    NoiseScaleEstimate,
    log_norms,
    log_trust_ratio,
    log_update_ratio,
    noise_scale,
    noise_scale_fit,
    noise_scale_from_microbatches,
    trust_ratio,
    update_ratio,
)
from tandv.schema import validate
from tandv.snapshot import Snapshot
from tandv.stats import summarize
from tandv.track.common import TensorKey
from tandv.track.common.rows import build_rows


# -- trust ratio and update ratio from snapshots ------------------------------------------------
def test_trust_ratio_by_hand():
    w = Snapshot({"a": np.array([3.0, 4.0]), "b": np.array([[1.0, 2.0], [2.0, 4.0]])})
    g = Snapshot({"a": np.array([0.0, 2.0]), "b": np.zeros((2, 2))})
    tr = trust_ratio(w, g)
    assert tr["a"] == 2.5  # ||(3,4)|| / ||(0,2)|| = 5 / 2
    assert tr["b"] == math.inf  # zero gradient
    assert trust_ratio(w, g, weight_decay=0.1)["a"] == pytest.approx(5 / (2 + 0.5))
    assert trust_ratio(w, g, weight_decay=0.1)["b"] == pytest.approx(1 / 0.1)
    assert list(trust_ratio(w, g, pattern="^a$").index) == ["a"]
    with pytest.raises(ValueError, match="different names"):
        trust_ratio(w, Snapshot({"a": np.ones(2)}))
    with pytest.raises(TypeError, match="Snapshot"):
        trust_ratio({"a": np.ones(2)}, g)


def test_update_ratio_and_trust_ratio_on_torch_snapshots():
    torch = pytest.importorskip("torch")
    from tandv.snapshot.torch import from_grad, from_weight

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    w0 = from_weight(model, clone=True)
    model(torch.randn(8, 6)).sum().backward()
    g = from_grad(model)
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    ur = update_ratio(from_weight(model) - w0, w0)
    tr = trust_ratio(w0, g)
    for k, p in model.named_parameters():
        wn = float(torch.linalg.vector_norm(w0[k]))
        # an SGD step: the update is -lr * grad, so the two ratios are tied: ur = lr / tr
        assert ur[k] == pytest.approx(
            float(torch.linalg.vector_norm(p.detach() - w0[k])) / wn, rel=1e-5
        )
        assert tr[k] == pytest.approx(wn / float(torch.linalg.vector_norm(p.grad)), rel=1e-6)
        assert ur[k] == pytest.approx(0.05 / tr[k], rel=1e-4)


# -- from a log -------------------------------------------------------------------------------
def _sgd_log(every: int = 1):
    """A log of 5 SGD steps of two parameters (weights, their gradients, one activation
    gradient and the update of ``w`` as ``w.update``), and the arrays behind it."""
    rng = np.random.default_rng(3)
    w = {"w": rng.standard_normal((4, 3)), "v": rng.standard_normal(5)}
    arrays, entries_by_step = [], {}
    for step in range(5):
        g = {k: rng.standard_normal(x.shape) for k, x in w.items()}
        new = {k: w[k] - 0.1 * g[k] for k in w}
        arrays.append((w, g, new))
        if step % every == 0:
            items = [(k, "Weight", x) for k, x in w.items()] + [
                (k, "Gradient", x) for k, x in g.items()
            ]
            items += [
                ("0", "Gradient", rng.standard_normal(3)),
                ("w.update", "Weight", new["w"] - w["w"]),
            ]
            entries = []
            for name, tt, x in items:
                v, layout = summarize(x.astype(np.float32))
                entries.append((TensorKey(name, tt, "Linear", "float32"), layout, v))
            entries_by_step[step] = build_rows(step, entries)
        w = new
    return validate(pd.concat(entries_by_step.values(), ignore_index=True)), arrays


def test_log_norms_and_trust_ratio_match_the_tensors():
    df, arrays = _sgd_log()
    norms = log_norms(df, "Weight")
    assert list(norms.columns) == ["w", "v", "w.update"] and list(norms.index) == [0, 1, 2, 3, 4]
    tr = log_trust_ratio(df, weight_decay=0.01)
    assert list(tr.columns) == ["w", "v"]  # the activation gradient "0" matches no weight
    for step, (w, g, _) in enumerate(arrays):
        for k in w:
            wn = np.linalg.norm(w[k].astype(np.float32).astype(np.float64))
            gn = np.linalg.norm(g[k].astype(np.float32).astype(np.float64))
            assert norms.loc[step, k] == pytest.approx(wn, rel=1e-12)
            assert tr.loc[step, k] == pytest.approx(wn / (gn + 0.01 * wn), rel=1e-12)


def test_log_norms_of_nonfinite_tensors():
    x = np.array([1.0, np.nan, 2.0], dtype=np.float32)
    y = np.array([1.0, np.inf, 2.0], dtype=np.float32)
    rows = [
        (TensorKey(n, "Weight", "", "float32"), *summarize(a)[::-1])
        for n, a in (("x", x), ("y", y))
    ]
    df = validate(build_rows(0, [(k, layout, v) for k, layout, v in rows]))
    n = log_norms(df)
    assert math.isnan(n.loc[0, "x"]) and n.loc[0, "y"] == math.inf
    with pytest.raises(ValueError, match="no 'Gradient' rows"):
        log_norms(df, "Gradient")


@pytest.mark.parametrize("every", [1, 2])
def test_log_update_ratio_bounds_and_exact(every):
    df, arrays = _sgd_log(every)
    out = log_update_ratio(df)
    assert set(out["name"]) == {"w", "v"}
    f64 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731 - the logged values
    for _, r in out.iterrows():
        k, step, nxt = r["name"], r["step"], r["next_step"]
        w = f64(arrays[step][0][k])
        wn = np.linalg.norm(w)
        assert r["weight_norm"] == pytest.approx(wn, rel=1e-12)
        if nxt == -1:  # the last logged step has no next weight
            assert math.isnan(r["lower"]) and math.isnan(r["upper"])
        else:
            assert nxt == step + every
            wnext = f64(arrays[nxt][0][k])
            true = np.linalg.norm(wnext - w) / wn  # the update over the logged interval
            assert r["lower"] == pytest.approx(abs(np.linalg.norm(wnext) - wn) / wn, rel=1e-9)
            assert r["lower"] <= true <= r["upper"]
        if k == "w":  # the log holds w's update: exact
            u = np.linalg.norm(f64(arrays[step][2][k] - arrays[step][0][k]))
            assert r["exact"] == pytest.approx(u / wn, rel=1e-12)
        else:
            assert math.isnan(r["exact"])


# -- gradient noise scale ---------------------------------------------------------------------
def test_noise_scale_two_batches_exact_expectations():
    # |G|^2 = 4, tr(Sigma) = 64: E|G_8|^2 = 4 + 64/8 = 12, E|G_32|^2 = 4 + 64/32 = 6
    est = noise_scale(12.0, 8, 6.0, 32)
    assert (est.g2, est.trace, est.b_simple) == pytest.approx((4.0, 64.0, 16.0))
    assert noise_scale(6.0, 32, 12.0, 8) == pytest.approx(est)  # order does not matter
    micro = noise_scale_from_microbatches([11.0, 13.0, 12.0, 12.0], 8, 6.0)  # 4 x 8 = 32
    assert (micro.g2, micro.trace) == pytest.approx((4.0, 64.0))
    fit = noise_scale_fit([1, 2, 4, 8, 16], [4 + 64 / b for b in (1, 2, 4, 8, 16)])
    assert (fit.g2, fit.trace) == pytest.approx((4.0, 64.0))
    two = noise_scale_fit([8, 32], [12.5, 5.0])
    assert (two.g2, two.trace) == pytest.approx(
        (noise_scale(12.5, 8, 5.0, 32).g2, noise_scale(12.5, 8, 5.0, 32).trace)
    )
    assert math.isnan(NoiseScaleEstimate(0.0, 1.0).b_simple)


def test_noise_scale_errors():
    with pytest.raises(ValueError, match="must differ"):
        noise_scale(1.0, 8, 1.0, 8)
    with pytest.raises(ValueError, match="positive"):
        noise_scale(1.0, 0, 1.0, 8)
    with pytest.raises(ValueError, match="at least two micro-batches"):
        noise_scale_from_microbatches([1.0], 8, 1.0)
    with pytest.raises(ValueError, match="two or more distinct"):
        noise_scale_fit([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError, match="2 batch sizes but 3"):
        noise_scale_fit([4, 8], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="beta"):
        NoiseScaleEMA(beta=1.0)


# The synthetic problem: per-example gradients g = G + e, e ~ N(0, Sigma) with Sigma diagonal.
# Then tr(Sigma) and |G|^2 are known, and B_simple = tr(Sigma) / |G|^2 = 32 here.
D = 64
RNG = np.random.default_rng(12345)
G_TRUE = RNG.standard_normal(D)
G_TRUE /= np.linalg.norm(G_TRUE)  # |G|^2 = 1
VARS = RNG.uniform(0.0, 1.0, D)
VARS *= 32.0 / VARS.sum()  # tr(Sigma) = 32


def _batch_means(rng, steps: int, groups: int, size: int) -> np.ndarray:
    """Mean per-example gradients: shape (steps, groups, D), each over ``size`` examples.
    The mean of ``size`` independent N(0, Sigma) draws is exactly N(0, Sigma / size), so it is
    drawn as that."""
    return G_TRUE + rng.standard_normal((steps, groups, D)) * np.sqrt(VARS / size)


def _within(mean: float, se: float, truth: float, what: str) -> None:
    # The estimators are unbiased, so over N independent steps their mean is within 5 standard
    # errors of the truth except with probability ~6e-7 (CLT). The tolerance must also be
    # sharp: 5 SE below 10% of the truth, so a biased estimator (|G_big|^2 alone is off by
    # tr(Sigma)/B_big = 100% of |G|^2 here) cannot pass.
    assert 5 * se < 0.1 * abs(truth), f"{what}: the test is too loose (SE {se})"
    assert abs(mean - truth) < 5 * se, f"{what}: {mean} vs {truth} (SE {se})"


def test_noise_scale_from_microbatches_recovers_known_answer():
    steps, n_micro, b = 1500, 8, 4
    micro = _batch_means(np.random.default_rng(7), steps, n_micro, b)
    ests = [
        noise_scale_from_microbatches((m**2).sum(axis=1), b, float((m.mean(axis=0) ** 2).sum()))
        for m in micro
    ]
    g2 = np.array([e.g2 for e in ests])
    tr = np.array([e.trace for e in ests])
    _within(g2.mean(), g2.std(ddof=1) / math.sqrt(steps), 1.0, "|G|^2")
    _within(tr.mean(), tr.std(ddof=1) / math.sqrt(steps), 32.0, "tr(Sigma)")
    # B_simple as the ratio of the means; its SE by the delta method
    rg, rt = g2.mean(), tr.mean()
    cov = np.cov(np.stack([tr, g2])) / steps
    grad = np.array([1 / rg, -rt / rg**2])
    _within(rt / rg, math.sqrt(grad @ cov @ grad), 32.0, "B_simple")


def test_noise_scale_ema_matches_hand_recursion():
    rng = np.random.default_rng(0)
    ests = [NoiseScaleEstimate(float(a), float(c)) for a, c in rng.normal(1.0, 0.5, (30, 2))]
    ema = NoiseScaleEMA(beta=0.9)
    assert math.isnan(ema.value.b_simple)
    first = ema.update(ests[0])
    assert (first.g2, first.trace) == pytest.approx((ests[0].g2, ests[0].trace))  # bias-corrected
    mg, mt = 0.1 * ests[0].g2, 0.1 * ests[0].trace
    for t, e in enumerate(ests[1:], start=2):
        mg, mt = 0.9 * mg + 0.1 * e.g2, 0.9 * mt + 0.1 * e.trace
        out = ema.update(e)
        assert out.g2 == pytest.approx(mg / (1 - 0.9**t)) and out.trace == pytest.approx(
            mt / (1 - 0.9**t)
        )
        assert out.b_simple == pytest.approx(mt / mg)


def test_noise_scale_fit_recovers_known_answer():
    sizes = np.array([4, 8, 16, 32, 64, 128])
    n = 4000
    rng = np.random.default_rng(11)
    sq = np.stack(
        [(_batch_means(rng, n, 1, int(b))[:, 0] ** 2).sum(axis=1) for b in sizes]
    )  # (5, n)
    fit = noise_scale_fit(np.repeat(sizes, n), sq.ravel())
    # least squares is linear in the data: coef = P y with P the design's pseudo-inverse;
    # with independent points its covariance is P diag(var_y) P^T, var_y estimated per size
    design = np.column_stack([np.ones(sizes.size * n), 1.0 / np.repeat(sizes, n)])
    p = np.linalg.pinv(design)
    cov = (p * np.repeat(sq.var(axis=1, ddof=1), n)) @ p.T
    _within(fit.g2, math.sqrt(cov[0, 0]), 1.0, "|G|^2 (fit)")
    _within(fit.trace, math.sqrt(cov[1, 1]), 32.0, "tr(Sigma) (fit)")
