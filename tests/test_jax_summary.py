"""The JAX summaries against the numpy reference tandv.stats.summarize: summarize_jax (XLA
operations, any backend), the fused Pallas kernel (_pallas, in interpret mode here) and the
host kernel called from inside XLA:CPU programs (_ffi)."""

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from tandv.stats import Layout, finalize, summarize  # noqa: E402
from tandv.stats.summary import CORE_FIELDS  # noqa: E402
from tandv.track.jax import _ffi, summarize_jax, to_vector  # noqa: E402

EXACT = [
    CORE_FIELDS.index(f)
    for f in ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "min_abs", "max_abs")
]
MOMENTS = [CORE_FIELDS.index(f) for f in ("mean", "m2", "p1", "p2", "p4", "p8")]


_jitted = {}
PATHS = [
    "xla",
    "matmul",
    "pallas",
    pytest.param("ffi", marks=pytest.mark.in_program_kernel),
]


def _accelerator_twin(layout):
    """summarize_jax as it runs on accelerators: exponent counts by one-hot matrix products
    (no scatter), which JAX picks on every platform but the CPU; forced here while tracing."""

    def fn(a):
        with _matmul_histograms():
            return summarize_jax(a, layout)

    return fn


def _matmul_histograms():
    """While tracing: the exponent counts by matrix products (what every platform but the
    CPU lowers), on the CPU too."""
    from unittest import mock

    from tandv.track.jax import _summary

    def by_matmul(idx, row_seg, num, length):
        return _summary.histograms_by_matmul(idx, row_seg, num, length)

    return mock.patch.object(_summary, "_scatter_histograms", by_matmul)


def _in_program(layout):
    """summarize_jax's twin on XLA:CPU: the host kernel as a custom call."""
    return lambda a: _ffi.ffi_summary(a, layout.format, layout.num_counts)


def _fused(layout):
    """The fused Pallas kernel, run by Pallas's interpreter (the kernel accelerators compile)."""
    from tandv.track.jax._pallas import pallas_summary

    return lambda a: pallas_summary(a, layout.format, layout.num_counts, interpret=True)


def _device(x, fmt=None, path="xla"):
    ref, layout = summarize(np.asarray(x), fmt)
    if (layout, path) not in _jitted:  # one compile per layout (and shape), not per call
        fn = (
            _in_program(layout)
            if path == "ffi"
            else _accelerator_twin(layout)
            if path == "matmul"
            else _fused(layout)
            if path == "pallas"
            else (lambda a: summarize_jax(a, layout))
        )
        _jitted[layout, path] = jax.jit(fn)
    return ref, layout, to_vector(jax.device_get(_jitted[layout, path](jnp.asarray(x))))


def assert_matches(x, fmt=None, path="xla"):
    ref, layout, got = _device(x, fmt, path)
    np.testing.assert_array_equal(got[EXACT], ref[EXACT])
    np.testing.assert_array_equal(
        got[layout.counts_start : layout.extras_start],
        ref[layout.counts_start : layout.extras_start],
    )
    # the mean to float32 rounding of sums of values up to max_abs (it may be a small
    # difference of large values); m2 and the power sums are relative to max_abs already
    mean = CORE_FIELDS.index("mean")
    np.testing.assert_allclose(
        got[mean], ref[mean], rtol=2e-5, atol=1e-6 * max(1.0, ref[CORE_FIELDS.index("max_abs")])
    )
    np.testing.assert_allclose(got[MOMENTS[1:]], ref[MOMENTS[1:]], rtol=2e-5, atol=1e-6)
    return ref, layout, got


rng = np.random.default_rng(0)
SPECIALS = np.array(
    [1e-45, 3e-42, -1e-40, 1.2e-38, 0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -2.0, 3.4e38, -7.5],
    np.float32,
)


