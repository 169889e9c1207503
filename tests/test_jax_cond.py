"""Tracked modules inside ``lax.cond``/``lax.switch`` branches (``nn.cond``, ``nn.switch``,
``nnx.cond``, stochastic depth) under ``jax.grad``: the rows are those of the branch taken,
exact against numpy, through the tracked program (a jitted update) and through the Python
path (the same update called from plain Python)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from test_jax_tracker import assert_row_matches  # noqa: E402

from tandv.schema import read_log  # noqa: E402
from tandv.track.jax import track  # noqa: E402

#: Data and parameters are multiples of 1/4 and 1/8: their products and sums are exact in
#: float32, so the program's values equal numpy's float64 ones.
X = jnp.asarray(np.arange(-6, 6).reshape(4, 3) / 4, jnp.float32)


def dyadic(tree):
    return jax.tree.map(lambda a: jnp.round(8 * a) / 8, tree)


def as_np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def module_names(df, step):
    m = df["metadata"]
    sel = df[(m["step"] == step) & m["tensor_type"].isin(["Activation", "Gradient"])]
    return set(zip(sel[("metadata", "name")], sel[("metadata", "tensor_type")]))


def dense(x, p):
    return x @ p["kernel"] + p["bias"]


class Branches(nn.Module):
    """``nn.cond`` (two branches) or ``nn.switch`` (three) over Dense layers, then a head."""

    switch: bool

    @nn.compact
    def __call__(self, x, which):
        layers = [nn.Dense(4, name=n) for n in ("a", "b", "c")[: 3 if self.switch else 2]]
        if self.is_initializing():
            for layer in layers:
                layer(x)
        fns = [lambda m, x, layer=layer: layer(x) for layer in layers]
        if self.switch:
            y = nn.switch(which, fns, self, x)
        else:
            y = nn.cond(which, fns[0], fns[1], self, x)
        return nn.Dense(1, name="head")(y)


@pytest.mark.parametrize("switch", [False, True], ids=["nn.cond", "nn.switch"])
@pytest.mark.parametrize("jitted", [True, False], ids=["program", "python"])
def test_linen_branches_under_grad(tmp_path, switch, jitted):
    model = Branches(switch)
    params = dyadic(model.init(jax.random.key(0), X, 0 if switch else True))

    def loss(p, which):
        return jnp.sum(model.apply(p, X, which) ** 2)

    grad = jax.jit(jax.grad(loss))
    update = grad if jitted else (lambda p, which: grad(p, which))
    choices = [0, 2, 1] if switch else [True, False]
    taken = ["a", "c", "b"] if switch else ["a", "b"]
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        for which in choices:
            tracker.step(params, tracker.intercept(update, params, which))
    df = read_log(tmp_path / "log")
    w = as_np(params["params"])
    for step, name in enumerate(taken):
        y = dense(np.asarray(X, np.float64), w[name])
        out = dense(y, w["head"])
        assert_row_matches(df, name, "Activation", step, y.astype(np.float32))
        assert_row_matches(df, "head", "Activation", step, out.astype(np.float32))
        cotangent = 2 * out @ w["head"]["kernel"].T  # d loss / d (branch output)
        assert_row_matches(df, name, "Gradient", step, cotangent.astype(np.float32))
        others = {n for n in ("a", "b", "c") if n != name}
        assert not {n for n, _ in module_names(df, step)} & others, step


class Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


class DropPath(nnx.Module):
    """Stochastic depth: the residual block runs or is skipped (``nnx.cond``)."""

    def __init__(self, rngs):
        self.block = Block(rngs)
        self.head = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x, keep):
        y = nnx.cond(keep, lambda b, x: x + b(x), lambda b, x: x, self.block, x)
        return self.head(y)


@pytest.mark.parametrize("jitted", [True, False], ids=["program", "python"])
def test_nnx_cond_stochastic_depth_under_grad(tmp_path, jitted):
    model = DropPath(nnx.Rngs(0))
    for layer in (model.block.fc, model.head):
        layer.kernel[...] = dyadic(layer.kernel[...])
        layer.bias[...] = dyadic(layer.bias[...] + 0.25)

    @nnx.jit
    def grads_of(model, keep):
        return nnx.grad(lambda m: jnp.sum(m(X, keep) ** 2))(model)

    update = grads_of if jitted else (lambda m, keep: grads_of(m, keep))
    with track(model, out=tmp_path / "log", verbose=False) as tracker:
        for keep in (True, False, True):
            tracker.step(model, tracker.intercept(update, model, keep))
    df = read_log(tmp_path / "log")
    fc = {"kernel": np.asarray(model.block.fc.kernel[...], np.float64)}
    fc["bias"] = np.asarray(model.block.fc.bias[...], np.float64)
    head = {"kernel": np.asarray(model.head.kernel[...], np.float64)}
    head["bias"] = np.asarray(model.head.bias[...], np.float64)
    x = np.asarray(X, np.float64)
    for step, keep in enumerate((True, False, True)):
        inner = dense(x, fc)
        y = x + inner if keep else x
        out = dense(y, head)
        assert_row_matches(df, "head", "Activation", step, out.astype(np.float32))
        names = {n for n, _ in module_names(df, step)}
        if keep:
            assert_row_matches(df, "block.fc", "Activation", step, inner.astype(np.float32))
            cotangent = 2 * out @ head["kernel"].T
            assert_row_matches(df, "block.fc", "Gradient", step, cotangent.astype(np.float32))
        else:
            assert not names & {"block", "block.fc"}, names
