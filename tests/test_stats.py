"""Number formats, the reference summary, merge and finalize, against hand-computed values."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tandv.stats import (
    DEFAULT_STATS,
    KNOWN_FORMATS,
    Layout,
    exponent_bins,
    exponent_labels,
    finalize,
    merge,
    merge_all,
    number_format,
    summarize,
)
from tandv.stats.summary import rebin


def counts_dict(x, fmt=None):
    """{label: count} of the non-zero exponent counts of x."""
    v, layout = summarize(x, fmt)
    _, c = finalize(v, layout)
    labels = exponent_labels(layout.format)
    return {labels[i]: int(c[i]) for i in np.nonzero(c)[0]}


# ------------------------------------------------------------------ number formats


@pytest.mark.parametrize("name", KNOWN_FORMATS)
def test_format_range_matches_ml_dtypes(name):
    info = ml_dtypes.finfo(name)
    f = number_format(name)
    assert 2.0**f.min_exponent == float(info.smallest_subnormal)
    assert 2.0**f.max_exponent <= float(info.max) < 2 * 2.0**f.max_exponent
    assert f.max == float(info.max)
    assert f.smallest_normal == float(info.smallest_normal)
    assert f.underflow_threshold == float(info.smallest_subnormal)
    assert f.overflow_threshold == float(info.max)


def test_format_hand_values():
    f = number_format("float8_e4m3fn")
    assert (f.min_exponent, f.max_exponent, f.max) == (-9, 8, 448.0)
    assert (number_format("float32").min_exponent, number_format("float32").max_exponent) == (
        -149,
        127,
    )
    assert (number_format("float64").min_exponent, number_format("float64").max_exponent) == (
        -1074,
        1023,
    )
    assert (number_format("float16").min_exponent, number_format("float16").max_exponent) == (
        -24,
        15,
    )
    assert number_format("bfloat16").min_exponent == -133


def test_format_accepts_framework_dtypes():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    assert number_format(torch.bfloat16).name == "bfloat16"
    assert number_format(torch.float8_e4m3fn).name == "float8_e4m3fn"
    assert number_format(jnp.float16).name == "float16"
    assert number_format(np.float32).name == "float32"
    assert number_format(np.dtype(ml_dtypes.float8_e5m2)).name == "float8_e5m2"


def test_unknown_format_lists_accepted_names():
    with pytest.raises(ValueError, match=r"unknown number format 'int8'.*float8_e4m3fn"):
        number_format("int8")
    with pytest.raises(ValueError, match="unknown number format"):
        number_format("float7")


# ------------------------------------------------------------------ exponent counts


def test_bin_edges_are_exact_powers_of_two():
    x = np.array([1.0, 2.0, 2.0 - 2**-23, 0.5, 3.0, 4.0], dtype=np.float32)
    # 1 and 2-ulp in [1, 2); 2 and 3 in [2, 4); 0.5 in [0.5, 1); 4 in [4, 8)
    assert counts_dict(x) == {-1: 1, 0: 2, 1: 2, 2: 1}


def test_zero_nan_never_counted_inf_overflows():
    x = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, -1.0], dtype=np.float32)
    assert counts_dict(x) == {0: 1, "+inf": 2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn"])
def test_subnormals_go_to_their_true_exponent(dtype):
    f = number_format(dtype)
    smallest = np.array(
        [f.smallest_subnormal, 2 * f.smallest_subnormal, f.smallest_normal], dtype=dtype
    )
    assert np.all(smallest.astype(np.float64) > 0)
    got = counts_dict(smallest)
    normal_exp = int(math.log2(f.smallest_normal))
    expected = {f.min_exponent: 1, f.min_exponent + 1: 1}
    expected[normal_exp] = expected.get(normal_exp, 0) + 1
    assert got == expected


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]
)
def test_max_finite_value_in_top_bin(dtype):
    f = number_format(dtype)
    x = np.array([f.max, -f.max], dtype=dtype)
    assert counts_dict(x) == {f.max_exponent: 2}


def test_simulated_format_underflow_and_overflow():
    f = number_format("float8_e4m3fn")
    x = np.array(
        [
            f.smallest_subnormal,
            f.smallest_subnormal / 2,
            1e-30,
            448.0,
            449.0,
            480.0,
            1e6,
            np.inf,
            0.0,
            np.nan,
        ],
        dtype=np.float32,
    )
    # below 2**-9 underflows; above 448 overflows (480 sits in binade 8 but exceeds max)
    assert counts_dict(x, "float8_e4m3fn") == {"-inf": 2, -9: 1, 8: 1, "+inf": 4}


def test_exponent_bins_agree_with_log2_on_random_values():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(5000) * np.exp(rng.uniform(-40, 40, 5000))).astype(np.float32)
    counts = exponent_bins(x, "float32")
    f = number_format("float32")
    expected = np.zeros(f.num_bins + 2, np.int64)
    for v in np.abs(x.astype(np.float64)):
        if v != 0:
            expected[1 + math.floor(math.log2(v)) - f.min_exponent] += 1
    np.testing.assert_array_equal(counts, expected)


# ------------------------------------------------------------------ scalar statistics


def test_stats_hand_computed():
    x = np.array([1.0, -2.0, 0.0, 4.0, np.nan, np.inf], dtype=np.float32)
    v, layout = summarize(x)
    s, _ = finalize(v, layout)
    fin = np.array([1.0, -2.0, 0.0, 4.0])
    assert list(s) == list(DEFAULT_STATS)
    assert s["numel"] == 6 and s["nan_count"] == 1 and s["inf_count"] == 1 and s["zero_count"] == 1
    assert s["mean"] == pytest.approx(0.75)
    assert s["std"] == pytest.approx(np.std(fin))
    assert s["mean_abs"] == pytest.approx(7 / 4)
    assert (s["min_abs"], s["max_abs"], s["min"], s["max"]) == (0.0, 4.0, -2.0, 4.0)
    assert s["rm2"] == pytest.approx(math.sqrt(21 / 4))
    assert s["rm4"] == pytest.approx((273 / 4) ** 0.25)
    assert s["rm8"] == pytest.approx(((1 + 256 + 65536) / 4) ** 0.125)


def test_empty_and_one_element():
    v, layout = summarize(np.zeros(0, np.float32))
    s, c = finalize(v, layout)
    assert s["numel"] == 0 and not c.any()
    assert all(math.isnan(s[k]) for k in ("mean", "std", "rm2", "min", "max", "max_abs"))
    v, layout = summarize(np.array([-3.0], np.float16))
    s, c = finalize(v, layout)
    assert (s["mean"], s["std"], s["rm2"], s["min"], s["max"]) == (-3.0, 0.0, 3.0, -3.0, -3.0)


def test_all_nonfinite_gives_nan_moments():
    v, layout = summarize(np.array([np.nan, np.inf], np.float32))
    s, _ = finalize(v, layout)
    assert s["numel"] == 2 and math.isnan(s["mean"]) and math.isnan(s["rm8"])


def test_std_accurate_when_mean_dominates():
    rng = np.random.default_rng(1)
    x = (1e4 + 1e-2 * rng.standard_normal(200_000)).astype(np.float32)
    v, layout = summarize(x)
    s, _ = finalize(v, layout)
    ref = np.std(x.astype(np.float64))
    assert abs(s["std"] - ref) / ref < 1e-3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_large_low_precision_values_do_not_overflow_moments(dtype):
    big = 60000.0 if dtype == "float16" else 1e38
    x = np.array([big, -big, big / 2], dtype=dtype)
    v, layout = summarize(x)
    s, _ = finalize(v, layout)
    a = np.abs(x.astype(np.float64))
    for k in (2, 4, 8):
        # reference in scaled form to avoid float64 overflow of big**8
        ref = a.max() * np.mean((a / a.max()) ** k) ** (1 / k)
        assert s[f"rm{k}"] == pytest.approx(ref, rel=1e-12)
        assert math.isfinite(s[f"rm{k}"])


# ------------------------------------------------------------------ merge


finite_arrays = hnp.arrays(
    np.float32,
    st.integers(0, 40),
    elements=st.one_of(
        st.floats(allow_nan=False, allow_infinity=False, width=32),
        st.sampled_from([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, 3.4e38]),
    ),
)


@settings(max_examples=200, deadline=None)
@given(finite_arrays, st.data())
def test_merge_of_split_equals_whole(x, data):
    cut = data.draw(st.integers(0, x.size))
    whole, layout = summarize(x)
    a, _ = summarize(x[:cut], layout.format)
    b, _ = summarize(x[cut:], layout.format)
    merged = merge(a, b, layout)
    ws, wc = finalize(whole, layout)
    ms, mc = finalize(merged, layout)
    np.testing.assert_array_equal(wc, mc)
    for k in DEFAULT_STATS:
        if isinstance(ws[k], int):
            assert ws[k] == ms[k], k
        else:
            # moments agree to rounding relative to the largest magnitude
            scale = ws["max_abs"] if np.isfinite(ws["max_abs"]) else 0.0
            np.testing.assert_allclose(ms[k], ws[k], rtol=1e-9, atol=1e-12 * scale, err_msg=k)


def test_merge_all_many_parts_and_neutral_empty():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(1000) * 3 + 7).astype(np.float32)
    whole, layout = summarize(x)
    parts = [summarize(p, layout.format)[0] for p in np.array_split(x, 7)]
    merged = merge_all(parts, layout)
    np.testing.assert_allclose(merged, whole, rtol=1e-10)
    np.testing.assert_array_equal(merge(layout.empty(), whole, layout), whole)


def test_extras_merge_rules():
    layout = Layout(
        number_format("float32"), (("s", "sum"), ("lo", "min"), ("hi", "max"), ("avg", "mean"))
    )
    a, _ = summarize(
        np.ones(3, np.float32),
        extras={"s": (1.0, "sum"), "lo": (5.0, "min"), "hi": (5.0, "max"), "avg": (1.0, "mean")},
    )
    b, _ = summarize(
        np.ones(1, np.float32),
        extras={"s": (2.0, "sum"), "lo": (2.0, "min"), "hi": (2.0, "max"), "avg": (5.0, "mean")},
    )
    s, _ = finalize(merge(a, b, layout), layout)
    assert (s["s"], s["lo"], s["hi"]) == (3.0, 2.0, 5.0)
    assert s["avg"] == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)


def test_layout_rejects_bad_extras():
    with pytest.raises(ValueError, match="merge rule 'median'"):
        Layout(number_format("float32"), (("q", "median"),))
    with pytest.raises(ValueError, match="clashes with a default statistic"):
        Layout(number_format("float32"), (("rm2", "sum"),))


def test_moments_of_float64_values_near_the_max_stay_finite():
    """Values of magnitude >= 2**1023: every moment is finite and matches the numpy
    reference computed on values scaled down by 2**1000 (exact for powers of two), both
    for one summary and for a merge of parts whose means have opposite signs."""
    x = np.array([2.0**1023, -(2.0**1023), 1.5 * 2.0**1023, -1.25 * 2.0**1023, 1.75 * 2.0**1023])
    y = x / 2.0**1000
    expected = {
        "mean": y.mean(),
        "std": y.std(),
        "mean_abs": np.abs(y).mean(),
        **{f"rm{k}": np.mean(np.abs(y) ** k) ** (1 / k) for k in (2, 4, 8)},
    }
    whole, layout = summarize(x)
    a, _ = summarize(x[1::2])
    b, _ = summarize(x[::2])
    with np.errstate(over="raise"):
        for v in (whole, merge(a, b, layout), merge(b, a, layout)):
            stats, _ = finalize(v, layout)
            for k, e in expected.items():
                assert np.isfinite(stats[k]), k
                assert stats[k] / 2.0**1000 == pytest.approx(e, rel=1e-12), k


def test_rebin_moves_a_summary_into_a_wider_format_exactly_or_refuses():
    """A bfloat16-format summary of bfloat16 values, re-binned into the float32 layout, is
    the float32-format summary of the same values; a summary that counted an underflow of
    its own format, or a format that does not nest in the target, is refused (``None``)."""
    x = np.array([1.5, -2.0, 0.0, 3.0e-30, np.inf, -7.0e20], dtype=ml_dtypes.bfloat16)
    v16, l16 = summarize(x)
    v32, l32 = summarize(x.astype(np.float32), "float32")
    assert l16 != l32
    np.testing.assert_array_equal(rebin(v16, l16, l32), v32)
    assert rebin(v16, l16, l16) is v16
    under, lu = summarize(np.array([1e-9, 2.0], np.float32), "float16")  # 1e-9 underflows
    assert rebin(under, lu, l32) is None
    assert rebin(v32, l32, l16) is None  # float32's subnormals reach below bfloat16's
