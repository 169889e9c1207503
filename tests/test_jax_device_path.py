"""The JAX tracker's accelerator path, run on the CPU: summaries computed inside the compiled
step (XLA's operations, ``summary_path("xla")``), leaving it as data through mailboxes, with
no host callback, also from loop bodies, where each iteration's summary merges on device."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from test_jax_tracker import ScanBlock as Block  # noqa: E402
from test_jax_tracker import assert_row_matches, data, row  # noqa: E402

from tandv.schema import read_log  # noqa: E402
from tandv.stats import Layout, summarize  # noqa: E402
from tandv.stats.summary import merge  # noqa: E402
from tandv.track.jax import _ffi, _intercept, _transfer, to_vector, track  # noqa: E402
from tandv.track.jax._kernels import FUSED_SIZE, summary_path  # noqa: E402
from tandv.track.jax._mailbox import MailRead  # noqa: E402
from tandv.track.jax._summary import DeviceSummary, merge_jax  # noqa: E402

rng = np.random.default_rng(3)


@pytest.fixture
def accelerator_path(monkeypatch):
    """Summaries in programs only (no host kernel), and every host callback counted."""
    monkeypatch.setattr(_ffi, "ffi_summary", None)  # must not be called
    calls = []
    deliver = _intercept._deliver
    monkeypatch.setattr(_intercept, "_deliver", lambda *a: (calls.append(a[1]), deliver(*a)))
    with summary_path("xla"):
        yield calls


PARTS = {
    "normal": rng.normal(size=50).astype(np.float32),
    "offset": (1e4 + rng.normal(size=30)).astype(np.float32),
    "subnormal": (rng.normal(size=20) * 1e-42).astype(np.float32),
    "huge": (rng.normal(size=10) * 1e37).astype(np.float32),
    "specials": np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 3.0], np.float32),
    "nan-only": np.full(4, np.nan, np.float32),
    "empty": np.zeros(0, np.float32),
}


def _as_device(vector, layout):
    """A reference summary vector in the device layout (int32 counts, float32 values)."""
    c, e = layout.counts_start, layout.extras_start
    return (
        np.concatenate([vector[:4], vector[c:e]]).astype(np.int32),
        np.concatenate([vector[4:c], vector[e:]]).astype(np.float32),
    )


def test_merge_on_device_matches_the_reference_merge():
    """merge_jax (what a loop body's mailbox does per iteration) of every pair of crafted
    parts (subnormals, huge values, |mean| >> std, specials, NaN only, empty) against
    tandv.stats.merge of the same summaries and the summary of the concatenation: counts,
    extrema and exponent counts exactly, custom statistics by their merge rules."""
    rules = (("total", "sum"), ("biggest", "max"), ("smallest", "min"), ("avg", "mean"))
    layout = Layout("float32", rules)
    core = Layout("float32")
    merge_fn = jax.jit(
        lambda a, b: merge_jax(DeviceSummary(*a), DeviceSummary(*b), [r for _, r in rules])
    )

    def reference(x):
        finite = x[np.isfinite(x)]
        extras = [
            float(finite.sum()),
            float(finite.max(initial=-np.inf)),
            float(finite.min(initial=np.inf)),
            float(finite.mean()) if finite.size else 0.0,
        ]
        return np.concatenate([summarize(x)[0], extras])

    for a, x in PARTS.items():
        for b, y in PARTS.items():
            got = to_vector(
                jax.device_get(
                    merge_fn(_as_device(reference(x), layout), _as_device(reference(y), layout))
                )
            )
            want = merge(reference(x), reference(y), layout)
            whole = reference(np.concatenate([x, y]))
            exact = list(range(8)) + list(range(core.counts_start, core.extras_start))
            np.testing.assert_array_equal(got[exact], want[exact], err_msg=f"{a} + {b}")
            np.testing.assert_array_equal(got[exact], whole[exact], err_msg=f"{a} + {b}")
            tol = 1e-6 * max(1.0, whole[10])  # m2 and the power sums are relative to max_abs
            np.testing.assert_allclose(
                got[8 : core.counts_start],
                whole[8 : core.counts_start],
                rtol=2e-5,
                atol=tol,
                err_msg=f"{a} + {b}",
            )
            # custom statistics as the reference merges them ("mean": weighted by numel); sums
            # of subnormals are float arithmetic, which XLA:CPU flushes (as it does the
            # statistics themselves): to 1e-30
            np.testing.assert_allclose(
                got[layout.extras_start :],
                want[layout.extras_start :],
                rtol=2e-5,
                atol=1e-30,
                err_msg=f"{a} + {b}",
            )
            np.testing.assert_array_equal(
                got[layout.extras_start + 1 :][:2], whole[layout.extras_start + 1 :][:2]
            )


class Stack(nn.Module):
    """nn.scan over nn.remat blocks, then a Dense applied three times in lax.scan."""

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        h = blocks(name="blocks")(x, None)[0]
        head = nn.Dense(4, name="head")

        def body(h, _):
            return jnp.tanh(head(h)), None

        body(h, None)  # create the parameters outside the loop
        h = jax.lax.scan(body, h, None, length=2)[0] if not self.is_initializing() else h
        return h.sum(axis=-1)


def test_loops_report_through_mailboxes_and_each_program_compiles_once(tmp_path, accelerator_path):
    """nn.scan(nn.remat(...)) and lax.scan in a jitted update on the accelerator path: no host
    callback (they were one per tap and iteration), every iteration counted, and after the
    first tracked and untracked step nothing is traced or compiled again."""
    from jax import monitoring

    model, opt = Stack(), optax.sgd(1e-2)
    x = data()[0][:, :4]
    params, x = jax.device_put((model.init(jax.random.key(1), x), x), jax.devices()[0])
    state = jax.device_put(opt.init(params), jax.devices()[0])
    traces, compiles = [], []

    @jax.jit
    def update(p, s, x):
        traces.append(1)
        g = jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(on_event)
    history = []
    try:
        with track(params, state, out=tmp_path / "log", every=2, verbose=False) as tracker:
            for step in range(6):
                history.append(params)
                params, state, grads = tracker.intercept(update, params, state, x)
                tracker.step(params, state, grads)
                if step == 1:
                    warm = len(compiles)
    finally:
        monitoring.unregister_event_duration_listener(on_event)
    assert accelerator_path == []  # no host callback
    assert len(traces) == 2  # the instrumented program and the user's own
    assert len(compiles) == warm
    df = read_log(tmp_path / "log")
    for step in (0, 2, 4):
        p = history[step]["params"]
        layer = p["blocks"]["Dense_0"]
        h, outs = np.asarray(x, np.float64), []
        for i in range(3):
            outs.append(
                h @ np.asarray(layer["kernel"][i], np.float64) + np.asarray(layer["bias"][i])
            )
            h = np.tanh(outs[-1])
        outs = np.concatenate(outs)
        r = row(df, "blocks.Dense_0", "Activation", step)
        assert r[("scalar_stats", "numel")] == outs.size
        assert r[("scalar_stats", "mean")] == pytest.approx(outs.mean(), rel=1e-4)
        assert r[("scalar_stats", "max_abs")] == pytest.approx(np.abs(outs).max(), rel=1e-5)
        assert row(df, "blocks.Dense_0", "Gradient", step)[("scalar_stats", "numel")] == outs.size
        # head: once outside the loop, twice inside
        assert row(df, "head", "Activation", step)[("scalar_stats", "numel")] == 3 * h.size
        assert row(df, "head", "Gradient", step)[("scalar_stats", "numel")] == 2 * h.size
    assert sorted(set(df[("metadata", "step")])) == [0, 2, 4]


def test_step_does_not_wait_for_its_summaries(tmp_path, accelerator_path, monkeypatch):
    """tracker.step() starts one copy of all the step's summaries (mailboxes, weights,
    gradients) and returns: the step is recorded at a later step's end once they are
    computed (or when the tracker closes), and they are read (decoded) with its rows on the
    log's writer thread, not by step(); the rows are those of the values computed here."""
    transfers = []
    # XLA:CPU may run a small program inline, so step 0's summaries can be computed before
    # step() returns; held, its transfer reports "not computed yet" as a device's would
    held = {"on": True}

    class Counted(_transfer.Transfer):
        def __init__(self, arrays):
            transfers.append(len(arrays))
            super().__init__(arrays)

        def ready(self) -> bool:
            return not held["on"] and super().ready()

    monkeypatch.setattr(_transfer, "Transfer", Counted)
    decoded_on = []  # the threads that decode mailbox words
    decode = MailRead._decode

    def recorded(self, got):
        decoded_on.append(threading.current_thread())
        return decode(self, got)

    monkeypatch.setattr(MailRead, "_decode", recorded)
    model = nn.Dense(3)
    x, _ = data()
    params = model.init(jax.random.key(1), x)
    update = jax.jit(jax.grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2)))
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        grads = tracker.intercept(update, params, x)
        tracker.step(params, gradients=grads)
        # one transfer: the mailbox words, the weights' and the gradients' counts and values
        assert transfers == [5]
        ((step, pending, _),) = tracker._flights
        mail = [s for _, _, s in pending if isinstance(s, _transfer.Mail)]
        # the tracked program's mailbox words (the root's activation and gradient): one
        # observation until they are decoded
        assert step == 0 and len(mail) == 1
        assert mail[0].read._decoded is None  # not read yet
        jax.block_until_ready(tracker._flights[0][2].transfer._device)  # step 0 computed
        held["on"] = False
        grads = tracker.intercept(update, params, x)
        tracker.step(params, gradients=grads)
        assert 0 not in [s for s, _, _ in tracker._flights]  # step 0 recorded
    # its rows were built on the writer thread, at the latest when the log was closed
    assert mail[0].read._decoded is not None
    assert decoded_on and threading.main_thread() not in decoded_on, decoded_on
    df = read_log(tmp_path / "log")
    out = np.asarray(model.apply(params, x), np.float64)
    for step in (0, 1):
        r = row(df, "root", "Activation", step)
        assert r[("scalar_stats", "numel")] == out.size
        assert r[("scalar_stats", "mean")] == pytest.approx(out.mean(), rel=1e-5)
        r = row(df, "root", "Gradient", step)
        assert r[("scalar_stats", "mean")] == pytest.approx((2 * out).mean(), rel=1e-5)
        assert_row_matches(df, "kernel", "Weight", step, params["params"]["kernel"])
        assert_row_matches(df, "kernel", "Gradient", step, grads["params"]["kernel"])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_activations_on_the_fused_kernel(tmp_path, dtype):
    """A bf16/fp16 model on the Pallas path (interpreted): its activation rows are those of
    the numpy reference on the same values, exponent counts exactly."""
    model = nn.Dense(8, dtype=dtype, param_dtype=dtype)
    x = jnp.asarray(data()[0], dtype)
    params = model.init(jax.random.key(2), x)
    fwd = jax.jit(lambda p, x: model.apply(p, x))
    with (
        summary_path("pallas"),
        track(out=tmp_path / "log", track_gradients=False, verbose=False) as tracker,
    ):
        out = tracker.intercept(fwd, params, x)
        tracker.step()
    assert_row_matches(
        read_log(tmp_path / "log"),
        "root",
        "Activation",
        0,
        np.asarray(out).astype(ml_dtypes.finfo(dtype).dtype),
    )


