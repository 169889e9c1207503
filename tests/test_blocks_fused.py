"""Block-scaled formats on the fused path (Triton; in its interpreter on CPU tensors without a
GPU): the block kernel's columns against the numpy reference, exactly (counts and block
ranges; ``sq_err`` to 1e-6 relative), on the crafted tensors of ``test_blocks.py`` and more,
on random tensors, with one, two and several programs per tensor, and on views."""

from __future__ import annotations

import math
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from test_blocks import COLS, NAMES, _random_arrays  # noqa: E402

from tandv.stats.blocks import block_extras, block_stats  # noqa: E402
from tandv.stats.formats import number_format  # noqa: E402
from tandv.stats.summary import Layout, summarize  # noqa: E402
from tandv.track.torch import _fused  # noqa: E402
from tandv.track.torch import summary as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def fused_path() -> Iterator[None]:
    with kernel.cpu_path("fused"):
        yield


def _torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(np.array(a)).to(DEVICE)


def fused_columns(
    x: torch.Tensor, names: tuple[str, ...] = NAMES, max_parts: int = 16
) -> np.ndarray:
    """The block columns (formats x 5) of ``x`` by :func:`_fused.launch_one` (the summary
    kernel, then the block kernel) with at most ``max_parts`` programs, finished."""
    layout = Layout(number_format(kernel.dtype_name(x.dtype)), block_extras(names))
    spec = _fused.spec_for(x.dtype)
    rows = torch.zeros(_fused.row_size(spec, layout), dtype=torch.float64, device=x.device)
    parts = max(1, _fused.scratch_rows(x.numel(), max_parts, spec))
    scratch = torch.zeros(parts * _fused.PART, dtype=torch.float64, device=x.device)
    _fused.launch_one(x, spec, layout, rows, 0, scratch, max_parts)
    vec = _fused.finish_rows(rows[None].cpu().numpy(), spec, layout)[0]
    return vec[layout.extras_start :].reshape(len(names), len(COLS))


def _check(got: np.ndarray, values: np.ndarray, names: tuple[str, ...], what: object) -> None:
    for name, g in zip(names, got):
        ref = block_stats(values, name)
        for col, value in zip(COLS, g.tolist()):
            tol = 1e-6 if col == "sq_err" else 0.0
            assert value == pytest.approx(ref[col], rel=tol, abs=0), (what, name, col, ref)


def _crafted() -> list[np.ndarray]:
    """The crafted tensors: all-zero blocks, one huge value (exactly representable, so the
    error is all in the values it pushes to zero), float32 subnormals, rounding midpoints,
    saturation, NaN and inf inside blocks, rows of 1, 31, 32 and 33."""
    out = [np.zeros((3, 40), np.float32)]
    one_huge = np.ones(32, np.float32)
    one_huge[5] = 1024.0
    out.append(one_huge)
    for big in (2.0**120, 2.0**127):  # the others 2**-120 .. 2**-276 of the block's max
        b = np.ones((2, 32), np.float32)
        b[0, 0] = big
        b[1] = 2.0**-149
        b[1, 3] = big
        out.append(b)
    nv = np.ones(32, np.float32)
    nv[0] = 2688.0  # NVFP4's tensor scale 1
    out.append(nv)
    out.append(
        np.array([256.0, 2.0**-7, 2.0**-10, 3 * 2.0**-10, 1 + 1 / 16, 1 + 3 / 16], np.float32)
    )
    out.append(np.array([2.0**-140, 2.0**-141, 2.0**-149], np.float32))
    sub = np.full(32, 2.0**-140, np.float32)
    sub[9] = 2.0**-149
    out.append(sub)
    out.append(np.array([464.0, 1.0], np.float32))
    out.append(np.array([[7.0], [3.0]], np.float32))
    out.append(np.array([np.nan, np.inf, -np.inf, 256.0, 2.0**-10, -1.0], np.float32))
    for length in (1, 31, 32, 33):
        rows = np.full((3, length), 64.0, np.float32)
        rows[:, length // 2] = 1.0
        rows[1, -1] = np.nan
        out.append(rows)
    # values on every E2M1 and E4M3 midpoint, scaled into blocks of 32
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0], np.float32)
    grid = np.tile(np.concatenate([mids, mids * 64, mids / 64, mids * 4]), (2, 1))
    grid[:, 0] = 448.0 * 1.0625  # E4M3's largest plus half a step: saturates
    out.append(grid)
    tiny = np.zeros((2, 32), np.float32)  # NVFP4's tensor scale 0 in float32
    tiny[0, :5] = np.float32(2.0**-149) * np.arange(1, 6)
    tiny[1, 3] = 2.0**-148
    out.append(tiny)
    out.append(np.array([256.0, 2.0**-10, 1 + 1 / 16], ml_dtypes.bfloat16))
    return out


@pytest.mark.parametrize("case", range(len(_crafted())))
def test_crafted_tensors(case: int) -> None:
    a = _crafted()[case]
    _check(fused_columns(_torch(a)), a, NAMES, a.shape)


