"""The JAX tracker under JAX and Flax transforms and with the common state containers.

Each test reproduces a failure of issue 13 (an exception from inside JAX, rows silently
dropped or misnamed) and checks the rows against values computed here independently."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402
from test_jax_tracker import ScanBlock as Block  # noqa: E402
from test_jax_tracker import assert_row_matches, data, names, row  # noqa: E402

from tandv.schema import read_log  # noqa: E402
from tandv.track.jax import track  # noqa: E402
from tandv.track.jax.trees import optimizer_state_leaves  # noqa: E402


def two_devices():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets jax_num_cpu_devices=2)")
    return jax.devices()[:2]


def assert_close_row(df, name, tensor_type, step, array, rel=1e-5):
    """Counts exactly, the other statistics to ``rel`` (for references computed by numpy,
    whose matmul rounds differently from XLA's)."""
    r = row(df, name, tensor_type, step)
    a = np.asarray(array, np.float64)
    assert r[("scalar_stats", "numel")] == a.size
    for stat, want in (("mean", a.mean()), ("max_abs", np.abs(a).max()), ("std", a.std())):
        assert r[("scalar_stats", stat)] == pytest.approx(want, rel=rel, abs=1e-7), (name, stat)


# ----------------------------------------------------------------------------- linen transforms


class ScannedRematStack(nn.Module):
    """The memory-saving transformer stack: nn.scan over nn.remat blocks."""

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        return blocks(name="blocks")(x, None)[0].sum(axis=-1)


def test_nn_scan_of_nn_remat_blocks(tmp_path):
    """Failed with KeyError: Var(...) from inside JAX."""
    model = ScannedRematStack()
    x = data()[0][:, :4]
    params = model.init(jax.random.key(1), x)
    update = jax.jit(jax.grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2)))
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        grads = tracker.intercept(update, params, x)
        tracker.step(params, gradients=grads)
    df = read_log(tmp_path / "log")
    layer = params["params"]["blocks"]["Dense_0"]
    h, outs = np.asarray(x, np.float64), []
    for i in range(3):
        outs.append(h @ np.asarray(layer["kernel"][i]) + np.asarray(layer["bias"][i]))
        h = np.tanh(outs[-1])
    assert_close_row(df, "blocks.Dense_0", "Activation", 0, np.concatenate(outs))
    assert row(df, "blocks.Dense_0", "Gradient", 0)[("scalar_stats", "numel")] == 3 * outs[0].size
    assert_row_matches(
        df, "blocks.Dense_0.kernel", "Gradient", 0, grads["params"]["blocks"]["Dense_0"]["kernel"]
    )


def test_vmap_inside_the_update_summarizes_the_mapped_axis_too(tmp_path):
    """Per-example gradients (jax.vmap of jax.grad) were refused; now each module's rows are
    those of the whole batch: the mapped axis is summarized as part of the tensor."""
    model = nn.Dense(3)
    x, _ = data()
    params = model.init(jax.random.key(1), x)

    def loss(p, x):
        return jnp.sum(model.apply(p, x) ** 2)

    per_example = jax.jit(lambda p, x: jax.vmap(jax.grad(loss), in_axes=(None, 0))(p, x[:, None]))
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        grads = tracker.intercept(per_example, params, x)
        tracker.step(params, gradients=jax.tree.map(lambda g: g.sum(0), grads))
    df = read_log(tmp_path / "log")
    out = model.apply(params, x)
    assert_row_matches(df, "root", "Activation", 0, out)
    assert_row_matches(df, "root", "Gradient", 0, 2 * out)  # d(sum out^2)/d out, every example
    assert_close_row(df, "kernel", "Gradient", 0, jax.grad(loss)(params, x)["params"]["kernel"])


def test_nn_vmap_module(tmp_path):
    class Ensemble(nn.Module):
        @nn.compact
        def __call__(self, x):
            heads = nn.vmap(
                nn.Dense,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=None,
                axis_size=2,
            )
            return heads(3, name="heads")(x)

    model = Ensemble()
    x, _ = data()
    params = model.init(jax.random.key(1), x)
    forward = jax.jit(model.apply)
    with track(params, out=tmp_path / "log", track_gradients=False, verbose=False) as tracker:
        out = tracker.intercept(forward, params, x)
        tracker.step(params)
    df = read_log(tmp_path / "log")
    assert names(df, "Activation") == {"heads", "root"}
    assert_row_matches(df, "heads", "Activation", 0, out)
    assert_row_matches(df, "heads.kernel", "Weight", 0, params["params"]["heads"]["kernel"])


