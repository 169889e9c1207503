"""The tracked update on JAX's C++ dispatch path (``_intercept.TrackedProgram``): a jitted
update is called through one compiled program that makes its mailbox arena inside and
returns the words as an extra output, so a tracked call costs about the Python calls of an
untracked one; the user's donation, static arguments, nnx updates and shardings carry over;
``tracker.step()`` does not wait for the device."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from test_jax_tracker import assert_row_matches  # noqa: E402

from tandv.schema import read_log  # noqa: E402
from tandv.track.jax import track  # noqa: E402


def python_calls(fn, *args, **kwargs) -> int:
    """Python function calls made while ``fn(*args, **kwargs)`` runs (``sys.setprofile``'s
    ``call`` events: Python frames, not C functions)."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return calls[0] - 1  # the profiled call itself


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, name="hidden")(x))
        return nn.Dense(1, name="head")(x)


def dyadic(tree):
    """``tree`` rounded to multiples of 1/8."""
    return jax.tree.map(lambda a: jnp.round(8 * a) / 8, tree)


def mlp_setup():
    """The MLP, its parameters, Adam's state, data and update. Data and parameters are
    multiples of 1/8 and 1/4 (exact in float32 products and sums: the first step's values
    are the same wherever they are computed)."""
    model, opt = MLP(), optax.adam(1e-2)
    x = jnp.round(4 * jax.random.normal(jax.random.key(0), (8, 5))) / 4
    y = jnp.round(4 * jax.random.normal(jax.random.key(1), (8, 1))) / 4
    params = dyadic(model.init(jax.random.key(2), x))

    def loss(p, x, y):
        return jnp.mean((model.apply(p, x) - y) ** 2)

    def update(p, s, x, y):
        grads = jax.grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, grads

    return model, params, opt.init(params), x, y, update


def test_a_jitted_update_costs_about_the_python_calls_of_an_untracked_call(tmp_path):
    """Counted with sys.setprofile: the tracked call of a jitted update makes at most
    2U + 20 Python calls, U those of the untracked call (before the tracked program, a ref
    closed over by the update sent every call through JAX's Python dispatch: thousands)."""
    _, params, state, x, y, update = mlp_setup()
    update = jax.jit(update)
    for _ in range(3):
        update(params, state, x, y)
    untracked = min(python_calls(update, params, state, x, y) for _ in range(3))
    with track(params, state, out=tmp_path / "log", verbose=False) as tracker:
        p, s = params, state
        for _ in range(3):  # compile and warm up
            p, s, g = tracker.intercept(update, p, s, x, y)
            tracker.step(p, s, g)
        tracked = python_calls(tracker.intercept, update, p, s, x, y)
    assert tracked <= 2 * untracked + 20, (tracked, untracked)


class Deep(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(8)(x))
        return nn.Dense(1)(x)


def steady_calls(tmp_path, depth):
    """Python calls of one tracked call and of one ``step()`` of an MLP of ``depth`` hidden
    layers with Adam (after warm-up; each ``step()`` records the step before it), and the
    calls of the step-time summarizing program that ``step()`` made."""
    model, opt = Deep(depth), optax.adam(1e-2)
    x, y = jnp.ones((4, 5)), jnp.ones((4, 1))
    params = model.init(jax.random.key(0), x)

    @jax.jit
    def update(p, s):
        g = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    with track(params, opt.init(params), out=tmp_path / f"d{depth}", verbose=False) as tracker:
        # each step() records the step before it, no other: the same work at every step
        tracker._adapter.in_flight_steps = 0
        tracker._adapter.arrived = lambda transfer: False  # (not also the step itself, when done)
        tracker.recorder.flush_seconds = float("inf")  # (nor the log's hand-over)
        p, s = params, opt.init(params)
        for _ in range(4):
            out = tracker.intercept(update, p, s)
            tracker.step(*out)
            p, s, _ = out
        for _, _, sent in tracker._flights:  # the step to record has arrived
            jax.block_until_ready(sent.transfer._device)
        summarized = []
        own = tracker._kernels.summarize_one_device
        tracker._kernels.summarize_one_device = lambda *a: summarized.append(a) or own(*a)
        out = [None]
        intercept = python_calls(lambda: out.__setitem__(0, tracker.intercept(update, p, s)))
        stepped = python_calls(tracker.step, *out[0])
    return intercept, stepped, summarized


def test_a_tracked_step_costs_the_same_python_calls_for_any_model_size(tmp_path):
    """A tracked step of a jitted update does no Python work per array: the tracked program
    summarizes its outputs (parameters, optimizer state, gradients) itself, so step() makes
    no summarizing call of its own, and the rows of a step are one observation, expanded on
    the log's writer thread. An MLP of 1 and of 6 hidden layers (12 and 42 tracked arrays
    per step): the same Python calls on the training thread, but for a few that depend on
    what the log's writer thread is doing at that moment (seen: step() 133 and 137, the
    tracked call 18 and 20, under load); work per array would add at least one call for each
    of the 30 more arrays."""
    small = steady_calls(tmp_path, 1)
    large = steady_calls(tmp_path, 6)
    assert small[2] == large[2] == []  # no summarizing call in step()
    assert abs(large[0] - small[0]) <= 4, (small, large)
    assert abs(large[1] - small[1]) <= 8, (small, large)


