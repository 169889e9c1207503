"""summarize_torch against the numpy reference tandv.stats.summarize."""

import os

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tandv.stats.summary import CORE_FIELDS, Layout, finalize, merge, summarize
from tandv.track.torch import summarize_torch
from tandv.track.torch import summary as kernel
from tandv.track.torch._workspace import Workspace, to_host

try:
    import triton  # noqa: F401

    # CPU tensors take the fused kernel in Triton's interpreter only (tests/conftest.py sets
    # it where no GPU is present); on a GPU, test_torch_fused.py runs it on CUDA tensors
    PATHS = ["host", "ops"] + (["fused"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    PATHS = ["host", "ops"]


@pytest.fixture(autouse=True, params=PATHS)
def kernel_path(request):
    """Every test runs each path: the host kernel CPU tensors take, the torch-op path of
    float64 and tensor subclasses, and the fused Triton kernel of CUDA tensors (forced here
    on CPU tensors, in Triton's interpreter when no GPU is present)."""
    with kernel.cpu_path(request.param):
        yield request.param


EXACT = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "min_abs", "max_abs")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor's values as numpy, in the same format (ml_dtypes for bf16/fp8)."""
    name = str(t.dtype).removeprefix("torch.")
    if name in ("float32", "float64", "float16"):
        return t.detach().numpy()
    return t.detach().float().numpy().astype(getattr(ml_dtypes, name))


def assert_matches_reference(x: torch.Tensor, fmt=None, rtol=2e-6):
    ref, layout = summarize(to_numpy(x), fmt)
    got = summarize_torch(x, layout)
    assert got.dtype == torch.float64 and got.shape == (layout.size,)
    got = got.numpy()
    for i, name in enumerate(CORE_FIELDS):
        if name in EXACT:
            assert got[i] == ref[i] or (np.isnan(got[i]) and np.isnan(ref[i])), (
                name,
                got[i],
                ref[i],
            )
        else:
            # moments: relative to the summary's own scale (they are sums of terms <= 1)
            tol = rtol * max(abs(ref[i]), ref[0] * 1e-9, 1e-300)
            nonfinite = ref[1] + ref[2]
            if name == "m2" and nonfinite:
                # documented: with NaN/inf present, m2 is accurate relative to the sum it is
                # taken from, which also holds nonfinite * (mean/scale)**2
                tol += rtol * nonfinite * (ref[8] / (ref[7] or 1.0)) ** 2
            if name == "mean":
                # the mean is not scaled: any float64 sum of n values is off by up to about
                # n * 2**-52 * max|x|, which is all that is known where values cancel (the
                # numpy reference of [1, FLT_MAX, -FLT_MAX] gives 0, the kernel's pivoted sum
                # 1, the mean 1/3)
                tol += 4 * ref[0] * 2.0**-52 * ref[7]
            assert abs(got[i] - ref[i]) <= tol, (name, got[i], ref[i])
    np.testing.assert_array_equal(got[layout.counts_start :], ref[layout.counts_start :])


SPECIAL = [
    1.0,
    -2.5,
    0.0,
    -0.0,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e-45,
    -3e-39,
    3e38,
    448.0,
    449.0,
    500.0,
    1e-9,
    65504.0,
    70000.0,
]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
)
@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn", "bfloat16", "float16", "float32"])
def test_random_and_special_values(dtype, fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3000, generator=g) * torch.exp(torch.randn(3000, generator=g) * 4)
    x = torch.cat([x, torch.tensor(SPECIAL)]).to(dtype)
    assert_matches_reference(x, fmt)


@pytest.mark.parametrize(
    "values",
    [
        [float("nan"), 2.0, 3.0],  # non-finite with all finite values > 0
        [float("inf"), -2.0, -3.0],  # non-finite with all finite values < 0
        [float("nan"), float("inf")],  # nothing finite
        [0.0, 0.0, 0.0],
        [3e38] * 7,  # constant near the float32 max: std exactly 0
        [1.0] * 5,
        [-1e-40, 2e-39, 1e-45],  # float32 subnormals only
        [1e-45],  # the smallest subnormal alone: its 8th power too
        [3e-45, -1e-45, 0.0],
    ],
)
def test_edge_cases(values):
    assert_matches_reference(torch.tensor(values, dtype=torch.float32))


def test_large_mean_small_std_keeps_variance():
    g = torch.Generator().manual_seed(2)
    x = 1000.0 + 1e-2 * torch.randn(200_000, generator=g)
    assert_matches_reference(x)
    ref, layout = summarize(x.numpy())
    stats, _ = finalize(summarize_torch(x, layout).numpy(), layout)
    assert stats["std"] == pytest.approx(float(np.std(x.numpy().astype(np.float64))), rel=1e-5)


def test_float64_subnormals():
    x = torch.tensor([1e-310, -4e-320, 5e-324, 1.0, float("nan")], dtype=torch.float64)
    assert_matches_reference(x)
    assert_matches_reference(x, "float32")


