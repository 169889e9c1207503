"""Skewness and kurtosis (``moments=4``) from the fused Triton kernel (in Triton's interpreter
on the CPU, compiled on a GPU), against ``scipy.stats`` of the tensor's own values in float64:
one program and several merging their partial rows, every dtype the kernel reads, data whose
mean dominates its spread, non-finite values, views read in place, one launch for many
tensors, micro-batches merged."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
stats = pytest.importorskip("scipy.stats")

from test_torch_fused import one  # noqa: E402  (one launch, finished)

from tandv.stats.summary import Layout, finalize, merge, summarize  # noqa: E402
from tandv.track.torch import _fused, _workspace  # noqa: E402
from tandv.track.torch import summary as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 1e-6


@pytest.fixture(autouse=True)
def fused_path():
    with kernel.cpu_path("fused"):
        yield


def values(x: torch.Tensor) -> np.ndarray:
    """``x``'s values as float64 (8-bit formats and bfloat16 through ml_dtypes)."""
    name = str(x.dtype).removeprefix("torch.")
    t = x.detach().cpu()
    if name in ("float32", "float16", "float64"):
        return t.numpy().astype(np.float64)
    bits = torch.uint8 if x.element_size() == 1 else torch.int16
    return t.view(bits).numpy().view(getattr(ml_dtypes, name)).astype(np.float64)


def check(v: np.ndarray, layout: Layout, xs: list[np.ndarray]) -> None:
    """Skewness to 1e-6 relative (or absolute near 0), Pearson's kurtosis (excess + 3) to
    1e-6 relative, against scipy of the finite values of ``xs`` together."""
    a = np.concatenate([np.ravel(x) for x in xs])
    a = a[np.isfinite(a)]
    got, _ = finalize(v, layout)
    assert got["skew"] == pytest.approx(stats.skew(a), rel=RTOL, abs=RTOL)
    assert got["kurtosis"] + 3 == pytest.approx(stats.kurtosis(a) + 3, rel=RTOL)


def data(n: int, mean: float, seed: int) -> torch.Tensor:
    """Heavy-tailed, skewed float32 values around ``mean`` (spread ~1)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(5, n) + 0.5 * rng.exponential(1.0, n) + mean
    return torch.from_numpy(x.astype(np.float32))


@pytest.fixture
def split_programs(monkeypatch):
    """Tensors of more than one tile split among programs; the last merges groups of 4."""
    monkeypatch.setattr(_fused, "ONE_PROGRAM", 0)
    monkeypatch.setattr(_fused, "GROUP", 4)
    _fused.clear_caches()
    yield
    _fused.clear_caches()


@pytest.mark.parametrize("mean", [0.0, 1e4])
def test_one_and_many_programs_match_scipy(mean, split_programs):
    """Mean 1e4 over a spread of ~1: the kernel's moments come from deviations about each
    block's mean, so they keep their precision; 1, 2 and 5 programs merge exactly."""
    block = _fused.spec_for(torch.float32).block
    x = data(9 * block - 5, mean, 0)
    x[block + 17] = mean + 40.0  # a slot whose scale grows in its second tile
    x = x.to(DEVICE)
    layout = Layout("float32", moments=4)
    ref, _ = summarize(x.cpu().numpy(), moments=4)
    for max_parts in (1, 2, 7):
        v = one(x, layout, max_parts)
        assert v.shape == (layout.size,)
        check(v, layout, [values(x)])
        np.testing.assert_allclose(v[-2:], ref[-2:], rtol=1e-6)
        np.testing.assert_array_equal(v[layout.exponent_counts], ref[layout.exponent_counts])


@pytest.mark.parametrize(
    "dtype, mean",
    [
        (torch.float64, 1e4),
        (torch.bfloat16, 0.0),
        (torch.float16, 30.0),
        (torch.float8_e4m3fn, 0.0),
    ],
    ids=str,
)
def test_other_dtypes_match_scipy(dtype, mean):
    """Each dtype in its own compute type (float64 in float64), against scipy of the values
    the tensor holds."""
    x = data(3000, mean, 1).to(dtype).to(DEVICE)
    layout = Layout(str(dtype).removeprefix("torch."), moments=4)
    check(kernel.summarize_torch(x, layout).cpu().numpy(), layout, [values(x)])


