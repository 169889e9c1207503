"""Snapshots (tandv.snapshot): arithmetic, norms and describe against torch / numpy on the same
tensors, and the torch and JAX adapters' names and values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandv.snapshot import DESCRIBE_COLUMNS, Snapshot, sqrt
from tandv.stats import DEFAULT_STATS

torch = pytest.importorskip("torch")
from tandv.snapshot import torch as st  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _adam_step(model, lr=1e-2):
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-8)
    w0 = st.from_weight(model, clone=True)
    shared = st.from_weight(model)
    model(torch.randn(7, 5)).pow(2).sum().backward()
    g = st.from_grad(model, clone=True)
    opt.step()
    return opt, w0, shared, g


def _numpy_stats(x: np.ndarray) -> dict:
    """The log's statistics computed directly (not through tandv.stats)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    f = x[np.isfinite(x)]
    a = np.abs(f)
    return {
        "mean": f.mean(),
        "std": f.std(),
        "mean_abs": a.mean(),
        "min_abs": a.min(),
        "max_abs": a.max(),
        "rm2": np.sqrt(np.mean(a**2)),
        "rm4": np.mean(a**4) ** 0.25,
        "rm8": np.mean(a**8) ** 0.125,
        "min": f.min(),
        "max": f.max(),
        "numel": x.size,
        "zero_count": int((x == 0).sum()),
        "nan_count": int(np.isnan(x).sum()),
        "inf_count": int(np.isinf(x).sum()),
        "norm": np.sqrt(np.sum(f**2)),
    }


def _check_row(row, expected):
    assert set(DEFAULT_STATS) <= set(expected)  # every statistic of a log is checked
    for k, v in expected.items():
        assert row[k] == pytest.approx(v, rel=1e-12, abs=1e-300), k


# -- torch ------------------------------------------------------------------------------------
def test_weights_shared_or_cloned_and_adam_update_from_state():
    model = _model()
    opt, w0, shared, _ = _adam_step(model, lr=1e-2)
    names = [k for k, _ in model.named_parameters()]
    assert list(w0) == names == list(shared)
    w1 = st.from_weight(model)
    for k, p in model.named_parameters():
        assert torch.equal(shared[k], p)  # shared storage followed the step
        assert not torch.equal(w0[k], p)  # the clone did not
    # Adam's first step, recomputed from its state keyed by parameter path
    m = st.from_optimizer_state(opt, "exp_avg", model=model)
    v = st.from_optimizer_state(opt, "exp_avg_sq", model=model)
    assert list(m) == names
    recomputed = -1e-2 * (m / (1 - 0.9)) / (sqrt(v / (1 - 0.999)) + 1e-8)
    update = w1 - w0
    for k in names:
        torch.testing.assert_close(update[k], recomputed[k], rtol=0, atol=1e-7)


def test_arithmetic_matches_torch_per_tensor():
    model = _model()
    _, w0, _, g = _adam_step(model)
    w1 = st.from_weight(model)
    cases = {
        "w1 - w0": (w1 - w0, lambda k: w1[k] - w0[k]),
        "w0 + g": (w0 + g, lambda k: w0[k] + g[k]),
        "g * w0": (g * w0, lambda k: g[k] * w0[k]),
        "w0 / g": (w0 / g, lambda k: w0[k] / g[k]),
        "2 - w0": (2 - w0, lambda k: 2 - w0[k]),
        "w0 * 3": (w0 * 3, lambda k: w0[k] * 3),
        "0.5 * w0": (0.5 * w0, lambda k: 0.5 * w0[k]),
        "1 / w0": (1 / w0, lambda k: 1 / w0[k]),
        "1 + w0": (1 + w0, lambda k: 1 + w0[k]),
        "-w0": (-w0, lambda k: -w0[k]),
        "abs": (abs(w0), lambda k: w0[k].abs()),
        "pow": (w0**3, lambda k: w0[k] ** 3),
        "rpow": (2**w0, lambda k: 2 ** w0[k]),
        "sqrt": (sqrt(abs(g)), lambda k: torch.sqrt(g[k].abs())),
    }
    for label, (snap, expect) in cases.items():
        assert list(snap) == list(w0), label
        for k in w0:
            assert torch.equal(snap[k], expect(k)), (label, k)


def test_arithmetic_errors_name_the_problem():
    model = _model()
    w = st.from_weight(model)
    with pytest.raises(ValueError, match=r"names differ.*only left: '0.bias'"):
        _ = w - w.filter(r"weight$|^2\.")
    with pytest.raises(TypeError, match="combines with another snapshot or a number"):
        _ = w + "x"
    with pytest.raises(ValueError, match="positive"):
        w.norm(p=0)
    with pytest.raises(ValueError, match="matches no name"):
        w.filter("nothing-like-this")
    with pytest.raises(KeyError, match="not in snapshot"):
        _ = w["fc.weight"]