@pytest.mark.parametrize(
    "x, fmt",
    [
        (rng.normal(size=(16, 33)).astype(np.float32), None),
        (rng.normal(size=(16, 33)).astype(np.float32), "float8_e4m3fn"),
        (rng.normal(size=(16, 33)).astype(np.float32) * 1e30, "bfloat16"),
        (rng.normal(size=(16, 33)).astype(np.float32) * 1e-38, None),  # mostly float32 subnormals
        (SPECIALS, None),
        (SPECIALS, "float16"),
        (SPECIALS, "float64"),
        (rng.normal(size=500).astype(ml_dtypes.bfloat16), None),
        (rng.normal(size=500).astype(np.float16) * np.float16(1e-6), None),  # float16 subnormals
        (rng.normal(size=64).astype(ml_dtypes.float8_e4m3fn), None),
        (
            np.array(
                [0.0, -0.0, 1e-45, -3e-42, np.inf, -np.inf, np.nan, 448.0, -0.001953125], np.float32
            ).astype(ml_dtypes.float8_e4m3fn),
            None,
        ),
        (
            np.array(
                [0.0, -0.0, 2.0**-16, -(2.0**-14), 57344.0, -np.inf, np.nan, 1.5], np.float32
            ).astype(ml_dtypes.float8_e5m2),
            None,
        ),
        (np.zeros((0, 3), np.float32), None),
        (np.array([np.nan, np.inf], np.float32), None),
    ],
    ids=[
        "f32",
        "f32-as-e4m3",
        "f32-as-bf16",
        "f32-subnormal",
        "specials",
        "specials-as-f16",
        "specials-as-f64",
        "bf16",
        "f16-subnormal",
        "e4m3",
        "e4m3-specials",
        "e5m2-specials",
        "empty",
        "no-finite",
    ],
)
@pytest.mark.parametrize("path", PATHS)
def test_matches_reference(x, fmt, path):
    assert_matches(x, fmt, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "scale", [1e-40, 1e-33, 1e35], ids=["all-subnormal", "below-2^-100", "above-2^100"]
)
def test_extreme_ranges_match_reference(path, scale):
    """Arrays whose values are all float32 subnormals (XLA:CPU's threads flush those to zero
    unless the kernel says otherwise) and arrays whose largest magnitude lies outside the
    kernel's one-pass range (2**±100: its moments then take a second, scaled pass)."""
    assert_matches((rng.normal(size=3000) * scale).astype(np.float32), None, path)


def test_variance_accurate_when_mean_dominates():
    x = np.float32(1000.0) + rng.normal(size=4096).astype(np.float32) * np.float32(1e-3)
    ref, layout, got = assert_matches(x)
    std_ref = finalize(ref, layout)[0]["std"]
    std_got = finalize(got, layout)[0]["std"]
    assert std_got == pytest.approx(std_ref, rel=1e-3)
    assert std_ref == pytest.approx(np.std(x.astype(np.float64)), rel=1e-6)


@pytest.mark.parametrize("n", [4096, 30_000, 100_000], ids=["one-chunk", "long-lanes", "chunks"])
def test_fused_kernel_variance_accurate_when_mean_dominates(n):
    """The Pallas kernel's lanes sum deviations from a shift that follows their mean: values
    that differ only in their last bits keep their spread (a running mean by Welford's
    update stalls at the float32 grid and lost 0.3-2% of the deviation)."""
    x = np.float32(1000.0) + rng.normal(size=n).astype(np.float32) * np.float32(1e-3)
    ref, layout, got = assert_matches(x, None, "pallas")
    assert finalize(got, layout)[0]["std"] == pytest.approx(np.std(x.astype(np.float64)), rel=1e-3)
    assert finalize(ref, layout)[0]["std"] == pytest.approx(np.std(x.astype(np.float64)), rel=1e-6)


def test_custom_statistic_is_appended():
    x = rng.normal(size=100).astype(np.float32)
    layout = Layout("float32", (("l1", "sum"),))
    fn = jax.jit(lambda a: summarize_jax(a, layout, {"l1": lambda v: jnp.sum(jnp.abs(v))}))
    got = to_vector(jax.device_get(fn(jnp.asarray(x))))
    assert got[layout.extras_start] == pytest.approx(np.abs(x).sum(), rel=1e-5)
    with pytest.raises(ValueError, match="do not match the layout's extras"):
        summarize_jax(jnp.asarray(x), layout, {})


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(np.float32, 41, elements=st.floats(width=32, allow_nan=True, allow_infinity=True)),
    st.sampled_from([None, "bfloat16", "float8_e5m2"]),
    st.sampled_from(["xla", "matmul", "pallas", "ffi"]),
)
def test_matches_reference_property(x, fmt, path):
    if path == "ffi" and not _ffi.available():
        return
    assert_matches(x, fmt, path)


