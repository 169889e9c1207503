"""Arrays past 2**31 - 1 elements (issue 28): summarized in segments of at most
``SEGMENT_ELEMENTS`` elements on every JAX path (host kernel by FFI, XLA, Pallas), merged on
the host in float64. Tested with the documented test hook ``SEGMENT_ELEMENTS(1000)``, so that
arrays of a few thousand elements are cut, against the unsegmented results and the numpy
reference; the real limit only by lowering abstract arrays (nothing allocated)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pandas as pd
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from tandv.schema import read_log  # noqa: E402
from tandv.stats import Layout, summarize  # noqa: E402
from tandv.stats.summary import COUNT_INDEX, HIGHER_STATS  # noqa: E402
from tandv.track.jax import _ffi, to_vector, track  # noqa: E402
from tandv.track.jax._kernels import summary_path  # noqa: E402
from tandv.track.jax._segments import (  # noqa: E402
    SEGMENT_ELEMENTS,
    core_layout,
    merge_segments,
    segment_count,
    segmented,
)
from tandv.track.jax._summary import MAX_ELEMENTS, DeviceSummary, summarize_jax  # noqa: E402

rng = np.random.default_rng(2028)
LIMIT = 1000  # the test hook's segment length: arrays of a few thousand elements are cut
SPECIALS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -3e-42, 1e4], np.float32)


def _array(n: int, dtype=np.float32) -> np.ndarray:
    """``n`` values: an offset normal (|mean| >> std), specials spread over the segments."""
    x = (50.0 + rng.normal(size=n)).astype(np.float32)
    x[rng.choice(n, SPECIALS.size, replace=False)] = SPECIALS
    return x.astype(dtype)


def _kernels() -> dict:
    """Each kernel's core summary of one segment, by path."""
    from tandv.track.jax._pallas import pallas_summary

    def xla(a, layout):
        return summarize_jax(a, layout)

    def pallas(a, layout):
        return pallas_summary(
            a, layout.format, layout.num_counts, interpret=True, moments=layout.moments
        )

    def ffi(a, layout):
        return _ffi.ffi_summary(a, layout.format, layout.num_counts, layout.moments)

    out = {"xla": xla, "pallas": pallas}
    if _ffi.available():
        out["ffi"] = ffi
    return out


def _check(got: np.ndarray, want: np.ndarray, layout: Layout) -> None:
    """Counts, extrema and exponent counts exactly; the other values to 1e-6."""
    exact = [*range(8), *range(layout.counts_start, layout.extras_start)]
    np.testing.assert_array_equal(got[exact], want[exact])
    rest = [i for i in range(layout.size) if i not in exact]
    np.testing.assert_allclose(got[rest], want[rest], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["xla", "pallas", "ffi"])
@pytest.mark.parametrize("moments", [2, 4])
def test_segments_merge_to_the_whole_arrays_summary(path, moments):
    """Each kernel on an array cut in 3 segments (2500 elements, limit 1000): the segments'
    rows merged on the host equal the uncut summary and the numpy reference, counts exactly
    (numel, NaN, inf and zero counts, exponent counts), moments (m3, m4 too) to 1e-6; a
    custom statistic is that of the whole array, not a merge of the segments'."""
    kernels = _kernels()
    if path not in kernels:
        pytest.skip("no in-program host kernel on this machine")
    kernel = kernels[path]
    layout = Layout("float32", (("median", "mean"),), moments=moments)
    custom = {"median": lambda a: jnp.nanmedian(a.astype(jnp.float32))}
    x = _array(2500)

    def summary(a):
        return DeviceSummary(*segmented(lambda b: kernel(b, core_layout(layout)), a, custom))

    whole = to_vector(jax.device_get(jax.jit(summary)(x)))
    with SEGMENT_ELEMENTS(LIMIT):
        assert segment_count(x.size) == 3
        counts, values = jax.device_get(jax.jit(summary)(x))
    assert counts.shape[0] == values.shape[0] == 3
    np.testing.assert_array_equal(counts[:, COUNT_INDEX["numel"]], [834, 834, 832])
    got = merge_segments(to_vector(DeviceSummary(counts, values)), layout)
    base = summarize(x, moments=moments)[0]  # no extras: the median goes before m3, m4
    at = layout.extras_start
    ref = np.concatenate([base[:at], [np.nanmedian(x)], base[at:]])
    _check(got, whole, layout)
    _check(got, ref, layout)


