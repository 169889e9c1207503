"""Block-scaled formats in the JAX tracker: the host kernel's columns for the arrays step()
is given, against the numpy reference; taps in loop bodies refuse (the device paths are
tested in test_blocks_jax_paths.py)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from test_blocks import COLS  # noqa: E402

import tandv  # noqa: E402
from tandv.stats.blocks import block_stats  # noqa: E402
from tandv.track.jax import track  # noqa: E402

FORMATS = ("mxfp8_e4m3", "nvfp4")


def _params() -> dict[str, jax.Array]:
    r = np.random.default_rng(0)
    w = r.standard_normal((6, 33)) * np.exp(r.uniform(-6, 6, (6, 1)))
    return {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(r.standard_normal(31), jnp.bfloat16)}


def test_step_arrays_equal_reference(tmp_path) -> None:
    params = _params()
    opt = optax.sgd(0.1)
    state = opt.init(params)
    grads = jax.tree_util.tree_map(lambda p: (p * 3).astype(p.dtype), params)
    with track(
        model_state=params,
        optimizer_state=state,
        block_formats=FORMATS,
        out=tmp_path / "log",
        verbose=False,
    ) as tracker:
        tracker.step(params, state, grads)
    df = tandv.read_parquet(tmp_path / "log")
    checked = 0
    for _, r in df.iterrows():
        tt, name = r.metadata["tensor_type"], r.metadata["name"]
        if tt not in ("Weight", "Gradient"):
            continue
        src = (params if tt == "Weight" else grads)[name]
        for f in FORMATS:
            ref = block_stats(np.asarray(src), f)
            for col in COLS:
                tol = 1e-6 if col == "sq_err" else 0.0
                got = r.scalar_stats[f"{f}.{col}"]
                assert got == pytest.approx(ref[col], rel=tol, abs=0), (name, tt, f, col)
        checked += 1
    assert checked == 4


def test_loop_taps_refuse(tmp_path) -> None:
    # a module inside a loop body (nn.scan) merges its iterations' summaries on the device,
    # which does not merge the block formats' words yet: refused, naming the module
    import flax.linen as nn

    class Body(nn.Module):
        @nn.compact
        def __call__(self, c: jax.Array, _: None) -> tuple[jax.Array, None]:
            return nn.Dense(4)(c), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            scan = nn.scan(
                Body, variable_broadcast="params", split_rngs={"params": False}, length=2
            )
            return scan(name="loop")(x, None)[0]

    model = Net()
    x = jnp.ones((2, 4))
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(p, x):
        return jnp.sum(model.apply(p, x))

    with track(
        model_state=params, block_formats=("nvfp4",), out=tmp_path / "log", verbose=False
    ) as tracker:
        with pytest.raises(NotImplementedError, match="block_formats.*loop body"):
            tracker.intercept(jax.jit(jax.grad(loss)), params, x)
