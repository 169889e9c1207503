"""The fused Triton kernel and the tracker's device workspace, against the numpy reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``conftest.py`` sets
``TRITON_INTERPRET=1``); a subprocess compiles them for real GPUs (no GPU needed) so that
code the interpreter accepts but the compiler would refuse is caught here too. With a GPU
the same tests run compiled, on CUDA tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from _benchmarks import load_benchmark  # noqa: E402

from tandv.schema import read_log  # noqa: E402
from tandv.stats.summary import CORE_FIELDS, Layout, summarize  # noqa: E402
from tandv.track.torch import _fused, _workspace, track  # noqa: E402
from tandv.track.torch import summary as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "min_abs", "max_abs")


@pytest.fixture(autouse=True)
def fused_path():
    with kernel.cpu_path("fused"):
        yield


def reference(x: torch.Tensor, fmt=None, extras=None):
    name = str(x.dtype).removeprefix("torch.")
    arr = x.detach().cpu()
    arr = (
        arr.numpy()
        if name in ("float32", "float16", "float64")
        else arr.view(torch.uint8 if x.element_size() == 1 else torch.int16)
        .numpy()
        .view(getattr(ml_dtypes, name))
    )
    return summarize(arr, fmt, extras)


def check(got: np.ndarray, ref: np.ndarray, layout: Layout, rtol: float = 2e-6) -> None:
    assert got.shape == ref.shape
    for i, name in enumerate(CORE_FIELDS):
        if name in EXACT:
            assert got[i] == ref[i] or (np.isnan(got[i]) and np.isnan(ref[i])), (
                name,
                got[i],
                ref[i],
            )
        else:
            tol = rtol * max(abs(ref[i]), ref[0] * 1e-9, 1e-300)
            if name == "m2" and ref[1] + ref[2]:
                tol += rtol * (ref[1] + ref[2]) * (ref[8] / (ref[7] or 1.0)) ** 2
            assert abs(got[i] - ref[i]) <= tol, (name, got[i], ref[i])
    np.testing.assert_array_equal(got[layout.counts_start :], ref[layout.counts_start :])


def one(x: torch.Tensor, layout: Layout, max_parts: int) -> np.ndarray:
    """``x`` summarized by one launch with at most ``max_parts`` programs."""
    spec = _fused.spec_for(x.dtype)
    rows = torch.zeros(_fused.row_size(spec, layout), dtype=torch.float64, device=x.device)
    scratch = torch.zeros(
        max(1, _fused.scratch_rows(x.numel(), max_parts)) * _fused.PART,
        dtype=torch.float64,
        device=x.device,
    )
    _fused.launch_one(x, spec, layout, rows, 0, scratch, max_parts)
    return _fused.finish_rows(rows.cpu().numpy()[None], spec, layout)[0]


def test_programs_of_one_tensor_merge_exactly(monkeypatch):
    """A tensor split among programs (the last one partial, the last program merging the
    partial rows in several groups) equals the reference; so do 1, 2 and 5 programs (whole
    tiles each, the last one's partial)."""
    monkeypatch.setattr(_fused, "ONE_PROGRAM", 0)  # split from the second tile on
    monkeypatch.setattr(_fused, "GROUP", 4)  # merge groups of 4 partial rows
    _fused.clear_caches()
    block = _fused.spec_for(torch.float32).block
    g = torch.Generator().manual_seed(0)
    n = 9 * block - 5
    x = (3.0 + torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(DEVICE)
    x[7] = float("nan")
    x[n - 1] = -float("inf")
    x[block * 5 + 3] = 0.0
    ref, layout = reference(x)
    for max_parts, programs in ((1, 1), (2, 2), (7, 5), (9, 9)):  # 7: 5 programs of 2 tiles
        check(one(x, layout, max_parts), ref, layout)
        assert _fused._parts(n, max_parts, block)[0] == programs
    _fused.clear_caches()


def test_tiles_merge_moments_when_mean_dwarfs_spread():
    """Blocks of ``1 + 1e-4 * noise`` and a scale that grows from tile to tile (each
    slot rescales its sums exactly): the centred second moment keeps its precision."""
    g = torch.Generator().manual_seed(5)
    block = _fused.spec_for(torch.float32).block
    x = 1.0 + 1e-4 * torch.randn(3 * block + 100, generator=g)
    x[block + 17] = 40.0  # raises the scale of one slot in its second tile
    x = x.to(DEVICE)
    ref, layout = reference(x)
    check(one(x, layout, 1), ref, layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_abs_is_the_largest_finite_magnitude_with_its_bits(dtype, monkeypatch):
    """``max_abs`` (taken per slot from the tile's signed extrema) is the largest finite
    ``|x|`` to the bit: for values all negative, for zeros of both signs (``+0``, as
    ``|x|`` gives), with infinities and NaN left out, and where the last tile's slots are
    partly or wholly masked off; from one program and from several."""
    monkeypatch.setattr(_fused, "ONE_PROGRAM", 0)  # split from the second tile on
    _fused.clear_caches()
    block = _fused.spec_for(dtype).block
    g = torch.Generator().manual_seed(11)
    cases = {
        "negative": -0.5 - torch.rand(2 * block + 7, generator=g, dtype=torch.float64),
        "negative zeros": torch.full((block + 3,), -0.0, dtype=torch.float64),
        "zeros and non-finite": torch.tensor([-0.0, -float("inf"), float("nan"), 0.0] * 5),
        "mixed signs": torch.randn(3 * block - 1, generator=g, dtype=torch.float64) * 1e3,
    }
    i = CORE_FIELDS.index("max_abs")
    for name, x in cases.items():
        x = x.to(dtype)
        arr = x.numpy()
        want = np.float64(np.abs(arr[np.isfinite(arr)]).max())
        ref, layout = reference(x.to(DEVICE))
        for max_parts in (1, 2):
            got = one(x.to(DEVICE), layout, max_parts)
            assert np.float64(got[i]).tobytes() == want.tobytes(), (name, max_parts, got[i], want)
            check(got, ref, layout)
    _fused.clear_caches()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_spanning_every_exponent_of_the_dtype(dtype):
    """One block holding every exponent of the dtype (subnormals included), in both signs,
    is counted exactly in every format."""
    exps = torch.arange(127, -134 if dtype == torch.bfloat16 else -150, -1, dtype=torch.float64)
    x = torch.cat([2.0**exps, -(2.0 ** (exps[:40] - 0.5))])
    x = (
        x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
        .to(dtype)
        .to(DEVICE)
    )
    for fmt in (None, "float8_e4m3fn", "float16"):
        ref, layout = reference(x, fmt)
        check(one(x, layout, 4), ref, layout)


EIGHT_BIT = [
    getattr(torch, n)
    for n in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, n)
]


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=str)
def test_every_code_of_eight_bit_formats(dtype):
    """All 256 codes of each 8-bit format (NaNs, infinities, subnormals, both zeros) read
    natively through the value table."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(3).view(dtype).to(DEVICE)
    for fmt in (None, "float8_e4m3fn", "bfloat16"):
        ref, layout = reference(codes, fmt)
        check(one(codes, layout, 2), ref, layout)


def test_views_are_read_in_place():
    """Dense permutations, gappy slices (by their strides) and broadcast dimensions (once,
    weighted) are read where they lie: no copy, the reference's statistics."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(64, 48, generator=g).to(DEVICE)
    base[3, 5] = float("nan")
    base[7, 6] = 0.0
    spec = _fused.spec_for(torch.float32)
    cube = torch.randn(6, 10, 12, generator=g).to(DEVICE)
    views = {
        "transposed": (base.t(), False),
        "permuted": (base.view(8, 8, 6, 8).permute(0, 2, 3, 1), False),
        "every third column": (base[:, ::3], True),
        "a block of columns": (base[:, 5:20], True),
        "gappy in three dimensions": (cube[1:5, ::3, 2:9], True),
        "reversed gappy": (base[::2, 1::2].t(), True),
    }
    for name, (view, strided) in views.items():
        src, weight, geo = _fused._view(view, spec)
        assert src.data_ptr() == view.data_ptr() and weight == 1, name
        assert (geo is not None) == bool(strided), name
        ref, layout = reference(view)
        check(one(view, layout, 2), ref, layout)
    # a broadcast row (stride 0), as the gradient of a sum is; and a gappy one broadcast
    row = torch.randn(1, 300, generator=g).to(DEVICE)
    row[0, 4] = float("inf")
    for view, weight in ((row.expand(40, 300), 40), (cube[:, :1, ::2].expand(6, 5, 6), 5)):
        src, w, _ = _fused._view(view, spec)
        assert w == weight and src.data_ptr() == view.data_ptr()
        ref, layout = reference(view)
        check(one(view, layout, 2), ref, layout)


def test_views_of_more_than_three_gappy_dimensions_are_copied():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 5, 6, 7, generator=g).to(DEVICE)[:, ::2, 1::2, :5]
    spec = _fused.spec_for(torch.float32)
    src, _, geo = _fused._view(x, spec)
    assert geo is None and src.is_contiguous() and src.data_ptr() != x.data_ptr()
    ref, layout = reference(x)
    check(one(x, layout, 2), ref, layout)


