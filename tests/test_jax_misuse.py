"""JAX tracker misuse that used to give plausible wrong rows (issue 28): each is refused
with an error naming what to change, and the documented uses next to it still work."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from test_jax_tracker import assert_row_matches, data, names, row  # noqa: E402
from test_jax_transforms import assert_close_row, two_devices  # noqa: E402

from tandv.schema import read_log  # noqa: E402
from tandv.track.jax import track  # noqa: E402
from tandv.track.jax._misuse import replica_axis  # noqa: E402


def dense_setup():
    model, opt = nn.Dense(4), optax.adam(1e-2)
    x, _ = data()
    params = model.init(jax.random.key(1), x)
    return model, opt, x, params, opt.init(params)


def adam_update(model, opt):
    @jax.jit
    def update(p, s, x):
        g = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    return update


# ----------------------------------------------------------------------------- step() trees


def test_swapped_step_arguments_are_refused_naming_the_argument(tmp_path):
    """step(p, g, o) used to write Optimiser_State rows 'bias.state' and Gradient rows
    '0.mu.params.bias'; now the argument whose tree is wrong is named."""
    model, opt, x, params, state = dense_setup()
    update = adam_update(model, opt)
    with track(params, state, out=tmp_path / "log", verbose=False) as tracker:
        p, s, g = tracker.intercept(update, params, state, x)
        for _ in range(2):  # refused again: the failed call left nothing cached
            with pytest.raises(ValueError, match="optimizer_state does not have the structure"):
                tracker.step(p, g, s)
        with pytest.raises(ValueError, match="gradients has leaves that name no parameter"):
            tracker.step(p, s, s)  # the optimizer state where the gradients go
        with pytest.raises(ValueError, match="model_state does not hold the parameters"):
            tracker.step(s, s, g)
        tracker.step(p, s, g)  # the documented order still records
    df = read_log(tmp_path / "log")
    assert names(df, "Optimiser_State") == {"bias.mu", "bias.nu", "kernel.mu", "kernel.nu"}
    assert names(df, "Gradient") == {"root", "bias", "kernel"}
    assert_row_matches(df, "kernel", "Gradient", 0, g["params"]["kernel"])
    assert_row_matches(df, "kernel.mu", "Optimiser_State", 0, s[0].mu["params"]["kernel"])


def test_second_positional_argument_is_the_gradients_only_when_it_is(tmp_path):
    """Without an optimizer state in track(), step(params, x) takes x as the gradients (the
    documented form); an optimizer state given there is refused, saying why it was read as
    gradients, instead of becoming Gradient rows '0.mu.params.kernel'."""
    model, opt, x, params, state = dense_setup()
    update = adam_update(model, opt)
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        p, s, g = tracker.intercept(update, params, state, x)
        with pytest.raises(ValueError, match="second positional argument"):
            tracker.step(p, s)
        tracker.step(p, g)
    df = read_log(tmp_path / "log")
    assert names(df, "Gradient") == {"root", "bias", "kernel"}
    assert_row_matches(df, "bias", "Gradient", 0, g["params"]["bias"])


def test_gradients_shaped_unlike_their_parameters_are_refused(tmp_path):
    model, opt, x, params, state = dense_setup()
    per_example = jax.tree.map(lambda a: jnp.stack([a] * 3), params)
    with track(params, out=tmp_path / "log", track_activations=False, verbose=False) as t:
        with pytest.raises(ValueError, match=r"shaped unlike their parameters: 'bias' \(3, 4\)"):
            t.step(params, per_example)


def test_a_gradient_subset_and_the_nnx_forms_pass(tmp_path):
    """Frozen parameters have no gradient: a gradient tree naming some parameters passes.
    nnx modules, optimizers and gradient states pass the checks step after step."""
    model, opt, x, params, state = dense_setup()
    with track(params, out=tmp_path / "a", track_activations=False, verbose=False) as t:
        t.step(params, {"params": {"kernel": params["params"]["kernel"]}})
    assert names(read_log(tmp_path / "a"), "Gradient") == {"kernel"}

    m = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    o = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train(m, o, x):
        g = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(m)
        o.update(m, g)
        return g

    with track(model_state=m, optimizer_state=o, out=tmp_path / "b", verbose=False) as t:
        for _ in range(2):
            g = t.intercept(train, m, o, x)
            t.step(m, o, g)
        with pytest.raises(ValueError, match="optimizer_state does not have the structure"):
            t.step(m, g, g)
    df = read_log(tmp_path / "b")
    assert names(df, "Gradient", 1) == {"root", "bias", "kernel"}


# ----------------------------------------------------------------------------- pmap copies


def test_pmap_with_an_axis_name_is_refused_without_device_axis(tmp_path):
    """pmap(axis_name=...) outputs used to give rows of both copies (numel doubled)."""
    devices = two_devices()
    model = nn.Dense(4)
    x, _ = data()
    params = model.init(jax.random.key(1), x)
    stacked = jax.tree.map(lambda a: jnp.stack([a] * 2), params)
    grad = jax.pmap(
        lambda p, x: jax.lax.pmean(jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(p), "i"),
        axis_name="i",
        devices=devices,
    )
    with track(stacked, out=tmp_path / "log", verbose=False) as tracker:
        grads = tracker.intercept(grad, stacked, x.reshape(2, 4, 5))
        with pytest.raises(ValueError, match=r"device_axis=True.*device_axis=False"):
            tracker.step(stacked, gradients=grads)
    # the same arrays with device_axis=True: rows of one replica
    with track(stacked, out=tmp_path / "ok", device_axis=True, verbose=False) as tracker:
        grads = tracker.intercept(grad, stacked, x.reshape(2, 4, 5))
        tracker.step(stacked, gradients=grads)
    assert_row_matches(
        read_log(tmp_path / "ok"), "kernel", "Gradient", 0, grads["params"]["kernel"][0]
    )


def test_arrays_split_along_their_leading_axis_on_purpose(tmp_path):
    """A sharded model whose every array is split along a leading axis of one slice per
    device looks like pmap's copies: refused by default, and device_axis=False says it is
    not (rows of the whole arrays). A model with other layouts is not refused."""
    devices = two_devices()
    mesh = Mesh(np.array(devices), ("d",))
    rows_split = NamedSharding(mesh, P("d"))
    stack = {"params": {"w": jnp.arange(10.0).reshape(2, 5), "b": jnp.ones((2, 3))}}
    stack = jax.device_put(stack, rows_split)
    assert replica_axis(stack["params"]["w"]) == "d"
    grads = jax.tree.map(lambda a: a * 2, stack)
    with pytest.raises(ValueError, match="device_axis=False"):  # at track(): the weights
        track(stack, out=tmp_path / "no", track_activations=False, verbose=False)
    with track(
        stack, out=tmp_path / "yes", device_axis=False, track_activations=False, verbose=False
    ) as t:
        t.step(stack, grads)
    assert_row_matches(
        read_log(tmp_path / "yes"), "w", "Gradient", 0, np.asarray(grads["params"]["w"])
    )

    mixed = dict(stack["params"], c=jax.device_put(jnp.ones(3), NamedSharding(mesh, P())))
    assert replica_axis(mixed["c"]) is None
    with track(mixed, out=tmp_path / "mixed", track_activations=False, verbose=False) as t:
        t.step(mixed, jax.tree.map(lambda a: a * 2, mixed))
    assert row(read_log(tmp_path / "mixed"), "w", "Gradient", 0)[("scalar_stats", "numel")] == 10


# ----------------------------------------------------------------------------- shard_map, pmap


def test_shard_map_without_varying_axes_is_refused(tmp_path):
    """With check_vma=False a module output computed alike on every device counted once per
    device (root numel 64 for a batch of 32 values); now refused, naming check_vma."""
    mesh = Mesh(np.array(two_devices()), ("d",))
    model, _, x, params, _ = dense_setup()
    forward = jax.jit(
        jax.shard_map(model.apply, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    )
    with track(params, out=tmp_path / "log", track_gradients=False, verbose=False) as tracker:
        with pytest.raises(ValueError, match="check_vma=True"):
            tracker.intercept(forward, params, x)
    checked = jax.jit(jax.shard_map(model.apply, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
    with track(params, out=tmp_path / "ok", track_gradients=False, verbose=False) as tracker:
        tracker.intercept(checked, params, x)
        tracker.step(params)
    assert_row_matches(read_log(tmp_path / "ok"), "root", "Activation", 0, model.apply(params, x))


def test_cotangent_rows_are_those_of_the_loss_each_device_differentiates(tmp_path):
    """The Gradient row of a module output is the cotangent of the loss each device
    differentiates. shard_map with the global loss (pmean of the per-device means): equal
    to a one-device run over the whole batch. pmap's idiom (per-device mean loss, gradients
    pmean'd afterwards): each device differentiates N times its share of the global loss,
    and its cotangents are N times the one-device run's (as docs/distributed.md says)."""
    devices = two_devices()
    mesh = Mesh(np.array(devices), ("d",))
    model, _, x, params, _ = dense_setup()
    out = np.asarray(model.apply(params, x), np.float64)
    one_device = 2 * out / out.size  # d mean(out**2) / d out, over the whole batch

    def global_loss(p, x):
        return jax.grad(lambda p: jax.lax.pmean(jnp.mean(model.apply(p, x) ** 2), "d"))(p)

    update = jax.jit(jax.shard_map(global_loss, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))
    with track(params, out=tmp_path / "sm", verbose=False) as tracker:
        grads = tracker.intercept(update, params, x)
        tracker.step(params, gradients=grads)
    df = read_log(tmp_path / "sm")
    assert_close_row(df, "root", "Gradient", 0, one_device)
    want = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)["params"]["kernel"]
    assert_close_row(df, "kernel", "Gradient", 0, want)

    stacked = jax.tree.map(lambda a: jnp.stack([a] * 2), params)

    def local_mean(p, x):
        g = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(p)
        return jax.lax.pmean(g, "d")

    step = jax.pmap(local_mean, axis_name="d", devices=devices)
    with track(stacked, out=tmp_path / "pm", device_axis=True, verbose=False) as tracker:
        grads = tracker.intercept(step, stacked, x.reshape(2, 4, 5))
        tracker.step(stacked, gradients=grads)
    df = read_log(tmp_path / "pm")
    assert_close_row(df, "root", "Gradient", 0, 2 * one_device)
    assert_close_row(df, "kernel", "Gradient", 0, want)  # the pmean'd gradients: one run's


