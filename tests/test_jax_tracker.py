"""The JAX/Flax tracker against independently captured arrays and the numpy reference."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from tandv.schema import read_log  # noqa: E402
from tandv.stats import exponent_labels, finalize, summarize  # noqa: E402
from tandv.track.jax import _ffi, track  # noqa: E402
from tandv.track.jax._kernels import summary_path  # noqa: E402
from tandv.track.jax.trees import optimizer_state_leaves  # noqa: E402

EXACT_STATS = ["min", "max", "min_abs", "max_abs", "numel", "zero_count", "nan_count", "inf_count"]
MOMENT_STATS = ["mean", "std", "mean_abs", "rm2", "rm4", "rm8"]


# ----------------------------------------------------------------------------- helpers


def row(df: pd.DataFrame, name: str, tensor_type: str, step: int) -> pd.Series:
    m = df["metadata"]
    sel = df[(m["name"] == name) & (m["tensor_type"] == tensor_type) & (m["step"] == step)]
    assert len(sel) == 1, f"expected one row for {(name, tensor_type, step)}, found {len(sel)}"
    return sel.iloc[0]


def assert_row_matches(
    df: pd.DataFrame, name: str, tensor_type: str, step: int, array, fmt=None
) -> None:
    """The row equals the numpy reference summary of ``array``: counts, extrema and exponent
    counts exactly, moments to float32 rounding."""
    r = row(df, name, tensor_type, step)
    stats, counts = finalize(*summarize(np.asarray(array), fmt))
    for s in EXACT_STATS:
        assert r[("scalar_stats", s)] == stats[s], (name, tensor_type, step, s)
    for s in MOMENT_STATS:
        assert r[("scalar_stats", s)] == pytest.approx(stats[s], rel=1e-4, abs=1e-7), (
            name,
            tensor_type,
            step,
            s,
        )
    labels = exponent_labels(fmt if fmt is not None else np.asarray(array).dtype)
    got = [
        int(r[("exponent_counts", lab)]) if ("exponent_counts", lab) in r.index else 0
        for lab in labels
    ]
    assert got == counts.tolist(), (name, tensor_type, step)
    present = [c for c in r.index if c[0] == "exponent_counts" and c[1] not in labels]
    assert all(r[c] == 0 for c in present)


def names(df: pd.DataFrame, tensor_type: str, step: int = 0) -> set[str]:
    m = df["metadata"]
    return set(m["name"][(m["tensor_type"] == tensor_type) & (m["step"] == step)])


class MLP(nn.Module):
    """Compact linen MLP; ``perturb`` lets the test take cotangents w.r.t. module outputs
    independently of the tracker (it is the identity unless a 'perturbations' collection is
    given)."""

    @nn.compact
    def __call__(self, x):
        h = self.perturb("at_Dense_0", nn.Dense(8, name="Dense_0")(x))
        h = self.perturb("at_LayerNorm_0", nn.LayerNorm(name="LayerNorm_0")(h))
        h = nn.relu(h)
        return self.perturb("at_Dense_1", nn.Dense(3, name="Dense_1")(h))


def data(seed: int = 0, n: int = 8):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (n, 5)), jax.random.normal(k2, (n, 3))


def make_update(model, opt, jit: bool, counter: list | None = None):
    def loss_fn(p, x, y):
        return jnp.mean((model.apply(p, x) - y) ** 2)

    def update(p, s, x, y):
        if counter is not None:
            counter.append(1)
        g = jax.grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    return jax.jit(update) if jit else update


# ----------------------------------------------------------------------------- linen


def captured_run(out, jit: bool, shard=None):
    """Train the MLP for 3 steps under the tracker, with the test's own capture of every
    tracked array. ``shard(tree) -> tree`` places params and batch on a device mesh."""
    model, opt = MLP(), optax.adam(1e-2)
    x, y = data()
    params = model.init(jax.random.key(1), x)
    _, inter0 = model.apply(params, x, capture_intermediates=True)
    mods = ("Dense_0", "LayerNorm_0", "Dense_1")
    zeros = {f"at_{k}": jnp.zeros(inter0["intermediates"][k]["__call__"][0].shape) for k in mods}
    zero_out = jnp.zeros_like(y)
    if shard is not None:
        params, x, y = shard(params, x, y)
    state = opt.init(params)

    def update(p, s, x, y):
        # The test's own capture, in the same computation the tracker sees: module outputs via
        # capture_intermediates, their cotangents as gradients of zero perturbations.
        def loss(p, pt, pt_out):
            out, inter = model.apply({**p, "perturbations": pt}, x, capture_intermediates=True)
            out_p = out + pt_out
            return jnp.mean((out_p - y) ** 2), (inter, out)

        (g, cot, cot_out), (inter, out) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(
            p, zeros, zero_out
        )
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g, (inter, cot, cot_out, out)

    update = jax.jit(update) if jit else update
    history = []
    with track(params, state, out=out, verbose=False) as tracker:
        for _ in range(3):
            before = params
            params, state, grads, captured = tracker.intercept(update, params, state, x, y)
            tracker.step(params, state, grads)
            history.append((before, grads, state, captured))
    return read_log(out), history


@pytest.fixture(scope="module")
def linen_runs(tmp_path_factory):
    """The jitted and the plain run, and jitted runs on the accelerators' path (every summary
    computed inside programs, none by the host kernel): by XLA's operations ("device") and by
    the fused Pallas kernel, interpreted ("pallas") (shared by several tests: compiles are
    the cost)."""
    tmp = tmp_path_factory.mktemp("linen")
    runs = {"jit": captured_run(tmp / "jit", True), "plain": captured_run(tmp / "plain", False)}
    for mode, path in (("device", "xla"), ("pallas", "pallas")):
        with summary_path(path), pytest.MonkeyPatch.context() as mp:
            mp.setattr(_ffi, "ffi_summary", None)  # must not be called
            runs[mode] = captured_run(tmp / mode, True)
    return runs


@pytest.mark.parametrize("mode", ["jit", "plain", "device", "pallas"])
def test_linen_rows_match_reference(linen_runs, mode):
    df, history = linen_runs[mode]
    mods = ("Dense_0", "LayerNorm_0", "Dense_1")
    assert sorted(df[("metadata", "step")].unique()) == [0, 1, 2]
    pnames = {
        "Dense_0.kernel",
        "Dense_0.bias",
        "LayerNorm_0.scale",
        "LayerNorm_0.bias",
        "Dense_1.kernel",
        "Dense_1.bias",
    }
    assert names(df, "Weight") == pnames
    assert names(df, "Optimiser_State") == {f"{p}.{f}" for p in pnames for f in ("mu", "nu")}
    assert names(df, "Activation") == {"Dense_0", "LayerNorm_0", "Dense_1", "root"}
    assert names(df, "Gradient") == pnames | {"Dense_0", "LayerNorm_0", "Dense_1", "root"}
    assert row(df, "Dense_0.kernel", "Weight", 0)[("metadata", "type")] == "Dense"
    assert row(df, "Dense_0", "Activation", 0)[("metadata", "type")] == "Dense"
    assert row(df, "root", "Activation", 0)[("metadata", "type")] == "MLP"

    for step, (before, grads, state, (inter, cot, cot_out, out)) in enumerate(history):
        # Weights used in this step's forward pass, gradients of this step, state after it.
        for path, leaf in jax.tree_util.tree_leaves_with_path(before["params"]):
            name = ".".join(k.key for k in path)
            assert_row_matches(df, name, "Weight", step, leaf)
            assert_row_matches(df, name, "Gradient", step, _get(grads["params"], path))
            assert_row_matches(
                df, f"{name}.mu", "Optimiser_State", step, _get(state[0].mu["params"], path)
            )
            assert_row_matches(
                df, f"{name}.nu", "Optimiser_State", step, _get(state[0].nu["params"], path)
            )
        for k in mods:
            assert_row_matches(df, k, "Activation", step, inter["intermediates"][k]["__call__"][0])
            assert_row_matches(df, k, "Gradient", step, cot[f"at_{k}"])
        assert_row_matches(df, "root", "Activation", step, out)
        assert_row_matches(df, "root", "Gradient", step, cot_out)


def _get(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def assert_same_log(a: pd.DataFrame, b: pd.DataFrame) -> None:
    key = [("metadata", c) for c in ("step", "tensor_type", "name")]
    a, b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
    assert len(a) == len(b) > 0
    pd.testing.assert_frame_equal(a["metadata"], b["metadata"])
    pd.testing.assert_frame_equal(a["exponent_counts"], b["exponent_counts"])
    pd.testing.assert_frame_equal(a["scalar_stats"], b["scalar_stats"], rtol=1e-4, atol=1e-7)


def test_jit_and_plain_give_the_same_log(linen_runs):
    assert_same_log(linen_runs["jit"][0], linen_runs["plain"][0])


@pytest.mark.parametrize("mode", ["device", "pallas"])
def test_host_kernel_and_in_program_summaries_give_the_same_log(linen_runs, mode):
    assert_same_log(linen_runs["jit"][0], linen_runs[mode][0])


def test_jitted_update_is_traced_once_per_tracking_mode(tmp_path):
    model, opt = nn.Dense(3), optax.adam(1e-2)
    x, y = data()
    params = model.init(jax.random.key(1), x)
    state = opt.init(params)
    traces: list = []
    update = make_update(model, opt, jit=True, counter=traces)
    with track(params, state, out=tmp_path / "every1", verbose=False) as tracker:
        for _ in range(3):
            params, state, grads = tracker.intercept(update, params, state, x, y)
            tracker.step(params, state, grads)
    assert len(traces) == 1
    assert names(read_log(tmp_path / "every1"), "Activation", step=2) == {"root"}
    with track(params, state, out=tmp_path / "every2", every=2, verbose=False) as tracker:
        for _ in range(5):
            params, state, grads = tracker.intercept(update, params, state, x, y)
            tracker.step(params, state, grads)
    # A new tracker traces its own tracked version once; the untracked one is traced once.
    assert len(traces) == 3
    df = read_log(tmp_path / "every2")
    assert sorted(df[("metadata", "step")].unique()) == [0, 2, 4]
    # Calling the jitted update outside a tracker runs the untracked version: no retrace.
    # And tracking never changes training: the same 8 steps untracked give identical bits.
    p = model.init(jax.random.key(1), x)
    s = opt.init(p)
    for _ in range(8):
        p, s, _ = update(p, s, x, y)
    assert len(traces) == 3
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p, s))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_forward_only_function_logs_activations(tmp_path):
    """An evaluation function (no jax.grad) intercepted under jit: activations are logged
    (written to mailboxes outside any custom_vjp), no cotangents exist to log."""
    model = MLP()
    x, _ = data()
    params = model.init(jax.random.key(1), x)
    evaluate = jax.jit(lambda p, x: model.apply(p, x, capture_intermediates=True))
    with track(params, out=tmp_path / "log", track_gradients=False, verbose=False) as tracker:
        for _ in range(2):
            out, inter = tracker.intercept(evaluate, params, x)
            tracker.step(params)
    df = read_log(tmp_path / "log")
    assert names(df, "Activation", step=1) == {"Dense_0", "LayerNorm_0", "Dense_1", "root"}
    for step in (0, 1):
        for k in ("Dense_0", "LayerNorm_0", "Dense_1"):
            assert_row_matches(df, k, "Activation", step, inter["intermediates"][k]["__call__"][0])
        assert_row_matches(df, "root", "Activation", step, out)


class RematMLP(nn.Module):
    """MLP's layers under nn.remat: their forward passes run again in the backward pass."""

    @nn.compact
    def __call__(self, x):
        h = nn.remat(nn.Dense)(8, name="Dense_0")(x)
        h = nn.relu(nn.remat(nn.LayerNorm)(name="LayerNorm_0")(h))
        return nn.Dense(3, name="Dense_1")(h)