def test_float64_in_the_kernel():
    """float64 (not the torch-op path): values beyond float32's range, float64 subnormals,
    NaN and inf; in its own format and counted in a narrower one."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -300, 300, (3000,), generator=g
    )
    x[:5] = torch.tensor([5e-324, -1e-310, 0.0, float("nan"), -float("inf")])
    x[10] = 1.7e308
    x = x.to(DEVICE)
    assert _fused.spec_for(torch.float64) is not None
    for fmt in (None, "float32", "float8_e4m3fn"):
        ref, layout = reference(x, fmt)
        check(one(x, layout, 2), ref, layout)
    small = (torch.randn(700, generator=g, dtype=torch.float64) + 5.0).to(DEVICE)
    ref, layout = reference(small)
    check(one(small, layout, 1), ref, layout)


def _window_case(case: str, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of about five tiles (the last one partial) that probes the edges of the
    kernel's window histogram (see ``_fused``'s notes on exponent counts)."""
    block = _fused.spec_for(dtype).block
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5 * block - 9, generator=g, dtype=torch.float64)
    if case == "relu":  # half zeros (and -0.0), the rest inside the window: no second read
        x = torch.relu(x)
        x[3] = -0.0
    elif case == "far_below":  # normal values 2**-100 below the window, in tile 3
        x[3 * block + 7] = 2.0**-100
        x[3 * block + 8] = -(2.0**-90)
    elif case == "subnormal":  # the compute type's subnormals, in tile 1 and the tail
        tiny = 2.0**-1070 if dtype == torch.float64 else 2.0**-130
        x[block + 1] = tiny
        x[x.numel() - 2] = -3 * tiny
    elif case == "jump":  # tile 2 within the headroom, tile 4 (the tail) far above it
        x *= 1e-3
        x[2 * block] = x[:block].abs().max() * 2.0 ** (_fused.HEADROOM.value - 2)
        x[4 * block + 5] = 2.0**40
    elif case == "zeros_first":  # the window anchored at tile 2 (the first non-zero)
        x[: 2 * block] = 0.0
        x[2 * block + 1] = 2.0**-30  # inside that window
    elif case == "tiny_only":  # all normal, near the bottom: the window starts at field 1
        x = (x.abs() + 0.5) * (2.0**-1000 if dtype == torch.float64 else 2.0**-115)
    elif case == "nonfinite":  # inf and NaN are outliers in every window
        x[block] = float("inf")
        x[2 * block + 3] = float("nan")
    return x.to(dtype).to(DEVICE)


