"""The PyTorch tracker on small models, checked against tensors the tests capture themselves
and summarize with the numpy reference."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandv.schema import read_log, validate
from tandv.stats.summary import DEFAULT_STATS, exponent_labels, finalize, merge_all, summarize
from tandv.track.torch import summary as kernel
from tandv.track.torch import track
from tandv.track.torch._workspace import Workspace

KINDS = ("Activation", "Gradient", "Weight", "Optimiser_State")


def _interpreted_only(path: str) -> None:
    """Skip the fused path on CPU tensors where Triton compiles for a GPU instead of
    interpreting (tests/conftest.py sets the interpreter only where no GPU is present; there
    the kernel refuses CPU tensors, and the CUDA test files run it)."""
    if path == "fused":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the fused kernel takes CPU tensors only in Triton's interpreter")


@pytest.fixture(params=["host", "fused"])
def any_path(request):
    """Runs a test with CPU tensors on the host kernel, and again on the fused Triton kernel
    that CUDA tensors take (in Triton's interpreter when no GPU is present)."""
    _interpreted_only(request.param)
    with kernel.cpu_path(request.param):
        yield request.param


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


MODULES = ("root", "fc1", "act", "fc2")
PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def make(seed: int = 0, opt_cls=torch.optim.Adam, **opt_kw):
    torch.manual_seed(seed)
    net = Net()
    opt = opt_cls(net.parameters(), **({"lr": 1e-2} | opt_kw))
    return net, opt


def batch(i: int, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


class Capture:
    """Independent capture of module outputs and output gradients with the test's own hooks."""

    def __init__(self, net: nn.Module) -> None:
        self.acts: dict[str, list[torch.Tensor]] = {}
        self.grads: dict[str, list[torch.Tensor]] = {}
        self.handles = []
        for name, m in net.named_modules():
            self.handles.append(m.register_forward_hook(self._hook(name or "root")))

    def _hook(self, name):
        def hook(mod, args, out):
            if not mod.training:
                return
            self.acts.setdefault(name, []).append(out.detach().clone())
            if out.requires_grad:
                out.register_hook(lambda g: self.grads.setdefault(name, []).append(g.clone()))

        return hook

    def reset(self) -> None:
        self.acts, self.grads = {}, {}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def index(df):
    m = df["metadata"]
    return {
        (n, t, int(s)): i for i, (n, t, s) in enumerate(zip(m["name"], m["tensor_type"], m["step"]))
    }


def assert_row(df, idx, key, tensors, fmt=None, rtol=1e-5):
    """The log row ``key`` equals the numpy reference summary of ``tensors`` (merged)."""
    assert key in idx, f"missing row {key}"
    row = df.iloc[idx[key]]
    arrays = [t.detach().double().numpy() for t in tensors]
    f = fmt or str(tensors[0].dtype).removeprefix("torch.")
    parts = [summarize(a.astype(np.float32) if f == "float32" else a, f) for a in arrays]
    layout = parts[0][1]
    stats, counts = finalize(merge_all([p[0] for p in parts], layout), layout)
    for s in DEFAULT_STATS:
        got, want = row[("scalar_stats", s)], stats[s]
        if s in (
            "numel",
            "zero_count",
            "nan_count",
            "inf_count",
            "min",
            "max",
            "min_abs",
            "max_abs",
        ):
            assert got == want, (key, s, got, want)
        else:
            assert got == pytest.approx(want, rel=rtol, abs=1e-12), (key, s, got, want)
    expected = dict(zip(exponent_labels(f), counts))
    exp_cols = {c[1]: row[c] for c in df.columns if c[0] == "exponent_counts"}
    for label, c in expected.items():
        assert exp_cols.get(label, 0) == c, (key, label, exp_cols.get(label, 0), c)
    assert all(v == 0 for lab, v in exp_cols.items() if lab not in expected)


def train(net, opt, steps, tracker=None, capture=None, record=None, micro=1):
    """A plain training loop; ``record`` collects the test's own copies per step."""
    losses = []
    for i in range(steps):
        if capture:
            capture.reset()
        weights = {n: p.detach().clone() for n, p in net.named_parameters()}
        opt.zero_grad()
        for j in range(micro):
            x, y = batch(i * micro + j)
            loss = F.mse_loss(net(x), y)
            loss.backward()
            losses.append(loss.detach().clone())
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        opt.step()
        state = {
            f"{n}.{k}": v.clone()
            for n, p in net.named_parameters()
            for k, v in opt.state.get(p, {}).items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
        if tracker:
            tracker.step()
        if record is not None:
            record.append(
                {
                    "weights": weights,
                    "grads": grads,
                    "state": state,
                    "acts": dict(capture.acts) if capture else {},
                    "out_grads": dict(capture.grads) if capture else {},
                }
            )
    return losses


def test_every_row_equals_the_reference_on_captured_tensors(any_path):
    net, opt = make()
    cap = Capture(net)
    rec = []
    with track(net, opt, out="log") as tr:
        train(net, opt, 3, tr, cap, rec)
    df = read_log(tr.out_path)
    idx = index(df)
    for k, r in enumerate(rec):
        for name in MODULES:
            assert_row(df, idx, (name, "Activation", k), r["acts"][name])
            assert_row(df, idx, (name, "Gradient", k), r["out_grads"][name])
        for name in PARAMS:
            assert_row(df, idx, (name, "Weight", k), [r["weights"][name]])
            assert_row(df, idx, (name, "Gradient", k), [r["grads"][name]])
            for key in ("exp_avg", "exp_avg_sq"):
                assert_row(
                    df, idx, (f"{name}.{key}", "Optimiser_State", k), [r["state"][f"{name}.{key}"]]
                )
    # nothing else: exactly the expected (name, tensor_type) at every step, the last included
    expected = (
        {(n, "Activation") for n in MODULES}
        | {(n, "Gradient") for n in MODULES + PARAMS}
        | {(n, "Weight") for n in PARAMS}
        | {(f"{n}.{k}", "Optimiser_State") for n in PARAMS for k in ("exp_avg", "exp_avg_sq")}
    )
    for k in range(3):
        got = {(n, t) for (n, t, s) in idx if s == k}
        assert got == expected
    types = dict(zip(df[("metadata", "name")], df[("metadata", "type")]))
    assert types["fc1"] == "Linear" and types["act"] == "Tanh" and types["root"] == "Net"
    assert types["fc1.weight.exp_avg"] == "Linear"
    assert set(df[("metadata", "dtype")]) == {"float32"}


def test_weight_row_at_next_step_is_the_weight_after_the_update():
    net, opt = make()
    after = []
    with track(net, opt, out="log") as tr:
        for i in range(3):
            x, y = batch(i)
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            opt.step()
            after.append({n: p.detach().clone() for n, p in net.named_parameters()})
            tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(2):
        for name in PARAMS:
            assert_row(df, idx, (name, "Weight", k + 1), [after[k][name]])
    # and it differs from the weight before the update (the update is not a no-op)
    w0 = df.iloc[idx[("fc1.weight", "Weight", 0)]][("scalar_stats", "mean")]
    w1 = df.iloc[idx[("fc1.weight", "Weight", 1)]][("scalar_stats", "mean")]
    assert w0 != w1


def test_losses_bit_identical_with_and_without_tracking(any_path):
    net, opt = make(3)
    plain = train(net, opt, 10)
    net, opt = make(3)
    with track(net, opt, out="log", number_format="float8_e4m3fn") as tr:
        tracked = train(net, opt, 10, tr)
    assert all(torch.equal(a, b) for a, b in zip(plain, tracked))


def test_gradient_accumulation_merges_micro_batches(any_path):
    net, opt = make()
    cap = Capture(net)
    rec = []
    with track(net, opt, out="log") as tr:
        train(net, opt, 2, tr, cap, rec, micro=3)
    df = read_log(tr.out_path)
    validate(df)  # no duplicate (name, tensor_type, step)
    idx = index(df)
    for k, r in enumerate(rec):
        assert len(r["acts"]["fc1"]) == 3
        for name in MODULES:
            assert_row(df, idx, (name, "Activation", k), r["acts"][name])
            assert_row(df, idx, (name, "Gradient", k), r["out_grads"][name])
        for name in PARAMS:
            assert_row(df, idx, (name, "Gradient", k), [r["grads"][name]])  # accumulated
            assert_row(df, idx, (name, "Weight", k), [r["weights"][name]])
    assert df.iloc[idx[("fc1", "Activation", 0)]][("scalar_stats", "numel")] == 3 * 5 * 8


def test_two_param_groups_in_shuffled_order_name_state_by_identity():
    torch.manual_seed(0)
    net = Net()
    frozen = nn.Parameter(torch.ones(4))  # in a group, but never gets a gradient: no state
    net.register_parameter("unused", frozen)
    params = dict(net.named_parameters())
    order = ["fc2.bias", "unused", "fc1.weight", "fc2.weight", "fc1.bias"]
    random.Random(5).shuffle(order)
    opt = torch.optim.AdamW(
        [
            {"params": [params[n] for n in order[:3]], "lr": 1e-2},
            {"params": [params[n] for n in order[3:]], "lr": 1e-3},
        ]
    )
    rec = []
    with track(net, opt, out="log") as tr:
        train(net, opt, 2, tr, record=rec)
    df = read_log(tr.out_path)
    idx = index(df)
    state_names = {n for (n, t, s) in idx if t == "Optimiser_State" and s == 1}
    assert (
        state_names
        == set(rec[1]["state"])
        == {f"{n}.{k}" for n in PARAMS for k in ("exp_avg", "exp_avg_sq")}
    )
    for name, value in rec[1]["state"].items():
        assert_row(df, idx, (name, "Optimiser_State", 1), [value])
    assert ("unused", "Weight", 0) in idx and ("unused", "Gradient", 0) not in idx


@pytest.mark.parametrize(
    "opt_cls, kw, keys",
    [
        (torch.optim.SGD, {"momentum": 0.9}, ("momentum_buffer",)),
        (torch.optim.Adam, {}, ("exp_avg", "exp_avg_sq")),
        (torch.optim.AdamW, {"amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
        (torch.optim.Adagrad, {}, ("sum",)),
        (torch.optim.RMSprop, {"momentum": 0.5}, ("square_avg", "momentum_buffer")),
    ],
)
def test_optimizer_state_names_and_values(opt_cls, kw, keys):
    net, opt = make(1, opt_cls, **kw)
    rec = []
    with track(net, opt, out="log") as tr:
        train(net, opt, 2, tr, record=rec)
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(2):
        names = {n for (n, t, s) in idx if t == "Optimiser_State" and s == k}
        assert names == {f"{p}.{key}" for p in PARAMS for key in keys}  # no scalar 'step'
        for name in names:
            assert_row(df, idx, (name, "Optimiser_State", k), [rec[k]["state"][name]])


def test_exception_mid_run_propagates_removes_hooks_and_keeps_completed_steps():
    net, opt = make()
    with pytest.raises(RuntimeError, match="boom"):
        with track(net, opt, out="log", flush_every=100) as tr:
            for i in range(10):
                x, y = batch(i)
                opt.zero_grad()
                F.mse_loss(net(x), y).backward()
                if i == 4:
                    raise RuntimeError("boom")
                opt.step()
                tr.step()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    assert not opt._optimizer_step_pre_hooks
    df = read_log(tr.out_path)
    assert sorted(set(df[("metadata", "step")])) == [0, 1, 2, 3]
    for k in range(4):
        assert set(df[df[("metadata", "step")] == k][("metadata", "tensor_type")]) == set(KINDS)
    # the module still trains normally afterwards
    F.mse_loss(net(batch(0)[0]), batch(0)[1]).backward()


def test_keyboard_interrupt_keeps_completed_steps():
    net, opt = make()
    with pytest.raises(KeyboardInterrupt):
        with track(net, opt, out="log.pkl", out_format="pickle") as tr:
            train(net, opt, 2, tr)
            raise KeyboardInterrupt
    df = read_log(tr.out_path, trust_pickle=True)
    assert sorted(set(df[("metadata", "step")])) == [0, 1]


@pytest.mark.parametrize(
    "options, steps",
    [
        ({"every": 3}, [0, 3, 6, 9]),
        ({"schedule": "linear(4, 1)"}, [1, 5, 9]),
        ({"schedule": lambda s: s in (2, 7)}, [2, 7]),
        ({"schedule": [0, 8]}, [0, 8]),
        ({"start": 6, "end": 9}, [6, 7, 8]),
        ({"every": 2, "start": 3}, [4, 6, 8]),
    ],
)
def test_schedules(options, steps):
    net, opt = make()
    with track(net, opt, out="log", **options) as tr:
        train(net, opt, 10, tr)
    df = read_log(tr.out_path)
    assert sorted(set(df[("metadata", "step")])) == steps
    for k in steps:
        assert set(df[df[("metadata", "step")] == k][("metadata", "tensor_type")]) == set(KINDS)


def test_scheduled_steps_reuse_their_module_hooks_and_follow_a_replaced_module(tmp_path):
    """With a schedule the module hooks are put in place at every scheduled step and taken
    away after it: the same hook functions each time (made once, until the model
    changes), none left on an unscheduled step, and a module replaced between two
    scheduled steps is hooked in its predecessor's place (the old module keeps no hook;
    the rows of the scheduled steps are right, by the numpy reference)."""
    net, opt = make()
    seen: dict[tuple[str, str, int], torch.Tensor] = {}

    def hooks_of(m: nn.Module) -> list:
        return list(m._forward_hooks.values())

    placed = []
    old = net.fc2
    with track(net, opt, out=tmp_path / "log", verbose=False, every=2) as tr:
        for i in range(6):
            if i == 3:  # an unscheduled step: the next scheduled one hooks the new layer
                net.fc2 = nn.Linear(8, 3)
                opt.add_param_group({"params": list(net.fc2.parameters())})
            if i % 2 == 0:
                placed.append({n: hooks_of(m) for n, m in net.named_modules()})
            else:
                assert all(not m._forward_hooks for m in net.modules())
            x, y = batch(i)
            opt.zero_grad()
            out = net.fc1(x)
            pred = net.fc2(net.act(out))
            seen[("fc1", "Activation", i)] = out.detach().clone()
            seen[("fc2", "Activation", i)] = pred.detach().clone()
            F.mse_loss(pred, y).backward()
            opt.step()
            tr.step()
    assert all(not m._forward_hooks for m in [*net.modules(), old])
    # one hook per module at each scheduled step: the same function at steps 0 and 2; made
    # again after the model changed (its names found again), the new fc2's among them
    for name in ("fc1", "act", "fc2"):
        assert [len(p[name]) for p in placed] == [1, 1, 1]
        assert placed[0][name][0] is placed[1][name][0]
        assert placed[2][name][0] is not placed[1][name][0]
    df = read_log(tr.out_path)
    idx = index(df)
    for key, t in seen.items():
        if key[2] % 2 == 0:  # (step 4's fc2 row: the new layer's output)
            assert_row(df, idx, key, [t])
    assert {k[2] for k in idx if k[0] == "fc2" and k[1] == "Activation"} == {0, 2, 4}


class _ToDouble(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


def test_a_forgotten_step_warns_at_the_exact_observation(tmp_path):
    """The tracker hands its rows over counted at its largest layout (here float64's) while
    that bound cannot reach ``warn_pending_bytes``: the warning still comes at the first
    observation whose exact bytes (float32 and float64 rows mixed) pass it. (The fused
    path: its hooks keep their rows and hand them over together.)"""
    _interpreted_only("fused")
    net = nn.Sequential(nn.Linear(4, 4), _ToDouble())
    with (
        kernel.cpu_path("fused"),
        track(net, out=tmp_path / "log", track_weights=False, verbose=False) as tr,
    ):
        with torch.no_grad():
            net(torch.randn(2, 4))
        rec = tr.recorder
        assert rec is not None
        sizes = [8 * lay.size for _, lay, _ in rec.buffer.pending]  # (a forward's rows)
        assert len(set(sizes)) == 2  # float32 and float64 rows
        warn = 20 * max(sizes) + 1  # (several hand-overs counted at the bound first)
        rec.buffer.warn_pending_bytes = warn
        rec.buffer.max_pending_bytes = 1000 * max(sizes)
        total, expected = sum(sizes), None
        n = len(sizes)
        while expected is None:  # the exact count at which the warning is due
            for b in sizes:
                total += b
                n += 1
                if total > warn:
                    expected = n
                    break
        with pytest.warns(RuntimeWarning, match=rf"^tandv: {expected} tensor observations"):
            with torch.no_grad():
                for _ in range(expected // len(sizes) + 1):
                    net(torch.randn(2, 4))
                    assert tr.recorder is rec  # (hands the hooks' rows over)


def test_unscheduled_steps_run_without_hooks(monkeypatch):
    """Hooks exist only during scheduled steps, and nothing is summarized outside them."""
    calls = []
    real = Workspace.summaries
    monkeypatch.setattr(Workspace, "summaries", lambda self, *a: calls.append(1) or real(self, *a))
    net, opt = make()

    def hooks():
        return (
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())
            + len(opt._optimizer_step_pre_hooks)
            + len(nn.modules.module._global_forward_pre_hooks)
        )

    with track(net, opt, out="log", schedule=[0, 3]) as tr:
        assert hooks() > 0
        train(net, opt, 1, tr)  # step 0
        n0 = len(calls)
        assert n0 > 0 and hooks() == 0  # step 1 is not scheduled
        train(net, opt, 2, tr)  # steps 1 and 2
        assert len(calls) == n0 and hooks() > 0  # step 3 is
        train(net, opt, 1, tr)
        assert len(calls) > n0
    assert hooks() == 0
    assert sorted(set(read_log(tr.out_path)[("metadata", "step")])) == [0, 3]


@pytest.mark.parametrize("path", ["ops", "fused"])
def test_no_host_sync_inside_hooks(monkeypatch, path):
    """Forward, backward and the optimizer update run with every host-sync method disabled.

    These are the paths accelerator tensors take (forced here on CPU): the fused kernel,
    and the torch-op path of float64 and tensor subclasses; CPU tensors take the host
    path, which reads reduced values because on the CPU that waits for nothing. On a GPU,
    test_torch_fused.py runs the fused path on CUDA tensors under CUDA's sync debug mode
    set to raise."""
    _interpreted_only(path)
    net, opt = make(0, torch.optim.SGD, momentum=0.9)

    def forbidden(*a, **k):
        raise AssertionError("host sync inside a hook")

    with kernel.cpu_path(path), track(net, opt, out="log") as tr:
        for i in range(2):
            x, y = batch(i)
            with monkeypatch.context() as m:
                for attr in ("item", "cpu", "tolist", "numpy", "__bool__"):
                    m.setattr(torch.Tensor, attr, forbidden)
                opt.zero_grad()
                F.mse_loss(net(x), y).backward()
                opt.step()
            tr.step()
    df = read_log(tr.out_path)
    assert set(df[("metadata", "tensor_type")]) == set(KINDS)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: tuple
    mask: torch.Tensor | None = None


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 4)

    def forward(self, x):
        h = self.enc(x)
        return {
            "logits": h * 2,
            "aux": (h.sum(-1), [h.exp()]),
            "ids": h.argmax(-1),
            "out": Out(h + 1, (h - 1,), mask=torch.ones(3, dtype=torch.bool)),
        }


def test_structured_outputs_are_flattened_with_unambiguous_names():
    torch.manual_seed(0)
    net = DictNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(5, 6)
    with track(net, opt, out="log") as tr:
        out = net(x)
        seen = []  # the gradient as autograd computes it (its rounding depends on the CPU)
        out["logits"].register_hook(lambda g: seen.append(g.clone()))
        loss = out["logits"].pow(2).mean() + out["aux"][1][0].mean() + out["out"].logits.sum()
        loss.backward()
        h = net.enc(x).detach()  # before the update
        opt.step()
        tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    acts = {n for (n, t, s) in idx if t == "Activation"}
    assert acts == {
        "enc",
        "root[logits]",
        "root[aux][0]",
        "root[aux][1][0]",
        "root[out][logits]",
        "root[out][hidden][0]",
    }
    assert_row(df, idx, ("root[aux][1][0]", "Activation", 0), [h.exp()])
    assert_row(df, idx, ("root[out][hidden][0]", "Activation", 0), [h - 1])
    # gradient of the loss w.r.t. outputs that take part in it
    torch.testing.assert_close(seen[0], 2 * (h * 2) / h.numel())
    assert_row(df, idx, ("root[logits]", "Gradient", 0), seen)
    assert ("root[aux][0]", "Gradient", 0) not in idx  # not used by the loss: no gradient


def test_eval_forwards_are_skipped_unless_asked():
    for track_eval in (False, True):
        net, opt = make()
        cap = Capture(net)
        with track(net, opt, out=f"log{track_eval}", track_eval=track_eval) as tr:
            x, y = batch(0)
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            net.eval()
            with torch.no_grad():
                ev = net(batch(1)[0]).detach()
            net.train()
            opt.step()
            tr.step()
        df = read_log(tr.out_path)
        idx = index(df)
        expected = cap.acts["root"] + ([ev] if track_eval else [])
        assert_row(df, idx, ("root", "Activation", 0), expected)
        assert_row(df, idx, ("root", "Gradient", 0), cap.grads["root"])


class InplaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        h.mul_(2).add_(1)  # in place on a hooked module's output
        return self.fc2(F.relu(h))


def test_inplace_ops_after_a_hooked_module_keep_autograd_correct():
    torch.manual_seed(0)
    ref = InplaceNet()
    net = InplaceNet()
    net.load_state_dict(ref.state_dict())
    cap = Capture(ref)
    x, y = batch(0)
    F.mse_loss(ref(x), y).backward()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with track(net, opt, out="log") as tr:
        F.mse_loss(net(x), y).backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.step()
        tr.step()
    for n, p in ref.named_parameters():
        assert torch.equal(grads[n], p.grad)
    df = read_log(tr.out_path)
    idx = index(df)
    # the gradient w.r.t. fc1's output as produced (before the in-place ops)
    pre = ref.fc1(x).detach()
    h = pre * 2 + 1
    out = ref.fc2(h.relu())
    g_out = 2 * (out - y) / out.numel()
    g_pre = (g_out @ ref.fc2.weight) * (h > 0) * 2
    torch.testing.assert_close(cap.grads["fc1"][0], g_pre.detach())
    assert_row(df, idx, ("fc1", "Gradient", 0), cap.grads["fc1"])


def test_bad_arguments_name_the_argument():
    net, opt = make()
    with pytest.raises(TypeError, match="module"):
        track("not a module")
    with pytest.raises(TypeError, match="optimizer"):
        track(net, "adam")
    with pytest.raises(ValueError, match="every"):
        track(net, every=0)
    with pytest.raises(ValueError, match="out_format"):
        track(net, out_format="csv")
    with pytest.raises(ValueError, match="unknown number format"):
        track(net, number_format="float7")
    with pytest.raises(ValueError, match="stats_merge"):
        track(net, stats_merge={"x": "median"})
    with pytest.raises(ValueError, match="include"):
        track(net, include="(")
    tr = track(net, opt, out="log")
    with pytest.raises(RuntimeError, match="outside"):
        tr.step()


def test_run_without_steps_writes_a_valid_empty_log():
    net, opt = make()
    with track(net, opt, out="log") as tr:
        pass
    df = read_log(tr.out_path)
    assert len(df) == 0
    validate(df)


def test_pickle_format_and_default_folder_printed_once(capfd):
    net, opt = make()
    with track(net, opt, out_format="pickle") as tr:
        train(net, opt, 2, tr)
    err = capfd.readouterr().err
    assert tr.out_path.suffix == ".pkl" and tr.out_path.is_file()
    assert tr.out_path.parent == Path("tandv_logs") and tr.out_path.name.startswith("net-")
    assert err.count(str(tr.out_path)) == 1
    assert list(Path("tandv_logs").iterdir()) == [tr.out_path]
    assert sorted(set(read_log(tr.out_path, trust_pickle=True)[("metadata", "step")])) == [0, 1]


def test_streaming_writes_part_files_during_the_run():
    net, opt = make()
    with track(net, opt, out="log", flush_every=2) as tr:
        train(net, opt, 5, tr)
        deadline = time.monotonic() + 10  # parts are written by the recorder's writer thread
        while len(list(Path("log").glob("*.parquet"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        parts = sorted(p.name for p in Path("log").glob("*.parquet"))
        assert parts == ["part-000000.parquet", "part-000001.parquet"]
        assert sorted(set(read_log("log")[("metadata", "step")])) == [0, 1, 2, 3]
    assert len(list(Path("log").glob("*.parquet"))) == 3
    assert sorted(set(read_log(tr.out_path)[("metadata", "step")])) == [0, 1, 2, 3, 4]


def test_selection_by_regex_and_module_type_applies_to_every_type():
    for options, expect in [
        ({"include": r"^fc1"}, lambda n: n.startswith("fc1")),
        ({"exclude": "Linear"}, lambda n: n in ("root", "act")),
        ({"include": nn.Tanh}, lambda n: n == "act"),
        ({"include": [r"\.bias"], "exclude": ["fc2"]}, lambda n: n.startswith("fc1.bias")),
    ]:
        net, opt = make()
        with track(net, opt, verbose=False, **options) as tr:
            train(net, opt, 2, tr)
            plan = tr.plan()  # optimizer state exists now
        df = read_log(tr.out_path)
        names = set(df[("metadata", "name")])
        assert names and all(expect(n) for n in names), (options, names)
        logged = set(zip(df[("metadata", "name")], df[("metadata", "tensor_type")]))
        assert set(zip(plan["name"], plan["tensor_type"])) == logged


def test_dry_run_plan_lists_what_will_be_tracked_without_training():
    net, opt = make()
    tr = track(net, opt, track_optimizer=False)
    plan = tr.plan()
    assert set(zip(plan["name"], plan["tensor_type"])) == (
        {(n, "Activation") for n in MODULES}
        | {(n, "Gradient") for n in MODULES + PARAMS}
        | {(n, "Weight") for n in PARAMS}
    )
    assert not Path("tandv_logs").exists()  # nothing written


def test_custom_statistics_and_merge_rules(any_path):
    def frac_pos(t):
        return {"frac_pos": (t > 0).float().mean(), "peak": t.abs().amax()}

    net, opt = make()
    cap = Capture(net)
    rec = []
    with track(net, opt, out="log", stats=[frac_pos], stats_merge={"peak": "max"}) as tr:
        train(net, opt, 1, tr, cap, rec, micro=2)
    df = read_log(tr.out_path)
    idx = index(df)
    a, b = cap.acts["fc1"]
    row = df.iloc[idx[("fc1", "Activation", 0)]]
    both = torch.cat([a.flatten(), b.flatten()])
    assert row[("scalar_stats", "frac_pos")] == pytest.approx(float((both > 0).float().mean()))
    assert row[("scalar_stats", "peak")] == pytest.approx(float(both.abs().max()))
    w = rec[0]["weights"]["fc2.weight"]
    wrow = df.iloc[idx[("fc2.weight", "Weight", 0)]]
    assert wrow[("scalar_stats", "frac_pos")] == pytest.approx(float((w > 0).float().mean()))
    with pytest.raises(TypeError, match="mapping"):
        with track(net, opt, out="log2", stats=lambda t: t.mean()) as tr:
            train(net, opt, 1, tr)


def test_number_format_sets_exponent_bins_for_every_tensor(any_path):
    net, opt = make()
    cap = Capture(net)
    rec = []
    with track(net, opt, out="log", number_format="float8_e4m3fn") as tr:
        train(net, opt, 1, tr, cap, rec)
    df = read_log(tr.out_path)
    idx = index(df)
    assert_row(df, idx, ("fc1", "Activation", 0), cap.acts["fc1"], fmt="float8_e4m3fn")
    assert_row(
        df, idx, ("fc1.weight", "Weight", 0), [rec[0]["weights"]["fc1.weight"]], fmt="float8_e4m3fn"
    )
    labels = {c[1] for c in df.columns if c[0] == "exponent_counts"}
    assert labels <= {"-inf", "+inf", *range(-9, 9)}
    assert df[("exponent_counts", "-inf")].sum() > 0  # small gradients underflow float8


def test_bfloat16_module_rows_carry_their_dtype(any_path):
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    cap = Capture(net)
    with track(net, opt, out="log") as tr:
        x, y = batch(0)
        F.mse_loss(net(x.bfloat16()), y.bfloat16()).backward()
        opt.step()
        tr.step()
    df = read_log(tr.out_path)
    assert set(df[("metadata", "dtype")]) == {"bfloat16"}
    idx = index(df)
    row = df.iloc[idx[("fc1", "Activation", 0)]]
    ref, layout = summarize(cap.acts["fc1"][0].float().numpy().astype("float32"), "bfloat16")
    stats, counts = finalize(ref, layout)
    assert row[("scalar_stats", "rm2")] == pytest.approx(stats["rm2"], rel=1e-6)
    assert counts[1] == row.get(("exponent_counts", -133), 0)  # bf16 subnormal range: -133..
    assert exponent_labels("bfloat16")[1] == -133


def test_tracker_cannot_be_reused_and_close_is_idempotent():
    net, opt = make()
    tr = track(net, opt, out="log")
    with tr:
        train(net, opt, 1, tr)
    assert tr.close() == tr.out_path  # a second close returns the path, as JAX's does
    with pytest.raises(RuntimeError, match="already"):
        tr.__enter__()
    assert re.search("log$", str(tr.out_path))
    assert track(net, opt, out="never").close() is None  # never started: nothing written


class CheckpointNet(Net):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.fc1, x, use_reentrant=self.reentrant)
        return self.fc2(self.act(h))


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_recompute_is_not_counted_twice(reentrant, any_path):
    """Activations are counted once, and the gradients of outputs inside a checkpointed
    block are logged in both modes (reentrant checkpointing runs the first forward without
    grad: its gradients flow through the recomputed outputs)."""
    torch.manual_seed(0)
    net = CheckpointNet(reentrant)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = batch(0)
    x.requires_grad_(True)
    h = F.linear(x, net.fc1.weight, net.fc1.bias)  # the same computation, not via the module
    h.retain_grad()
    F.mse_loss(net.fc2(net.act(h)), y).backward()
    opt.zero_grad()
    with track(net, opt, out="log") as tr:
        F.mse_loss(net(x), y).backward()
        opt.step()
        tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    assert_row(df, idx, ("fc1", "Activation", 0), [h.detach()])
    assert_row(df, idx, ("fc1", "Gradient", 0), [h.grad])


def test_tensor_type_switches_and_root_name():
    net, opt = make()
    with track(
        net, opt, out="log", track_activations=False, track_optimizer=False, root_name="model"
    ) as tr:
        train(net, opt, 2, tr)
    df = read_log(tr.out_path)
    pairs = set(zip(df[("metadata", "name")], df[("metadata", "tensor_type")]))
    assert {t for _, t in pairs} == {"Gradient", "Weight"}
    assert ("model", "Gradient") in pairs and ("root", "Gradient") not in pairs
    assert set(
        track(net, opt, track_gradients=False, track_weights=False).plan()["tensor_type"]
    ) == {"Activation", "Optimiser_State"}


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_step_with_a_closure_logs_the_gradients_of_that_update(how):
    """``optimizer.step(closure)`` (PyTorch Lightning's way) computes the gradients inside
    the step: the rows hold those, not the previous step's."""
    net, opt = make(0, torch.optim.SGD, momentum=0.9)
    used = []
    with track(net, opt, out="log") as tr:
        for i in range(3):
            x, y = batch(i)

            def closure(x=x, y=y):  # bind this iteration's batch
                opt.zero_grad()
                loss = F.mse_loss(net(x), y)
                loss.backward()
                return loss

            opt.step(closure) if how == "positional" else opt.step(closure=closure)
            used.append({n: p.grad.clone() for n, p in net.named_parameters()})
            tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(3):
        for name in PARAMS:
            assert_row(df, idx, (name, "Gradient", k), [used[k][name]])


def test_lbfgs_closure_called_several_times():
    net, opt = make(0, torch.optim.LBFGS, lr=0.5, max_iter=3)
    x, y = batch(0)
    last = {}

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        last.update({n: p.grad.clone() for n, p in net.named_parameters()})
        return loss

    with track(net, opt, out="log", track_activations=False) as tr:
        opt.step(closure)
        tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    for name in PARAMS:  # the gradient of the closure's last call
        assert_row(df, idx, (name, "Gradient", 0), [last[name]])


class _AcceleratedLike(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: an Optimizer subclass that never runs
    ``Optimizer.__init__`` (so it has no hook registry) and forwards to ``.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


class _LightningLike:
    """Like Lightning's LightningOptimizer: not an Optimizer, wraps ``_optimizer``."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def state(self):
        return self._optimizer.state

    def step(self, closure=None):
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self._optimizer.zero_grad(set_to_none)


@pytest.mark.parametrize("wrap", [_AcceleratedLike, _LightningLike])
def test_wrapped_optimizers_are_tracked_through_what_they_wrap(wrap):
    net, opt = make()
    rec = []
    wrapped = wrap(opt)
    with track(net, wrapped, out="log") as tr:
        train(net, wrapped, 2, tr, record=rec)
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(2):
        for name in PARAMS:
            assert_row(df, idx, (name, "Gradient", k), [rec[k]["grads"][name]])
            assert_row(
                df,
                idx,
                (f"{name}.exp_avg", "Optimiser_State", k),
                [rec[k]["state"][f"{name}.exp_avg"]],
            )
    with pytest.raises(TypeError, match="optimizer=.*got object"):
        track(net, object())


def test_a_failed_start_leaves_no_hook(monkeypatch):
    net, opt = make()

    def refuse(*a, **k):
        raise RuntimeError("no hooks here")

    monkeypatch.setattr(torch.optim.Optimizer, "register_step_pre_hook", refuse)
    with pytest.raises(RuntimeError, match="no hooks here"):
        with track(net, opt, out="log"):
            pass
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


_THREADS = """
import torch
torch.set_num_threads({torch_threads})
{numba_setup}
from tandv.track.torch import track
net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))
opt = torch.optim.Adam(net.parameters())
with track(net, opt, out="log", verbose=False) as tr:
    for _ in range(2):
        net(torch.randn(512, 512)).square().mean().backward()
        opt.step(); opt.zero_grad(); tr.step()
import numba
print(torch.get_num_threads(), numba.get_num_threads())
"""


@pytest.mark.parametrize("torch_threads, numba_threads", [(1, None), (2, 1)])
def test_tracking_leaves_thread_settings_as_found(tmp_path, torch_threads, numba_threads):
    """numba's OpenMP threading layer, starting inside the first tracked step, used to
    reset torch's thread count (1 became 2), which changes training's numerics."""
    setup = "" if numba_threads is None else f"import numba; numba.set_num_threads({numba_threads})"
    code = _THREADS.format(torch_threads=torch_threads, numba_setup=setup)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got_torch, got_numba = map(int, run.stdout.split()[-2:])
    assert got_torch == torch_threads
    if numba_threads is not None:
        assert got_numba == numba_threads


def test_a_module_seen_in_two_dtypes_in_one_step_gives_one_row(any_path):
    """A shared module fed float32 and (under autocast) bfloat16 in one step: its rows
    merge into the widest dtype's layout, exactly (the log used to be lost at close)."""
    torch.manual_seed(0)
    net = nn.Linear(6, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(5, 6)
    with track(net, opt, out="log", track_gradients=False) as tr:
        y32 = net(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y16 = net(x)
        (y32.sum() + y16.float().sum()).backward()
        opt.step()
        tr.step()
    df = read_log(tr.out_path)
    rows = df[df[("metadata", "tensor_type")] == "Activation"]
    assert len(rows) == 1 and rows[("metadata", "dtype")].iloc[0] == "float32"
    row = rows.iloc[0]
    layout = summarize(np.zeros(1, np.float32))[1]
    parts = [
        summarize(y32.detach().numpy())[0],
        summarize(y16.detach().float().numpy().astype(np.float32), "float32")[0],
    ]
    stats, counts = finalize(merge_all(parts, layout), layout)
    for s in DEFAULT_STATS:
        assert row[("scalar_stats", s)] == pytest.approx(stats[s], rel=1e-6), s
    labels = exponent_labels("float32")
    got = {
        lab: row[("exponent_counts", lab)]
        for lab in labels
        if ("exponent_counts", lab) in row.index
    }
    assert all(got.get(lab, 0) == c for lab, c in zip(labels, counts))


def test_weights_are_those_of_the_forward_when_the_root_is_never_called():
    """A loop that calls submodules directly and updates weights by hand (no root forward,
    no optimizer): Weight rows hold the weights the step's forward used, not the updated ones."""
    net, _ = make()
    before = []
    with track(net, out="log", track_activations=False, track_gradients=False) as tr:
        for i in range(2):
            x, y = batch(i)
            before.append({n: p.detach().clone() for n, p in net.named_parameters()})
            loss = F.mse_loss(net.fc2(net.act(net.fc1(x))), y)
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(2):
        for name in PARAMS:
            assert_row(df, idx, (name, "Weight", k), [before[k][name]])


@pytest.mark.parametrize("explicit_unscale", [True, False])
def test_grad_scaler_skipped_steps_keep_their_gradient_rows(explicit_unscale):
    """With ``scaler=``, gradients are unscaled in the rows, and the step the scaler skips
    (an inf gradient) keeps its gradient rows, infinities included, although the docs'
    order zeroes the gradients before ``tracker.step()``."""
    net, opt = make(0, torch.optim.SGD)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    seen = []
    with track(net, opt, out="log", scaler=scaler, track_activations=False) as tr:
        for i in range(3):
            x, y = batch(i)
            if i == 1:
                x[0, 0] = float("inf")  # NaN gradients (0 * inf) in the backward pass
            opt.zero_grad()
            scaler.scale(F.mse_loss(net(x), y)).backward()
            if explicit_unscale:
                scaler.unscale_(opt)
            grads = {
                n: p.grad.clone() / (1.0 if explicit_unscale else scaler.get_scale())
                for n, p in net.named_parameters()
            }
            seen.append(grads)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            tr.step()
    assert scaler.get_scale() < 2.0**8  # step 1 was skipped
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(3):
        for name in PARAMS:
            if torch.isfinite(seen[k][name]).all():
                assert_row(df, idx, (name, "Gradient", k), [seen[k][name]])
            else:  # the skipped step's non-finite gradients, as they were
                assert k == 1
                row = df.iloc[idx[(name, "Gradient", 1)]]
                want = (~torch.isfinite(seen[k][name])).sum().item()
                assert (
                    row[("scalar_stats", "inf_count")] + row[("scalar_stats", "nan_count")] == want
                )
    assert "unscale_" not in scaler.__dict__  # the wrapper is gone after the run
    from tandv.schema import run_record

    assert run_record(df)["options"]["loss_scaled_output_gradients"] is True  # marked in the log
    # output-gradient rows hold the scale they are multiplied by: 2**8, then halved after the skip
    out_grads = df[
        (df[("metadata", "tensor_type")] == "Gradient") & df[("metadata", "name")].isin(MODULES)
    ]
    by_step = pd.Series(
        out_grads[("scalar_stats", "loss_scale")].to_numpy(),
        index=out_grads[("metadata", "step")].to_numpy(),
    )
    scales = by_step.groupby(level=0).agg(["min", "max"])
    assert scales["min"].tolist() == scales["max"].tolist() == [256.0, 256.0, 128.0]
    params = df[df[("metadata", "name")].isin(PARAMS)]
    assert params[("scalar_stats", "loss_scale")].isna().all()  # parameter gradients are unscaled


def test_buffers_are_tracked_on_request():
    """BatchNorm's running statistics as Weight rows, as each step's forward found them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []
    with track(net, opt, out="log", track_buffers=True, track_activations=False) as tr:
        assert {"1.running_mean", "1.running_var"} <= set(tr.plan()["name"])
        for i in range(3):
            x, y = batch(i)
            seen.append({k: getattr(net[1], k).clone() for k in ("running_mean", "running_var")})
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            opt.step()
            tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(3):
        for b in ("running_mean", "running_var"):
            assert_row(df, idx, (f"1.{b}", "Weight", k), [seen[k][b]])
    assert not any(
        "num_batches_tracked" in n for n in df[("metadata", "name")]
    )  # an integer buffer
    with track(net, opt, out="log2") as tr:
        train(net, opt, 1, tr)
    assert not any("running" in n for n in read_log(tr.out_path)[("metadata", "name")])


def test_optimizer_state_replaced_between_steps_is_the_one_recorded(any_path):
    """The tracker keeps the list of state tensors between steps: state values replaced
    by new tensors and a state reloaded (the old tensors still alive) are the ones
    summarized at the next step."""
    net, opt = make()
    rec = []
    with track(net, opt, out="log") as tr:
        train(net, opt, 2, tr)
        old = [state["exp_avg"] for state in opt.state.values()]  # kept alive
        for state in opt.state.values():
            state["exp_avg"] = state["exp_avg"] * 3.0 + 1.0
        train(net, opt, 1, tr, record=rec)
        old.append(opt.state_dict())
        opt.load_state_dict(opt.state_dict())  # new state dicts of copies
        for state in opt.state.values():
            state["exp_avg_sq"].mul_(5.0)
        train(net, opt, 1, tr, record=rec)
    df = read_log(tr.out_path)
    idx = index(df)
    for step, r in zip((2, 3), rec):
        for name, value in r["state"].items():
            assert_row(df, idx, (name, "Optimiser_State", step), [value])