# ----------------------------------------------------------------------------- applied twice


def teacher_update(model):
    @jax.jit
    def update(p, ema, x):
        def loss(p):
            teacher = model.apply(ema, x)  # the EMA teacher: not differentiated
            return jnp.mean((model.apply(p, x) - teacher) ** 2)

        return jax.grad(loss)(p)

    return update


def test_a_model_applied_twice_differentiated_and_not_is_refused(tmp_path):
    """An EMA teacher in the update used to merge into the training rows (root numel 64 =
    2 x 32, the teacher's max_abs); now refused, saying how to keep it out. Computed outside
    the intercepted update, the rows are the student's alone."""
    model, _, x, params, _ = dense_setup()
    ema = jax.tree.map(lambda a: a * 0.5 + 0.1, params)
    update = teacher_update(model)
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        with pytest.raises(ValueError, match=r"module .root. \(Dense\) is output twice"):
            tracker.intercept(update, params, ema, x)

    @jax.jit
    def student_update(p, teacher, x):
        return jax.grad(lambda p: jnp.mean((model.apply(p, x) - teacher) ** 2))(p)

    teacher = jax.jit(model.apply)(ema, x)  # outside intercept: not tracked
    with track(params, out=tmp_path / "ok", verbose=False) as tracker:
        grads = tracker.intercept(student_update, params, teacher, x)
        tracker.step(params, gradients=grads)
    df = read_log(tmp_path / "ok")
    student = model.apply(params, x)
    assert_row_matches(df, "root", "Activation", 0, student)
    assert_close_row(df, "root", "Gradient", 0, 2 * (student - teacher) / student.size)

    # without Activation rows nothing merges (the teacher has no cotangent): allowed
    with track(params, out=tmp_path / "grads", track_activations=False, verbose=False) as t:
        grads = t.intercept(update, params, ema, x)
        t.step(params, gradients=grads)
    assert_close_row(
        read_log(tmp_path / "grads"),
        "root",
        "Gradient",
        0,
        2 * (student - model.apply(ema, x)) / student.size,
    )