@pytest.mark.parametrize("histograms", ["scatter", "matmul"])
def test_summarize_many_equals_one_by_one(histograms):
    """Several arrays summarized together, each as numpy summarizes it alone; with the
    exponent counts of the CPU (a scatter per array) and of accelerators (one batched matrix
    product for all arrays, whose rows are summed per array: arrays of several rows).

    The moments are XLA's float32 sums, within about ``n * 2**-24`` of numpy's float64
    ones for a sum of ``n`` positive terms (the second moment of the heavy-tailed array
    came within 4.7e-5 of numpy's over 300 seeds, where that bound is 1.5e-4); the data is
    the test's own (a module-level generator's would depend on which tests ran first)."""
    import contextlib

    from tandv.track.jax import summarize_many_jax

    rng = np.random.default_rng(215)
    arrays = [
        rng.normal(size=(3, 4)).astype(np.float32),
        SPECIALS,
        np.zeros((0,), np.float32),
        rng.normal(size=7).astype(np.float32) * 1e-39,
        (rng.normal(size=2500) * np.exp(rng.normal(size=2500) * 8)).astype(np.float32),
        rng.normal(size=1024).astype(np.float32) * 1e30,
    ]
    layout = Layout("float32")
    with _matmul_histograms() if histograms == "matmul" else contextlib.nullcontext():
        many = jax.jit(lambda xs: summarize_many_jax(xs, layout)).trace(
            [jnp.asarray(a) for a in arrays]
        )
    many = many.lower().compile()([jnp.asarray(a) for a in arrays])
    for a, got in zip(arrays, jax.device_get(many)):
        ref = summarize(a)[0]
        got = to_vector(got)
        np.testing.assert_array_equal(got[EXACT], ref[EXACT])
        np.testing.assert_array_equal(got[layout.counts_start :], ref[layout.counts_start :])
        rtol = max(2e-5, a.size * 2.0**-24)
        np.testing.assert_allclose(got[MOMENTS], ref[MOMENTS], rtol=rtol, atol=1e-6)


def test_summarize_many_float64_arrays_with_x64():
    """With jax_enable_x64, several float64 arrays summarized together (the exponent
    counts' two platform branches count in one integer type), each as numpy summarizes it:
    float64 subnormals and the float64 format's exponent range."""
    from tandv.track.jax import summarize_many_jax

    arrays = [rng.normal(size=1500) * 1e-310, np.array([np.nan, -np.inf, 0.0, 2.0**1000, -3.5])]
    layout = Layout("float64")
    with jax.enable_x64(True):
        many = jax.jit(lambda xs: summarize_many_jax(xs, layout))([jnp.asarray(a) for a in arrays])
        many = jax.device_get(many)
    for a, got in zip(arrays, many):
        ref = summarize(a, "float64")[0]
        got = to_vector(got)
        np.testing.assert_array_equal(got[EXACT], ref[EXACT])
        np.testing.assert_array_equal(got[layout.counts_start :], ref[layout.counts_start :])
        np.testing.assert_allclose(got[MOMENTS], ref[MOMENTS], rtol=1e-12, atol=1e-12)