def test_non_finite_values_are_left_out(split_programs):
    """NaN and inf read as zeros in the kernel's sums, taken out again when the row is
    finished (exact up to rounding when the mean does not dwarf the spread)."""
    block = _fused.spec_for(torch.float32).block
    x = data(3 * block + 11, 2.0, 2)
    x[[5, block + 3, 3 * block + 2]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    layout = Layout("float32", moments=4)
    for max_parts in (1, 3):
        v = one(x.to(DEVICE), layout, max_parts)
        check(v, layout, [values(x)])
        assert v[1] == 1 and v[2] == 2  # the counts are the kernel's own


def test_views_read_in_place():
    """A broadcast view (its row weighted by the repeat) and a gappy one (read by strides)."""
    base = data(4 * 600, 1e4, 3).reshape(4, 600).to(DEVICE)
    layout = Layout("float32", moments=4)
    for view in (base[:1].expand(5, 600), base[:, ::3], base.t()):
        check(kernel.summarize_torch(view, layout).cpu().numpy(), layout, [values(view)])


def test_one_launch_for_many_tensors_with_a_custom_statistic():
    """launch_many's table: m3, m4 land after the custom statistics of each row."""
    block = _fused.spec_for(torch.float32).block
    tensors = [
        data(n, m, s).to(DEVICE)
        for s, (n, m) in enumerate(((7, 1.0), (5 * block + 3, 1e4), (900, -3.0)))
    ]
    layout = Layout("float32", (("peak", "max"),), moments=4)
    ws = _workspace.Workspace()
    spec = _fused.spec_for(torch.float32)
    extras = [{"peak": torch.tensor(float(i))} for i in range(len(tensors))]
    got = _workspace.to_host(ws.fused(tensors, spec, layout, extras), ws.end_step())
    for i, t in enumerate(tensors):
        assert got[i][layout.extras_start] == i
        check(got[i], layout, [values(t)])


def test_micro_batches_merge_exactly():
    """Summaries of three micro-batches (different sizes, one mean dominating) merged on the
    host equal scipy of their concatenation; so does the kernel's whole-tensor row."""
    xs = [data(n, 1e4, 10 + n).to(DEVICE) for n in (33, 5000, 1200)]
    layout = Layout("float32", moments=4)
    vs = [kernel.summarize_torch(x, layout).cpu().numpy() for x in xs]
    merged = merge(merge(vs[0], vs[1], layout), vs[2], layout)
    check(merged, layout, [values(x) for x in xs])
    whole = torch.cat(xs)
    check(kernel.summarize_torch(whole, layout).cpu().numpy(), layout, [values(whole)])


def test_default_rows_are_unchanged():
    """Without moments=4 a row has no m3, m4 (and the kernel no HOFF)."""
    spec = _fused.spec_for(torch.float32)
    two, four = Layout("float32"), Layout("float32", moments=4)
    assert _fused.row_size(spec, two) == spec.row_size
    assert _fused.row_size(spec, four) == spec.row_size + 2
    assert _fused._consts(spec, False).kwargs["HOFF"] == 0
    x = data(500, 0.0, 4).to(DEVICE)
    v2, v4 = one(x, two, 1), one(x, four, 1)
    assert v2.shape == (two.size,)
    np.testing.assert_array_equal(v4[: two.size], v2)


def test_summarize_torch_with_a_custom_statistic():
    """``summarize_torch`` on the fused path: the custom statistic in its column, m3 and m4
    after it."""
    x = data(3000, 5.0, 6).to(DEVICE)
    layout = Layout("float32", (("scale", "max"),), moments=4)
    v = kernel.summarize_torch(x, layout, {"scale": 2.5}).cpu().numpy()
    assert v.shape == (layout.size,) and v[layout.extras_start] == 2.5
    check(v, layout, [values(x)])