def test_empty_non_contiguous_and_large():
    assert_matches_reference(torch.empty(0))
    g = torch.Generator().manual_seed(3)
    assert_matches_reference(torch.randn(64, 48, generator=g).t())  # non-contiguous
    assert_matches_reference(torch.randn(3, 70_000, generator=g)[:, ::3])
    assert_matches_reference(torch.randn(1 << 18, generator=g))  # the parallel scatter path


def test_input_is_not_modified():
    x = torch.tensor([1.0, float("nan"), -3.0, float("inf")])
    before = x.clone()
    summarize_torch(x, Layout("float32"))
    torch.testing.assert_close(x, before, equal_nan=True)


def test_hand_computed_case():
    x = torch.tensor([1.0, -2.0, 4.0, 0.0])
    layout = Layout("float32")
    stats, counts = finalize(summarize_torch(x, layout).numpy(), layout)
    assert stats["mean"] == 0.75
    assert stats["max_abs"] == 4.0 and stats["min_abs"] == 0.0 and stats["min"] == -2.0
    assert stats["rm2"] == pytest.approx(np.sqrt(21 / 4))
    assert stats["std"] == pytest.approx(np.std([1.0, -2.0, 4.0, 0.0]))
    labels = ["-inf", *layout.format.exponents, "+inf"]
    assert {labels[i]: c for i, c in enumerate(counts) if c} == {0: 1, 1: 1, 2: 1}


def test_extras_values_and_validation():
    layout = Layout("float32", (("frac_pos", "mean"), ("peak", "max")))
    x = torch.tensor([1.0, -1.0, 2.0, 3.0])
    v = summarize_torch(x, layout, {"peak": torch.tensor(3.0), "frac_pos": 0.75}).numpy()
    assert list(v[layout.extras_start :]) == [0.75, 3.0]
    with pytest.raises(ValueError, match="extras"):
        summarize_torch(x, layout, {"peak": 1.0})
    with pytest.raises(TypeError, match="floating-point"):
        summarize_torch(torch.arange(3), Layout("float32"))


def test_merged_summaries_equal_the_whole():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(500, generator=g), torch.randn(300, generator=g) * 5 + 2
    layout = Layout("float32")
    merged = merge(summarize_torch(a, layout).numpy(), summarize_torch(b, layout).numpy(), layout)
    whole, _ = summarize(torch.cat([a, b]).numpy())
    np.testing.assert_allclose(merged, whole, rtol=1e-6)


finite_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(finite_floats, min_size=1, max_size=60),
    st.sampled_from([None, "float8_e4m3fn", "bfloat16", "float16"]),
)
@example(values=[1.0, 3.4028234663852886e38, -3.4028234663852886e38], fmt=None)  # cancels
def test_property_any_float32_values(values, fmt):
    assert_matches_reference(torch.tensor(values, dtype=torch.float32), fmt)


