"""Skewness and kurtosis (``moments=4``) on every JAX path: XLA's operations, the host kernel
as an XLA custom call, the Pallas kernel (``interpret=True``), their on-device merge
(``merge_jax``), and the JAX tracker, against ``scipy.stats`` of the arrays' float64 values;
and the PyTorch and JAX trackers logging the same skewness and kurtosis for the same model
and data."""

from __future__ import annotations

import numpy as np
import pytest

stats = pytest.importorskip("scipy.stats")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from tandv.schema import read_log  # noqa: E402
from tandv.stats.summary import Layout, finalize, merge  # noqa: E402
from tandv.track.jax import _ffi, _kernels, _tracker  # noqa: E402
from tandv.track.jax._pallas import pallas_summary  # noqa: E402
from tandv.track.jax._summary import (  # noqa: E402
    DeviceSummary,
    merge_jax,
    summarize_jax,
    to_vector,
    with_custom,
)

RTOL = 1e-6
LAYOUT = Layout("float32", moments=4)


def data(n: int, mean: float, seed: int) -> np.ndarray:
    """Heavy-tailed, skewed float32 values around ``mean`` (spread ~1)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_t(5, n) + 0.5 * rng.exponential(1.0, n) + mean).astype(np.float32)


def scipy_of(*xs: np.ndarray) -> tuple[float, float]:
    """scipy's skewness and Pearson's kurtosis (excess + 3) of the finite values together
    (NaN for a constant array)."""
    a = np.concatenate([np.ravel(x) for x in xs]).astype(np.float64)
    a = a[np.isfinite(a)]
    if np.ptp(a) == 0:
        return float("nan"), float("nan")
    return float(stats.skew(a)), float(stats.kurtosis(a)) + 3


def check(got_skew: float, got_kurt: float, want: tuple[float, float], rtol: float = RTOL):
    """Skewness to ``rtol`` relative (or absolute near 0), Pearson's kurtosis relative;
    both NaN where scipy's are (a constant array)."""
    if np.isnan(want[0]):
        assert np.isnan(got_skew) and np.isnan(got_kurt)
        return
    assert got_skew == pytest.approx(want[0], rel=rtol, abs=rtol)
    assert got_kurt + 3 == pytest.approx(want[1], rel=rtol)


def finished(summary: DeviceSummary) -> tuple[float, float]:
    got, _ = finalize(to_vector(jax.device_get(summary)), LAYOUT)
    return got["skew"], got["kurtosis"]


# Each path is one jitted function for the whole file: a shape compiles once, whichever
# test or parameter brings it (a new jit per call traced and compiled again every time).
@jax.jit
def _ffi_path(x):
    return _ffi.ffi_summary(x, LAYOUT.format, LAYOUT.num_counts, 4)


def _pallas_path(x):  # (its kernel is jitted, cached per shape)
    return pallas_summary(x, LAYOUT.format, LAYOUT.num_counts, interpret=True, moments=4)


@jax.jit
def _xla_path(x):
    return summarize_jax(x, LAYOUT)


@jax.jit
def _merge3(a, b, c):
    return merge_jax(merge_jax(a, b), c)


PATHS = {"ffi": _ffi_path, "pallas": _pallas_path, "xla": _xla_path}


@pytest.fixture(params=list(PATHS))
def path(request):
    if request.param == "ffi" and not _ffi.available():
        pytest.skip("no in-program host kernel on this machine")
    return PATHS[request.param]


@pytest.mark.parametrize("mean", [0.0, 3.0, 1e4])
def test_each_path_matches_scipy(path, mean):
    """One array, its mean up to 1e4 times its spread. The host kernel's sums are float64
    about the exact mean; the Pallas kernel carries each part's mean less the total's to
    its residue's precision; XLA's operations take deviations from the float32 mean with
    its rounding taken out. NaN and inf are left out."""
    x = data(30_000, mean, 0)
    x[[3, 777]] = [np.nan, -np.inf]
    s = path(x)
    assert to_vector(jax.device_get(s)).shape == (LAYOUT.size,)
    rtol = 2e-6 if path is _xla_path and mean else RTOL  # the float32 core m2 (see below)
    check(*finished(s), scipy_of(x), rtol)