def test_rematerialized_modules_are_logged_once_per_step(tmp_path):
    """With nn.remat the forward pass of a layer runs twice; its rows equal those of the same
    layers without remat (one observation per step, nothing counted twice), up to the
    rounding XLA's different fusion of the recomputation brings (a value may cross into the
    next binade)."""
    opt = optax.adam(1e-2)
    x, y = data()
    logs = {}
    for name, model in (("remat", RematMLP()), ("plain", MLP())):
        params = model.init(jax.random.key(1), x)
        state = opt.init(params)
        update = make_update(model, opt, jit=True)
        with track(params, state, out=tmp_path / name, verbose=False) as tracker:
            for _ in range(2):
                params, state, grads = tracker.intercept(update, params, state, x, y)
                tracker.step(params, state, grads)
        logs[name] = read_log(tmp_path / name)
    assert names(logs["remat"], "Activation") == {"Dense_0", "LayerNorm_0", "Dense_1", "root"}
    assert names(logs["remat"], "Gradient") == names(logs["plain"], "Gradient")
    assert names(logs["remat"], "Gradient", step=1) == names(logs["plain"], "Gradient", step=1)
    # Step 0 only: Adam turns the rounding differences of near-zero gradients into different
    # updates, so the two runs part after it.
    key = [("metadata", c) for c in ("step", "tensor_type", "name")]
    remat, plain = (
        logs[k][logs[k][("metadata", "step")] == 0].sort_values(key).reset_index(drop=True)
        for k in ("remat", "plain")
    )
    pd.testing.assert_frame_equal(
        remat["metadata"].drop(columns="type"), plain["metadata"].drop(columns="type")
    )
    pd.testing.assert_frame_equal(
        remat["scalar_stats"], plain["scalar_stats"], rtol=1e-4, atol=1e-6
    )
    counts = remat["exponent_counts"].fillna(0) - plain["exponent_counts"].fillna(0)
    assert (counts.sum(axis=1) == 0).all() and counts.abs().to_numpy().max() <= 2