@pytest.mark.parametrize("p", [1, 2, 3, math.inf])
def test_norms_match_torch(p):
    model = _model()
    w = st.from_weight(model)
    per = w.norm(p, layerwise=True)
    assert isinstance(per, Snapshot) and list(per) == list(w)
    for k, t in model.named_parameters():
        assert per[k] == pytest.approx(float(torch.linalg.vector_norm(t.detach(), ord=p)), rel=1e-6)
    flat = torch.cat([t.detach().ravel() for t in model.parameters()]).double()
    assert w.norm(p) == pytest.approx(float(torch.linalg.vector_norm(flat, ord=p)), rel=1e-6)
    # a layerwise norm combines with tensors per name
    unit = w / per
    for k in w:
        assert float(torch.linalg.vector_norm(unit[k], ord=p)) == pytest.approx(1.0, rel=1e-5)


def test_describe_matches_numpy_layerwise_and_whole():
    model = _model()
    w = st.from_weight(model)
    lw = w.describe(layerwise=True)
    assert list(lw.columns) == list(DESCRIBE_COLUMNS) and list(lw.index) == list(w)
    arrays = {k: t.detach().numpy() for k, t in model.named_parameters()}
    for k, a in arrays.items():
        _check_row(lw.loc[k], _numpy_stats(a))
        assert lw.loc[k, "shape"] == a.shape and lw.loc[k, "dtype"] == "float32"
    whole = w.describe()
    assert list(whole.index) == [w.name]
    _check_row(whole.iloc[0], _numpy_stats(np.concatenate([a.ravel() for a in arrays.values()])))
    assert whole.iloc[0]["norm"] == pytest.approx(w.norm(2), rel=1e-6)
    sub = w.describe(layerwise=True, pattern=r"weight$", include=["numel", "rm2"])
    assert list(sub.columns) == ["numel", "rm2"] and list(sub.index) == ["0.weight", "2.weight"]
    with pytest.raises(ValueError, match="unknown columns"):
        w.describe(include=["norm2"])


def test_describe_counts_nonfinite_and_half_precision():
    x = torch.tensor([0.0, -2.0, float("nan"), 3.0, float("inf"), 0.0, 0.5]).to(torch.bfloat16)
    snap = Snapshot({"x": x, "y": torch.arange(6.0).reshape(2, 3)}, "mixed")
    row = snap.describe(layerwise=True).loc["x"]
    assert row["dtype"] == "bfloat16"
    _check_row(row, _numpy_stats(x.float().numpy()))
    whole = snap.describe().iloc[0]
    assert whole["dtype"] == "mixed"
    _check_row(whole, _numpy_stats(np.concatenate([x.float().numpy(), np.arange(6.0)])))


def test_from_grad_and_optimizer_state_names_and_errors():
    model = _model()
    with pytest.raises(ValueError, match="no parameter has a .grad"):
        st.from_grad(model)
    params = dict(model.named_parameters())
    # param groups listed in another order than the model's; one parameter not in the model
    stray = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD(
        [
            {"params": [params["2.weight"], stray]},
            {"params": [params["0.weight"], params["0.bias"]]},
        ],
        lr=0.1,
        momentum=0.9,
    )
    with pytest.raises(KeyError, match="no state yet"):
        st.from_optimizer_state(opt, "momentum_buffer", model=model)
    model(torch.randn(3, 5)).sum().backward()
    stray.grad = torch.full((2,), 3.0)
    g = st.from_grad(model)
    assert list(g) == list(params)  # 2.bias has a grad too; order is the model's
    opt.step()
    buf = st.from_optimizer_state(opt, "momentum_buffer", model=model)
    assert list(buf) == ["2.weight", "param_groups.0.1", "0.weight", "0.bias"]
    assert torch.equal(buf["param_groups.0.1"], stray.grad)
    for k in ("2.weight", "0.weight", "0.bias"):  # first SGD momentum buffer is the gradient
        assert torch.equal(buf[k], params[k].grad)
    with pytest.raises(KeyError, match=r"holds \['momentum_buffer'\]"):
        st.from_optimizer_state(opt, "exp_avg", model=model)