@pytest.mark.parametrize("mean", [0.0, 3.0])
def test_parts_merge_on_device_and_on_the_host(path, mean):
    """Micro-batches (a loop body's iterations) merged by ``merge_jax`` under jit, and by the
    host's float64 merge (ranks, steps), equal scipy of the whole. (A summary's float32
    mean is off by up to half its last bit: where the mean dwarfs the spread, merging two
    such summaries carries that into m3, ~1e-5 of the skewness at 1e4 x the spread.)"""
    x = data(20_000, mean, 1)
    parts = [path(p) for p in (x[:3000], x[3000:3001], x[3001:])]
    merged = _merge3(*parts)
    check(*finished(merged), scipy_of(x))
    vs = [to_vector(jax.device_get(p)) for p in parts]
    got, _ = finalize(merge(merge(vs[0], vs[1], LAYOUT), vs[2], LAYOUT), LAYOUT)
    check(got["skew"], got["kurtosis"], scipy_of(x))


def test_custom_statistics_go_before_m3_m4():
    """The layout's order: core values, custom statistics, then m3 and m4 (each kernel
    returns m3, m4 after its core; ``with_custom`` inserts the custom statistics), and
    ``merge_jax`` merges both by their rules."""
    # (the halves' lengths are those of test_parts_merge_on_device_and_on_the_host's first
    # and last parts, 3000 and 16999: the Pallas kernel compiled for them there runs here
    # again; its grid is specialized to the length)
    x = data(19_999, 2.0, 2)
    layout = Layout("float32", (("peak", "max"),), moments=4)
    custom = {"peak": lambda a: jnp.max(a)}
    # jitted as in a tracked program (op by op, each operation compiled for each shape)
    add_custom = jax.jit(lambda core, a: with_custom(core, a, custom))
    for fn in (_pallas_path, _xla_path):
        core = fn(x)
        s = add_custom(core, x)
        v = to_vector(jax.device_get(s))
        assert v.shape == (layout.size,)
        assert v[layout.extras_start] == pytest.approx(float(x.max()))
        got, _ = finalize(v, layout)
        check(got["skew"], got["kurtosis"], scipy_of(x))
    halves = [add_custom(_pallas_path(h), h) for h in (x[:3000], x[3000:])]
    merged = jax.jit(lambda a, b: merge_jax(a, b, rules=("max",)))(*halves)
    v = to_vector(jax.device_get(merged))
    assert v[layout.extras_start] == pytest.approx(float(x.max()))
    got, _ = finalize(v, layout)
    check(got["skew"], got["kurtosis"], scipy_of(x))
    with pytest.raises(ValueError, match="merge_jax: values of"):
        merge_jax(*halves)  # the custom statistic's rule not given
    with pytest.raises(ValueError, match="merge rule 'median' does not merge value by value"):
        merge_jax(*halves, rules=("median",))  # not one of MERGE_RULES


# ------------------------------------------------------------------ the trackers


def _weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Multiples of 1/8: the model's arithmetic is exact in float32 in both frameworks."""
    return (rng.integers(-8, 9, size=shape) / 8).astype(np.float32)


def _setup():
    rng = np.random.default_rng(0)
    w = {"k0": _weights(rng, (6, 16)), "b0": _weights(rng, (16,)), "k1": _weights(rng, (16, 8))}
    w["b1"] = _weights(rng, (8,)) + np.float32(64.0)  # outputs whose mean dominates
    xs = [rng.integers(-3, 4, size=(12, 6)).astype(np.float32) for _ in range(2)]
    return w, xs


def _run_jax(w, xs, out):
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(16)(x))
            return nn.Dense(8)(h)

    model = MLP()
    params = {
        "params": {
            f"Dense_{i}": {"kernel": jnp.asarray(w[f"k{i}"]), "bias": jnp.asarray(w[f"b{i}"])}
            for i in (0, 1)
        }
    }
    tx = optax.sgd(0.5)
    opt_state = tx.init(params)

    @jax.jit
    def update(params, opt_state, x):
        grads = jax.grad(lambda p: (model.apply(p, x) - 64.0).sum())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    record = []
    with _tracker.track(
        model_state=params, optimizer_state=opt_state, out=out, moments=4, verbose=False
    ) as tr:
        for x in xs:
            _, inter = model.apply(params, jnp.asarray(x), capture_intermediates=True)
            before = jax.tree.map(np.asarray, params)
            params, opt_state, grads = tr.intercept(update, params, opt_state, jnp.asarray(x))
            tr.step(params, opt_state, grads)
            acts = {
                k: np.asarray(inter["intermediates"][k]["__call__"][0])
                for k in ("Dense_0", "Dense_1")
            }
            record.append((before, jax.tree.map(np.asarray, grads), acts))
    return read_log(tr.out_path), record


