"""No tensor outlives the hook that summarizes it: a tracked step's peak memory is the
untracked step's (within 4 MiB) on a small GPT whose logits alone are 8 MiB."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandv.demos.torch_gpt import GPT, GPTConfig
from tandv.track.torch import track

# logits of batch 8 x seq 64 x vocab 4096 float32: 8 MiB, as are their gradient and the
# softmax cross-entropy saves; a tracker that keeps them past the root's hook adds 8 MiB
CFG = GPTConfig(vocab_size=4096, seq_len=64, d_model=32, n_layers=1, n_heads=2, d_mlp=64)
BATCH = 8
LOGITS = BATCH * CFG.seq_len * CFG.vocab_size * 4
SLACK = 4 * 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():
    """glibc's ``mallinfo2`` (all arenas), or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    fn = getattr(libc, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return fn


class PeakBytes(TorchDispatchMode):
    """Samples the C heap's bytes in use (small blocks and mmapped ones: torch's CPU
    allocator takes every tensor from malloc, uncached) after every torch operation, and
    keeps the largest sample above the first."""

    def __init__(self, mallinfo) -> None:
        super().__init__()
        self._info = mallinfo
        self.base = self._used()
        self.peak = 0

    def _used(self) -> int:
        m = self._info()
        return int(m.uordblks + m.hblkhd)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self._used() - self.base)
        return out


def _step(model, opt, tokens) -> None:
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _model():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1))
    return model, opt, tokens


@pytest.fixture
def one_thread():
    """torch on one thread (one arena's worth of threads: fewer stray allocations), and
    the process's setting back afterwards for the tests that follow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tracked_step_peak_memory_is_the_untracked_one_on_the_cpu(one_thread):
    info = _mallinfo2()
    if info is None:
        pytest.skip("needs glibc's mallinfo2 to read the C heap")
    model, opt, tokens = _model()
    for _ in range(2):
        _step(model, opt, tokens)  # the optimizer state and the allocator settle
    with PeakBytes(info) as plain:
        _step(model, opt, tokens)
    with track(model, opt, out="log", verbose=False) as tr:
        for _ in range(2):
            _step(model, opt, tokens)
            tr.step()
        with PeakBytes(info) as tracked:
            _step(model, opt, tokens)
        tr.step()
    # the measurement sees the logits: the untracked step's peak holds a few of them
    assert plain.peak > 2 * LOGITS
    assert tracked.peak <= plain.peak + SLACK, (tracked.peak / 2**20, plain.peak / 2**20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tracked_step_peak_memory_is_the_untracked_one_on_cuda():
    model, opt, tokens = _model()
    model, tokens = model.cuda(), tokens.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def peak() -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(model, opt, tokens)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    for _ in range(2):
        _step(model, opt, tokens)
    plain = peak()
    with track(model, opt, out="log", verbose=False) as tr:
        for _ in range(2):
            _step(model, opt, tokens)
            tr.step()
        tracked = peak()
        tr.step()
    assert plain > 2 * LOGITS
    assert tracked <= plain + SLACK, (tracked / 2**20, plain / 2**20)