@pytest.mark.parametrize("max_parts", [1, 2, 16])
def test_random_tensors_with_one_two_and_several_programs(max_parts: int) -> None:
    for a in _random_arrays(max_parts):
        if a.size == 0:
            continue
        if a.size > 10000 and a.shape[-1] % 32:  # (ragged rows: the interpreter's slowest)
            a = a[:120]
        _check(fused_columns(_torch(a), max_parts=max_parts), a, NAMES, (a.shape, max_parts))


def test_blocks_over_the_whole_float32_range() -> None:
    # blocks of every magnitude (float32 subnormals to near the largest float32), elements
    # on the rounding midpoints and up to 2**-29 below their block's largest; each band of
    # magnitudes alone too, so that no band's error is lost in a larger one's
    r = np.random.default_rng(5)
    blocks = 1024
    mant = r.integers(0, 16, (blocks, 32)) / 8.0 + 0.0625 * r.integers(0, 2, (blocks, 32))
    e_blk = r.integers(-149, 125, (blocks, 1))
    x = np.ldexp(mant, e_blk - r.integers(0, 30, (blocks, 32))) * r.choice(
        [-1.0, 1.0], (blocks, 32)
    )
    x = np.where(r.random((blocks, 32)) < 0.3, x * (1 + r.standard_normal((blocks, 32)) * 1e-3), x)
    x = x.astype(np.float32)
    x.reshape(-1)[r.integers(0, x.size, 20)] = np.nan
    x.reshape(-1)[r.integers(0, x.size, 20)] = np.inf
    arrays = [x.reshape(16, -1)]
    for lo, hi in ((-149, -120), (-20, 20), (100, 125)):
        arrays.append(x[(e_blk[:, 0] >= lo) & (e_blk[:, 0] < hi)])
    for a in arrays:
        _check(fused_columns(_torch(a), max_parts=4), a, NAMES, a.shape)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize("shape", [(9, 45), (6, 64)])
def test_narrow_dtypes(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    r = np.random.default_rng(7)
    x = torch.from_numpy((r.standard_normal(shape) * 4.0).astype(np.float32)).to(dtype)
    x[2, 3] = 0.0
    values = x.float().cpu().numpy()
    _check(fused_columns(x.to(DEVICE)), values, NAMES, dtype)


def test_views_are_read_by_their_rows() -> None:
    r = np.random.default_rng(11)
    base = torch.from_numpy(
        (r.standard_normal((40, 70)) * np.exp(r.uniform(-6, 6, (40, 1)))).astype(np.float32)
    ).to(DEVICE)
    views = {
        "transposed": base.t(),
        "gappy": base[:, ::3],
        "negated": torch._neg_view(base[3:9]),
        "expanded": base[0].expand(5, 70),
        "permuted 3-d": base.reshape(4, 10, 70).permute(1, 2, 0),  # leading dims: a copy
        "0-d": base[1, 2],
    }
    for what, v in views.items():
        _check(fused_columns(v, max_parts=3), v.resolve_neg().cpu().numpy(), NAMES, what)


def test_summary_and_custom_statistics_beside_block_columns() -> None:
    # the core summary is the fused kernel's as without block formats, and a custom
    # statistic lands after the block columns
    r = np.random.default_rng(2)
    a = (r.standard_normal((6, 50)) * 3).astype(np.float32)
    x = torch.from_numpy(a).to(DEVICE)
    names = ("nvfp4", "mxfp8_e4m3")
    layout = Layout(number_format("float32"), (*block_extras(names), ("mine", "sum")))
    got = kernel.summarize_torch(x, layout, {"mine": 4.5}).cpu().numpy()
    plain, _ = summarize(a, "float32", {"mine": (4.5, "sum")})
    core = layout.extras_start
    np.testing.assert_allclose(got[:core], plain[:core], rtol=2e-6)
    assert got[-1] == 4.5
    _check(got[core:-1].reshape(2, 5), a, names, "summarize_torch")


@pytest.mark.parametrize("cols", [64, 40])
def test_with_third_and_fourth_moments(cols: int) -> None:
    r = np.random.default_rng(9)
    a = (r.standard_normal((5, cols)) * 2 + 0.5).astype(np.float32)
    names = ("mxfp8_e4m3", "nvfp4")
    layout = Layout(number_format("float32"), block_extras(names), moments=4)
    got = kernel.summarize_torch(_torch(a), layout).cpu().numpy()
    plain, _ = summarize(a, "float32", moments=4)
    core = layout.extras_start
    np.testing.assert_allclose(got[:core], plain[:core], rtol=2e-6)
    np.testing.assert_allclose(got[-2:], plain[-2:], rtol=1e-5)
    _check(got[core:-2].reshape(2, 5), a, names, "moments=4")


def test_float64_takes_the_torch_op_path() -> None:
    layout = Layout(number_format("float64"), block_extras(("mxfp4_e2m1",)))
    x = torch.zeros(3, dtype=torch.float64, device=DEVICE)
    assert kernel.fused_spec(x, layout) is None
    assert kernel.fused_spec(x.float(), layout) is not None


def test_nvfp4_scale_by_hand() -> None:
    # the NVFP4 case of test_blocks worked by hand: tensor scale 1; block 1 scale 448 (the
    # ones underflow), block 2 scale 11/64 (the ones dequantize to 66/64)
    x = np.ones(32, np.float32)
    x[0] = 2688.0
    got = fused_columns(_torch(x), ("nvfp4",))[0]
    want = [15.0, 0.0, 0.0, 15.0 + 16 * (2 / 64) ** 2, math.log2(2688.0)]
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=0)


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """Records each kernel launch: which kernel, and its block columns ``C_*`` (0: none)."""
    seen: list[tuple[str, tuple[int, ...]]] = []
    launch = _fused._launch
    names = {
        id(_fused._summarize_one): "one",
        id(_fused._summarize_many): "many",
        id(_fused._blocks_one): "blocks",
        id(_fused._blocks_many): "blocks_many",
    }

    def spy(kernel, programs, args, consts, ptrs):  # type: ignore[no-untyped-def]
        cols = ("C_E4M3", "C_E5M2", "C_E2M1", "C_NV")
        seen.append((names[id(kernel)], tuple(consts.kwargs.get(c, 0) for c in cols)))
        return launch(kernel, programs, args, consts, ptrs)

    monkeypatch.setattr(_fused, "_launch", spy)
    return seen


