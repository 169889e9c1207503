"""Block-scaled formats: the numpy reference against hand-computed cases, and the host kernel
against the reference (exact counts and block ranges, sq_err to 1e-6 relative)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from tandv.stats.blocks import (
    BLOCK_FORMATS,
    block_extras,
    block_formats_of,
    block_stats,
    parse_block_formats,
)
from tandv.stats.formats import number_format
from tandv.stats.host import host_summaries
from tandv.stats.summary import Layout, merge

NAMES = tuple(BLOCK_FORMATS)
COLS = ("underflow", "subnormal", "saturated", "sq_err", "block_range")


def _layout(names: tuple[str, ...] = NAMES) -> Layout:
    return Layout(number_format("float32"), block_extras(names))


def host_block_stats(x: np.ndarray, name: str) -> dict[str, float]:
    """The host kernel's columns of ``x`` for format ``name``."""
    lay = _layout((name,))
    row = host_summaries([np.asarray(x)], lay)[0]
    return dict(zip(COLS, row[lay.extras_start :].tolist()))


IMPLS = {"reference": block_stats, "host": host_block_stats}


def _check(impl: str, x: np.ndarray, name: str, **want: float) -> None:
    got = IMPLS[impl](x, name)
    full = dict.fromkeys(COLS, 0.0) | want
    assert got == pytest.approx(full, rel=1e-12, abs=0), (name, got, full)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_zero_blocks(impl: str) -> None:
    for name in NAMES:
        _check(impl, np.zeros((3, 40), np.float32), name)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_huge_value(impl: str) -> None:
    x = np.ones(32, np.float32)
    x[5] = 1024.0
    # E4M3: scale 2**(10 - 8) = 4, 1/4 exact (normal): nothing lost
    _check(impl, x, "mxfp8_e4m3", block_range=10.0)
    _check(impl, x, "mxfp8_e5m2", block_range=10.0)
    # E2M1: scale 2**(10 - 2) = 256, 1/256 is below half the smallest subnormal (0.5): zero
    _check(impl, x, "mxfp4_e2m1", underflow=31.0, sq_err=31.0, block_range=10.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_by_hand(impl: str) -> None:
    # max 2688 = 448 * 6 makes the tensor scale 1 exactly. Block 1: scale 448, 2688 -> 6
    # exact, the ones -> 1/448 underflow (15 values). Block 2 (ones): 1/6 in float32 rounds
    # into E4M3 to 11/64; 1/(11/64) = 5.82 -> 6; dequantized 66/64, error (2/64)**2 each.
    x = np.ones(32, np.float32)
    x[0] = 2688.0
    _check(
        impl,
        x,
        "nvfp4",
        underflow=15.0,
        sq_err=15.0 + 16 * (2 / 64) ** 2,
        block_range=math.log2(2688.0),
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_subnormals_and_midpoints(impl: str) -> None:
    # amax 256: E4M3 scale 1. 2**-7 is an E4M3 subnormal (normal from 2**-6, spacing
    # 2**-9); 2**-10 is the midpoint between 0 and 2**-9: even is 0 (underflow); 3 * 2**-10
    # lies between 2**-9 and 2**-8: even is 2**-8 (subnormal). 1 + 1/16 -> 1 and
    # 1 + 3/16 -> 1.25 (mantissa midpoints, to even).
    x = np.array([256.0, 2.0**-7, 2.0**-10, 3 * 2.0**-10, 1 + 1 / 16, 1 + 3 / 16], np.float32)
    _check(
        impl,
        x,
        "mxfp8_e4m3",
        underflow=1.0,
        subnormal=2.0,
        sq_err=2.0**-20 + 2.0**-20 + 2 * (1 / 16) ** 2,
        block_range=18.0,
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_float32_subnormal_inputs(impl: str) -> None:
    # a block of float32 subnormals: the power-of-two scale brings them back to normal
    x = np.array([2.0**-140, 2.0**-141, 2.0**-149], np.float32)
    assert x[2] > 0
    # scale 2**(-140 - 8): 2**-149 -> 2**-1 exact (E4M3 normal), no loss
    _check(impl, x, "mxfp8_e4m3", block_range=9.0)
    # E2M1: scale 2**-142; 2**-141 -> 2 exact, 2**-149 -> 2**-7: underflow
    _check(impl, x, "mxfp4_e2m1", underflow=1.0, sq_err=2.0**-298, block_range=9.0)
    # a whole block of them (the kernel's tiled path, whose 1/scale is no float32)
    y = np.full(32, 2.0**-140, np.float32)
    y[9] = 2.0**-149
    _check(impl, y, "mxfp8_e4m3", block_range=9.0)
    _check(impl, y, "mxfp4_e2m1", underflow=1.0, sq_err=2.0**-298, block_range=9.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_saturation(impl: str) -> None:
    # 464 has floor(log2) 8: E4M3 scale 1, and 464 > 448 saturates (error 16**2)
    _check(
        impl,
        np.array([464.0, 1.0], np.float32),
        "mxfp8_e4m3",
        saturated=1.0,
        sq_err=256.0,
        block_range=math.log2(464.0),
    )
    # rows of length 1: 7 -> E2M1 scale 1, 7 > 6 saturates; 3 -> scale 1/2, 6 exact
    _check(impl, np.array([[7.0], [3.0]], np.float32), "mxfp4_e2m1", saturated=1.0, sq_err=1.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_inf_left_out(impl: str) -> None:
    x = np.array([np.nan, np.inf, -np.inf, 256.0, 2.0**-10, -1.0], np.float32)
    _check(impl, x, "mxfp8_e4m3", underflow=1.0, sq_err=2.0**-20, block_range=18.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_blocks_follow_rows(impl: str) -> None:
    # rows of 33: a block of 32 values of 64 and a last block of one value 1, per row.
    # Blocks of the flat array would put a 1 beside 64s (1/16 underflows in E2M1).
    x = np.full((2, 33), 64.0, np.float32)
    x[:, 32] = 1.0
    _check(impl, x, "mxfp4_e2m1")
    # rows of 31: one short block each; 1 beside 64 underflows in E2M1 (scale 2**4)
    y = np.full((2, 31), 64.0, np.float32)
    y[:, 3] = 1.0
    _check(impl, y, "mxfp4_e2m1", underflow=2.0, sq_err=2.0, block_range=6.0)
    # rows of 32 and a 1-d tensor are the same blocks
    z = np.full((1, 32), 64.0, np.float32)
    z[0, 7] = 1.0
    _check(impl, z, "mxfp4_e2m1", underflow=1.0, sq_err=1.0, block_range=6.0)
    _check(impl, z[0], "mxfp4_e2m1", underflow=1.0, sq_err=1.0, block_range=6.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_input(impl: str) -> None:
    x = np.array([256.0, 2.0**-10, 1 + 1 / 16], ml_dtypes.bfloat16)
    _check(impl, x, "mxfp8_e4m3", underflow=1.0, sq_err=2.0**-20 + (1 / 16) ** 2, block_range=18.0)


def _random_arrays(seed: int) -> list[np.ndarray]:
    r = np.random.default_rng(seed)
    out = []
    for shape in [(1,), (31,), (32,), (33,), (5, 1), (4, 31), (3, 32), (6, 33), (7, 100), ()]:
        a = r.standard_normal(shape) * np.exp(r.uniform(-8, 8, shape))
        out.append(np.asarray(a, np.float32))
    big = r.standard_normal((700, 97)).astype(np.float32)  # blocks straddle 64K chunks
    big[r.random(big.shape) < 0.3] = 0.0
    big[r.random(big.shape) < 0.001] = np.nan
    big[r.random(big.shape) < 0.001] = -np.inf
    big *= np.exp(r.uniform(-20, 20, (700, 1))).astype(np.float32)
    out.append(big)
    out.append((r.standard_normal((65, 1056)) * 1e-30).astype(np.float32))  # tiny values
    out.append(r.standard_normal((9, 48)).astype(ml_dtypes.bfloat16))
    out.append(np.zeros(0, np.float32))
    return out


def _assert_rows_equal_reference(arrays: list[np.ndarray], rows: np.ndarray) -> None:
    """Each host row's block columns equal :func:`block_stats` of its array: counts and
    ranges exactly, ``sq_err`` within the documented 1e-6."""
    lay = _layout()
    for a, row in zip(arrays, rows):
        got = row[lay.extras_start :].reshape(len(NAMES), len(COLS))
        for name, g in zip(NAMES, got):
            ref = block_stats(a, name)
            for col, value in zip(COLS, g):
                tol = 1e-6 if col == "sq_err" else 0.0
                assert value == pytest.approx(ref[col], rel=tol, abs=0), (a.shape, name, col)


@pytest.mark.parametrize("seed", [0, 1])
def test_host_kernel_equals_reference_on_random_arrays(seed: int) -> None:
    arrays = _random_arrays(seed)
    lay = _layout()
    rows = host_summaries(arrays, lay, threads=2)
    _assert_rows_equal_reference(arrays, rows)
    # the random arrays exercise every column somewhere
    total = np.abs(rows[:, lay.extras_start :]).reshape(len(arrays), len(NAMES), -1).sum((0, 1))
    assert (total > 0).all()


def test_merge_adds_counts_and_takes_the_largest_range() -> None:
    r = np.random.default_rng(3)
    a = r.standard_normal((4, 64)).astype(np.float32)
    b = (r.standard_normal((4, 64)) * np.exp(r.uniform(-9, 9, (4, 1)))).astype(np.float32)
    lay = _layout(("mxfp4_e2m1", "mxfp8_e4m3"))
    va, vb = host_summaries([a, b], lay)
    both = merge(va, vb, lay)[lay.extras_start :].reshape(2, 5)
    for k, name in enumerate(("mxfp4_e2m1", "mxfp8_e4m3")):
        ra, rb = block_stats(a, name), block_stats(b, name)
        for j, col in enumerate(COLS[:4]):
            assert both[k, j] == pytest.approx(ra[col] + rb[col], rel=1e-6)  # sq_err's bound
        assert both[k, 4] == max(ra["block_range"], rb["block_range"])


def test_parse_and_layout_columns() -> None:
    assert parse_block_formats(None) == ()
    assert parse_block_formats("nvfp4") == ("nvfp4",)
    assert parse_block_formats(["nvfp4", "mxfp8_e4m3", "nvfp4"]) == ("nvfp4", "mxfp8_e4m3")
    with pytest.raises(ValueError, match="unknown format 'mxfp6'.*mxfp8_e4m3, mxfp8_e5m2"):
        parse_block_formats(("mxfp6",))
    with pytest.raises(TypeError, match="block_formats"):
        parse_block_formats(3)
    extras = block_extras(("nvfp4", "mxfp8_e5m2")) + (("mine", "mean"),)
    assert extras[:5] == (
        ("nvfp4.underflow", "sum"),
        ("nvfp4.subnormal", "sum"),
        ("nvfp4.saturated", "sum"),
        ("nvfp4.sq_err", "sum"),
        ("nvfp4.block_range", "max"),
    )
    assert [f.name for f in block_formats_of(extras)] == ["nvfp4", "mxfp8_e5m2"]
    assert block_formats_of((("mine", "mean"),)) == ()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiled_rows_over_the_whole_float32_range(seed: int) -> None:
    # rows a multiple of 32 take the kernel's tiled path: blocks of every magnitude (float32
    # subnormals to near the largest float32, so MX scales out of float32's normal range and
    # NVFP4 block scales that round to zero), element values on the formats' rounding
    # midpoints, and NaN/inf inside blocks
    r = np.random.default_rng(seed)
    blocks = 4096
    mant = r.integers(0, 16, (blocks, 32)) / 8.0 + 0.0625 * r.integers(0, 2, (blocks, 32))
    e_blk = r.integers(-149, 125, (blocks, 1))
    e_el = e_blk - r.integers(0, 30, (blocks, 32))
    x = np.ldexp(mant, e_el) * r.choice([-1.0, 1.0], (blocks, 32))
    noise = r.random((blocks, 32)) < 0.3
    x = np.where(noise, x * (1 + r.standard_normal((blocks, 32)) * 1e-3), x)
    x = x.astype(np.float32)
    x.reshape(-1)[r.integers(0, x.size, 40)] = np.nan
    x.reshape(-1)[r.integers(0, x.size, 40)] = np.inf
    # the whole array, and the blocks of each magnitude alone (so that the error of the
    # smallest blocks is not lost in that of the largest)
    bands = [x[e_blk[:, 0] == e] for e in range(-149, 125)]
    arrays = [x.reshape(64, -1)] + [b for b in bands if len(b)]
    _assert_rows_equal_reference(arrays, host_summaries(arrays, _layout()))


def test_nearly_exact_arrays_keep_their_tiny_error() -> None:
    # powers of two, on every MX grid (their error is 0), and a few values 2**-80 below the
    # block maxima, which round to 0: their squares are all of an MX format's sq_err, far
    # below float32's normals even relative to the largest value, where the kernel's
    # float32 squares would lose them
    r = np.random.default_rng(5)
    x = np.ldexp(1.0, r.integers(-2, 1, (64, 64))).astype(np.float32)
    x.reshape(-1)[r.integers(0, x.size, 12)] = np.float32(2.0**-80)
    assert all(block_stats(x, name)["sq_err"] > 0 for name in NAMES)
    _assert_rows_equal_reference([x], host_summaries([x], _layout()))


@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_tensor_scale_underflows(impl: str) -> None:
    # max |x| = 2**-148 < 2688 * 2**-149: s_t is 0 in float32, so every block's scale is
    # 448 * 0 or 0 / 0, both counted as zero: every non-zero value underflows
    x = np.zeros((2, 32), np.float32)
    x[0, :5] = np.float32(2.0**-149) * np.arange(1, 6)
    x[1, 3] = 2.0**-148
    sq = float(np.sum(x.astype(np.float64) ** 2))
    _check(impl, x, "nvfp4", underflow=6.0, sq_err=sq, block_range=math.log2(5.0))


def _crafted_rows(rowlen: int, rows: int, seed: int) -> np.ndarray:
    """Rows of ``rowlen`` built to hit every case of a block: all-zero blocks, one huge
    value beside small ones, float32 subnormals, values on E2M1's and E4M3's rounding
    midpoints (relative to a power-of-two block maximum), NaN and inf."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((rows, rowlen)) * np.exp2(r.integers(-20, 20, (rows, 1)))
    kind = np.arange(rows) % 6
    x[kind == 0] = 0.0  # all-zero blocks
    one = np.flatnonzero(kind == 1)
    x[one, r.integers(0, rowlen, one.size)] = 2.0**60  # one huge value beside small ones
    sub = kind == 2  # float32 subnormals
    x[sub] = np.ldexp(
        r.integers(1, 8, (sub.sum(), rowlen)), r.integers(-149, -140, (sub.sum(), rowlen))
    )
    mid = kind == 3  # E2M1's and E4M3's midpoints, in blocks whose maximum is 6 * 2**e
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1.0625, 1.1875, 448.0, 464.0])
    e = r.integers(-30, 30, (mid.sum(), 1))
    x[mid] = np.ldexp(r.choice(mids, (mid.sum(), rowlen)), e)
    x[mid, 0] = np.ldexp(6.0, e[:, 0])
    bad = np.flatnonzero(kind == 4)  # NaN and inf inside a block
    x[bad, r.integers(0, rowlen, bad.size)] = np.nan
    x[bad, r.integers(0, rowlen, bad.size)] = -np.inf
    return x.astype(np.float32)


@pytest.mark.parametrize("rowlen", [1, 31, 32, 33, 48, 64, 1024])
def test_first_pass_block_maxima_serve_every_format(rowlen: int) -> None:
    # All formats at once: the first pass reads the maxima of the blocks of 16 once,
    # the MX blocks of 32 take pairs of them, and NVFP4's pass reuses them with the
    # tensor's scale. Small arrays share one buffer; large ones (several 64K chunks, the
    # largest value in the last chunk, so s_t spans the items) are read in place.
    small = [_crafted_rows(rowlen, 12, seed) for seed in range(3)]
    big_rows = -(-3 * 65536 // rowlen)
    big = _crafted_rows(rowlen, big_rows, 7)
    big[-1, -1] = 1.37 * 2.0**66  # (not a power of two times the 2**60 of other chunks)
    arrays = [*small, small[0].astype(ml_dtypes.bfloat16)]
    if rowlen > 1:  # (the reference takes seconds over 196K rows of one value)
        arrays += [big, big.astype(ml_dtypes.bfloat16)]
    _assert_rows_equal_reference(arrays, host_summaries(arrays, _layout(), threads=2))


@pytest.mark.parametrize("size", [16, 32])
@pytest.mark.parametrize("blocks", [7, 8, 61])
def test_block_maxima_and_minima_of_random_bits(size: int, blocks: int) -> None:
    # any int32 pattern: zeros and -0, subnormals, inf and NaN of both signs; the kernel's
    # tiles of 8 blocks, the blocks after the last tile, and a strided view (no tiles)
    from tandv.stats.host import _block_bits

    r = np.random.default_rng(size * 100 + blocks)
    bits = r.integers(-(2**31), 2**31, (blocks, size), dtype=np.int64).astype(np.int32)
    bits[r.random(bits.shape) < 0.3] = 0
    bits[r.random(bits.shape) < 0.05] = np.int32(-(2**31))
    for special in (0x7F800000, 0x7FC00000, 0x00000001):
        bits[r.random(bits.shape) < 0.03] = special
    bits[1] = 0  # a block without a non-zero value
    bits[2] = 0x7F800000  # only inf
    bits[3, ::2] = 0x7FC00001  # NaN beside finite values
    m = bits & 0x7FFFFFFF
    finite = m < 0x7F800000
    want_hi = np.where(finite, m, 0).max(axis=1)
    want_lo = np.where(finite & (m > 0), m, 0x7F800000).min(axis=1)
    for view in (bits, np.repeat(bits, 2, axis=0)[::2]):
        view.flags.writeable = False  # (as the kernels get their input: see host._read_only)
        hi = np.empty(blocks, np.int32)
        lo = np.empty(blocks, np.int32)
        _block_bits(view, hi, lo)
        np.testing.assert_array_equal(hi, want_hi)
        np.testing.assert_array_equal(lo, want_lo)


@pytest.mark.parametrize("size", [16, 32])
def test_block_range_among_close_ratios(size: int) -> None:
    # The kernel divides only the blocks whose bits say their ratio may be the largest
    # (the bits' difference is log2 of the ratio to within 0.09): blocks whose ratios
    # differ by less than that, in any order of their mantissas, and a subnormal minimum
    # (whose bits are no logarithm) must still give the reference's range exactly.
    r = np.random.default_rng(size)
    blocks = 2048
    hi = np.ldexp(1.0 + r.random(blocks), 10)
    lo = 1.0 + r.random(blocks)
    x = np.full((blocks, size), 3.0)
    x[:, 0] = hi
    x[:, 1] = lo
    tiny = x.copy()
    tiny[5, 1] = 2.0**-140  # a subnormal minimum: the largest ratio, whatever its bits say
    for arr in (x.astype(np.float32), tiny.astype(np.float32)):
        name = "nvfp4" if size == 16 else "mxfp8_e4m3"
        assert (
            host_block_stats(arr.reshape(-1, 256), name)["block_range"]
            == (block_stats(arr.reshape(-1, 256), name)["block_range"])
        )


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_inf_and_nan_in_the_vectorized_element_loops(bad: float) -> None:
    # Gaussian rows a multiple of 32, in float32's normal range, take the vectorized
    # element loops, which first run without testing for inf and NaN and run again with
    # the test when the sum of the squared errors comes out inf or NaN: a few such values
    # (in one 64K item of two; and in a row of its own) must count as the reference says
    r = np.random.default_rng(11)
    x = r.standard_normal((1024, 128)).astype(np.float32)
    x[r.integers(0, 512, 3), r.integers(0, 128, 3)] = bad
    y = r.standard_normal((4, 64)).astype(np.float32)
    y[1, 5] = bad
    arrays = [x, y, x.astype(ml_dtypes.bfloat16)]
    _assert_rows_equal_reference(arrays, host_summaries(arrays, _layout()))