_JAX_RUNS: dict = {}


def _jax_run(path: str, tmp_path_factory) -> tuple:
    """:func:`_run_jax`'s log and record on summary path ``path``, run once per path for
    the file (the trackers' comparison reads the ``auto`` run the tracker test made)."""
    if path not in _JAX_RUNS:
        w, xs = _setup()
        with _kernels.summary_path(path):
            _JAX_RUNS[path] = _run_jax(w, xs, tmp_path_factory.mktemp(f"jax_{path}"))
    return _JAX_RUNS[path]


def _row(df, name: str, tt: str, step: int):
    m = df["metadata"]
    sel = (m["name"] == name) & (m["tensor_type"] == tt) & (m["step"] == step)
    assert sel.sum() == 1, (name, tt, step)
    row = df[sel].iloc[0]
    return row[("scalar_stats", "skew")], row[("scalar_stats", "kurtosis")]


@pytest.mark.parametrize("summary_path", ["auto", "xla", "pallas"])
def test_jax_tracker_logs_exact_skew_and_kurtosis(tmp_path_factory, summary_path):
    """``track(moments=4)`` in the JAX tracker on each summary path (``auto``: the host
    kernel inside the program on the CPU): weights, gradients and activations (one of them
    64 x its spread) against scipy of the arrays the test takes itself. XLA's operations
    run in float32 (no x64): their core m2 and the third sums of small arrays whose cubes
    cancel are off by up to ~3e-6 of their values (measured on these gradients), so that
    path is held to 1e-5."""
    rtol = 1e-5 if summary_path == "xla" else RTOL
    df, record = _jax_run(summary_path, tmp_path_factory)
    for step, (params, grads, acts) in enumerate(record):
        for layer in ("Dense_0", "Dense_1"):
            for leaf in ("kernel", "bias"):
                name = f"{layer}.{leaf}"
                want = scipy_of(params["params"][layer][leaf])
                check(*_row(df, name, "Weight", step), want, rtol)
                want = scipy_of(grads["params"][layer][leaf])
                check(*_row(df, name, "Gradient", step), want, rtol)
            check(*_row(df, layer, "Activation", step), scipy_of(acts[layer]), rtol)


def test_torch_and_jax_trackers_agree(tmp_path, tmp_path_factory):
    """The same model, weights and data (exact float32 arithmetic in both): the two trackers
    log the same skewness and kurtosis, and both equal scipy's."""
    torch = pytest.importorskip("torch")
    from tandv.track.torch import track as torch_track

    w, xs = _setup()
    jdf, record = _jax_run("auto", tmp_path_factory)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with torch.no_grad():
        for i, layer in ((0, model[0]), (1, model[2])):
            layer.weight.copy_(torch.from_numpy(w[f"k{i}"].T.copy()))
            layer.bias.copy_(torch.from_numpy(w[f"b{i}"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch_track(model, opt, out=tmp_path / "torch", moments=4, verbose=False) as tr:
        for x in xs:
            opt.zero_grad()
            (model(torch.from_numpy(x)) - 64.0).sum().backward()
            opt.step()
            tr.step()
    tdf = read_log(tr.out_path)
    pairs = [
        (t, j, tt)
        for tl, jl in (("0", "Dense_0"), ("2", "Dense_1"))
        for t, j, tt in (
            (tl, jl, "Activation"),
            (f"{tl}.weight", f"{jl}.kernel", "Weight"),
            (f"{tl}.bias", f"{jl}.bias", "Weight"),
            (f"{tl}.weight", f"{jl}.kernel", "Gradient"),
        )
    ]
    for step, (_, _, acts) in enumerate(record):
        for t_name, j_name, tt in pairs:
            ts, tk = _row(tdf, t_name, tt, step)
            js, jk = _row(jdf, j_name, tt, step)
            check(js, jk, (ts, tk + 3))
            if tt == "Activation":
                check(ts, tk, scipy_of(acts[j_name]))