def test_taps_inside_a_loop_report_every_iteration(tmp_path):
    """A module applied in lax.scan: each iteration's output (and cotangent) is one
    observation of the step, merged into one row, as three calls in Python would be."""
    model = nn.Dense(5)
    x, _ = data()
    params = model.init(jax.random.key(1), x)

    def run(p, x):
        def body(h, _):
            h = jnp.tanh(model.apply(p, h))
            return h, h

        return jax.lax.scan(body, x, None, length=3)[1]

    def loss(p, x):
        outs = run(p, x)
        return jnp.sum(outs**2), outs

    update = jax.jit(jax.grad(loss, has_aux=True))
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        grads, outs = tracker.intercept(update, params, x)
        tracker.step(params, gradients=grads)
    df = read_log(tmp_path / "log")
    # The Dense outputs are arctanh of the tanh'd outputs collected by the scan.
    dense_out = np.arctanh(np.asarray(outs, np.float64)).astype(np.float32)
    r = row(df, "root", "Activation", 0)
    assert r[("scalar_stats", "numel")] == dense_out.size
    assert r[("scalar_stats", "mean")] == pytest.approx(dense_out.mean(), rel=1e-4)
    assert r[("scalar_stats", "max_abs")] == pytest.approx(np.abs(dense_out).max(), rel=1e-5)
    assert row(df, "root", "Gradient", 0)[("scalar_stats", "numel")] == dense_out.size


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(4, name="Dense_0")(h)), None


