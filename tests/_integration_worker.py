"""The per-rank program of the multi-process tests in tests/test_integrations.py (torchrun,
gloo, CPU): ``python -m torch.distributed.run --nproc_per_node 2 _integration_worker.py
FRAMEWORK OUT`` trains under Lightning's or the HuggingFace Trainer's DDP with tandv's
callback (``distributed=True``: every rank tracks, rank 0 writes the merged log to
``OUT/log``), and each rank saves what a spy callback saw (its first layer's outputs per
update, and the gradients and weights of each update) to ``OUT/spy<rank>.pt``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 3


def lightning(out: Path) -> tuple[int, dict[str, Any]]:
    import lightning.pytorch as pl

    from tandv.integrations.lightning import TandvCallback

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class Spy(pl.Callback):
        def __init__(self) -> None:
            self.seen: dict[str, list[Any]] = {"activations": [], "grads": [], "weights": []}

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            self.seen["weights"].append(
                {n: p.detach().clone() for n, p in module.named_parameters()}
            )
            first = module.net[0]  # its output, computed without calling it (tandv's hooks)
            self.seen["activations"].append(F.linear(batch[0], first.weight, first.bias).detach())

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.seen["grads"].append({n: p.grad.clone() for n, p in module.named_parameters()})

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
    )
    spy = Spy()
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TandvCallback(out=out / "log", verbose=False, distributed=True), spy],
        default_root_dir=out,
    )
    trainer.fit(Lit(), torch.utils.data.DataLoader(data, batch_size=4))
    return trainer.global_rank, spy.seen


def tiny_gpt2(out: Path, steps: int, **arguments: Any) -> tuple[Any, list[dict[str, Any]], Any]:
    """A one-layer GPT-2 of width 16, its 16 training sequences of 8 tokens and the
    Trainer's arguments for ``steps`` updates on the CPU without logging, saving or progress
    bars (``arguments``: more TrainingArguments); shared with tests/test_integrations.py."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    g = torch.Generator().manual_seed(2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (16, 8), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **arguments,
    )
    return transformers.GPT2LMHeadModel(cfg), data, args


def hf(out: Path) -> tuple[int, dict[str, Any]]:
    import transformers

    from tandv.integrations.hf import TandvCallback

    class Spy(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.seen: dict[str, list[Any]] = {"grads": []}

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            model = kw["model"]
            self.seen["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})

    model, data, args = tiny_gpt2(out, STEPS, ddp_backend="gloo")
    spy = Spy()
    cb = TandvCallback(out=out / "log", verbose=False, distributed=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb, spy])
    trainer.train()
    return args.process_index, spy.seen


if __name__ == "__main__":
    framework, out = sys.argv[1], Path(sys.argv[2])
    rank, seen = {"lightning": lightning, "hf": hf}[framework](out)
    torch.save(seen, out / f"spy{rank}.pt")
    # a gloo group that ran collectives and is left to the interpreter's exit can abort the
    # process there (Lightning destroys its groups at exit only under NCCL)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
