"""The compiled host kernel (tandv.stats.host) against the numpy reference summarize."""

import math

import ml_dtypes
import numba
import numpy as np
import pytest
from _benchmarks import load_benchmark

from tandv.stats import host
from tandv.stats.blocks import block_extras
from tandv.stats.formats import number_format
from tandv.stats.summary import CORE_FIELDS, Layout, summarize

EXACT = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "min_abs", "max_abs")


def assert_rows_match(arrays, fmt, rows):
    assert rows.shape == (len(arrays), len(CORE_FIELDS) + Layout(fmt).num_counts)
    for a, row in zip(arrays, rows):
        ref, layout = summarize(a, fmt)
        for i, name in enumerate(CORE_FIELDS):
            if name in EXACT:
                assert row[i] == ref[i] or (np.isnan(row[i]) and np.isnan(ref[i])), (a.size, name)
            else:
                assert row[i] == pytest.approx(ref[i], rel=1e-9, abs=1e-300), (
                    a.size,
                    name,
                    row[i],
                    ref[i],
                )
        np.testing.assert_array_equal(
            row[len(CORE_FIELDS) :], ref[layout.counts_start : layout.extras_start]
        )


def mixed_arrays():
    rng = np.random.default_rng(11)
    specials = np.array(
        [
            0.0,
            -0.0,
            1e-45,
            -3e-42,
            9e-39,
            np.nan,
            np.inf,
            -np.inf,
            448.0,
            449.0,
            500.0,
            -1e-20,
            65504.0,
        ],
        np.float32,
    )
    big = rng.standard_normal(host._CHUNK * 2 + 123).astype(np.float32)  # three chunks
    big[::1001] = 0.0
    big[5::3001] = 2e-41  # subnormals in several chunks
    big[7::50_000] = np.nan
    # finite only (each chunk takes the pass without inf/NaN selects): zeros, -0.0,
    # subnormals, magnitudes above the float8 formats' largest and near float32's
    finite = (rng.standard_normal(host._CHUNK * 2 + 5) * 300).astype(np.float32)
    finite[::777] = 0.0
    finite[3::999] = -0.0
    finite[11::1333] = -3e-40
    finite[17::2000] = 3e38
    # the count above a format's largest value runs only in chunks whose largest magnitude
    # exceeds it: here the middle one (449 > float8_e4m3fn's 448); the last holds 448 itself
    over_in_one = (rng.standard_normal(host._CHUNK * 3) * 10).astype(np.float32)
    over_in_one[host._CHUNK + 5] = -449.0
    over_in_one[2 * host._CHUNK + 9] = 448.0
    return [
        big,
        finite,
        over_in_one,
        specials,
        rng.standard_normal(host._SMALL + 1).astype(np.float32),  # read in place
        np.zeros(5, np.float32),
        np.array([], np.float32),
        np.array([np.nan, np.inf], np.float32),  # nothing finite
        -np.abs(rng.standard_normal(300)).astype(np.float32),  # all negative
        rng.standard_normal(host._CHUNK + 7).astype(ml_dtypes.bfloat16),
        specials.astype(np.float16),
        (rng.standard_normal(999) * 100).astype(ml_dtypes.float8_e4m3fn),
        rng.standard_normal(50).astype(ml_dtypes.float8_e5m2),
    ]


@pytest.mark.parametrize("fmt", ["float32", "float8_e4m3fn", "bfloat16", "float64"])
def test_matches_the_reference(fmt):
    arrays = mixed_arrays()
    rows = host.host_summaries(arrays, Layout(fmt))
    assert_rows_match(arrays, fmt, rows)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_the_same_rows(threads):
    arrays = mixed_arrays()
    one = host.host_summaries(arrays, Layout("float8_e5m2"))
    many = host.host_summaries(arrays, Layout("float8_e5m2"), threads=threads)
    np.testing.assert_allclose(many, one, rtol=1e-12)
    counts = slice(len(CORE_FIELDS), None)
    np.testing.assert_array_equal(many[:, counts], one[:, counts])