class ScannedMLP(nn.Module):
    """Three Dense layers as one nn.scan over stacked parameters."""

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(
            ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        h, _ = blocks(name="blocks")(x, None)
        return h.sum(axis=-1)


@pytest.mark.parametrize("gradients", [True, False])
def test_nn_scan_layers_are_observed_every_iteration(tmp_path, gradients):
    """A module inside nn.scan: its row merges the three iterations' outputs (computed here
    from the stacked parameters), with or without cotangents."""
    model = ScannedMLP()
    x, _ = data()
    x = x[:, :4]
    params = model.init(jax.random.key(1), x)
    update = jax.jit(jax.grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2)))
    with track(params, out=tmp_path / "log", track_gradients=gradients, verbose=False) as tracker:
        grads = tracker.intercept(update, params, x)
        tracker.step(params, gradients=grads if gradients else None)
    df = read_log(tmp_path / "log")
    layer = params["params"]["blocks"]["Dense_0"]
    h, outs = np.asarray(x), []
    for i in range(3):
        outs.append(h @ np.asarray(layer["kernel"][i]) + np.asarray(layer["bias"][i]))
        h = np.tanh(outs[-1])
    outs = np.concatenate(outs)  # rounding differs from XLA's matmul: compare to 1e-5
    r = row(df, "blocks.Dense_0", "Activation", 0)
    assert r[("scalar_stats", "numel")] == outs.size
    for stat, want in (("mean", outs.mean()), ("max_abs", np.abs(outs).max()), ("std", outs.std())):
        assert r[("scalar_stats", stat)] == pytest.approx(want, rel=1e-5), stat
    assert (names(df, "Gradient") >= {"blocks.Dense_0", "root"}) == gradients
    if gradients:
        assert row(df, "blocks.Dense_0", "Gradient", 0)[("scalar_stats", "numel")] == outs.size


def test_jvp_works_without_gradients(tmp_path):
    model = nn.Dense(3)
    x, _ = data()
    params = model.init(jax.random.key(1), x)

    def loss(p, x):
        return jnp.sum(model.apply(p, x) ** 2)

    # Forward mode: the cotangent taps (custom_vjp) cannot be jvp'd, the activation taps can.
    directional = jax.jit(lambda p, x: jax.jvp(lambda q: loss(q, x), (p,), (p,)))
    with track(params, out=tmp_path / "jvp", track_gradients=False, verbose=False) as tracker:
        tracker.intercept(directional, params, x)
        tracker.step(params)
    assert_row_matches(read_log(tmp_path / "jvp"), "root", "Activation", 0, model.apply(params, x))


