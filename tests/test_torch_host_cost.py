"""The host side of the GPU path, checked on the CPU: the host-cost benchmark's tiny mode,
the order of stream joins and buffer marks (with stand-in streams), and the refusal of
tracking inside a CUDA graph capture."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _benchmarks import load_benchmark
from torch import nn

from tandv.track.torch import _workspace, track

ROOT = Path(__file__).resolve().parents[1]


def _tiny_run(*flags: str) -> tuple[str, float, float]:
    """The benchmark's tiny mode with ``flags`` (kernels replaced by no-ops): its output,
    which ends with its two figures, and those figures, after checking that the tracker
    observed more than 10 tensors a step and launched at most one kernel per activation or
    activation gradient plus 8."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    script = str(ROOT / "benchmarks" / "host_cost.py")
    run = subprocess.run(
        [sys.executable, script, "--tiny", "--no-triton", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    x = re.fullmatch(r"host_us_per_observation: ([0-9.]+)", lines[-2])
    y = re.fullmatch(r"host_us_fixed_per_step: ([0-9.]+)", lines[-1])
    assert x and y, lines[-2:]
    assert float(x.group(1)) > 0 and float(y.group(1)) > 0
    counts = re.search(
        r"(\d+) activation/activation-gradient observations per step, "
        r"([0-9.]+) kernel launches per step",
        run.stdout,
    )
    assert counts, run.stdout
    observations, launches = int(counts.group(1)), float(counts.group(2))
    assert observations > 10
    assert 0 < launches <= observations + 8
    return run.stdout, float(x.group(1)), float(y.group(1))


def test_host_cost_benchmark_tiny_mode():
    """The benchmark runs (see :func:`_tiny_run`); its cross-check by difference (an
    untracked copy stepping beside it) prints a figure, and its floors (stand-ins for
    tandv's forward hooks, and for its per-step work) figure below tandv's."""
    pytest.importorskip("triton")
    out, x, y = _tiny_run("--difference", "--floor")
    # a number (the CPU time of 3 tiny steps by difference may come out either side of 0)
    diff = re.search(r"by difference \(.*\): (-?[0-9.]+) us", out)
    assert diff, out
    # --floor: the stand-in hooks ran and cost less than tandv's (several times less)
    floor = re.search(
        r"an empty hook (-?[0-9.]+) us; .* version (-?[0-9.]+) us; .* the same, (-?[0-9.]+) us",
        out,
    )
    assert floor, out
    assert max(map(float, floor.groups())) < x
    # and per step: each weight, gradient and state tensor asked its address and size
    step_floor = re.search(r"floor per step, .* the step's (\d+) weights, .*: ([0-9.]+) us", out)
    assert step_floor, out
    tensors = int(step_floor.group(1))
    bench = load_benchmark("host_cost")
    model, opt, _ = bench._trainer(
        bench.config_of({**bench.PRESETS["small"], **bench.TINY}), 2, 0, "cpu"
    )
    params = sum(1 for _ in model.parameters())
    assert tensors == 4 * params  # weights, gradients, AdamW's two moments (not its step)
    assert 0 < float(step_floor.group(2)) < y
    # and again with what tandv asks of each (a positive time)
    asked = re.search(
        r"floor per step asking each of them what tandv asks .*?: ([0-9.]+) us; "
        r"tandv's step above it: (-?[0-9]+) us",
        out,
    )
    assert asked and float(asked.group(1)) > 0, out
    # the difference of the printed step figure and that floor (rounded: within 1 us)
    assert abs(int(asked.group(2)) - (y - float(asked.group(1)))) <= 1, out


def test_host_cost_benchmark_host_only_tiny_mode():
    """``--host-only`` (the model's operations compute nothing, as on a GPU host): the
    run says so, and observes and launches as the plain run does (see :func:`_tiny_run`)."""
    pytest.importorskip("triton")
    out, _, _ = _tiny_run("--host-only")
    assert "host only: the model's and the optimizer's operations" in out


def test_no_compute_mode_allocates_outputs_and_computes_nothing():
    """:class:`NoCompute`, the model of ``--host-only``: an operation's outputs have the
    sizes, strides and dtypes of its real outputs; an in-place operation returns its
    argument unchanged; views alias their base; one-element operations and those whose
    outputs meta tensors cannot tell (a data-dependent size) compute for real."""
    bench = load_benchmark("host_cost")
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.ones(4, 5, dtype=torch.float32)
    expect = a @ b
    with bench.NoCompute() as mode:
        got = a @ b
        again = a @ b  # (its shapes from the cache)
        same = a.add_(1.0)
        view = a.t()
        count = torch.zeros(())
        count += 1
        found = torch.nonzero(torch.tensor([0.0, 2.0, 0.0, 3.0]))
        half = a.to(torch.bfloat16)
    for out in (got, again):
        assert out.shape == expect.shape and out.stride() == expect.stride()
        assert out.dtype == expect.dtype and out.data_ptr() != a.data_ptr()
    assert len(mode.outputs) >= 2  # (matmul's shapes kept once, the cast's)
    assert same is a and torch.equal(a, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert view.data_ptr() == a.data_ptr() and view.shape == (4, 3)
    assert count.item() == 1.0
    assert found.tolist() == [[1], [3]]
    assert half.dtype == torch.bfloat16 and half.shape == (3, 4)


def test_instrumented_puts_the_tracker_back_and_floor_hooks_replace_the_forward_hooks():
    """``instrumented(clock, floor)`` (``--floor``'s runs): within it, tandv's forward hook
    factory gives the stand-in, timed; at its end every method is back, so the benchmark's
    runs in one process do not time each other's wrappers."""
    bench = load_benchmark("host_cost")
    from tandv.track.torch.tracker import Tracker

    names = bench.INSTRUMENTED
    assert "_make_forward_hook" in names and "_optimizer_post_hook" in names
    before = {name: getattr(Tracker, name) for name in names}
    calls = []
    bench.FLOOR_HOOKS["spy"] = lambda mod, args, output: calls.append(output)
    clock = bench.Clock()
    try:
        with bench.instrumented(clock, "spy"):
            hook = Tracker._make_forward_hook(None, "a", nn.Linear(2, 2))
            clock.on = True
            out = torch.ones(2)
            hook(None, (), out)
    finally:
        del bench.FLOOR_HOOKS["spy"]
    assert calls == [out] and clock.calls["hook"] == 1
    assert {name: getattr(Tracker, name) for name in names} == before


def test_launch_path_worker_times_launch_one():
    """The benchmark's launch-path figures: ``launch_one`` of a kernel compiled for sm_90,
    a hook's launch (``HookLaunch.summarize``, the compiled kernel called through
    Triton's launcher) and a batch's (``BatchLaunch.summarize``), with Triton's C launcher
    a no-op (no GPU needed), give a positive time per call. Run so that a change of the
    launch code's signatures cannot leave the figures unmeasured (or the hooks' and the
    batches' compiled-kernel paths unexercised): the worker also checks that a batch's
    direct launch hands the C launcher what Triton's own binding handed it."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_cost.py"), "--triton-worker", "20"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    want = {"triton_run_us_per_call", "hook_launch_us_per_call", "batch_launch_us_per_call"}
    assert set(got) == want, got
    assert all(v > 0 for v in got.values()), got


class Log(list):
    """The calls made on the stand-ins, in order."""


class FakeStream:
    def __init__(self, name: str, log: Log) -> None:
        self.name, self.log = name, log
        self.cuda_stream = name  # (the raw handle's stand-in)

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class FakeBuffer:
    """A device buffer's stand-in: records ``record_stream`` calls."""

    def __init__(self, name: str, log: Log, n: int) -> None:
        self.name, self.log, self.n = name, log, n

    def record_stream(self, s: FakeStream) -> None:
        self.log.append(("record", self.name, s.name))

    def numel(self) -> int:
        return self.n


@pytest.fixture
def space(monkeypatch):
    """A CPU space that believes it is a CUDA one, with stand-in streams and buffers; the
    current stream is ``space.current[0]``."""
    log = Log()
    sp = _workspace._Space(torch.device("cpu"))
    sp.cuda = True
    sp.home = FakeStream("home", log)
    sp.rows = FakeBuffer("rows", log, sp.capacity)
    sp.scratch = FakeBuffer("scratch", log, 0)
    sp.current = [sp.home]
    sp.log = log
    sp.index = 0
    sp.raw_stream = lambda index: sp.current[0].cuda_stream
    sp.ordered = {sp.home.cuda_stream}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sp.current[0])
    return sp


def test_side_stream_waits_for_the_rows_and_marks_the_buffers_once(space):
    side = FakeStream("side", space.log)
    space.stream()  # the home stream: nothing to order
    assert space.log == []
    space.current[0] = side
    space.stream()
    space.stream()  # again on the same stream this step: nothing more
    assert space.log == [
        ("wait", "side", "home"),  # after the rows' zeroing on the home stream
        ("record", "rows", "side"),
        ("record", "scratch", "side"),
    ]


def test_join_orders_the_reader_after_every_writer(space):
    a, b = FakeStream("a", space.log), FakeStream("b", space.log)
    for s in (a, b):
        space.current[0] = s
        space.stream()
    space.log.clear()
    space.current[0] = space.home
    space.join()  # e.g. the end of the step, on the home stream
    assert space.log == [("wait", "home", "a"), ("wait", "home", "b")]
    assert space.writers == []
    space.log.clear()
    space.current[0] = a  # the next step's first write from a waits for home again
    space.stream()
    assert space.log[0] == ("wait", "a", "home")


def test_join_from_a_new_stream_takes_it_as_home(space):
    a, c = FakeStream("a", space.log), FakeStream("c", space.log)
    space.current[0] = a
    space.stream()
    space.log.clear()
    space.current[0] = c
    space.join()
    assert space.log == [
        ("wait", "c", "a"),
        ("wait", "c", "home"),
        ("record", "rows", "c"),
        ("record", "scratch", "c"),
    ]
    assert space.home == c


def test_growing_the_rows_first_joins_the_writers(space, monkeypatch):
    """The copy into the bigger buffer follows every kernel queued on the old one."""
    a = FakeStream("a", space.log)
    space.current[0] = a
    space.stream()
    space.log.clear()
    space.current[0] = space.home

    class Rows(FakeBuffer):
        def __getitem__(self, key):
            return torch.ones(self.n, dtype=torch.float64)[key]

    space.rows = Rows("rows", space.log, space.capacity)
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):
        space.log.append(("alloc",))
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    old = space.capacity
    space.used = old - 1
    assert space.reserve(8) == old - 1
    assert space.log == [("wait", "home", "a"), ("alloc",)]
    assert space.capacity == space.rows.numel() >= old + 7
    assert space.rows[: old - 1].eq(1).all() and space.rows[old - 1 :].eq(0).all()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.fixture
def capturing(monkeypatch):
    """CPU tensors that say they are on CUDA while a graph capture is under way (only the
    tracker asks; the model's own operations run on the CPU)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


def test_capture_of_a_tracked_activation_is_refused_naming_the_module(capturing):
    net = Net()
    with track(net, out="log", track_weights=False, verbose=False):
        with pytest.raises(RuntimeError, match=r"output of module 'fc1'.*CUDA graph capture"):
            net(torch.randn(3, 4))


def test_capture_of_tracked_weights_is_refused_naming_the_parameter(capturing):
    net = Net()
    with track(net, out="log", verbose=False):
        with pytest.raises(RuntimeError, match=r"Weight 'fc1.weight'.*CUDA graph capture"):
            net(torch.randn(3, 4))


def test_no_capture_no_refusal(monkeypatch):
    """The check does not fire on CUDA-less tensors, capture or not."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with track(net, opt, out="log", verbose=False) as tr:
        F.mse_loss(net(torch.randn(3, 4)), torch.zeros(3, 2)).backward()
        opt.step()
        tr.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_8bit_value_tables_are_on_the_device_when_tracking_starts():
    pytest.importorskip("triton")
    from tandv.track.torch import _fused

    net = Net().cuda()
    with track(net, out="log", verbose=False):
        dev = next(net.parameters()).device
        for dtype in _workspace._fused_8bit_dtypes():
            assert (dtype, dev) in _fused._luts