def test_variance_far_from_zero():
    """The pivot keeps the variance exact when |mean| >> std (a plain sum of squares
    would lose every digit here)."""
    rng = np.random.default_rng(3)
    x = (1e4 + 1e-2 * rng.standard_normal(300_000)).astype(np.float32)
    rows = host.host_summaries([x], Layout("float32"))
    ref = x.astype(np.float64)
    i = {n: k for k, n in enumerate(CORE_FIELDS)}
    std = rows[0, i["max_abs"]] * np.sqrt(rows[0, i["m2"]] / x.size)
    assert std == pytest.approx(ref.std(), rel=1e-6)
    assert rows[0, i["mean"]] == pytest.approx(ref.mean(), rel=1e-12)


def test_magnitudes_outside_the_one_pass_range_take_the_scaled_pass():
    """Largest magnitudes beyond SAFE_RANGE (2**±100), where |x|**8 would overflow or vanish
    in float64, and at its edges: all match the reference (float32 maximum and all-subnormal
    arrays included)."""
    rng = np.random.default_rng(5)
    arrays = [
        np.array([2.0**101, 1.0], np.float32),
        np.array([2.0**-101], np.float32),
        np.array([2.0**100, -(2.0**-100)], np.float32),
        np.zeros(3, np.float32),
        (rng.standard_normal(70_000).clip(-1.1, 1.1) * 3e38).astype(np.float32),
        (rng.standard_normal(5_000) * 1e-40).astype(np.float32),
    ]
    assert_rows_match(arrays, "float32", host.host_summaries(arrays, Layout("float32")))


def test_other_dtypes_are_refused_with_the_accepted_list():
    with pytest.raises(TypeError, match=r"dtype float64 is not one of float32, float16, bfloat16"):
        host.host_summaries([np.zeros(3)], Layout("float32"))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("values", [[0.0] * 5, [-0.0] * 5, [0.0, -0.0, 0.0]])
def test_max_abs_of_zeros_is_positive_zero(dtype, values):
    """A zero-initialised bias at step 0: max|x| is +0.0, as in the reference (and as |x|
    always is), not -0.0; compared bit for bit, since -0.0 == 0.0."""
    a = np.array(values, dtype)
    row = host.host_summaries([a], Layout(np.dtype(dtype)))[0]
    ref, _ = summarize(a)
    i = CORE_FIELDS.index("max_abs")
    assert row[i] == 0.0 and not np.signbit(row[i]) and not np.signbit(ref[i])


@pytest.mark.parametrize("below", [30, 31, 60])
@pytest.mark.parametrize("extra", [0, 1, 2 * host._CHUNK - 16384])
def test_exponent_counts_in_pairs_at_the_window_edge(below, extra):
    """Items of at least _PAIRS_MIN elements count exponent fields in pairs, within a window
    of 31 fields ending at the item's largest: a value 30 fields below the top is inside
    it, 31 or more below falls out and the item is counted element by element. Both, with
    zeros, subnormals, inf and NaN (fields 0 and 255) and odd sizes, give numpy's counts of
    the exponent fields (in the float32 layout each field has its own bin)."""
    rng = np.random.default_rng(below + extra)
    n = host._PAIRS_MIN + extra
    x = (rng.uniform(1.0, 2.0, n) * 2.0 ** rng.integers(-10, 11, n)).astype(np.float32)
    x[::997] = 0.0
    x[5::1999] = -3e-41  # subnormal
    x[7::4001] = np.inf
    x[9::5003] = np.nan
    x[11] = 2.0 ** (10 - below)  # the largest finite field is that of 2**10
    fields = np.bincount(((x.view(np.int32) >> 23) & 0xFF).astype(np.int64), minlength=256)
    assert fields[137 - below] > 0 and fields[137] > 0
    arrays = [x]
    rows = host.host_summaries(arrays, Layout("float32"))
    assert_rows_match(arrays, "float32", rows)
    # and against the raw fields: field f (1 .. 254, exponent f - 127) has bin f + 23
    start = len(CORE_FIELDS) + 24
    np.testing.assert_array_equal(rows[0, start : start + 254], fields[1:255])


def test_kernel_benchmark_runs_in_its_tiny_mode(capsys):
    """``benchmarks/host_kernel.py --tiny``: every row timed, the exponent counts checked
    against numpy (in the pairs' window and outside it)."""

    bench = load_benchmark("host_kernel")
    assert bench.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "exponent counts" in out and "bfloat16" in out
    assert float(out.strip().splitlines()[-1].split(": ")[1]) > 0