WINDOW_CASES = [
    (case, dtype)
    for case in ("relu", "far_below", "subnormal", "jump", "zeros_first", "tiny_only")
    for dtype in (torch.float32, torch.bfloat16, torch.float64)
] + [("nonfinite", torch.float16), ("nonfinite", torch.float32), ("relu", torch.float16)]


@pytest.mark.parametrize(("case", "dtype"), WINDOW_CASES, ids=lambda v: str(v))
def test_exponent_counts_at_the_edges_of_the_window(case, dtype):
    """Exponent, zero, inf and NaN counts equal the reference exactly whether a program
    keeps its narrow window histogram or reads its range again with the full one: values
    far below the window, subnormals, a zero-heavy ReLU output, a tile whose largest
    exponent jumps within and beyond the headroom, a window anchored late (leading zero
    tiles) or at the bottom of the range; one program, and programs of two tiles of which
    only some hold the outliers (their counts added by atomics)."""
    x = _window_case(case, dtype)
    ref, layout = reference(x)
    for max_parts in (1, 3):
        check(one(x, layout, max_parts), ref, layout)


def test_kernel_writes_a_one_element_statistic():
    """``extra``: the kernel copies a 1-element device tensor (a GradScaler's scale) into
    its custom statistic column, for one program and for several."""
    g = torch.Generator().manual_seed(8)
    scale = torch.tensor([2.0**14], dtype=torch.float32).to(DEVICE)
    layout = Layout("float32", (("loss_scale", "max"),))
    spec = _fused.spec_for(torch.float32)
    for n, parts in ((100, 1), (5 * spec.block + 3, 4)):
        x = torch.randn(n, generator=g).to(DEVICE)
        rows = torch.zeros(_fused.row_size(spec, layout), dtype=torch.float64, device=DEVICE)
        scratch = torch.zeros(16 * 8, dtype=torch.float64, device=DEVICE)
        _fused.launch_one(x, spec, layout, rows, 0, scratch, parts, extra=(0, scale))
        got = _fused.finish_rows(rows.cpu().numpy()[None], spec, layout)[0]
        ref, lay = reference(x, None, {"loss_scale": (2.0**14, "max")})
        check(got, ref, lay)