@pytest.mark.parametrize("where", ["vmap-of-scan", "scan-of-vmap"])
def test_vmapped_loop_bodies_still_report(tmp_path, where):
    """A loop body under jax.vmap cannot merge into an unbatched mailbox: its taps report by
    host callback (vmap calls it once per example), and the rows hold every example and
    iteration once (the cotangent rows of vmap-of-scan counted the whole batch once per
    example)."""
    model = nn.Dense(5)
    x, _ = data()
    params = model.init(jax.random.key(1), x)

    def scan(p, h):
        return jax.lax.scan(lambda h, _: (jnp.tanh(model.apply(p, h)), None), h, None, length=2)[0]

    if where == "vmap-of-scan":

        def loss(p, x):
            return jnp.sum(jax.vmap(lambda xi: scan(p, xi[None]))(x) ** 2)
    else:

        def loss(p, x):
            def body(h, _):
                return jax.vmap(lambda hi: jnp.tanh(model.apply(p, hi)))(h), None

            return jnp.sum(jax.lax.scan(body, x, None, length=2)[0] ** 2)

    update = jax.jit(jax.grad(loss))
    with track(params, out=tmp_path / "log", verbose=False) as tracker:
        grads = tracker.intercept(update, params, x)
        tracker.step(params, gradients=grads)
    df = read_log(tmp_path / "log")
    h, outs = np.asarray(x, np.float64), []
    for _ in range(2):
        outs.append(
            h @ np.asarray(params["params"]["kernel"], np.float64)
            + np.asarray(params["params"]["bias"])
        )
        h = np.tanh(outs[-1])
    outs = np.concatenate(outs)
    r = row(df, "root", "Activation", 0)
    assert r[("scalar_stats", "numel")] == outs.size
    assert r[("scalar_stats", "mean")] == pytest.approx(outs.mean(), rel=1e-4)
    assert row(df, "root", "Gradient", 0)[("scalar_stats", "numel")] == outs.size