def test_fused_kernel_shares_calls_between_small_arrays_with_the_same_results():
    """pallas_summaries: small arrays whose chunks match share one kernel call (a program
    each), and each summary is bit for bit the one of the array's own call, and numpy's."""
    from tandv.track.jax._pallas import chunk_size, pallas_summaries, pallas_summary

    arrays = [
        rng.normal(size=(3, 4)).astype(np.float32),
        SPECIALS,
        np.zeros((0,), np.float32),
        rng.normal(size=7).astype(np.float32) * 1e-39,
        rng.normal(size=130).astype(np.float32) + 1000,  # these two: a chunk of 256
        (rng.normal(size=250) * np.exp(rng.normal(size=250) * 8)).astype(np.float32),
    ]
    layout = Layout("float32")
    assert {chunk_size(a.size, 4, 16) for a in arrays} == {128, 256}
    fmt, counts = layout.format, layout.num_counts
    xs = [jnp.asarray(a) for a in arrays]
    shared = jax.jit(lambda xs: pallas_summaries(xs, fmt, counts, interpret=True))
    calls = str(shared.trace(xs).jaxpr).count("pallas_call")
    assert calls == 2  # one per chunk size, not one per array
    own = jax.jit(lambda xs: [pallas_summary(x, fmt, counts, interpret=True) for x in xs])
    for a, got, want in zip(arrays, jax.device_get(shared(xs)), jax.device_get(own(xs))):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(
                np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32)
            )
        ref = summarize(a)[0]
        got = to_vector(got)
        np.testing.assert_array_equal(got[EXACT], ref[EXACT])
        np.testing.assert_array_equal(got[layout.counts_start :], ref[layout.counts_start :])
        np.testing.assert_allclose(got[MOMENTS[1:]], ref[MOMENTS[1:]], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"])
def test_large_array_counted_in_pairs(fmt, path):
    """Arrays of 32 rows or more take the pairwise histogram (XLA), several 64K chunks (the
    kernel); odd specials included."""
    x = (rng.normal(size=140_000) * np.exp(rng.normal(size=140_000) * 6)).astype(np.float32)
    x[rng.integers(0, x.size, 200)] = rng.choice(SPECIALS, 200)
    assert_matches(x, fmt, path)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_fused_kernel_merges_blocks_of_unlike_scales(dtype):
    """The Pallas kernel's lanes each scale their moments by their own largest magnitude
    and merge by Chan's formula: blocks (BLOCK elements) of tiny, huge and offset values,
    a block of zeros and -0.0 only, a block of NaN only, and a ragged last block, read in
    the array's own dtype."""
    from tandv.track.jax._pallas import BLOCK

    big = float(ml_dtypes.finfo(dtype).max) / 8
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    parts = [
        rng.normal(size=BLOCK) * tiny * 50,  # subnormals of the dtype
        rng.normal(size=BLOCK) * big,
        np.where(rng.random(BLOCK) < 0.5, 0.0, -0.0),
        np.full(BLOCK, np.nan),
        100.0 + rng.normal(size=BLOCK),  # |mean| >> std
        rng.normal(size=777),
    ]  # ragged end
    x = np.concatenate(parts).astype(dtype)
    assert_matches(x, None, "pallas")
    assert_matches(x, "float8_e4m3fn", "pallas")


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_fused_kernel_merges_programs_and_lanes_of_unlike_scales(dtype):
    """Several programs (chunks of chunk_size elements), each looping over many blocks whose
    lanes keep their own moments: blocks cycling through tiny, unit and huge scales (a lane's
    state moves to a larger scale mid-loop, then takes values far below it), a stretch where
    |mean| >> std, specials scattered over every program (zeros, -0.0, subnormals, +-inf,
    NaN, values at the dtype's largest finite), and a ragged end no block size divides."""
    from tandv.stats.formats import number_format
    from tandv.track.jax._pallas import BLOCK, chunk_size

    info = ml_dtypes.finfo(dtype)
    itemsize = np.dtype(dtype).itemsize
    high = 32  # the dtype formats' histograms (at most 512 bins) as high x 16
    assert number_format(np.dtype(dtype).name).num_bins < high * 16
    n = 2 * chunk_size(10**6, itemsize, high) + 12_345
    scales = [float(info.tiny) * 4, 1.0, float(info.max) / 8]
    if dtype != np.float16:
        scales += [1e-30, 1e30]
    blocks = -(-n // BLOCK)
    by_block = np.array(scales)[np.arange(blocks) % len(scales)]
    x = rng.normal(size=n) * np.repeat(by_block, BLOCK)[:n]
    x[n // 2 : n // 2 + 5000] = 100.0 + rng.normal(size=5000)
    specials = np.array(
        [0.0, -0.0, float(info.smallest_subnormal), -3 * float(info.smallest_subnormal),
         np.inf, -np.inf, np.nan, float(info.max), -float(info.max)]
    )  # fmt: skip
    x[rng.integers(0, n, 300)] = rng.choice(specials, 300)
    x = x.astype(dtype)
    assert chunk_size(n, itemsize, high) < n  # several programs
    assert_matches(x, None, "pallas")
    assert_matches(x, "float8_e4m3fn", "pallas")


def test_in_program_kernel_is_available_on_x86_and_arm():
    """Where the kernel is meant to serve, it must: its self-test (the custom call against the
    host kernel on specials) passing is what keeps the ffi cases above from being skipped."""
    if _ffi.SUPPORTED:
        assert _ffi.available()
