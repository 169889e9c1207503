"""``track(..., track_updates=True)``: ``<param>.update`` rows hold the statistics of
(after - before) the optimizer step, checked against numpy on independently kept copies."""

from __future__ import annotations

import numpy as np
import pytest

import tandv
from tandv.quantities import log_update_ratio


def rows(df, suffix=".update"):
    m = df["metadata"]
    return df[m["name"].str.endswith(suffix)]


def check_row(row, d: np.ndarray) -> None:
    """The row's statistics against numpy on the update ``d`` (float64 arithmetic)."""
    d = d.astype(np.float64).ravel()
    s = row["scalar_stats"]
    assert s["numel"] == d.size and s["zero_count"] == int((d == 0).sum())
    np.testing.assert_allclose(
        [s["mean"], s["std"], s["rm2"], s["max_abs"], s["min"], s["max"]],
        [d.mean(), d.std(), np.sqrt(np.mean(d**2)), np.abs(d).max(), d.min(), d.max()],
        rtol=1e-9,
        atol=1e-300,
    )
    nz = np.abs(d[d != 0])
    exps, counts = np.unique(np.floor(np.log2(nz)).astype(int), return_counts=True)
    logged = row["exponent_counts"]
    assert {int(e): int(c) for e, c in zip(exps, counts)} == {
        int(k): int(v) for k, v in logged.items() if k not in ("-inf", "+inf") and v > 0
    }


def test_torch_update_rows_match_numpy_and_feed_the_update_ratio(tmp_path):
    torch = pytest.importorskip("torch")
    from tandv.track.torch import track

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    model[2].bias.requires_grad_(False)  # frozen: an optimizer never moves it, no row
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    updates, befores = {}, {}
    with track(
        model, opt, out=tmp_path / "log", track_updates=True, every=2, verbose=False
    ) as tracker:
        for step in range(5):
            before = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
            model(torch.randn(8, 5)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            for n, p in model.named_parameters():
                updates[(n, step)] = p.detach().numpy() - before[n]
                befores[(n, step)] = before[n]
            tracker.step()
    df = tandv.read_log(tmp_path / "log")
    up = rows(df)
    assert up[("metadata", "tensor_type")].eq("Weight").all()
    got = set(zip(up[("metadata", "name")], up[("metadata", "step")]))
    assert got == {
        (f"{n}.update", s) for n in ("0.weight", "0.bias", "2.weight") for s in (0, 2, 4)
    }
    for _, row in up.iterrows():
        name = row[("metadata", "name")][: -len(".update")]
        check_row(row, updates[(name, int(row[("metadata", "step")]))])
    ratio = log_update_ratio(df).set_index(["name", "step"])["exact"]
    for n in ("0.weight", "0.bias", "2.weight"):
        for s in (0, 2, 4):
            expected = np.linalg.norm(updates[(n, s)].astype(np.float64)) / np.linalg.norm(
                befores[(n, s)].astype(np.float64)
            )
            assert ratio[(n, s)] == pytest.approx(expected, rel=1e-6)
    assert np.isnan(ratio[("2.bias", 0)])


def test_torch_track_updates_needs_an_optimizer():
    torch = pytest.importorskip("torch")
    from tandv.track.torch import track

    with pytest.raises(ValueError, match="track_updates=True.*pass the optimizer"):
        track(torch.nn.Linear(2, 2), track_updates=True)


def test_torch_update_capture_works_with_any_tracker_seam():
    """The update capture knows the tracker only as a ``TrackerSeam``: driven by a
    hand-written one, it records ``after - before`` (exactly) of the parameters the seam
    names, under ``<path>.update``, and nothing while the seam is not recording."""
    torch = pytest.importorskip("torch")
    from tandv.track.torch._updates import UpdateCapture

    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)

    class Seam:  # tracks the weight only (the bias is not selected)
        recording = True
        module = net
        kinds = {"Weight": True}
        track_eval = False

        def __init__(self):
            self.recorded = []

        def hooked_modules(self):
            return []

        def parameter(self, p):
            return ("weight", net) if p is net.weight else None

        def observe(self, name, kind, owner, x, *, fresh=False):
            raise AssertionError("the update capture observes no hook tensor")

        def record(self, items):
            self.recorded.append([(n, k, o, t.clone()) for n, k, o, t in items])

    seam = Seam()
    capture = UpdateCapture(seam, opt)
    for step in range(3):
        seam.recording = step != 1
        net(torch.randn(4, 3)).square().sum().backward()
        before = net.weight.detach().clone()
        opt.step()
        opt.zero_grad()
        if step == 1:
            assert len(seam.recorded) == 1  # nothing recorded at step 1
            continue
        [(name, kind, owner, d)] = seam.recorded[-1]
        assert (name, kind, owner) == ("weight.update", "Weight", net)
        np.testing.assert_array_equal(d.numpy(), (net.weight.detach() - before).numpy())
    capture.remove()
    net(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    assert len(seam.recorded) == 2  # no hooks once removed


def test_jax_update_rows_match_numpy(tmp_path):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    from tandv.track.jax import track

    rng = np.random.default_rng(0)
    params = {
        "dense": {
            "kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
            "bias": jnp.zeros((3,), jnp.float32),
        }
    }
    opt = optax.sgd(0.1, momentum=0.9)
    state = opt.init(params)

    @jax.jit
    def update(params, state, x):
        grads = jax.grad(
            lambda p: jnp.mean(jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"]) ** 2)
        )(params)
        u, state = opt.update(grads, state, params)
        return optax.apply_updates(params, u), state, grads

    updates = {}
    with track(
        params,
        state,
        out=tmp_path / "log",
        track_updates=True,
        track_activations=False,
        schedule=[1, 2],
        verbose=False,
    ) as tracker:
        for step in range(4):
            new, state, grads = update(
                params, state, jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
            )
            for k in ("kernel", "bias"):
                updates[(f"dense.{k}", step)] = np.asarray(new["dense"][k]) - np.asarray(
                    params["dense"][k]
                )
            params = new
            tracker.step(params, state, grads)
    df = tandv.read_log(tmp_path / "log")
    up = rows(df)
    assert set(zip(up[("metadata", "name")], up[("metadata", "step")])) == {
        (f"dense.{k}.update", s) for k in ("kernel", "bias") for s in (1, 2)
    }
    for _, row in up.iterrows():
        check_row(
            row,
            updates[(row[("metadata", "name")][: -len(".update")], int(row[("metadata", "step")]))],
        )
    assert log_update_ratio(df)["exact"].notna().sum() == 4


def test_jax_donated_parameters_are_a_clear_error(tmp_path):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from tandv.track.jax import track

    params = {"w": jnp.ones((3,))}
    step_fn = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x * 0.5, p), donate_argnums=0)
    with track(
        params,
        track_gradients=False,
        track_activations=False,
        track_updates=True,
        out=tmp_path / "log",
        verbose=False,
    ) as tracker:
        params = step_fn(params)
        if not jax.tree_util.tree_leaves(tracker._before[1])[0].is_deleted():
            pytest.skip("this backend ignores buffer donation")
        with pytest.raises(ValueError, match="deleted them \\(buffer donation"):
            tracker.step(params)