def test_sharded_arrays_are_summarized_where_they_lie(tmp_path, accelerator_path):
    """Arrays split over two devices (rows, columns, and replicated along a second mesh
    axis): each device summarizes its own shard (the program has no collective), the host
    merges the shards' summaries, and the rows are those of the global arrays (a replicated
    copy counted once)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets jax_num_cpu_devices=2)")
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "model"))
    mesh_t = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    values = {
        "rows": (rng.normal(size=(64, 8)) * 3).astype(np.float32),
        "cols": np.concatenate([rng.normal(size=(8, 4)), np.full((8, 4), 1e-42)], 1).astype(
            np.float32
        ),
        "replicated_along_model": rng.normal(size=(6, 10)).astype(np.float32),
    }
    values["cols"][0, 0] = np.nan
    params = {
        "rows": jax.device_put(values["rows"], NamedSharding(mesh, P("data", None))),
        "cols": jax.device_put(values["cols"], NamedSharding(mesh_t, P(None, "model"))),
        "replicated_along_model": jax.device_put(
            values["replicated_along_model"], NamedSharding(mesh_t, P("data"))
        ),
    }
    with track(
        params, out=tmp_path / "log", track_activations=False, track_gradients=False, verbose=False
    ) as tracker:
        arrays = list(params.values())
        plans = tuple(_transfer.shard_plan(x) for x in arrays)
        assert [p[2] for p in plans] == [(0, 1), (0, 1), (0,)]  # one copy of the last is counted
        hlo = tracker._kernels.summarize_many.lower(arrays, False, plans).compile().as_text()
        assert "all-reduce" not in hlo and "all-gather" not in hlo
        tracker.step(params)
    df = read_log(tmp_path / "log")
    for name, value in values.items():
        assert_row_matches(df, name, "Weight", 0, value)


def test_tracked_step_lowers_for_cuda_without_host_callbacks(tmp_path, monkeypatch):
    """Off the CPU a tracked step must not call the host. JAX refuses to lower a host callback
    for a platform it has no device of, so lowering the instrumented update (and the step's
    weight and gradient summaries) for CUDA here, on a CPU-only machine, proves there is none:
    nn.scan(nn.remat(...)) and lax.scan taps report through mailboxes, and arrays of at least
    FUSED_SIZE elements take the fused Triton kernel."""
    import re

    from tandv.track.jax import _ffi

    def custom_calls(text):
        return re.findall(r"custom_call @([\w$.]+)", text)

    def with_callback(v):
        jax.debug.callback(lambda _: None, v)
        return v

    with pytest.raises(ValueError, match="lowering platform cuda"):  # what this test relies on
        jax.jit(with_callback).trace(jnp.ones(3)).lower(lowering_platforms=("cuda",))

    # as on a GPU: no host kernel
    monkeypatch.setattr(_ffi, "available", lambda blocks=False: False)
    model, opt = Stack(), optax.adam(1e-3)
    wide = nn.Dense(FUSED_SIZE // 64)  # kernel, output and its gradient: fused
    x = jnp.ones((64, 4))
    params = {
        "stack": model.init(jax.random.key(1), x),
        "wide": wide.init(jax.random.key(2), jnp.ones((64, 64))),
    }
    state = opt.init(params)

    def loss(p, x):
        y = jnp.tile(x, (1, 16))
        return jnp.sum(model.apply(p["stack"], x) ** 2) + jnp.sum(wide.apply(p["wide"], y) ** 2)

    @jax.jit
    def update(p, s, x):
        g = jax.grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    lowered = []
    with track(params, state, out=tmp_path / "log", verbose=False) as tracker:
        tracker.intercept(
            lambda *a: lowered.append(
                update.trace(*a).lower(lowering_platforms=("cuda",)).as_text()
            ),
            params,
            state,
            x,
        )
        leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(params)]
        summaries = (
            jax.jit(tracker._kernels.summaries, static_argnums=(1, 2))
            .trace(leaves, True, (None,) * len(leaves))
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    (step,) = lowered
    assert "callback" not in " ".join(custom_calls(step) + custom_calls(summaries))
    # the wide layer's output and its cotangent (the only arrays over FUSED_SIZE)
    assert custom_calls(step).count("__gpu$xla.gpu.triton") == 2
    assert custom_calls(summaries).count("__gpu$xla.gpu.triton") == 1  # the wide kernel


def test_a_loop_merge_beyond_int32_counts_is_refused_not_wrapped():
    """A loop body's mailbox merges every iteration's summary; their int32 counts cannot hold
    more than 2**31 - 1 elements. merge_jax marks such a union (numel -1, kept by later
    merges) and to_vector refuses it, naming the row; up to the limit the counts are exact."""
    from tandv.stats.summary import COUNT_INDEX
    from tandv.track.jax._summary import MAX_ELEMENTS, summarize_jax

    numel = COUNT_INDEX["numel"]
    part = summarize_jax(jnp.linspace(-3.0, 3.0, 1000), Layout("float32"))

    def claiming(n: int) -> DeviceSummary:  # the part, as if it had n elements
        return DeviceSummary(part.counts.at[numel].set(n), part.values)

    merge_fn = jax.jit(merge_jax)
    exact = merge_fn(claiming(2**30), claiming(2**30 - 1))
    assert int(exact.counts[numel]) == MAX_ELEMENTS
    wrapped = merge_fn(claiming(2**30), claiming(2**30))
    assert int(wrapped.counts[numel]) == -1
    for more in (part, wrapped):
        assert int(merge_fn(wrapped, more).counts[numel]) == -1
        assert int(merge_fn(more, wrapped).counts[numel]) == -1
    with pytest.raises(ValueError, match=r"Activation row of module 'blocks'.*exclude="):
        to_vector(jax.device_get(wrapped), "the Activation row of module 'blocks'")
    to_vector(jax.device_get(exact))  # at the limit: accepted
