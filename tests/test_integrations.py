"""The Lightning and HuggingFace Trainer callbacks, with the real frameworks on tiny models:
each log row is checked against the test's own capture (a callback of the framework)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _integration_worker import tiny_gpt2
from torch import nn

from tandv.schema import read_log
from tandv.stats.summary import DEFAULT_STATS, finalize, summarize


def assert_row(df, name, tensor_type, step, tensor):
    sel = df[
        (df[("metadata", "name")] == name)
        & (df[("metadata", "tensor_type")] == tensor_type)
        & (df[("metadata", "step")] == step)
    ]
    assert len(sel) == 1, (name, tensor_type, step)
    stats, _ = finalize(*summarize(tensor.detach().numpy()))
    for s in DEFAULT_STATS:
        got, want = sel.iloc[0][("scalar_stats", s)], stats[s]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-12, nan_ok=True), (name, step, s)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def test_lightning_callback_with_accumulation_and_closures(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from tandv.integrations.lightning import TandvCallback

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class Spy(pl.Callback):
        """The gradients right before each update, and the weights its forwards used."""

        def __init__(self):
            self.grads, self.weights = [], []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx % 2 == 0:
                self.weights.append({n: p.detach().clone() for n, p in module.named_parameters()})

        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.grads.append({n: p.grad.clone() for n, p in module.named_parameters()})

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(
            torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
        ),
        batch_size=4,
    )
    cb, spy = TandvCallback(out=tmp_path / "log", verbose=False), Spy()
    trainer = pl.Trainer(
        max_steps=3,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb, spy],
        default_root_dir=tmp_path,
    )
    trainer.fit(Lit(), data)
    df = read_log(cb.out_path)
    assert sorted(set(df[("metadata", "step")])) == [0, 1, 2]
    for k in range(3):
        for name in ("net.fc1.weight", "net.fc2.bias"):
            assert_row(df, name, "Gradient", k, spy.grads[k][name])
            assert_row(df, name, "Weight", k, spy.weights[k][name])
        act = df[
            (df[("metadata", "name")] == "net.fc1")
            & (df[("metadata", "step")] == k)
            & (df[("metadata", "tensor_type")] == "Activation")
        ]
        assert act[("scalar_stats", "numel")].item() == 2 * 4 * 8  # two micro-batches merged


def test_hf_trainer_callback_with_accumulation_and_accelerate(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tandv.integrations.hf import TandvCallback

    class Spy(transformers.TrainerCallback):
        """The gradients the optimizer sees (after clipping), right before each update."""

        def __init__(self):
            self.grads = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.append({n: p.grad.clone() for n, p in model.named_parameters()})

    model, data, args = tiny_gpt2(tmp_path, 3, gradient_accumulation_steps=2)
    cb, spy = TandvCallback(out=tmp_path / "log", verbose=False), Spy()
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb, spy]).train()
    df = read_log(cb.out_path)
    assert sorted(set(df[("metadata", "step")])) == [0, 1, 2]
    assert cb.tracker is not None and type(cb.tracker.optimizers[0]).__name__ == "AdamW"
    for k in range(3):
        for name in ("transformer.h.0.attn.c_attn.weight", "transformer.wpe.weight"):
            assert_row(df, name, "Gradient", k, spy.grads[k][name])
    states = set(df[df[("metadata", "tensor_type")] == "Optimiser_State"][("metadata", "name")])
    assert "transformer.h.0.mlp.c_fc.weight.exp_avg_sq" in states


def test_callbacks_refuse_a_model_or_optimizer_argument():
    pytest.importorskip("lightning.pytorch")
    from tandv.integrations.lightning import TandvCallback

    with pytest.raises(TypeError, match="keyword options"):
        TandvCallback(optimizer=None)


def _launch(framework: str, out: Path) -> list[dict]:
    """Run tests/_integration_worker.py FRAMEWORK under torchrun on 2 CPU processes (gloo);
    the spy captures of rank 0 and rank 1."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(here / "_integration_worker.py"), framework, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out / f"spy{rank}.pt") for rank in (0, 1)]