def test_host_path_is_taken_exactly_when_it_applies(kernel_path):
    """CPU tensors of at most float32 precision go to the host kernel, whatever their range
    (NaN, inf, zeros and magnitudes beyond 2**±100 included); float64 takes the device path."""
    kept = []
    real = kernel.host_summaries

    def spy(arrays, *args):
        kept.extend(a.size for a in arrays)
        return real(arrays, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel, "host_summaries", spy)
        for values in (
            [1.0, -2.0],
            [1.0, float("nan")],
            [0.0, 0.0],
            [2.0**101, 1.0],
            [2.0**-101],
            [float("inf"), -3.0],
        ):
            assert_matches_reference(torch.tensor(values))
        assert_matches_reference(torch.tensor([1.0], dtype=torch.float64))
    assert kept == ([2, 2, 2, 2, 1, 2] if kernel_path == "host" else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_subnormals_and_normals_together(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5000, generator=g)
    x[::7] = 0.0
    x[1::11] = torch.tensor([1e-40, -3e-42, 1.4e-45, 9e-39]).repeat(455)[: len(x[1::11])]
    assert_matches_reference(x.to(dtype))
    assert_matches_reference(x.to(dtype), "float8_e5m2")


@pytest.mark.parametrize("offset", [0.0, 0.5, 1.0, 3.0, 1e3])
def test_variance_either_side_of_the_centring_threshold(offset):
    g = torch.Generator().manual_seed(6)
    x = offset + torch.randn(10_000, generator=g)
    ref, layout = summarize(x.numpy())
    stats, _ = finalize(summarize_torch(x, layout).numpy(), layout)
    assert stats["std"] == pytest.approx(float(np.std(x.numpy().astype(np.float64))), rel=1e-6)
    assert stats["mean"] == pytest.approx(
        float(np.mean(x.numpy().astype(np.float64))), rel=1e-6, abs=1e-9
    )


def test_batched_small_tensors_equal_the_reference(kernel_path):
    """A tracker's batch of tensors (small CPU tensors summarized together on the host path,
    one launch for all on the fused path) agrees with the numpy reference tensor by tensor,
    specials included."""
    g = torch.Generator().manual_seed(7)
    special = torch.tensor(SPECIAL)
    tensors = [
        torch.randn(300, generator=g) * 1e-3,
        special,
        torch.tensor([float("nan")] * 3),
        torch.zeros(5),
        torch.tensor([-2.0, -3.0, float("inf")]),
        torch.randn(4096, generator=g) + 50,
        torch.randn(5000, generator=g),  # read in place, not copied with the small ones
        torch.empty(0),
        special.to(torch.bfloat16),
    ]
    batches, launches = [], []
    real = kernel.host_summaries
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(
        kernel, "host_summaries", lambda ts, *a: batches.append(len(ts)) or real(ts, *a)
    )
    if kernel_path == "fused":
        from tandv.track.torch import _fused

        real_many = _fused.launch_many
        monkeypatch.setattr(
            _fused, "launch_many", lambda ts, *a: launches.append(len(ts)) or real_many(ts, *a)
        )
    for fmt in ("float32", "float8_e4m3fn"):
        layout = Layout(fmt, (("peak", "max"),))
        ws = Workspace()
        summaries = ws.summaries(tensors, layout, [{"peak": float(i)} for i in range(len(tensors))])
        for i, (t, got) in enumerate(zip(tensors, to_host(summaries, ws.end_step()))):
            ref, _ = summarize(to_numpy(t), fmt, {"peak": (float(i), "max")})
            assert got.shape == ref.shape
            for j, name in enumerate(CORE_FIELDS):
                if name in EXACT:
                    assert got[j] == ref[j] or (np.isnan(got[j]) and np.isnan(ref[j])), (i, name)
                else:
                    tol = 2e-6 * max(abs(ref[j]), ref[0] * 1e-9, 1e-300)
                    if name == "m2" and ref[1] + ref[2]:
                        tol += 2e-6 * (ref[1] + ref[2]) * (ref[8] / (ref[7] or 1.0)) ** 2
                    assert abs(got[j] - ref[j]) <= tol, (i, name, got[j], ref[j])
            np.testing.assert_array_equal(got[layout.counts_start :], ref[layout.counts_start :])
    monkeypatch.undo()
    assert batches == ([len(tensors)] * 2 if kernel_path == "host" else [])
    # float32 tensors (the empty one excluded) in one launch; the bfloat16 one alone
    assert launches == ([len(tensors) - 2] * 2 if kernel_path == "fused" else [])


class _Wrapped(torch.Tensor):
    """A tensor subclass standing in for DTensor and the like."""


def test_tensor_subclasses_and_negative_views_on_the_host_path(kernel_path):
    """Subclasses (a DTensor holds one shard) take the device path; a lazily negated view
    (negative bit set, which ``.numpy()`` refuses) is read correctly."""
    x = torch.linspace(-3, 5, 101)
    assert kernel._host_array(x.as_subclass(_Wrapped)) is None
    assert_matches_reference(x.as_subclass(_Wrapped))
    neg = torch._neg_view(x)
    assert neg.is_neg()
    ref, layout = summarize(-x.numpy())
    np.testing.assert_allclose(summarize_torch(neg, layout).numpy(), ref, rtol=2e-6)


def test_float64_values_near_the_largest_keep_finite_moments():
    """Finishing takes the scale's power of two in halves: 2**1024 would overflow."""
    x = torch.tensor([2.0**1023, -(2.0**1023), 1.5 * 2.0**1023, 3.0], dtype=torch.float64)
    assert_matches_reference(x)


def test_the_cpu_path_hook_routes_cpu_tensors_and_restores(kernel_path):
    """``cpu_path`` (the test hook the fixture above uses) sends a CPU tensor to the host
    kernel only on ``"host"`` and to the fused kernel only on ``"fused"``; a ``with`` block
    puts the path before back, also when it raises; an unknown path is refused."""
    x = torch.ones(8)
    _, layout = summarize(x.numpy())

    def host(t):  # whether the host kernel takes t
        return kernel.host_vectors([t], layout, [{}])[0] is not None

    assert kernel.current_cpu_path() == kernel_path
    assert host(x) == (kernel_path == "host")
    assert (kernel.fused_spec(x) is not None) == (kernel_path == "fused")
    with pytest.raises(KeyError), kernel.cpu_path("host"):
        assert kernel.current_cpu_path() == "host"
        assert host(x) and kernel.fused_spec(x) is None
        raise KeyError("inside")
    assert kernel.current_cpu_path() == kernel_path
    with pytest.raises(ValueError, match="cpu_path\\('device'\\): expected one of 'host'"):
        kernel.cpu_path("device")
    assert kernel.current_cpu_path() == kernel_path