def test_from_activation_captures_outputs_and_removes_hooks():
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _model()

        def forward(self, x):
            y = self.body(x)
            return {"y": y, "parts": (y * 2, torch.ones(1, dtype=torch.long))}

    model = Pair()
    x = torch.randn(2, 5)
    with st.from_activation(model) as acts:
        model(x)
    h = model.body[0](x)
    expect = {"body.0": h, "body.1": torch.tanh(h), "body.2": model.body(x)}
    for k, v in expect.items():
        torch.testing.assert_close(acts[k], v)
    torch.testing.assert_close(acts["root[parts][0]"], 2 * expect["body.2"])
    assert "root[parts][1]" not in acts  # integer tensors are skipped, as in a log
    assert set(acts) == {*expect, "body", "root[y]", "root[parts][0]"}
    assert all(not m._forward_hooks for m in model.modules())


def test_repr_is_compact_and_truthful():
    snap = Snapshot({f"l{i}.weight": np.full((2, 3), float(i)) for i in range(20)}, "big")
    text = repr(snap)
    l2 = math.sqrt(sum(6 * i * i for i in range(20)))
    assert (
        text.splitlines()[0]
        == f"Snapshot 'big' [20 tensors, numel=120, L2={l2:.4g}, dtype=float64]"
    )
    assert "l11.weight" in text and "l12.weight" not in text and "... 8 more" in text
    assert len(str(snap).splitlines()) == 21  # str lists all 20
    per = snap.norm(layerwise=True)
    assert repr(per).splitlines()[2].split() == ["1:", "l1.weight", f"{math.sqrt(6):.6g}"]


def test_numpy_snapshot_and_clone():
    a = np.arange(6.0).reshape(2, 3)
    snap = Snapshot({"a": a})
    frozen = snap.clone()
    a += 1
    assert np.array_equal(snap["a"], a) and np.array_equal(frozen["a"], a - 1)
    assert snap.at(-1) is a and len(snap) == 1
    with pytest.raises(IndexError):
        snap.at(1)
    np.testing.assert_array_equal((sqrt(snap) ** 2)["a"], np.sqrt(a) ** 2)


# -- JAX --------------------------------------------------------------------------------------
def test_jax_snapshots_against_numpy():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    from tandv.snapshot import jax as sj

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.tanh(nn.Dense(4, name="hidden")(x))
            return nn.Dense(2, name="out")(h)

    model = MLP()
    x = jnp.linspace(-1, 1, 15).reshape(3, 5)
    variables = model.init(jax.random.PRNGKey(0), x)
    params = variables["params"]
    w = sj.from_weight(variables)  # the params collection of the variables dict
    assert list(w) == ["hidden.bias", "hidden.kernel", "out.bias", "out.kernel"]
    np_params = {f"{m}.{p}": np.asarray(params[m][p]) for m in params for p in params[m]}
    for k in w:
        np.testing.assert_array_equal(np.asarray(w[k]), np_params[k])

    grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(params)
    g = sj.from_grad(grads)
    opt = optax.adam(1e-2)
    state = opt.init(params)
    _, state = opt.update(grads, state, params)
    mu = sj.from_optimizer_state(state, "mu", params)
    nu = sj.from_optimizer_state(state, "nu", params)
    assert list(mu) == list(nu) == list(w)
    for k in w:
        gk = np.asarray(g[k])
        np.testing.assert_allclose(np.asarray(mu[k]), 0.1 * gk, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(nu[k]), 0.001 * gk**2, rtol=1e-6)
        np.testing.assert_allclose(np.asarray((w - 0.5 * g)[k]), np_params[k] - 0.5 * gk, rtol=1e-6)
        np.testing.assert_allclose(
            np.asarray((mu / (sqrt(nu) + 1e-8))[k]),
            0.1 * gk / (np.sqrt(0.001 * gk**2) + 1e-8),
            rtol=1e-5,
        )
    with pytest.raises(KeyError, match=r"holds \['mu', 'nu'\]"):
        sj.from_optimizer_state(state, "trace", params)

    for k, a in np_params.items():
        assert w.norm(layerwise=True)[k] == pytest.approx(np.linalg.norm(a.ravel()), rel=1e-6)
    flat = np.concatenate([a.ravel() for a in np_params.values()])
    assert w.norm(1) == pytest.approx(np.abs(flat).sum(), rel=1e-6)
    d = w.describe(layerwise=True)
    _check_row(d.loc["hidden.kernel"], _numpy_stats(np_params["hidden.kernel"]))
    _check_row(w.describe().iloc[0], _numpy_stats(flat))

    _, st_ = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    acts = sj.from_activation(st_)
    h = x @ np_params["hidden.kernel"] + np_params["hidden.bias"]
    np.testing.assert_allclose(np.asarray(acts["hidden"]), h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(acts["root"]),
        np.tanh(h) @ np_params["out.kernel"] + np_params["out.bias"],
        rtol=1e-5,
        atol=1e-6,
    )
    assert set(acts) == {"hidden", "out", "root"}