def test_lightning_ddp_merges_the_ranks_into_one_log(tmp_path):
    """Lightning's DDP on 2 processes with ``TandvCallback(distributed=True)``: one log,
    written by rank 0, whose activation rows summarize both ranks' batches together and
    whose weight and gradient rows are the (replicated) tensors each rank saw."""
    pytest.importorskip("lightning.pytorch")
    spies = _launch("lightning", tmp_path)
    assert sorted(p.name for p in (tmp_path / "log").iterdir()) == ["part-000000.parquet"]
    df = read_log(tmp_path / "log")
    assert sorted(set(df[("metadata", "step")])) == [0, 1, 2]
    for k in range(3):
        both = torch.cat([spy["activations"][k] for spy in spies])
        assert both.shape[0] == 8  # each rank's own batch of 4
        assert_row(df, "net.0", "Activation", k, both)
        for name in ("net.0.weight", "net.2.bias"):
            torch.testing.assert_close(spies[0]["grads"][k][name], spies[1]["grads"][k][name])
            assert_row(df, name, "Gradient", k, spies[0]["grads"][k][name])
            assert_row(df, name, "Weight", k, spies[0]["weights"][k][name])


def test_hf_trainer_ddp_merges_the_ranks_into_one_log(tmp_path):
    """The HuggingFace Trainer under torchrun (DDP, 2 processes) with
    ``TandvCallback(distributed=True)``: one log with the parameters' names (no DDP
    ``module.`` prefix), gradients as each rank's optimizer saw them, and activations of
    both ranks' examples."""
    pytest.importorskip("transformers")
    spies = _launch("hf", tmp_path)
    df = read_log(tmp_path / "log")
    assert sorted(set(df[("metadata", "step")])) == [0, 1, 2]
    assert not any(n.startswith("module.") for n in df[("metadata", "name")])
    for k in range(3):
        for name in ("transformer.h.0.attn.c_attn.weight", "transformer.wpe.weight"):
            torch.testing.assert_close(spies[0]["grads"][k][name], spies[1]["grads"][k][name])
            assert_row(df, name, "Gradient", k, spies[0]["grads"][k][name])
        wte = df[
            (df[("metadata", "name")] == "transformer.wte")
            & (df[("metadata", "tensor_type")] == "Activation")
            & (df[("metadata", "step")] == k)
        ]
        assert wte[("scalar_stats", "numel")].item() == 2 * 2 * 8 * 16  # ranks x batch x seq x d


def test_hf_trainer_failure_keeps_completed_steps_removes_hooks_and_trains_again(tmp_path):
    """Training raises after two updates: the log holds those two steps (as the optimizer
    saw them), no tandv hook stays on the model, and ``train()`` runs again into a log of
    its own."""
    transformers = pytest.importorskip("transformers")
    from tandv.integrations.hf import TandvCallback

    class Spy(transformers.TrainerCallback):
        def __init__(self):
            self.grads = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.append({n: p.grad.clone() for n, p in model.named_parameters()})

    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("boom")

    def hooks(model):
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    model, data, args = tiny_gpt2(tmp_path, 4)
    cb, spy, boom = TandvCallback(out=tmp_path / "log", verbose=False), Spy(), Boom()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[cb, spy, boom]
    )
    before = (hooks(model), len(torch.nn.modules.module._global_forward_pre_hooks))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert (hooks(model), len(torch.nn.modules.module._global_forward_pre_hooks)) == before
    df = read_log(tmp_path / "log")
    assert sorted(set(df[("metadata", "step")])) == [0, 1]
    for k in range(2):
        assert_row(
            df,
            "transformer.h.0.attn.c_attn.weight",
            "Gradient",
            k,
            spy.grads[k]["transformer.h.0.attn.c_attn.weight"],
        )
    trainer.remove_callback(boom)
    spy.grads = []
    trainer.train()
    assert cb.out_path == tmp_path / "log-2"
    again = read_log(cb.out_path)
    assert sorted(set(again[("metadata", "step")])) == [0, 1, 2, 3]
    assert_row(
        again, "transformer.wpe.weight", "Gradient", 3, spy.grads[3]["transformer.wpe.weight"]
    )
    assert hooks(model) == before[0]