def test_loss_scale_adds_no_operation_to_a_hook():
    """A hook's tensor with a device loss scale: one launch, no torch operation (before,
    the scale took three: a conversion, a stack and a copy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(500, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    scale = torch.full((1,), 1024.0, device=DEVICE)
    ws = _workspace.Workspace()
    layout = Layout("float32", (("loss_scale", "max"),))
    spec = _fused.spec_for(torch.float32)
    ws.fused([x], spec, layout, [{"loss_scale": scale}])  # the buffers exist from now on
    launches = []  # run after the count: the interpreter's own copies are no GPU work
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_fused, "launch_one", lambda *a, **k: launches.append((a, k)))
        with Ops() as mode:
            slots = ws.fused([x], spec, layout, [{"loss_scale": scale}])
    assert len(launches) == 1 and mode.ops == []
    _fused.launch_one(*launches[0][0], **launches[0][1])
    got = _workspace.to_host(slots, ws.end_step())[0]
    ref, lay = reference(x, None, {"loss_scale": (1024.0, "max")})
    check(got, ref, lay)


def test_one_launch_for_many_tensors_of_mixed_sizes():
    """launch_many: tiny, empty-free, multi-program and unaligned tensors in one table."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(5 * _fused.spec_for(torch.float32).block + 11, generator=g) * 1e-3
    tensors = [
        torch.randn(5, generator=g),
        big,
        torch.tensor([float("nan"), 2.0, -0.0]),
        torch.randn(1000, generator=g),
        torch.randn(40, 30, generator=g),
        torch.randn(1, 50, generator=g),
    ]
    # the views are taken on the device (copied there, they would be dense)
    tensors = [t.to(DEVICE) for t in tensors]
    tensors[3] = tensors[3][1:]  # offset by 4 bytes from its allocation
    tensors[4] = tensors[4][:, ::4]  # gappy: a launch of its own, in place
    tensors[5] = tensors[5].expand(7, 50)  # broadcast: likewise
    layout = Layout("float32", (("peak", "max"),))
    ws = _workspace.Workspace()
    spec = _fused.spec_for(torch.float32)
    extras = [{"peak": torch.tensor(float(i))} for i in range(len(tensors))]
    launches = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("launch_one", "launch_many"):
            real = getattr(_fused, name)
            mp.setattr(
                _fused,
                name,
                lambda *a, name=name, real=real, **k: launches.append(name) or real(*a, **k),
            )
        slots = ws.fused(tensors, spec, layout, extras)
    assert launches == ["launch_many", "launch_one", "launch_one"]
    got = _workspace.to_host(slots, ws.end_step())
    for i, t in enumerate(tensors):
        ref, lay = reference(t, "float32", {"peak": (float(i), "max")})
        check(got[i], ref, lay)