def test_overhead_benchmark_times_the_kernel_by_call_in_tiny_mode(capsys):
    """``benchmarks/overhead.py --kernel-calls`` on a tiny GPT: the batches of a step
    (weights, gradients, the two Adam moments) read four times the model's parameters,
    each activation hook one tensor, and every figure is a time."""
    import torch

    bench = load_benchmark("overhead")
    tiny = "--layers 1 --d-model 16 --heads 2 --mlp 32 --vocab 32 --seq 8 --batch 2"
    cfg, batch = bench._model(bench._parser().parse_args(tiny.split()))
    rows = bench.kernel_calls(cfg, batch, steps=2, warmup=1)
    torch.manual_seed(0)
    params = sum(p.numel() for p in bench.GPT(cfg).parameters())
    assert sum(r["elements"] for r in rows if r["arrays"] > 1) == 4 * params
    hooks = [r for r in rows if r["arrays"] == 1]
    assert hooks and all(r["elements"] == r["calls"] * math.prod(r["shape"]) for r in hooks)
    for r in rows:
        assert all(0 < r[k] < 1e6 for k in ("first_ns", "again_ns", "after_ns")), r
    assert bench.main(tiny.split() + "--steps 2 --warmup 1 --kernel-calls".split()) == 0
    assert "ns per element: in the step, again, after the loop" in capsys.readouterr().out


@pytest.mark.parametrize("threads", [1, 2])
def test_one_array_takes_the_short_path_with_the_same_row(threads):
    """A call with one array and no block formats (a hook's) skips the planning of many
    arrays' items: each row still matches the reference, and equals bit for bit the row
    the same array gets among others (same items, pivot and merge), the scaled pass for
    magnitudes outside SAFE_RANGE included."""
    arrays = mixed_arrays() + [
        np.array([2.0**101, 1.0], np.float32),
        (np.random.default_rng(2).standard_normal(70_000) * 1e-35).astype(np.float32),
    ]
    together = host.host_summaries(arrays, Layout("float8_e4m3fn"), threads=threads)
    for a, row in zip(arrays, together):
        alone = host.host_summaries([a], Layout("float8_e4m3fn"), threads=threads)
        assert_rows_match([a], "float8_e4m3fn", alone)
        np.testing.assert_array_equal(alone[0].view(np.int64), row.view(np.int64))


