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

from tandv.schema import read_log  # noqa: E402
from tandv.stats.summary import CORE_FIELDS, Layout, summarize  # noqa: E402
from tandv.track.torch import _fused, _workspace, track  # noqa: E402
from tandv.track.torch import summary as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "min_abs", "max_abs")


@pytest.fixture(autouse=True)
def fused_path(monkeypatch):
    monkeypatch.setattr(kernel, "HOST_PATH", False)
    monkeypatch.setattr(kernel, "FUSED_ON_CPU", True)


def reference(x: torch.Tensor, fmt=None, extras=None):
    name = str(x.dtype).removeprefix("torch.")
    arr = x.detach().cpu()
    arr = (
        arr.numpy()
        if name in ("float32", "float16")
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
    """A tensor split among more programs than one merge group (the last program merges
    partial rows in groups) equals the reference; so do 1, 2 and 7 programs."""
    monkeypatch.setattr(_fused, "MIN_CHUNK", _fused.BLOCK)  # many programs on a small tensor
    g = torch.Generator().manual_seed(0)
    n = (_fused.GROUP + 2) * _fused.MIN_CHUNK - 5
    x = (3.0 + torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(DEVICE)
    x[7] = float("nan")
    x[n - 1] = -float("inf")
    x[_fused.MIN_CHUNK * 5 + 3] = 0.0
    ref, layout = reference(x)
    for parts in (1, 2, 7, 64):
        check(one(x, layout, parts), ref, layout)
        assert _fused._parts(n, parts)[0] == min(parts, _fused.GROUP + 2)


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


def test_views_are_read_in_place_or_copied_when_gappy():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(64, 48, generator=g).to(DEVICE)
    spec = _fused.spec_for(torch.float32)
    for view in (base.t(), base.view(8, 8, 6, 8).permute(0, 2, 3, 1)):  # dense, permuted
        assert not view.is_contiguous()
        assert _fused._flat(view, spec).data_ptr() == base.data_ptr()
        ref, layout = reference(view)
        check(one(view, layout, 2), ref, layout)
    gappy = base[:, ::3]
    assert _fused._flat(gappy, spec).data_ptr() != base.data_ptr()
    ref, layout = reference(gappy)
    check(one(gappy, layout, 2), ref, layout)


def test_one_launch_for_many_tensors_of_mixed_sizes():
    """launch_many: tiny, empty-free, multi-program and unaligned tensors in one table."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 * _fused.MIN_CHUNK + 11, generator=g) * 1e-3
    tensors = [
        torch.randn(5, generator=g),
        big,
        torch.tensor([float("nan"), 2.0, -0.0]),
        torch.randn(1000, generator=g)[1:],
    ]  # offset by 4 bytes from its allocation
    tensors = [t.to(DEVICE) for t in tensors]
    layout = Layout("float32", (("peak", "max"),))
    ws = _workspace.Workspace()
    spec = _fused.spec_for(torch.float32)
    slots = ws.fused(tensors, spec, layout, [{"peak": torch.tensor(float(i))} for i in range(4)])
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
def test_no_synchronization_inside_hooks_on_cuda():
    """CUDA's sync debug mode raises on any synchronizing call inside forward, backward
    and the optimizer step of tracked steps."""
    torch.manual_seed(0)
    net = Net().cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x, y = torch.randn(5, 6, device="cuda"), torch.randn(5, 3, device="cuda")
    with track(net, opt, out="log") as tr:
        for _ in range(3):
            torch.cuda.set_sync_debug_mode("error")
            try:
                opt.zero_grad()
                F.mse_loss(net(x), y).backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            tr.step()
    assert sorted(set(read_log(tr.out_path)[("metadata", "step")])) == [0, 1, 2]


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_gpus_without_spills(arch):
    """The interpreter runs code the GPU compiler may refuse (a branch that changes a
    value's type, say): compile both kernels for every kernel dtype, for sm_80 and sm_90 (no
    GPU needed), through the real launch path so that Triton specializes them as it would on
    a GPU, and require that no kernel spills registers to local memory (a spill turns the
    kernel's one read of each tensor into extra memory traffic)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_triton_compile_worker.py")), str(arch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    compiled = {(r["dtype"], r["kernel"]) for r in report}
    assert len(compiled) == 10  # 5 dtypes x (one tensor, a table of tensors)
    for r in report:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert 0 < r["registers"] <= 255, r