def test_an_evaluation_call_in_a_training_step_is_refused(tmp_path):
    """An evaluation pass given to intercept in the step of a training call would merge
    its Activation rows into the training pass's: refused, naming the module and the step.
    On a step of its own, or after tracker.step(), it is recorded alone; a second training
    call in a step (gradient accumulation) still merges."""
    model, _, x, params, _ = dense_setup()
    x2 = x[::-1] * 3
    train = jax.jit(lambda p, x: jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(p))
    evaluate = jax.jit(model.apply)
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        g = tracker.intercept(train, params, x)
        g2 = tracker.intercept(train, params, x2)  # accumulation: both differentiated
        tracker.step(params, gradients=jax.tree.map(jnp.add, g, g2))
        tracker.intercept(evaluate, params, x2)  # a step of its own: alone
        tracker.step(params, gradients=g)
        g = tracker.intercept(train, params, x)
        with pytest.raises(ValueError, match=r"module 'root' is output by two intercepted calls"):
            tracker.intercept(evaluate, params, x2)
    df = read_log(tmp_path / "log")
    both = np.concatenate([model.apply(params, x), model.apply(params, x2)])
    assert_row_matches(df, "root", "Activation", 0, both)
    assert_row_matches(df, "root", "Activation", 1, model.apply(params, x2))
    assert set(df[("metadata", "step")]) == {0, 1}  # the refused step is not written