# ----------------------------------------------------------------------------- shard_map and pmap


def test_shard_map_update_logs_the_global_arrays(tmp_path):
    """Failed with AttributeError: 'AbstractRef' object has no attribute 'nospec'. Each
    device summarizes its shard; the rows are those of the whole batch."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(two_devices()), ("d",))
    model, opt = nn.Dense(4), optax.sgd(0.1)
    x, _ = data()
    params = model.init(jax.random.key(1), x)
    state = opt.init(params)

    def local(p, s, x):
        g = jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(p)  # summed over devices by JAX
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    update = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P(), P()))
    )
    with track(params, state, out=tmp_path / "log", verbose=False) as tracker:
        new, state, grads = tracker.intercept(update, params, state, x)
        tracker.step(new, state, grads)
    df = read_log(tmp_path / "log")
    out = model.apply(params, x)  # one matmul over the whole batch rounds unlike two halves
    assert_close_row(df, "root", "Activation", 0, out)
    assert_close_row(df, "root", "Gradient", 0, 2 * out)
    want = jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(params)["params"]["kernel"]
    r = row(df, "kernel", "Gradient", 0)
    assert r[("scalar_stats", "numel")] == want.size
    assert r[("scalar_stats", "mean")] == pytest.approx(float(np.mean(want)), rel=1e-5)
    assert_row_matches(df, "kernel", "Weight", 0, params["params"]["kernel"])


def test_pmap_rows_are_of_the_logical_arrays(tmp_path):
    """Failed like shard_map; with taps off, Weight and Gradient rows were of the stacked
    per-device copies (numel doubled). With device_axis=True they are of one replica, and
    activations of the whole batch; without it, pmap's arrays are refused with the way out."""
    devices = two_devices()
    model = nn.Dense(4)
    x, _ = data()
    params = model.init(jax.random.key(1), x)
    stacked = jax.tree.map(lambda a: jnp.stack([a] * len(devices)), params)
    grad = jax.pmap(
        lambda p, x: jax.lax.pmean(jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(p), "i"),
        axis_name="i",
        devices=devices,
    )
    with track(stacked, out=tmp_path / "log", device_axis=True, verbose=False) as tracker:
        grads = tracker.intercept(grad, stacked, x.reshape(2, 4, 5))
        tracker.step(stacked, gradients=grads)
    df = read_log(tmp_path / "log")
    assert_close_row(df, "root", "Activation", 0, model.apply(params, x))
    assert_row_matches(df, "kernel", "Weight", 0, params["params"]["kernel"])
    assert_row_matches(df, "kernel", "Gradient", 0, np.asarray(grads["params"]["kernel"][0]))

    unnamed = jax.pmap(
        lambda p, x: jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(p), devices=devices
    )
    with track(
        stacked, out=tmp_path / "refused", track_activations=False, verbose=False
    ) as tracker:
        grads = tracker.intercept(unnamed, stacked, x.reshape(2, 4, 5))
        with pytest.raises(ValueError, match="device_axis=True"):
            tracker.step(stacked, gradients=grads)


# ----------------------------------------------------------------------------- nnx transforms


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


@nnx.vmap(in_axes=0, out_axes=0)
def _make_layers(key):
    return Layer(nnx.Rngs(key))


class Stack(nnx.Module):
    """Three stacked layers applied by nnx.scan (a chain) or nnx.vmap (side by side), or
    one layer under nnx.remat."""

    def __init__(self, how):
        self.how = how
        self.layers = _make_layers(jax.random.split(jax.random.key(0), 3))

    def __call__(self, x):
        if self.how == "scan":
            return nnx.scan(lambda layer, h: layer(h), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(
                self.layers, x
            )
        if self.how == "vmap":
            return nnx.vmap(lambda layer, h: layer(h), in_axes=(0, None), out_axes=0)(
                self.layers, x
            )
        return nnx.remat(lambda layer, h: layer(h))(self.layers, x)


@pytest.mark.parametrize("how", ["scan", "vmap", "remat"])
def test_nnx_transforms_keep_activations(tmp_path, how):
    """nnx.scan, nnx.vmap and nnx.remat silently dropped every module output inside them."""
    model = Stack(how)
    if how == "remat":  # one layer, not stacked
        model.layers = Layer(nnx.Rngs(1))
    x = data()[0][:, :4]

    @nnx.jit
    def grads_of(model, x):
        return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)

    with track(model, out=tmp_path / "log", verbose=False) as tracker:
        grads = tracker.intercept(grads_of, model, x)
        tracker.step(model, gradients=grads)
    df = read_log(tmp_path / "log")
    assert names(df, "Activation") == {"layers", "layers.lin", "root"}
    assert {"layers", "layers.lin", "root"} <= names(df, "Gradient")
    w = np.asarray(model.layers.lin.kernel.get_value(), np.float64)
    b = np.asarray(model.layers.lin.bias.get_value(), np.float64)
    h = np.asarray(x, np.float64)
    if how == "scan":
        outs = []
        for i in range(3):
            outs.append(h @ w[i] + b[i])
            h = np.tanh(outs[-1])
        lin = np.concatenate(outs)
    elif how == "vmap":
        lin = np.stack([h @ w[i] + b[i] for i in range(3)])
    else:
        lin = h @ w + b
    assert_close_row(df, "layers.lin", "Activation", 0, lin)
    assert_close_row(df, "root", "Activation", 0, np.tanh(lin[-8:] if how == "scan" else lin))