def test_rows_buffer_grows_within_a_step(monkeypatch):
    """A step whose rows outgrow the buffer keeps every row written before the growth."""
    monkeypatch.setattr(_workspace, "_INITIAL", 64)
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(50 + i, generator=g).to(DEVICE) for i in range(6)]
    layout = Layout("float32")
    ws = _workspace.Workspace()
    slots = [ws.summaries([t], layout, [{}])[0] for t in tensors]
    assert (
        ws._spaces[torch.device(DEVICE) if DEVICE == "cpu" else tensors[0].device].rows.numel() > 64
    )
    for t, got in zip(tensors, _workspace.to_host(slots, ws.end_step())):
        ref, lay = reference(t)
        check(got, ref, lay)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _train(net, opt, tr, steps):
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g).to(DEVICE), torch.randn(5, 3, generator=g).to(DEVICE)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        tr.step()


def test_steps_land_a_step_later_and_all_land_at_close(monkeypatch):
    """While a step's copy is under way its rows wait; they are recorded at the next step
    (in order), and closing records the last one: nothing is lost."""
    monkeypatch.setattr(_workspace.Flight, "ready", lambda self: False)
    torch.manual_seed(0)
    net = Net().to(DEVICE)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    with track(net, opt, out="log", every=2) as tr:
        _train(net, opt, tr, 1)
        assert tr.recorder.steps_recorded == 0 and len(tr._flights) == 1
        _train(net, opt, tr, 1)  # unscheduled step 1 lands step 0
        assert tr.recorder.steps_recorded == 1 and not tr._flights
        _train(net, opt, tr, 3)  # steps 2 and 4 recorded; 4 in flight
        assert tr.recorder.steps_recorded == 2 and len(tr._flights) == 1
    df = read_log(tr.out_path)
    assert sorted(set(df[("metadata", "step")])) == [0, 2, 4]
    assert len(df) == 3 * len(df[df[("metadata", "step")] == 0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
def test_no_synchronization_inside_hooks_on_cuda():
    """CUDA's sync debug mode raises on any synchronizing call inside forward, backward
    and the optimizer step of tracked steps."""
    torch.manual_seed(0)
    net = Net().cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x, y = torch.randn(5, 6, device="cuda"), torch.randn(5, 3, device="cuda")
    with track(net, opt, out="log") as tr:
        for _ in range(3):
            try:
                torch.cuda.set_sync_debug_mode("error")
                opt.zero_grad()
                F.mse_loss(net(x), y).backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            tr.step()
    assert sorted(set(read_log(tr.out_path)[("metadata", "step")])) == [0, 1, 2]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the tiny mode runs in Triton's interpreter (on a GPU: benchmarks/gpu.sh runs it whole)",
)
def test_kernel_benchmark_runs_in_its_tiny_mode(capsys):
    """``benchmarks/fused_kernel.py --tiny``: the interpreter, checked against numpy."""
    bench = load_benchmark("fused_kernel")
    assert bench.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "torch.float32" in out and "torch.bfloat16" in out and "error" in out


@pytest.fixture(scope="module")
def compiled_for_gpus() -> dict[str, list[dict]]:
    """Each kernel variant compiled for sm_80 and for sm_90 by ``_triton_compile_worker``
    (no GPU needed), in one subprocess (without the interpreter): its figures by
    architecture."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    worker = Path(__file__).with_name("_triton_compile_worker.py")
    run = subprocess.run(
        [sys.executable, str(worker), "80", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_gpus_near_memory_speed(compiled_for_gpus, arch):
    """The interpreter runs code the GPU compiler may refuse (a branch that changes a
    value's type, say): compile both kernels for every kernel dtype, for sm_80 and sm_90 (no
    GPU needed), through the real launch path so that Triton specializes them as it would on
    a GPU. Static figures of the machine code (counted as ``_triton_compile_worker``
    describes): float32, bfloat16 and float16 tensors are read by 128-bit vector loads,
    the loop over whole tiles costs at most 1.5 warp instructions per element and never
    touches local memory (a spill there would turn the one read of each tensor into
    extra memory traffic), and counts exponents by shared-memory atomics (the kernel's own
    table, not ``tl.histogram``: Triton 3.6 lowers that to a warp ballot per bit of the bin
    index, about 1.2 more instructions per element, 2.2-2.5 in all).
    """
    report = [r for r in compiled_for_gpus[str(arch)] if "formats" not in r]
    compiled = {(r["dtype"], r["kernel"], r["strided"], r["moments"]) for r in report}
    # 5 dtypes x (one tensor, a table of tensors), a strided view, float32 with moments=4
    assert len(compiled) == 13
    for r in report:
        print(r)
        assert 0 < r["registers"] <= 255 and r["loop_spill_instructions"] == 0, r
        assert r["histogram"] == "shared atomics", r
        if r["dtype"] in ("torch.float32", "torch.bfloat16", "torch.float16") and not r["strided"]:
            assert r["ptx_v4_loads"] > 0 and r["loop_128bit_loads"] > 0, r
            if r["moments"] == 2:
                assert r["instructions_per_element"] <= 1.5, r
                assert r["registers"] <= _fused.MAXNREG, r  # 3 programs of 256 threads per SM
            else:  # m3, m4 too: their float64 update per tile (no register cap, no spills)
                assert r["instructions_per_element"] <= 1.7, r


@pytest.mark.parametrize("arch", [80, 90])
def test_block_kernels_compile_for_gpus_without_spills(compiled_for_gpus, arch):
    """The block-format kernels (the second read for the block-scaled formats' columns)
    compile for sm_80 and sm_90 in every variant the launchers pick for float32 tensors,
    and no variant touches local memory: a spill anywhere (their tile loop is most of their
    code) would add memory traffic to a read meant to run at memory speed."""
    report = [r for r in compiled_for_gpus[str(arch)] if "formats" in r]
    compiled = {(r["dtype"], r["kernel"], r["strided"], r["formats"]) for r in report}
    # (one tensor, a table of tensors) x (every format on dense rows and on rows read by
    # their strides, NVFP4 alone on dense rows)
    assert len(compiled) == 6
    assert {r["formats"] for r in report} == {"+".join(_fused._BLOCK_KERNEL_FORMATS), "nvfp4"}
    for r in report:
        assert 0 < r["registers"] <= 255 and r["spill_instructions"] == 0, r


def test_launch_many_reuses_its_table_only_for_the_same_tensors():
    """The table of programs is built once for the same tensors in the same rows, and
    rebuilt for tensors at other addresses: each launch summarizes the tensors it is given."""
    _fused.clear_caches()
    spec = _fused.spec_for(torch.float32)
    layout = Layout("float32")
    g = torch.Generator().manual_seed(5)
    first = [torch.randn(n, generator=g).to(DEVICE) for n in (7, 3 * spec.block + 5)]
    second = [torch.randn(n, generator=g).to(DEVICE) * 8 for n in (7, 3 * spec.block + 5)]
    ws = _workspace.Workspace()
    for tensors, tables in ((first, 1), (first, 1), (second, 2), (first, 2)):
        slots = ws.fused(tensors, spec, layout, [{}, {}])
        assert len(_fused._tables) == tables
        got = _workspace.to_host(slots, ws.end_step())
        for i, t in enumerate(tensors):
            check(got[i], reference(t, "float32")[0], layout)
    _fused.clear_caches()


def test_the_overhead_benchmark_s_large_split_changes_large_tensors_only():
    """``benchmarks/overhead.py --large-split 3``: tensors of 2**24 elements or more are
    split among up to 3 programs per SM, smaller ones as the library splits them, and the
    scratch rows follow the split (one per program of a split tensor)."""
    bench = load_benchmark("overhead")
    sms, block = 132, _fused.spec_for(torch.float32).block
    split = bench.large_split(_fused._parts, sms, 3)
    for n in (1 << 20, (1 << 24) - 1):  # below: the library's own split
        assert split(n, 2 * sms, block) == _fused._parts(n, 2 * sms, block)
    # 2**24 elements, 8,192 tiles of 2,048: 21 tiles a program (8,192 / 396 rounded up),
    # 391 programs (at 2 per SM: 32 tiles, 256 programs); 3 * 2**26, 98,304 tiles: 249
    # tiles a program, 395 programs
    assert split(1 << 24, 2 * sms, block) == (391, 21 * block)
    assert _fused._parts(1 << 24, 2 * sms, block) == (256, 32 * block)
    assert split(3 << 26, 2 * sms, block) == (395, 249 * block)
    plain = _fused._parts
    try:
        _fused._parts = split
        assert _fused.scratch_rows(1 << 24, 2 * sms) == 391
        assert _fused.scratch_rows(1 << 20, 2 * sms) == 256  # 512 tiles, 2 each
    finally:
        _fused._parts = plain
