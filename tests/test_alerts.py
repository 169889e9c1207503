"""Alerts while training (``track(on_nonfinite=..., alerts=...)``), both trackers: a NaN put into
one layer's output at a known step stops the run within two steps, names that step and layer,
and leaves a log that ends at it."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest

import tandv
from tandv.schema import read_log
from tandv.track.common import TrackOptions

BAD = 5  # the step whose activation gets a NaN
STEPS = 10


# ----------------------------------------------------------------------------- PyTorch


def torch_run(out, poison_step=BAD, layer=2, **options):
    """Train a small MLP for STEPS steps; at ``poison_step`` the output of ``model[layer]``
    gets a NaN (a user hook, registered before tandv's). Returns (the step of the last
    ``tracker.step()`` entered, the error raised or None)."""
    import torch
    from torch import nn

    from tandv.track.torch import track

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    state = {"step": 0}

    def poison(module, inputs, output):
        if state["step"] == poison_step:
            output = output.clone()
            output[0, 0] = float("nan")
            return output
        return None

    model[layer].register_forward_hook(poison)
    error = None
    try:
        with track(model, opt, out=out, verbose=False, **options) as tracker:
            for step in range(STEPS):
                state["step"] = step
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                tracker.step()
    except tandv.AlertError as e:
        error = e
    return state["step"], error


def test_torch_nan_raises_within_two_steps_naming_step_and_layer(tmp_path):
    at, error = torch_run(tmp_path / "log", on_nonfinite="raise")
    assert isinstance(error, tandv.NonFiniteError)
    assert BAD <= at <= BAD + 2
    assert error.step == BAD
    # layers 0 and 1 are clean at step 5: the first non-finite tensor is layer 2's output,
    # though its weights' gradients and later layers also hold NaN at that step
    assert (error.tensor_type, error.name) == ("Activation", "2")
    assert f"step {BAD}" in str(error) and "Activation '2'" in str(error)
    assert set(error.rows[("metadata", "name")]) > {"2"}  # more tensors went bad, "2" first
    steps = sorted(read_log(tmp_path / "log")[("metadata", "step")].unique())
    assert steps == list(range(BAD + 1))
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), str(back), back.step, back.name) == (
        tandv.NonFiniteError,
        str(error),
        BAD,
        "2",
    )


def test_torch_pickle_log_is_written_when_it_raises(tmp_path):
    out = tmp_path / "log.pkl"
    _, error = torch_run(out, on_nonfinite="raise", out_format="pickle")
    assert isinstance(error, tandv.NonFiniteError)
    df = read_log(out, trust_pickle=True)
    assert sorted(df[("metadata", "step")].unique()) == list(range(BAD + 1))
    assert str(out) in str(error)


def test_torch_clean_run_does_not_raise(tmp_path):
    at, error = torch_run(tmp_path / "log", poison_step=-1, on_nonfinite="raise")
    assert error is None and at == STEPS - 1
    assert read_log(tmp_path / "log")[("metadata", "step")].nunique() == STEPS


def test_torch_warn_once_and_keep_training(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at, error = torch_run(tmp_path / "log", on_nonfinite="warn")
    assert error is None and at == STEPS - 1
    ours = [w for w in caught if "NaN/inf at step" in str(w.message)]
    assert len(ours) == 1  # the first bad step only, though later steps hold NaN too
    assert f"step {BAD}" in str(ours[0].message) and "'2'" in str(ours[0].message)
    assert read_log(tmp_path / "log")[("metadata", "step")].nunique() == STEPS


def test_torch_callable_gets_each_bad_steps_rows_in_computation_order(tmp_path):
    seen = []

    def handler(rows):
        m = rows["metadata"]
        seen.append((int(m["step"].iloc[0]), m["tensor_type"].iloc[0], m["name"].iloc[0]))
        bad = rows[("scalar_stats", "nan_count")] + rows[("scalar_stats", "inf_count")]
        assert (bad > 0).all()  # only the tensors that hold NaN/inf

    at, error = torch_run(tmp_path / "log", on_nonfinite=handler)
    assert error is None and at == STEPS - 1
    assert seen[0] == (BAD, "Activation", "2")
    # from step 6 the weights themselves are NaN (the update took the NaN gradient)
    assert [s for s, _, _ in seen] == list(range(BAD, STEPS))
    assert all(tt == "Weight" for s, tt, _ in seen[1:])


def test_torch_callable_that_raises_stops_the_run(tmp_path):
    class Stop(Exception):
        pass

    def handler(rows):
        raise Stop("enough")

    with pytest.raises(Stop):
        torch_run(tmp_path / "log", on_nonfinite=handler)
    steps = sorted(read_log(tmp_path / "log")[("metadata", "step")].unique())
    assert steps == list(range(BAD + 1))


def test_torch_alert_rule_over_rows(tmp_path):
    """A rule flags the first step where a gradient's largest |value| passes a bound found
    from an unflagged run of the same training (the independent expectation)."""
    _, error = torch_run(tmp_path / "ref", poison_step=-1)
    ref = read_log(tmp_path / "ref")
    grads = ref[ref[("metadata", "tensor_type")] == "Gradient"]
    per_step = (
        grads[("scalar_stats", "max_abs")].groupby(grads[("metadata", "step")].to_numpy()).max()
    )
    bound = float(np.median(per_step))
    expected = int(per_step.index[np.argmax(per_step.to_numpy() > bound)])

    def rule(rows):
        g = rows[rows[("metadata", "tensor_type")] == "Gradient"]
        top = g[("scalar_stats", "max_abs")].max()
        return f"gradient max_abs {top:.3g} > {bound:.3g}" if top > bound else None

    at, error = torch_run(tmp_path / "log", poison_step=-1, alerts=rule)
    assert isinstance(error, tandv.AlertError) and not isinstance(error, tandv.NonFiniteError)
    assert error.step == expected and expected <= at <= expected + 2
    assert f"alert at step {expected}: gradient max_abs" in str(error)
    steps = sorted(read_log(tmp_path / "log")[("metadata", "step")].unique())
    assert steps == list(range(expected + 1))


def test_alert_options_are_checked():
    with pytest.raises(ValueError, match="on_nonfinite='stop'"):
        TrackOptions(on_nonfinite="stop")
    with pytest.raises(ValueError, match="on_nonfinite=array"):
        TrackOptions(on_nonfinite=np.array(["raise", "warn"]))
    with pytest.raises(TypeError, match="alerts"):
        TrackOptions(alerts=["not callable"])
    TrackOptions(on_nonfinite=print, alerts=lambda rows: None)


# ----------------------------------------------------------------------------- JAX


def jax_run(out, poison_step=BAD, **options):
    """The JAX twin of :func:`torch_run`: a linen MLP whose second block's output gets a NaN
    at ``poison_step`` (through an argument of the jitted update)."""
    jax = pytest.importorskip("jax")
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    from tandv.track.jax import track

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, poison):
            return nn.relu(nn.Dense(8, name="Dense_0")(x)) + poison

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, poison):
            h = Block(name="Block_0")(x, 0.0)
            h = Block(name="Block_1")(h, poison)
            return nn.Dense(2, name="Dense_0")(h)

    model, opt = MLP(), optax.sgd(0.1)
    k1, k2 = jax.random.split(jax.random.key(0))
    x, y = jax.random.normal(k1, (16, 4)), jax.random.normal(k2, (16, 2))
    params = model.init(jax.random.key(1), x, 0.0)
    state = opt.init(params)

    @jax.jit
    def update(p, s, poison):
        def loss(p):
            return jnp.mean((model.apply(p, x, poison) - y) ** 2)

        g = jax.grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    last, error = 0, None
    try:
        with track(params, state, out=out, verbose=False, **options) as tracker:
            for step in range(STEPS):
                last = step
                poison = jnp.float32(np.nan if step == poison_step else 0.0)
                params, state, grads = tracker.intercept(update, params, state, poison)
                tracker.step(params, state, grads)
    except tandv.AlertError as e:
        error = e
    return last, error


def test_jax_nan_raises_within_two_steps_naming_step_and_layer(tmp_path):
    at, error = jax_run(tmp_path / "log", on_nonfinite="raise")
    assert isinstance(error, tandv.NonFiniteError)
    assert BAD <= at <= BAD + 2
    assert error.step == BAD
    # Block_0 and Block_1's own Dense are clean: Block_1's output is the first NaN
    assert (error.tensor_type, error.name) == ("Activation", "Block_1")
    assert f"step {BAD}" in str(error) and "'Block_1'" in str(error)
    steps = sorted(read_log(tmp_path / "log")[("metadata", "step")].unique())
    assert steps == list(range(BAD + 1))


def test_jax_clean_run_does_not_raise(tmp_path):
    at, error = jax_run(tmp_path / "log", poison_step=-1, on_nonfinite="raise")
    assert error is None and at == STEPS - 1
    assert read_log(tmp_path / "log")[("metadata", "step")].nunique() == STEPS


def test_alert_due_when_the_loop_fails_is_reported_beside_the_loops_error(
    tmp_path, capsys, monkeypatch
):
    """JAX lands a step once its summaries are computed, up to some steps later: a loop that
    fails in between still gets its own error, the alert is printed, and the log ends at
    the bad step."""
    jax = pytest.importorskip("jax")
    from tandv.track.jax import _transfer, track

    # summaries not computed until the tracker closes (XLA:CPU may compute them at once)
    monkeypatch.setattr(_transfer.Transfer, "ready", lambda self: False)
    params = {"w": jax.numpy.ones((2, 3))}

    def update(p, bad):
        return {"w": p["w"] * bad}

    with pytest.raises(KeyError, match="the loop's own"):
        with track(
            params, track_gradients=False, out=tmp_path / "log", verbose=False, on_nonfinite="raise"
        ) as tracker:
            for step in range(STEPS):
                if step == BAD + 1:
                    raise KeyError("the loop's own")
                # the weights given at step k are the Weight rows of step k + 1
                params = tracker.intercept(update, params, np.nan if step == BAD - 1 else 1.0)
                tracker.step(params)
    err = capsys.readouterr().err
    assert f"NaN/inf at step {BAD}: first in Weight 'w'" in err
    assert "could not finish the log" not in err
    steps = sorted(read_log(tmp_path / "log")[("metadata", "step")].unique())
    assert steps == list(range(BAD + 1))
