"""The same model, weights and data in PyTorch and Flax give the same log.

Weights are multiples of 1/8, inputs small integers and the learning rate and momentum
powers of two, so every forward, backward and update is exact in float32 in both
frameworks: the rows must then agree exactly in exponent counts and to float rounding
in the statistics.
"""

import numpy as np
import pytest

import tandv
from tandv.stats import DEFAULT_STATS

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

from tandv.track.jax import track as jax_track  # noqa: E402
from tandv.track.torch import track as torch_track  # noqa: E402

STEPS = 3
LR, MOMENTUM = 0.5, 0.5


def weights(rng, shape):
    return (rng.integers(-8, 9, size=shape) / 8).astype(np.float32)


class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(3)(x))
        return nn.Dense(2)(x)


def run_torch(w, xs, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    with torch.no_grad():
        for i, layer in ((0, model[0]), (1, model[2])):
            layer.weight.copy_(torch.from_numpy(w[f"k{i}"].T.copy()))
            layer.bias.copy_(torch.from_numpy(w[f"b{i}"]))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    with torch_track(model, opt, out=tmp_path / "torch", verbose=False) as tracker:
        for x in xs:
            opt.zero_grad()
            model(torch.from_numpy(x)).sum().backward()
            opt.step()
            tracker.step()
    return tandv.read_parquet(tracker.out_path)


def run_jax(w, xs, tmp_path):
    model = FlaxMLP()
    params = {
        "params": {
            f"Dense_{i}": {"kernel": jnp.asarray(w[f"k{i}"]), "bias": jnp.asarray(w[f"b{i}"])}
            for i in (0, 1)
        }
    }
    tx = optax.sgd(LR, momentum=MOMENTUM)
    opt_state = tx.init(params)

    @jax.jit
    def update(params, opt_state, x):
        grads = jax.grad(lambda p: model.apply(p, x).sum())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    with jax_track(
        model_state=params, optimizer_state=opt_state, out=tmp_path / "jax", verbose=False
    ) as tracker:
        for x in xs:
            params, opt_state, grads = tracker.intercept(update, params, opt_state, jnp.asarray(x))
            tracker.step(params, opt_state, grads)
    return tandv.read_parquet(tracker.out_path)


# (torch name, flax name, tensor_type)
PAIRS = [
    (t, j, tt)
    for i, (tl, jl) in enumerate((("0", "Dense_0"), ("2", "Dense_1")))
    for t, j, tt in (
        (tl, jl, "Activation"),
        (tl, jl, "Gradient"),
        (f"{tl}.weight", f"{jl}.kernel", "Weight"),
        (f"{tl}.bias", f"{jl}.bias", "Weight"),
        (f"{tl}.weight", f"{jl}.kernel", "Gradient"),
        (f"{tl}.bias", f"{jl}.bias", "Gradient"),
        (f"{tl}.weight.momentum_buffer", f"{jl}.kernel.trace", "Optimiser_State"),
        (f"{tl}.bias.momentum_buffer", f"{jl}.bias.trace", "Optimiser_State"),
    )
]


def test_torch_and_flax_logs_agree(tmp_path):
    rng = np.random.default_rng(0)
    w = {
        "k0": weights(rng, (4, 3)),
        "b0": weights(rng, (3,)),
        "k1": weights(rng, (3, 2)),
        "b1": weights(rng, (2,)),
    }
    xs = [rng.integers(-3, 4, size=(5, 4)).astype(np.float32) for _ in range(STEPS)]
    logs = {"torch": run_torch(w, xs, tmp_path), "jax": run_jax(w, xs, tmp_path)}
    rows = {
        k: df.set_index([("metadata", "name"), ("metadata", "tensor_type"), ("metadata", "step")])
        for k, df in logs.items()
    }
    for step in range(STEPS):
        for t_name, j_name, tt in PAIRS:
            a = rows["torch"].loc[(t_name, tt, step)]
            b = rows["jax"].loc[(j_name, tt, step)]
            assert a[("metadata", "dtype")] == b[("metadata", "dtype")] == "float32"
            ea = a["exponent_counts"][a["exponent_counts"] != 0]
            eb = b["exponent_counts"][b["exponent_counts"] != 0]
            assert ea.to_dict() == eb.to_dict(), (t_name, tt, step)
            assert ea.sum() > 0
            for stat in DEFAULT_STATS:
                np.testing.assert_allclose(
                    b[("scalar_stats", stat)],
                    a[("scalar_stats", stat)],
                    rtol=1e-6,
                    atol=1e-7,
                    err_msg=f"{t_name} {tt} {step} {stat}",
                )