def test_two_intercepted_calls_in_one_step_are_both_observed(tmp_path):
    """Gradient accumulation: two micro-batches through intercept() before one step(); each
    module's rows hold both calls' outputs (the first call's mailboxes are read before the
    second reuses them)."""
    model = nn.Dense(4)
    x, _ = data(n=6)
    params = model.init(jax.random.key(1), x)
    forward = jax.jit(model.apply)
    with track(params, out=tmp_path / "log", track_gradients=False, verbose=False) as tracker:
        outs = [
            tracker.intercept(forward, params, x[:3]),
            tracker.intercept(forward, params, x[3:]),
        ]
        tracker.step(params)
    assert_row_matches(read_log(tmp_path / "log"), "root", "Activation", 0, np.concatenate(outs))


def test_mailbox_arena_grows_when_a_trace_needs_more_room(tmp_path, monkeypatch, linen_runs):
    """With a tiny first arena the first trace overflows: its remaining taps report by host
    callback, the next step gets a larger arena and a new trace; nothing is lost."""
    from tandv.track.jax._intercept import Mailboxes

    monkeypatch.setattr(Mailboxes, "CAPACITY", 400)  # about one float32 report
    df, _ = captured_run(tmp_path / "log", True)
    assert_same_log(df, linen_runs["jit"][0])


def test_exception_in_update_propagates_and_completed_steps_are_on_disk(tmp_path):
    model, opt = nn.Dense(3), optax.sgd(0.1)
    x, y = data()
    params = model.init(jax.random.key(1), x)
    state = opt.init(params)
    update = make_update(model, opt, jit=True)
    boom = RuntimeError("boom at step 2")

    def failing(p, s, x, y, step):
        if step == 2:
            raise boom
        return update(p, s, x, y)

    with pytest.raises(RuntimeError) as info:
        with track(params, state, out=tmp_path / "log", verbose=False) as tracker:
            for i in range(4):
                params, state, grads = tracker.intercept(failing, params, state, x, y, i)
                tracker.step(params, state, grads)
    assert info.value is boom
    df = read_log(tmp_path / "log")
    assert sorted(df[("metadata", "step")].unique()) == [0, 1]
    assert tracker.closed


def test_setup_style_linen_module_names(tmp_path):
    class Block(nn.Module):
        def setup(self):
            self.proj = nn.Dense(4)
            self.norm = nn.LayerNorm()

        def __call__(self, x):
            return self.norm(self.proj(x))

    class Net(nn.Module):
        def setup(self):
            self.embed = nn.Embed(10, 4)
            self.block = Block()
            self.head = nn.Dense(2)

        def __call__(self, tokens):
            return self.head(self.block(self.embed(tokens)))

    model, opt = Net(), optax.adamw(1e-3)
    tokens = jnp.arange(6).reshape(2, 3)
    params = model.init(jax.random.key(0), tokens)
    state = opt.init(params)

    @jax.jit
    def update(p, s):
        g = jax.grad(lambda p: jnp.sum(model.apply(p, tokens) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    with track(
        params, state, out=tmp_path / "log", verbose=False, track_gradients=False
    ) as tracker:
        new, state, grads = tracker.intercept(update, params, state)
        tracker.step(new, state)
    df = read_log(tmp_path / "log")
    assert names(df, "Gradient") == set()
    assert names(df, "Weight") == {
        "embed.embedding",
        "block.proj.kernel",
        "block.proj.bias",
        "block.norm.scale",
        "block.norm.bias",
        "head.kernel",
        "head.bias",
    }
    assert names(df, "Activation") == {"embed", "block.proj", "block.norm", "block", "head", "root"}
    assert_row_matches(df, "embed.embedding", "Weight", 0, params["params"]["embed"]["embedding"])
    assert_row_matches(
        df, "head.kernel.mu", "Optimiser_State", 0, state[0].mu["params"]["head"]["kernel"]
    )
    assert row(df, "embed", "Activation", 0)[("metadata", "type")] == "Embed"


# ----------------------------------------------------------------------------- optax states


def _params():
    return {
        "params": {
            "Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)},
            "scale": jnp.ones(()),
        }
    }


@pytest.mark.parametrize(
    "opt, expected",
    [
        (optax.adam(1e-3), {"mu", "nu"}),
        (optax.adamw(1e-3), {"mu", "nu"}),
        (optax.sgd(1e-3, momentum=0.9), {"trace"}),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), {"mu", "nu"}),
        (optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), {"mu", "nu"}),
        (optax.chain(optax.trace(0.9), optax.trace(0.5)), {"trace_0", "trace_1"}),
    ],
    ids=["adam", "adamw", "sgd-momentum", "chain", "inject_hyperparams", "two-traces"],
)
def test_optimizer_state_names(opt, expected):
    params = _params()
    leaves = optimizer_state_leaves(opt.init(params), params)
    pnames = {"Dense_0.kernel", "Dense_0.bias", "scale"}
    assert {leaf.name for leaf in leaves} == {f"{p}.{f}" for p in pnames for f in expected}