def run_log(path, update, steps=3):
    """Log of ``steps`` tracked steps of ``update`` (jitted or not) on the MLP; returns the
    log and the gradients of each step."""
    model, params, state, x, y, _ = mlp_setup()
    grads = []
    with track(params, state, out=path, verbose=False) as tracker:
        p, s = params, state
        for _ in range(steps):
            p, s, g = tracker.intercept(update, p, s, x, y)
            grads.append(g)
            tracker.step(p, s, g)
    return read_log(path), grads


def test_the_tracked_program_logs_what_the_python_path_logs(tmp_path):
    """The same steps through the tracked program (a jitted update) and through the
    closed-over arena (the same jitted function called from plain Python): the same rows,
    bit for bit, and the module rows equal the numpy reference."""
    model, params, _, x, y, update = mlp_setup()
    jitted = jax.jit(update)
    fast, grads = run_log(tmp_path / "fast", jitted)
    slow, _ = run_log(tmp_path / "slow", lambda *a: jitted(*a))
    key = [("metadata", c) for c in ("step", "name", "tensor_type")]
    fast = fast.sort_values(key).reset_index(drop=True)
    slow = slow.sort_values(key).reset_index(drop=True)
    assert len(fast) == len(slow) > 0
    stats = [c for c in fast.columns if c[0] in ("scalar_stats", "exponent_counts")]
    np.testing.assert_array_equal(fast[stats].to_numpy(), slow[stats].to_numpy())
    # the first step's rows against numpy (exact values: see mlp_setup)
    w = {
        k: {n: np.asarray(a, np.float64) for n, a in v.items()} for k, v in params["params"].items()
    }
    hidden = np.asarray(x, np.float64) @ w["hidden"]["kernel"] + w["hidden"]["bias"]
    out = np.maximum(hidden, 0) @ w["head"]["kernel"] + w["head"]["bias"]
    assert_row_matches(fast, "hidden", "Activation", 0, hidden.astype(np.float32))
    assert_row_matches(fast, "head", "Activation", 0, out.astype(np.float32))
    cotangent = 2 * (out - np.asarray(y, np.float64)) / out.size
    assert_row_matches(fast, "head", "Gradient", 0, cotangent.astype(np.float32))
    assert_row_matches(fast, "head.kernel", "Gradient", 0, grads[0]["params"]["head"]["kernel"])


def test_donation_and_static_arguments_carry_over(tmp_path):
    """``donate_argnums`` and ``static_argnums`` of the user's jit hold for the tracked
    call: the donated parameters are deleted as by the untracked call, the static argument
    picks the computation (a new value: a new trace), and the rows follow it."""
    model = nn.Dense(3)
    x = jnp.arange(12.0).reshape(4, 3) / 4
    params = dyadic(model.init(jax.random.key(0), x))

    def update(p, x, scale):
        g = jax.grad(lambda p: jnp.sum(model.apply(p, x) * scale))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), g

    jitted = jax.jit(update, static_argnums=2, donate_argnums=0)
    copy = jax.tree.map(jnp.copy, params)
    jitted(copy, x, 2.0)
    donates = jax.tree.leaves(copy)[0].is_deleted()
    outs = []
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        p = jax.tree.map(jnp.copy, params)
        for scale in (2.0, -3.0):
            given = p
            w = {k: np.asarray(a, np.float64) for k, a in p["params"].items()}
            outs.append(np.asarray(x, np.float64) @ w["kernel"] + w["bias"])
            p, g = tracker.intercept(jitted, p, x, scale)
            assert jax.tree.leaves(given)[0].is_deleted() == donates
            tracker.step(p, g)
    df = read_log(tmp_path / "log")
    for step, (out, scale) in enumerate(zip(outs, (2.0, -3.0))):
        assert_row_matches(df, "root", "Activation", step, out.astype(np.float32))
        assert_row_matches(df, "root", "Gradient", step, np.full(out.shape, scale, np.float32))