def test_calls_all_differentiated_or_all_not_still_merge(tmp_path):
    """Two views of a batch through one model (both differentiated), and a frozen model
    feeding a trained head (never differentiated): one row per module merging its calls,
    as documented for weight sharing."""
    model, _, x, params, _ = dense_setup()
    x2 = x[::-1] * 2

    @jax.jit
    def two_views(p, x, x2):
        return jax.grad(lambda p: jnp.mean(model.apply(p, x) * model.apply(p, x2)))(p)

    with track(params, out=tmp_path / "views", verbose=False) as tracker:
        grads = tracker.intercept(two_views, params, x, x2)
        tracker.step(params, gradients=grads)
    df = read_log(tmp_path / "views")
    both = np.concatenate([model.apply(params, x), model.apply(params, x2)])
    assert_row_matches(df, "root", "Activation", 0, both)

    w = jax.random.normal(jax.random.key(2), (4, 2))  # a trained head on frozen features

    @jax.jit
    def fine_tune(w, p, x):
        return jax.grad(lambda w: jnp.sum((model.apply(p, x) @ w) ** 2))(w)

    with track(params, out=tmp_path / "frozen", track_gradients=False, verbose=False) as tracker:
        tracker.intercept(fine_tune, w, params, x)
        tracker.intercept(fine_tune, w, params, x2)  # a second batch: merged
        tracker.step(params)
    df = read_log(tmp_path / "frozen")
    assert_row_matches(df, "root", "Activation", 0, both)


def test_two_models_with_like_names_one_differentiated_are_refused(tmp_path):
    """A frozen linen backbone and a trained linen head applied apart both name their
    outermost output 'root': the rows would merge two models; refused, saying so."""
    model, _, x, params, _ = dense_setup()
    head = nn.Dense(2)
    head_params = head.init(jax.random.key(2), jnp.ones((1, 4)))

    @jax.jit
    def fine_tune(hp, p, x):
        return jax.grad(lambda hp: jnp.sum(head.apply(hp, model.apply(p, x)) ** 2))(hp)

    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        with pytest.raises(ValueError, match="another model whose modules are named alike"):
            tracker.intercept(fine_tune, head_params, params, x)


def test_an_nnx_teacher_clone_is_refused_too(tmp_path):
    """nnx: a clone of the tracked module (an EMA teacher) called in the update carries
    the same names."""
    m = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    teacher = nnx.clone(m)
    x, _ = data()

    @nnx.jit
    def train(m, t, x):
        return nnx.grad(lambda m: jnp.mean((m(x) - t(x)) ** 2))(m)

    with track(model_state=m, out=tmp_path / "log", verbose=False) as tracker:
        with pytest.raises(ValueError, match=r"module 'root' \(Linear\) is output twice"):
            tracker.intercept(train, m, teacher, x)