@pytest.mark.parametrize("formats", [(), ("mxfp8_e4m3", "nvfp4")])
def test_one_thread_runs_serially_with_the_same_bits(formats):
    """With one thread every source runs whole in one serial call (no parallel launch to
    compile or start); with two, the small sources share lanes and the large share their
    items: the same items, pivots and merges, so the same rows bit for bit, block formats'
    columns included; and so do the one-array kernels (serial and parallel) of each."""
    rng = np.random.default_rng(17)
    # the first above _LANE_MAX (it shares its items), in rows of 64 (blocks tile them)
    arrays = [a[: a.size // 64 * 64].reshape(-1, 64) for a in mixed_arrays()[:3]]
    arrays += [
        rng.standard_normal((8, 64)).astype(np.float32),
        rng.standard_normal((5, 40)).astype(np.float32),  # rows that blocks do not tile
        rng.standard_normal((4, 96)).astype(ml_dtypes.bfloat16),
        (rng.standard_normal((64, 1024)) * 1e-3).astype(np.float32),  # a lane of its own
    ]
    assert arrays[0].size > host._LANE_MAX
    layout = Layout(number_format("float8_e4m3fn"), block_extras(formats))
    one = host.host_summaries(arrays, layout, threads=1)
    two = host.host_summaries(arrays, layout, threads=2)
    assert one.shape[1] == layout.extras_start + 5 * len(formats)
    np.testing.assert_array_equal(one.view(np.int64), two.view(np.int64))
    for a, row in zip(arrays, one):  # each as the reference has it, and alone the same
        assert_rows_match([a.ravel()], "float8_e4m3fn", row[None, : layout.extras_start])
        for threads in (1, 2):  # the one-array kernels, serial and parallel
            alone = host.host_summaries([a], layout, threads=threads)[0]
            np.testing.assert_array_equal(alone.view(np.int64), row.view(np.int64))


def test_no_block_formats_compile_no_block_code():
    """Without block formats the kernels get None for the blocks, and numba prunes the
    block-format branches at typing time: their code (about two thirds of a cold
    compile) is not compiled for a run that asks for none. Checked on a fresh, uncached
    compile of the per-source kernel: it calls the item kernel, never the blocks'."""
    fresh = numba.njit(nogil=True)(host._run_unit.py_func)
    x = host._as_float32(np.ones(100, np.float32))  # (as the kernels get it: its callees cached)
    part = np.zeros((1, host._NPART))
    part[0, host._PIVOT] = 1.0
    hist = np.zeros((1, 4, 256), np.int64)
    sub = np.zeros((1, host._NSUB), np.int64)
    fresh(x, 0, 1, np.array([0]), np.array([100]), 448.0, part, hist, sub, None)
    assert hist[:, :, 127].sum() == 100  # it ran: a hundred ones, exponent field 127
    llvm = "".join(fresh.inspect_llvm().values())
    assert "_item" in llvm
    assert "_first_blocks" not in llvm and "_tensor_scales" not in llvm


def test_a_long_compile_of_the_kernels_is_announced_once(monkeypatch, capfd):
    """A compile of tandv's numba kernels (a new install's first step) that runs past
    ``NOTICE_AFTER_S`` prints one line saying what is happening and that it happens once;
    a short one, one of another package's functions, and every later one print nothing.
    Driven by numba's own compile events, as its dispatcher broadcasts them around a
    compile (nested for a kernel's callees)."""
    import time

    from numba.core import event

    from tandv.stats import _compile_notice as notice

    def compile_of(dispatcher, seconds: float) -> None:
        data = dict(dispatcher=dispatcher, args=(), return_type=None)
        with event.trigger_event("numba:compile", data=data):
            with event.trigger_event("numba:compile", data=data):  # (a callee)
                time.sleep(seconds)

    monkeypatch.setattr(notice.listener, "said", False)  # (as in a process that said nothing)
    monkeypatch.setattr(notice, "NOTICE_AFTER_S", 5.0)
    compile_of(host._f32_of, 0.0)  # short: done before the notice is due
    time.sleep(0.1)
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(notice, "NOTICE_AFTER_S", 0.05)
    compile_of(numba.njit(lambda v: v), 0.5)  # not tandv's
    assert capfd.readouterr().err == ""
    compile_of(host._f32_of, 1.0)
    assert capfd.readouterr().err == notice.NOTICE + "\n"
    compile_of(host._f32_of, 0.5)  # said once per process
    assert capfd.readouterr().err == ""


_NRT_SCRIPT = """
import numpy as np
from numba.core.runtime import rtsys
from tandv.stats import host
from tandv.stats.blocks import block_extras
from tandv.stats.formats import number_format
from tandv.stats.summary import Layout

layout = Layout(number_format("float8_e4m3fn"), block_extras(["mxfp8_e4m3", "nvfp4"]))
x = np.random.default_rng(0).standard_normal((300, 1024)).astype(np.float32)
x[5, 7] = np.inf  # blocks with an inf: their second element pass (a new array, frozen)
arrays = [x, np.ones((3, 64), np.float32), np.ones(70000, np.float32)]

def calls():
    for threads in (1, 2):
        host.host_summaries(arrays, layout, threads)  # by address (frozen carrays)
        host.host_summaries([x], layout, threads)  # one array, parallel loops

calls()  # (compiled, or loaded from the cache)
before = rtsys.get_allocation_stats()
calls()
after = rtsys.get_allocation_stats()
print(after.alloc - before.alloc, after.free - before.free)
"""


def test_read_only_views_in_compiled_code_free_what_they_hold():
    """``host.frozen`` retypes an array read-only in compiled code and holds a reference
    to it: every array the kernels allocate is freed again (numba's allocation counters,
    which only count when ``NUMBA_NRT_STATS`` is set as the process starts)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_NRT_STATS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _NRT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    allocated, freed = map(int, run.stdout.split())
    assert allocated > 0 and freed == allocated