def test_masked_optimizer_state_tracks_only_unmasked_leaves():
    params = _params()
    mask = {"params": {"Dense_0": {"kernel": True, "bias": False}, "scale": False}}
    opt = optax.masked(optax.adam(1e-3), mask)
    leaves = optimizer_state_leaves(opt.init(params), params)
    assert {leaf.name for leaf in leaves} == {"Dense_0.kernel.mu", "Dense_0.kernel.nu"}


def test_inject_hyperparams_state_values(tmp_path):
    model, opt = nn.Dense(3), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    x, y = data()
    params = model.init(jax.random.key(1), x)
    state = opt.init(params)
    update = make_update(model, opt, jit=True)
    with track(
        params, state, out=tmp_path / "log", verbose=False, track_activations=False
    ) as tracker:
        params, state, grads = tracker.intercept(update, params, state, x, y)
        tracker.step(params, state, grads)
    df = read_log(tmp_path / "log")
    assert names(df, "Activation") == set()
    assert_row_matches(
        df, "kernel.trace", "Optimiser_State", 0, state.inner_state[0].trace["params"]["kernel"]
    )


# ----------------------------------------------------------------------------- options and errors


def test_step_argument_errors(tmp_path):
    params = _params()
    state = optax.adam(1e-3).init(params)
    with track(params, state, out=tmp_path / "a", verbose=False) as tracker:
        with pytest.raises(ValueError, match="optimizer_state is missing"):
            tracker.step(params, gradients=params)
        with pytest.raises(ValueError, match="model_state is missing"):
            tracker.step(optimizer_state=state, gradients=params)
        with pytest.raises(ValueError, match="gradients is missing"):
            tracker.step(params, state)
    with track(params, out=tmp_path / "b", verbose=False, track_gradients=False) as tracker:
        with pytest.raises(ValueError, match="got optimizer_state, but track\\(\\) was not given"):
            tracker.step(params, state)
        with pytest.raises(ValueError, match="got gradients, but track\\(track_gradients=False\\)"):
            tracker.step(params, gradients=params)
    with track(out=tmp_path / "c", verbose=False) as tracker:
        with pytest.raises(ValueError, match="got model_state"):
            tracker.step(params)
    with pytest.raises(ValueError, match="optimizer_state was given without model_state"):
        track(optimizer_state=state, out=tmp_path / "d", verbose=False)
    with pytest.raises(ValueError, match="every=0"):
        track(params, out=tmp_path / "e", every=0, verbose=False)
    with pytest.raises(ValueError, match=r"stats\['bad'\]"):
        track(params, out=tmp_path / "f", stats={"bad": (len, "median")}, verbose=False)
    with pytest.raises(ValueError, match="model_state has no floating-point leaves"):
        track({"step": jnp.zeros((), jnp.int32)}, out=tmp_path / "g", verbose=False)
    with pytest.raises(RuntimeError, match="closed"):
        tracker.step()


def test_track_refuses_arguments_that_do_not_fit(tmp_path):
    """track() names the argument and what to pass: a device_axis that is not a bool, and
    track_updates without the parameters whose differences the updates are."""
    params = {"w": jnp.ones((2, 3))}
    with pytest.raises(TypeError, match=r"track\(device_axis='yes'\): expected True, False"):
        track(params, out=tmp_path / "a", device_axis="yes", verbose=False)
    with pytest.raises(ValueError, match=r"track_updates=True.*pass model_state"):
        track(out=tmp_path / "b", track_updates=True, verbose=False)


def test_include_exclude_number_format_and_custom_stats(tmp_path):
    model, opt = MLP(), optax.sgd(0.1)
    x, y = data()
    params = model.init(jax.random.key(1), x)
    state = opt.init(params)
    update = make_update(model, opt, jit=True)
    with track(
        params,
        state,
        out=tmp_path / "log",
        verbose=False,
        include=["Dense"],
        exclude=["bias"],
        number_format="float8_e4m3fn",
        stats={"l1": (lambda a: jnp.sum(jnp.abs(a)), "sum")},
    ) as t:
        before = params
        params, state, grads = t.intercept(update, params, state, x, y)
        t.step(params, state, grads)
    df = read_log(tmp_path / "log")
    assert names(df, "Weight") == {"Dense_0.kernel", "Dense_1.kernel"}
    assert names(df, "Activation") == {"Dense_0", "Dense_1"}
    assert names(df, "Optimiser_State") == set()  # plain sgd keeps no parameter-shaped state
    kernel = before["params"]["Dense_0"]["kernel"]
    assert_row_matches(df, "Dense_0.kernel", "Weight", 0, kernel, fmt="float8_e4m3fn")
    r = row(df, "Dense_0.kernel", "Weight", 0)
    assert r[("metadata", "dtype")] == "float32"
    assert r[("scalar_stats", "l1")] == pytest.approx(
        float(np.abs(np.asarray(kernel)).sum()), rel=1e-5
    )