def test_nnx_jit_updates_the_model_as_untracked(tmp_path):
    """An ``nnx.jit`` train step runs its inner jitted function as a tracked program: the
    model and optimizer are updated as by the untracked step (the same values), the rows
    are logged, and the call costs about the Python calls of an untracked one."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 8, rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.fc(x)))

    @nnx.jit
    def train_step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return grads

    x = jax.random.normal(jax.random.key(0), (6, 4))
    y = jnp.ones((6, 1))
    ref = Net(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with track(model, optimizer, out=tmp_path / "log", verbose=False) as tracker:
        for _ in range(3):
            seen = np.asarray(model(x))
            train_step(ref, ref_opt, x, y)
            grads = tracker.intercept(train_step, model, optimizer, x, y)
            tracker.step(model, optimizer, grads)
        untracked = python_calls(train_step, ref, ref_opt, x, y)
        tracked = python_calls(tracker.intercept, train_step, model, optimizer, x, y)
        tracker.step(model, optimizer, grads)
    np.testing.assert_array_equal(np.asarray(model.fc.kernel[...]), np.asarray(ref.fc.kernel[...]))
    assert tracked <= 2 * untracked + 20, (tracked, untracked)
    df = read_log(tmp_path / "log")
    assert_row_matches(df, "root", "Activation", 2, seen)


def test_shardings_carry_over(tmp_path):
    """A jit with ``in_shardings``/``out_shardings`` over two CPU devices: the tracked call
    returns arrays sharded as the untracked call's, and the rows equal the numpy reference
    of the whole arrays."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if len(jax.devices()) < 2:
        pytest.skip("needs two devices (tests/conftest.py sets jax_num_cpu_devices)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    rows, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    model = nn.Dense(4)
    x = jax.device_put(jnp.arange(24.0).reshape(8, 3) / 5, rows)
    params = jax.device_put(model.init(jax.random.key(0), x), repl)

    def forward(p, x):
        return model.apply(p, x)

    jitted = jax.jit(forward, in_shardings=(repl, rows), out_shardings=rows)
    expected = jitted(params, x)
    with track(params, out=tmp_path / "log", verbose=False, track_gradients=False) as tracker:
        out = tracker.intercept(jitted, params, x)
        tracker.step(params)
    assert out.sharding.is_equivalent_to(expected.sharding, out.ndim)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    assert_row_matches(read_log(tmp_path / "log"), "root", "Activation", 0, np.asarray(expected))


#: How long the update of the test below takes on the device, at least (seconds).
BUSY_S = 1.0


def test_step_returns_before_the_update_has_run(tmp_path):
    """``tracker.step()`` waits for nothing on the device: the update's gradients depend on
    a loop of matrix products that keeps XLA:CPU busy for about ``BUSY_S`` seconds (its
    length measured first), and when ``intercept()`` and ``step()`` have returned the
    gradients are still being computed (``is_ready()`` is False). Were step() to read any of
    the step's values (a view, a summary, the mailbox words), they would be ready.

    (A program holding its values in a host callback, as ``jax.pure_callback``, cannot
    show it: XLA:CPU runs such a program synchronously, inside the call.)"""
    model = nn.Dense(3)
    x = jnp.arange(12.0).reshape(4, 3) / 7
    params = model.init(jax.random.key(0), x)
    w = jnp.eye(256) * 0.5 + 0.25 / 256

    def busy(n):
        """n products of 256 x 256 matrices, and a 4 x 3 zero matrix that depends on them."""
        m = jax.lax.fori_loop(0, n, lambda i, m: jnp.tanh(m @ w), jnp.ones((256, 256)))
        return jnp.zeros((4, 3)) * m[:4, :3]

    @jax.jit
    def update(p, n):
        return jax.grad(lambda p: jnp.sum(model.apply(p, x + busy(n)) ** 2))(p)

    def kernel_of(grads):
        return grads["params"]["kernel"]

    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        tracker.step(params, tracker.intercept(update, params, 1))  # compiles
        n = 16
        while True:  # a loop long enough to outlast the host's work by far
            start = time.monotonic()
            jax.block_until_ready(update(params, n))
            if time.monotonic() - start >= BUSY_S / 4 or n >= 1 << 20:
                break
            n *= 4
        grads = tracker.intercept(update, params, 4 * n)
        dispatched = not kernel_of(grads).is_ready()
        tracker.step(params, grads)
        still_running = not kernel_of(grads).is_ready()
    assert dispatched, "intercept() returned after the update had run"
    assert still_running, "step() returned after the update had run: it waited for it"
    df = read_log(tmp_path / "log")
    g = jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(params)
    assert_row_matches(df, "kernel", "Gradient", 1, g["params"]["kernel"])


def test_overhead_benchmark_tiny_mode():
    """``benchmarks/jax_overhead.py`` on a tiny MLP: it runs, and prints last the Python
    calls per tracked call (within 2U + 20 of the untracked call's U) and the host time per
    tracked step."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "jax_overhead.py"), "--width", "16"]
        + ["--depth", "2", "--batch", "8", "--block", "10", "--rounds", "1"]
        + ["--block-formats", "mxfp8_e4m3", "nvfp4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "every=1 with block formats mxfp8_e4m3 + nvfp4: median step" in done.stdout
    last = done.stdout.strip().splitlines()[-2:]
    calls = re.fullmatch(r"python_calls_per_tracked_call: (\d+) \(untracked: (\d+)\)", last[0])
    assert calls, last
    tracked, untracked = int(calls[1]), int(calls[2])
    assert tracked <= 2 * untracked + 20, last
    host = re.fullmatch(r"host_ms_per_tracked_step: ([0-9.]+)", last[1])
    assert host and float(host[1]) > 0, last