# ----------------------------------------------------------------------------- state containers


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dense(3)(nn.BatchNorm(use_running_average=not train)(nn.Dense(6)(x)))


class StateWithStats(train_state.TrainState):
    batch_stats: dict


def test_train_state_as_model_state(tmp_path):
    """A TrainState was logged whole as Weight rows named params.X, opt_state.X, ...: its
    parameters, optimizer state and batch statistics each become their own rows, and
    step(state, grads) takes the gradients as its second positional argument."""
    model = BNNet()
    x, y = data()
    variables = model.init(jax.random.key(1), x)
    state = StateWithStats.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.adam(1e-2),
        batch_stats=variables["batch_stats"],
    )

    @jax.jit
    def update(state, x, y):
        def loss(p):
            out, upd = state.apply_fn(
                {"params": p, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
            )
            return jnp.mean((out - y) ** 2), upd

        grads, upd = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"]), grads

    seen = []
    with track(state, out=tmp_path / "log", verbose=False) as tracker:
        for _ in range(2):
            seen.append(state)
            state, grads = tracker.intercept(update, state, x, y)
            tracker.step(state, grads)
    df = read_log(tmp_path / "log")
    pnames = {
        "Dense_0.kernel",
        "Dense_0.bias",
        "BatchNorm_0.scale",
        "BatchNorm_0.bias",
        "Dense_1.kernel",
        "Dense_1.bias",
    }
    assert names(df, "Weight") == pnames | {
        "batch_stats.BatchNorm_0.mean",
        "batch_stats.BatchNorm_0.var",
    }
    assert names(df, "Optimiser_State") == {f"{p}.{f}" for p in pnames for f in ("mu", "nu")}
    assert pnames <= names(df, "Gradient")
    assert_row_matches(df, "Dense_0.kernel", "Weight", 0, seen[0].params["Dense_0"]["kernel"])
    assert_row_matches(
        df, "batch_stats.BatchNorm_0.mean", "Weight", 1, seen[1].batch_stats["BatchNorm_0"]["mean"]
    )
    assert row(df, "batch_stats.BatchNorm_0.var", "Weight", 0)[("metadata", "type")] == "BatchNorm"
    assert_row_matches(
        df, "Dense_1.kernel.mu", "Optimiser_State", 1, state.opt_state[0].mu["Dense_1"]["kernel"]
    )
    assert_row_matches(df, "Dense_1.bias", "Gradient", 1, grads["Dense_1"]["bias"])
    with pytest.raises(ValueError, match="holds the optimizer state already"):
        track(state, state.opt_state, out=tmp_path / "twice", verbose=False)


def test_lookahead_fast_and_slow_params(tmp_path):
    """optax.lookahead's parameters were logged as fast.params.X / slow.params.X: the fast
    ones are the weights, the slow ones optimizer state X.slow."""
    model = nn.Dense(3)
    x, y = data()
    opt = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
    params = optax.LookaheadParams.init_synced(model.init(jax.random.key(1), x))
    state = opt.init(params)

    @jax.jit
    def update(params, state, x, y):
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params.fast)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, grads

    with track(params, state, out=tmp_path / "log", verbose=False) as tracker:
        first = params
        params, state, grads = tracker.intercept(update, params, state, x, y)
        tracker.step(params, state, grads)
    df = read_log(tmp_path / "log")
    assert names(df, "Weight") == {"kernel", "bias"}
    assert names(df, "Optimiser_State") == {
        f"{p}.{f}" for p in ("kernel", "bias") for f in ("mu", "nu", "slow")
    }
    assert_row_matches(df, "kernel", "Weight", 0, first.fast["params"]["kernel"])
    assert_row_matches(df, "kernel.slow", "Optimiser_State", 0, params.slow["params"]["kernel"])
    assert_row_matches(df, "kernel", "Gradient", 0, grads["params"]["kernel"])