def test_torch_style_custom_stats_and_step_window(tmp_path):
    """The PyTorch tracker's option forms work here too: stats functions returning
    {name: scalar}, stats_merge rules, and start/end."""
    model, opt = MLP(), optax.sgd(0.1)
    x, y = data()
    params = model.init(jax.random.key(2), x)
    state = opt.init(params)
    update = make_update(model, opt, jit=True)
    seen = []
    with track(
        params,
        state,
        out=tmp_path / "log",
        verbose=False,
        start=1,
        end=3,
        stats=lambda a: {"peak": jnp.max(jnp.abs(a)), "sq": jnp.sum(a * a)},
        stats_merge={"peak": "max", "sq": "sum"},
    ) as t:
        for _ in range(4):
            seen.append(params)
            params, state, grads = t.intercept(update, params, state, x, y)
            t.step(params, state, grads)
    df = read_log(tmp_path / "log")
    assert sorted(set(df[("metadata", "step")])) == [1, 2]
    for step in (1, 2):
        kernel = np.asarray(seen[step]["params"]["Dense_0"]["kernel"], dtype=np.float64)
        r = row(df, "Dense_0.kernel", "Weight", step)
        assert r[("scalar_stats", "peak")] == pytest.approx(np.abs(kernel).max(), rel=1e-6)
        assert r[("scalar_stats", "sq")] == pytest.approx((kernel**2).sum(), rel=1e-5)


# ----------------------------------------------------------------------------- nnx


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(5, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.norm(self.l1(x))))


def test_nnx_model_and_optimizer(tmp_path):
    model = NnxMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x, y = data()
    traces: list = []

    @nnx.jit
    def train_step(model, optimizer, x, y):
        traces.append(1)
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return grads

    history = []
    linear_call = nnx.Linear.__dict__["__call__"]
    with track(model, optimizer, out=tmp_path / "log", verbose=False) as tracker:
        for _ in range(3):
            before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
            grads = tracker.intercept(train_step, model, optimizer, x, y)
            tracker.step(model, optimizer, grads)
            history.append((before, grads))
    assert len(traces) == 1
    assert nnx.Linear.__dict__["__call__"] is linear_call  # nnx classes restored on close
    df = read_log(tmp_path / "log")
    pnames = {"l1.kernel", "l1.bias", "norm.scale", "norm.bias", "l2.kernel", "l2.bias"}
    assert names(df, "Weight") == pnames
    assert names(df, "Optimiser_State") == {f"{p}.{f}" for p in pnames for f in ("mu", "nu")}
    assert names(df, "Activation") == {"l1", "norm", "l2", "root"}
    assert row(df, "l1", "Activation", 0)[("metadata", "type")] == "Linear"
    assert row(df, "l1.kernel", "Weight", 0)[("metadata", "type")] == "Linear"
    for step, (before, grads) in enumerate(history):
        assert_row_matches(df, "l1.kernel", "Weight", step, before["l1"]["kernel"].get_value())
        assert_row_matches(df, "l2.bias", "Gradient", step, grads["l2"]["bias"].get_value())
        h = x @ before["l1"]["kernel"].get_value() + before["l1"]["bias"].get_value()
        assert_row_matches(df, "l1", "Activation", step, h)
    mu = optimizer.opt_state[0].mu["l2"]["kernel"].get_value()
    assert_row_matches(df, "l2.kernel.mu", "Optimiser_State", 2, mu)


# ----------------------------------------------------------------------------- sharding


def test_sharded_run_logs_global_statistics(tmp_path, linen_runs):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets jax_num_cpu_devices=2)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

    def shard(params, x, y):
        def place(a):  # kernels split over their output dimension, the rest replicated
            spec = P(None, "d") if a.ndim == 2 and a.shape[1] % 2 == 0 else P()
            return jax.device_put(a, NamedSharding(mesh, spec))

        params = jax.tree.map(place, params)
        assert len(params["params"]["Dense_0"]["kernel"].sharding.device_set) == 2
        batch = NamedSharding(mesh, P("d"))
        return params, jax.device_put(x, batch), jax.device_put(y, batch)

    sharded, history = captured_run(tmp_path / "sharded", True, shard)
    assert len(history[-1][0]["params"]["Dense_0"]["kernel"].sharding.device_set) == 2
    assert_same_log(sharded, linen_runs["jit"][0])