def test_lightning_manual_optimization_with_two_optimizers(tmp_path):
    """A GAN in Lightning's manual optimization: D's optimizer, then G's after a backward
    that also reaches D. One log step per batch; each parameter's gradient row is the one
    its own optimizer used (captured in the test's training_step)."""
    pl = pytest.importorskip("lightning.pytorch")
    from tandv.integrations.lightning import TandvCallback

    used = []

    class GAN(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.G = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 4))
            self.D = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))

        def training_step(self, batch, batch_idx):
            (real,) = batch
            opt_d, opt_g = self.optimizers()
            z = torch.randn(real.shape[0], 2, generator=torch.Generator().manual_seed(batch_idx))
            fake = self.G(z)
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            d_loss = F.binary_cross_entropy_with_logits(
                self.D(real), ones
            ) + F.binary_cross_entropy_with_logits(self.D(fake.detach()), zeros)
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            step = {f"D.{n}": p.grad.clone() for n, p in self.D.named_parameters()}
            opt_d.step()
            opt_g.zero_grad()
            self.manual_backward(F.binary_cross_entropy_with_logits(self.D(fake), ones))
            step |= {f"G.{n}": p.grad.clone() for n, p in self.G.named_parameters()}
            opt_g.step()
            used.append(step)

        def configure_optimizers(self):
            return (
                torch.optim.SGD(self.D.parameters(), lr=0.1),
                torch.optim.Adam(self.G.parameters(), lr=0.01),
            )

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 4, generator=torch.Generator())),
        batch_size=4,
    )
    cb = TandvCallback(out=tmp_path / "log", verbose=False)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        default_root_dir=tmp_path,
    )
    trainer.fit(GAN(), data)
    assert trainer.global_step == 8  # Lightning counts each optimizer's step
    df = read_log(cb.out_path)
    assert sorted(set(df[("metadata", "step")])) == [0, 1, 2, 3]  # one per batch
    for k in range(4):
        for name, g in used[k].items():
            assert_row(df, name, "Gradient", k, g)


def test_hf_trainer_torch_compile_with_the_callback(tmp_path):
    """``torch_compile=True``: the Trainer trains a compiled wrapper of the model the
    callback tracks. Training runs (it used to fail at the first step inside dynamo, which
    traced tandv's hooks into numba), no graph break comes from tandv, the gradient rows are
    those the optimizer saw, and the activations the graph hides are told once."""
    transformers = pytest.importorskip("transformers")
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tandv.integrations.hf import TandvCallback

    class Spy(transformers.TrainerCallback):
        def __init__(self):
            self.grads = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.append({n: p.grad.clone() for n, p in model.named_parameters()})

    torch._dynamo.reset()
    counters.clear()
    model, data, args = tiny_gpt2(tmp_path, 2, torch_compile=True, torch_compile_backend="eager")
    cb, spy = TandvCallback(out=tmp_path / "log", verbose=False), Spy()
    with pytest.warns(RuntimeWarning, match="no activation"):
        transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=[cb, spy]
        ).train()
    breaks = " ".join(counters["graph_break"])
    assert "tandv" not in breaks and "numba" not in breaks, breaks
    df = read_log(cb.out_path)
    for k in range(2):
        for name in ("transformer.h.0.attn.c_attn.weight", "transformer.wpe.weight"):
            assert_row(df, name, "Gradient", k, spy.grads[k][name])
    torch._dynamo.reset()