def test_factored_optimizer_state_gets_a_row_per_leaf(tmp_path):
    """adafactor's v_row / v_col (shapes unlike the parameter's) had no row."""
    params = {"params": {"w": jax.random.normal(jax.random.key(0), (256, 128)), "b": jnp.ones(128)}}
    opt = optax.adafactor(1e-2)
    grads = jax.tree.map(lambda a: a * 0.5 + 0.25, params)
    state = opt.update(grads, opt.init(params), params)[1]
    with track(
        params, state, out=tmp_path / "log", track_activations=False, verbose=False
    ) as tracker:
        tracker.step(params, state, grads)
    df = read_log(tmp_path / "log")
    assert names(df, "Optimiser_State") == {
        "w.v_row",
        "w.v_col",
        "w.v",
        "b.v_row",
        "b.v_col",
        "b.v",
    }
    factored = state[0]
    assert factored.v_row["params"]["w"].ndim == 1 and factored.v_col["params"]["w"].ndim == 1
    assert_row_matches(df, "w.v_row", "Optimiser_State", 0, factored.v_row["params"]["w"])
    assert_row_matches(df, "w.v_col", "Optimiser_State", 0, factored.v_col["params"]["w"])
    assert_row_matches(df, "b.v", "Optimiser_State", 0, factored.v["params"]["b"])


def test_multi_transform_and_muon_names_carry_no_branch():
    params = {"params": {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}}
    leaves = optimizer_state_leaves(optax.contrib.muon(1e-3).init(params), params)
    assert {leaf.name for leaf in leaves} == {"w.mu", "b.mu", "b.nu"}
    labels = {"params": {"w": "a", "b": "s"}}
    opt = optax.multi_transform({"a": optax.adam(1e-3), "s": optax.sgd(1e-3, momentum=0.9)}, labels)
    leaves = optimizer_state_leaves(opt.init(params), params)
    assert {leaf.name for leaf in leaves} == {"w.mu", "w.nu", "b.trace"}


def test_step_with_params_and_gradients_only(tmp_path):
    """tr.step(params, grads) without an optimizer put the gradients in the optimizer-state
    slot and failed."""
    model = nn.Dense(3)
    x, y = data()
    params = model.init(jax.random.key(1), x)
    grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
    with track(params, out=tmp_path / "log", track_activations=False, verbose=False) as tracker:
        tracker.step(params, grads)
    df = read_log(tmp_path / "log")
    assert_row_matches(df, "kernel", "Gradient", 0, grads["params"]["kernel"])
    assert_row_matches(df, "kernel", "Weight", 0, params["params"]["kernel"])


# ----------------------------------------------------------------------------- compilations


def test_scheduled_and_unscheduled_steps_compile_once_each(tmp_path):
    """intercept keeps the user's own program for unscheduled steps and the instrumented one
    for tracked steps: after the first of each, no step traces or compiles anything, and on
    the CPU no tap reports by host callback."""
    from jax import monitoring
    from test_jax_tracker import MLP

    from tandv.track.jax import _intercept

    model, opt = MLP(), optax.adam(1e-2)
    x, y = data()
    # Committed to one device from the start, as the update's outputs are: jit compiles
    # again for arguments whose placement changes, tracked or not.
    params, x, y = jax.device_put((model.init(jax.random.key(1), x), x, y), jax.devices()[0])
    state = jax.device_put(opt.init(params), jax.devices()[0])
    traces, compiles, callbacks = [], [], []

    @jax.jit
    def update(p, s, x, y):
        traces.append(1)
        g = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(on_event)
    deliver = _intercept._deliver
    try:
        _intercept._deliver = lambda *a: (callbacks.append(1), deliver(*a))
        with track(params, state, out=tmp_path / "log", every=2, verbose=False) as tracker:
            for step in range(8):
                params, state, grads = tracker.intercept(update, params, state, x, y)
                tracker.step(params, state, grads)
                if step == 1:
                    warm = len(compiles)
    finally:
        _intercept._deliver = deliver
        monitoring.unregister_event_duration_listener(on_event)
    assert len(traces) == 2  # the instrumented program and the user's own
    assert len(compiles) == warm  # steps 2..7 compiled nothing
    assert callbacks == []
    assert sorted(set(read_log(tmp_path / "log")[("metadata", "step")])) == [0, 2, 4, 6]