def test_param_names_skip_other_linen_collections_and_non_float_leaves():
    from tandv.track.jax.trees import param_leaves

    variables = {
        "params": {
            "BatchNorm_0": {"scale": jnp.ones(3), "bias": jnp.zeros(3)},
            "layers": [{"kernel": jnp.ones((2, 2))}],
            "ids": jnp.arange(3),
        },
        "batch_stats": {"BatchNorm_0": {"mean": jnp.zeros(3), "var": jnp.ones(3)}},
    }
    leaves, _ = param_leaves(variables)
    assert {leaf.name for _, leaf in leaves} == {
        "BatchNorm_0.scale",
        "BatchNorm_0.bias",
        "layers.0.kernel",
    }
    flat = jax.tree_util.tree_leaves(variables)
    for _, leaf in leaves:  # indices point at the right leaves
        assert flat[leaf.index].dtype == jnp.float32


def test_bfloat16_parameters_are_summarized_in_their_own_format(tmp_path):
    params = {"params": {"w": (jnp.arange(-6, 6, dtype=jnp.float32) / 7).astype(jnp.bfloat16)}}
    with track(params, out=tmp_path / "log", verbose=False, track_gradients=False) as tracker:
        with pytest.raises(TypeError, match="f must be the update function"):
            tracker.intercept(None)
        tracker.step(params)
    df = read_log(tmp_path / "log")
    assert row(df, "w", "Weight", 0)[("metadata", "dtype")] == "bfloat16"
    assert_row_matches(df, "w", "Weight", 0, np.asarray(params["params"]["w"]))


def test_host_kernel_reads_step_arrays_before_a_donating_update_can_reuse_them(tmp_path):
    """On the CPU the host kernel summarizes the arrays given to ``step`` in a background
    thread while the next update runs. An update that donates its inputs must not change what
    it reads: every Weight row equals the reference of the parameters as they were passed."""
    import jax

    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(300, 700)), jnp.float32)}  # read in place
    update = jax.jit(
        lambda p: jax.tree_util.tree_map(lambda x: x * -1.5 + 0.25, p), donate_argnums=0
    )
    seen = []
    with track(
        params, track_gradients=False, track_activations=False, out=tmp_path / "log", verbose=False
    ) as tracker:
        for _ in range(4):
            seen.append(np.array(params["w"]))
            params = update(params)
            tracker.step(params)
    df = read_log(tmp_path / "log")
    for k, w in enumerate(seen):
        assert_row_matches(df, "w", "Weight", k, w)


@pytest.mark.in_program_kernel
def test_step_time_rows_keep_the_host_kernels_float64_moments(tmp_path):
    """On the CPU the arrays given to ``step`` are summarized by the host kernel inside an
    XLA program, whose float outputs are float32 without x64. Their moments still come out
    as the kernel's float64 sums: equal to numpy's float64 computation to 1e-12, where
    float32 rounding is off by about 1e-8; counts stay exact."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal(1001) * 3 + 0.7).astype(np.float32)
    w[::97] = 0
    g = (rng.standard_normal((13, 77)) * 1e-3 - 2e-4).astype(np.float32)
    params = {"w": jnp.asarray(w), "k": jnp.asarray(g * 50)}
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        tracker.step(params, gradients={"w": jnp.asarray(w * -2), "k": jnp.asarray(g)})
        tracker.step({"w": jnp.asarray(w[::-1]), "k": params["k"]}, gradients=params)
    df = read_log(tmp_path / "log")
    for step, name, tensor_type, a in [
        (0, "w", "Weight", w),
        (0, "k", "Weight", g * 50),
        (0, "w", "Gradient", w * -2),
        (0, "k", "Gradient", g),
        (1, "w", "Weight", w[::-1]),
        (1, "w", "Gradient", w),
    ]:
        s = row(df, name, tensor_type, step)["scalar_stats"]
        d = a.astype(np.float64).ravel()
        for stat, want in (("mean", d.mean()), ("std", d.std())):
            assert abs(float(np.float32(want)) - want) > 1e-11 * abs(want)  # float32 would fail
            assert s[stat] == pytest.approx(want, rel=1e-12, abs=0), (step, name, tensor_type)
        assert s["numel"] == a.size and s["zero_count"] == int((a == 0).sum())