def test_mx_formats_in_the_summary_pass_where_tile_rows_are_blocks(monkeypatch) -> None:
    seen = _launches(monkeypatch)
    r = np.random.default_rng(4)
    a = (r.standard_normal((4, 64)) * np.exp(r.uniform(-9, 9, (4, 1)))).astype(np.float32)
    mx = ("mxfp4_e2m1", "mxfp8_e4m3")
    # rows of 64, contiguous: the summary kernel alone computes the MX formats
    _check(fused_columns(_torch(a), mx), a, mx, "in the pass")
    assert [k for k, _ in seen] == ["one"] and all(seen[0][1][i] for i in (0, 2))
    # with NVFP4: a second read for NVFP4 alone
    seen.clear()
    both = ("mxfp8_e4m3", "nvfp4")
    _check(fused_columns(_torch(a), both), a, both, "in the pass, and NVFP4")
    assert [k for k, _ in seen] == ["one", "blocks"]
    assert seen[0][1][0] and not seen[0][1][3] and seen[1][1][:3] == (0, 0, 0) and seen[1][1][3]
    # rows of 33, and a transposed view: the block kernel computes every format
    for x in (_torch(a[:, :33]), _torch(a).t()):
        seen.clear()
        values = x.cpu().numpy()
        _check(fused_columns(x, both), values, both, x.shape)
        assert [k for k, _ in seen] == ["one", "blocks"]
        assert seen[0][1] == (0, 0, 0, 0) and seen[1][1][0] and seen[1][1][3]


def test_launch_many_computes_the_mx_formats_in_its_pass_when_every_tensor_allows(
    monkeypatch,
) -> None:
    seen = _launches(monkeypatch)
    r = np.random.default_rng(6)
    names = ("mxfp8_e5m2", "nvfp4", "mxfp8_e4m3")
    layout = Layout(number_format("float32"), block_extras(names))
    spec = _fused.spec_for(torch.float32)
    size = _fused.row_size(spec, layout)
    cases = [
        ([(9, 64), (3, 32), (5000, 32)], True),  # every row a multiple of 32: in the pass
        ([(9, 64), (5, 33), (2, 3, 40)], False),
        ([(9, 64), "t"], False),  # a transposed (dense) tensor: its blocks by its strides
    ]
    for shapes, in_pass in cases:
        seen.clear()
        tensors = [
            torch.from_numpy((r.standard_normal((64, 40)) * 5).astype(np.float32)).to(DEVICE).t()
            if s == "t"
            else torch.from_numpy((r.standard_normal(s) * 5).astype(np.float32)).to(DEVICE)
            for s in shapes
        ]
        rows = torch.zeros(size * len(tensors), dtype=torch.float64, device=DEVICE)
        scratch = torch.zeros(64 * _fused.PART, dtype=torch.float64, device=DEVICE)
        offsets = [size * i for i in range(len(tensors))]
        _fused.launch_many(tensors, spec, layout, rows, offsets, lambda k, s=scratch: s, 8)
        vecs = _fused.finish_rows(rows.view(len(tensors), size).cpu().numpy(), spec, layout)
        for t, v in zip(tensors, vecs):
            a = t.cpu().numpy()
            _check(v[layout.extras_start :].reshape(3, 5), a, names, (a.shape, in_pass))
        many = [c for k, c in seen if k == "many"]
        assert len(many) == 1 and bool(many[0][0]) == in_pass
        blocks = [(k, c) for k, c in seen if k.startswith("blocks")]
        # one launch for the contiguous tensors' blocks, one per other tensor
        assert sorted(k for k, _ in blocks) == ["blocks"] * ("t" in shapes) + ["blocks_many"]
        assert all(bool(c[0]) != in_pass and c[3] for _, c in blocks)