def test_segment_limit_is_checked_and_cuts_are_aligned():
    """The hook refuses limits an int32 count cannot hold; at the real limit, segments
    start at multiples of 1024 elements and are at most 2**31 - 1 long."""
    from tandv.track.jax._segments import _cuts

    for bad in (0, MAX_ELEMENTS + 1, 2.5):
        with SEGMENT_ELEMENTS(bad), pytest.raises(ValueError, match="SEGMENT_ELEMENTS"):
            segment_count(10)
    for n in (2**31, 2**32 + 7, 3 * 2**31 - 5):
        cuts = _cuts(n)
        sizes = np.diff(cuts)
        assert cuts[0] == 0 and cuts[-1] == n and (sizes <= MAX_ELEMENTS).all()
        assert all(c % 1024 == 0 for c in cuts[:-1])
        assert len(sizes) == -(-n // (MAX_ELEMENTS // 1024 * 1024))  # as few as fit
    assert _cuts(MAX_ELEMENTS) == [0, MAX_ELEMENTS]


class Wide(nn.Module):
    """Outputs and parameters past the test limit: Dense_0's output (16 x 96 = 1536
    elements, 2 segments), Dense_1's kernel (96 x 24 = 2304, 3 segments: a first, a middle
    and a last) and its Adam moments (each segment is one more summary to compile)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(96, name="Dense_0")(x))
        return nn.Dense(24, name="Dense_1")(h)


def _run(out, path: str, jit: bool, limit: int | None, **options) -> pd.DataFrame:
    """Two tracked steps of :class:`Wide` on ``path`` with ``options``, with the segment
    limit ``limit`` (None: the real one), as a log sorted by tensor and step."""
    model, opt = Wide(), optax.adam(1e-2)
    k1, k2 = jax.random.split(jax.random.key(0))
    x, y = jax.random.normal(k1, (16, 5)), jax.random.normal(k2, (16, 24))
    params = model.init(jax.random.key(1), x)
    state = opt.init(params)

    def update(p, s, x, y):
        g = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    update = jax.jit(update) if jit else update
    with SEGMENT_ELEMENTS(limit or MAX_ELEMENTS), summary_path(path):
        with track(params, state, out=out, verbose=False, **options) as tracker:
            for _ in range(2):
                params, state, grads = tracker.intercept(update, params, state, x, y)
                tracker.step(params, state, grads)
    df = read_log(out)
    m = df["metadata"]
    return df.set_index(pd.MultiIndex.from_frame(m[["name", "tensor_type", "step"]])).sort_index()


HIGHER = {"moments": 4, "percentiles": (10, 50, 90)}


@pytest.mark.parametrize(
    "path, jit, options",
    [
        ("auto", True, HIGHER),
        ("auto", False, {}),
        ("xla", True, HIGHER),
        ("xla", False, {}),
        # No Pallas case (35 s interpreted, the suite's slowest test): the tracker cuts every
        # path's arrays by the same `segmented(core, ...)`, run here on XLA's and the host
        # kernel's cores; the Pallas core in segments (moments 2 and 4) is checked against
        # the uncut summary and numpy in test_segments_merge_to_the_whole_arrays_summary,
        # and the Pallas path of a tracker in test_blocks_jax_paths / test_jax_tracker.
    ],
)
def test_tracked_rows_do_not_depend_on_segments(tmp_path, path, jit, options):
    """A tracked run whose module outputs, gradients, weights and optimizer state pass the
    segment limit (taps in a tracked program or on the Python path, arrays summarized in
    the program or at step()) writes the rows of a run without segments: counts exactly,
    moments and percentiles to 1e-6, skewness and kurtosis (``moments=4``) to 1e-5."""
    if path == "auto" and not _ffi.available():
        pytest.skip("no in-program host kernel on this machine")
    whole = _run(tmp_path / "whole", path, jit, None, **options)
    cut = _run(tmp_path / "cut", path, jit, LIMIT, **options)
    assert whole.index.equals(cut.index)
    names = set(whole.index.get_level_values("name"))
    assert {"Dense_0", "Dense_1.kernel"} <= names  # the arrays past the limit have rows
    assert ("Dense_0", "Gradient", 1) in whole.index
    counts = whole["exponent_counts"].columns
    pd.testing.assert_frame_equal(cut["exponent_counts"][counts], whole["exponent_counts"])
    stats = whole["scalar_stats"]
    for col in stats.columns:
        got, want = cut[("scalar_stats", col)].to_numpy(), stats[col].to_numpy()
        if col in ("numel", "nan_count", "inf_count", "zero_count", "min", "max"):
            np.testing.assert_array_equal(got, want, err_msg=col)
        else:
            # skewness and kurtosis: ratios of float32 sums of cubes and fourth powers (the
            # XLA path's), which the two runs round apart
            tol = 1e-5 if col in HIGHER_STATS else 1e-6
            np.testing.assert_allclose(got, want, rtol=tol, atol=1e-6, err_msg=col)


class Step(nn.Module):
    """One iteration: a Dense whose output (64 x 24 = 1536 elements) passes the test limit;
    its kernel stacked over the iterations (3 x 24 x 24 = 1728) is cut in 2 only (a wide
    kernel would be cut in dozens of segments, each one more summary to compile)."""

    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(24, name="Dense_0")(h)), None


class Looped(nn.Module):
    """:class:`Step` under ``nn.scan``: its mailbox merges each iteration's segments."""

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Step, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan(name="blocks")(x, None)[0]


def test_loop_body_segments_merge_per_iteration(tmp_path):
    """A module inside a scan body whose output passes the limit: each iteration's segment
    rows merge into the mailbox row by row, and the host joins the segments: the rows of a
    run without segments (the Activation row counts all 3 iterations' elements)."""
    model = Looped()
    x = jax.random.normal(jax.random.key(0), (64, 24))
    params = model.init(jax.random.key(1), x)

    def update(p, x):
        return jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(p)

    logs = {}
    for limit in (None, LIMIT):
        out = tmp_path / str(limit)
        with SEGMENT_ELEMENTS(limit or MAX_ELEMENTS), summary_path("xla"):
            with track(params, out=out, verbose=False) as tracker:
                grads = tracker.intercept(jax.jit(update), params, x)
                tracker.step(params, None, grads)
        logs[limit] = read_log(out)
    df = logs[None]
    m = df["metadata"]
    act = df[(m["name"] == "blocks.Dense_0") & (m["tensor_type"] == "Activation")]
    assert int(act[("scalar_stats", "numel")].iloc[0]) == 3 * 64 * 24
    pd.testing.assert_frame_equal(logs[LIMIT], df)


def _lower(fn, n: int, dtype, platform: str) -> str:
    """The text of ``fn`` lowered for ``platform`` on an abstract ``(n,)`` array."""
    lowered = (
        jax.jit(fn).trace(jax.ShapeDtypeStruct((n,), dtype)).lower(lowering_platforms=(platform,))
    )
    return lowered.as_text()


@pytest.mark.parametrize("path", ["xla", "pallas", "auto"])
def test_arrays_past_int32_counts_lower_in_segments(path):
    """At the real limit, nothing allocated: an array of 2**32 + 5 bfloat16 elements is
    traced and lowered (for CUDA; the host kernel for the CPU) as 3 segments of at most
    2**31 - 1 elements, each summarized by the path's kernel, with int32 counts only per
    segment; 2**31 - 1 elements stay one summary."""
    if path == "auto" and not _ffi.available():
        pytest.skip("no in-program host kernel on this machine")
    # "pallas": the default path lowered for CUDA, which picks the fused kernel
    with summary_path("xla" if path == "xla" else "auto"):
        tracker = track(verbose=False)
    n = 2**32 + 5
    if path == "auto":
        fn, platform = tracker._kernels.summarize_in_program, "cpu"
    else:
        fn, platform = tracker._kernels.summarize, "cuda"
    shape = jax.eval_shape(fn, jax.ShapeDtypeStruct((n,), jnp.bfloat16))
    assert shape.counts.shape[0] == 3 and shape.counts.dtype == jnp.int32
    text = _lower(fn, n, jnp.bfloat16, platform)
    from tandv.track.jax._segments import _cuts

    for size in set(np.diff(_cuts(n)).tolist()):  # each segment, a slice the kernel reads
        assert f"tensor<{size}x" in text, size
    if path != "xla":  # the kernel: the host kernel's custom call, or Triton's
        assert ("tandv" if path == "auto" else "__gpu$xla.gpu.triton") in text
    else:  # XLA's operations only, on a GPU too
        assert "custom_call" not in text
    assert jax.eval_shape(fn, jax.ShapeDtypeStruct((MAX_ELEMENTS,), jnp.bfloat16)).counts.ndim == 1
    tracker.close()


@pytest.mark.parametrize("path", ["auto", "xla"])
def test_step_arrays_past_the_limit(tmp_path, path):
    """Weights past the limit given to step() alone (no intercept; bfloat16 and float32, so
    two stacks with segment rows beside a small array's row): each row equals the numpy
    summary of its array (the host kernel's exact float64 moments, or XLA's)."""
    arrays = {
        "w": _array(2100, ml_dtypes.bfloat16),
        "b": _array(10, ml_dtypes.bfloat16),
        "v": _array(3100),
    }
    params = {k: jnp.asarray(v) for k, v in arrays.items()}
    with SEGMENT_ELEMENTS(LIMIT), summary_path(path):
        with track(params, out=tmp_path / "log", verbose=False, track_gradients=False) as tracker:
            tracker.step(params)
    df = read_log(tmp_path / "log")
    from test_jax_tracker import assert_row_matches

    for name, x in arrays.items():
        assert_row_matches(df, name, "Weight", 0, x)


@pytest.mark.parametrize("path", ["xla", "pallas", "ffi"])
def test_one_kernel_call_takes_at_most_one_segment(path):
    """Each kernel, called directly, lowers an array of 2**31 - 1 elements (the longest
    segment) and refuses one more element when traced (its int32 counts would wrap: the XLA
    path silently, Pallas with an OverflowError from deep inside), pointing to segments."""
    from tandv.track.jax._pallas import pallas_summary

    layout = Layout("float32")
    if path == "xla":
        fn, platform = (lambda a: summarize_jax(a, layout)), "cuda"
    elif path == "pallas":
        fn, platform = (
            (lambda a: pallas_summary(a, layout.format, layout.num_counts, interpret=False)),
            "cuda",
        )
    else:
        if not _ffi.available():
            pytest.skip("no in-program host kernel on this machine")
        fn, platform = (lambda a: _ffi.ffi_summary(a, layout.format, layout.num_counts)), "cpu"
    assert MAX_ELEMENTS == np.iinfo(np.int32).max
    with pytest.raises(ValueError, match=r"has 2,147,483,648 elements.*in segments"):
        _lower(fn, 2**31, jnp.bfloat16, platform)
    _lower(fn, MAX_ELEMENTS, jnp.bfloat16, platform)


def test_sharded_array_past_the_limit(tmp_path):
    """A weight split over two devices whose shards each pass the limit: each shard's
    segments are merged, then the shards (ShardRows with segment rows): the row equals the
    numpy summary of the whole array."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs two devices")
    mesh = Mesh(np.array(devices[:2]), ("d",))
    x = _array(2 * 2100).reshape(2, 2100)
    w = jax.device_put(jnp.asarray(x), NamedSharding(mesh, PartitionSpec("d")))
    with SEGMENT_ELEMENTS(LIMIT):
        with track(
            {"w": w}, out=tmp_path / "log", verbose=False, track_gradients=False, device_axis=False
        ) as t:
            t.step({"w": w})
    from test_jax_tracker import assert_row_matches

    assert_row_matches(read_log(tmp_path / "log"), "w", "Weight", 0, x)


def test_block_formats_refuse_an_array_summarized_in_segments(tmp_path):
    """Block formats' words are of one whole array: an array the tracker would cut into
    segments (here on the XLA path; CPU arrays given to step() on the auto path are read by
    the host kernel whole, uncut) is refused with block formats: a clear error naming it, no
    row without them."""
    params = {"w": jnp.asarray(_array(2100)), "b": jnp.asarray(_array(10))}
    with SEGMENT_ELEMENTS(LIMIT), summary_path("xla"):
        with pytest.raises(NotImplementedError, match="2100 elements"):
            with track(
                params,
                out=tmp_path / "log",
                verbose=False,
                track_gradients=False,
                block_formats=("mxfp8_e4m3",),
            ) as tracker:
                tracker.step(params)
