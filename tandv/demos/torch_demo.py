"""``tandv demo``: train a small GPT on an embedded text for a few hundred steps on CPU,
tracking activations, gradients, weights, optimizer state and updates at every step, the loss,
learning rate and gradient norm beside them, and some of Taiyi's quantities every 10 steps.

No downloads: the task is next-character prediction on a short text embedded below.
:func:`run` returns the log's path; the CLI then prints a summary of the log.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ..taiyi.torch import Monitor
from ..track.torch import track
from .torch_gpt import GPT, GPTConfig

__all__ = ["run", "TEXT", "DEFAULT_STEPS", "TAIYI_CONFIG", "demo_config"]

#: Default number of training steps of the demo.
DEFAULT_STEPS = 300

#: The demo's training text (written for tandv; free to use).
TEXT = """\
To see what a network is doing while it learns, look at its numbers. Every layer passes
a tensor forward and receives a gradient backward; every weight moves a little at each
step, and the optimizer keeps running averages of what it has seen. When training goes
wrong, one of these numbers usually went wrong first: an activation that grew without
bound, a gradient that vanished below the smallest number the format can hold, a weight
that stopped moving, a second moment that collapsed to zero. Low precision formats make
this sharper. A float8 value has only a handful of exponents; anything smaller than its
smallest subnormal becomes zero and anything larger than its maximum becomes a saturated
or infinite value. Tracking the exponent of every element, step after step, shows at a
glance which tensors fit a format and which do not. The quick brown fox jumps over the
lazy dog, and the lazy dog, unbothered, goes back to sleep in the afternoon sun.
"""


def demo_config(vocab_size: int) -> GPTConfig:
    """The demo's model: 2 layers, d_model 64, 4 heads, context 64."""
    return GPTConfig(
        vocab_size=vocab_size, seq_len=64, d_model=64, n_layers=2, n_heads=4, d_mlp=256
    )


#: Taiyi's quantities the demo computes beside its log (Taiyi's config form), every 10 steps.
TAIYI_CONFIG = {
    torch.nn.Linear: [
        ["InputCovStableRank", "linear(10, 0)"],
        ["RankMe", "linear(10, 0)"],
        ["OutputGradSndNorm", "linear(10, 0)"],
    ]
}


def _batches(
    data: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        chunk = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def run(
    steps: int | None = None,
    out: str | os.PathLike | None = None,
    seed: int = 0,
    progress: bool = True,
    threads: int | None = 1,
) -> Path:
    """Train the demo model for ``steps`` steps (default :data:`DEFAULT_STEPS`), tracking
    everything at every step; returns the log path.

    Arguments:
        steps: number of training steps (>= 1).
        out: log path; default a new folder under ``tandv_logs/``.
        seed: seed of the model initialisation and the batch order.
        progress: show a progress bar (tqdm) with the loss.
        threads: torch CPU threads during the run (restored afterwards); ``None`` keeps the
            current setting. The default 1 is as fast for this small model and much faster
            on a busy machine, where multi-threaded small ops wait for each other.

    Raises:
        ValueError: if ``steps`` is not a positive int.
    """
    steps = DEFAULT_STEPS if steps is None else steps
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected an int >= 1")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(steps, out, seed, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _train(steps: int, out: str | os.PathLike | None, seed: int, progress: bool) -> Path:
    torch.manual_seed(seed)
    chars = sorted(set(TEXT))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lookup[c] for c in TEXT], dtype=torch.long)
    cfg = demo_config(len(chars))
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    batches = _batches(data, cfg.seq_len, 16, torch.Generator().manual_seed(seed))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="tandv demo", unit="step")
    t0 = time.perf_counter()
    with (
        track(model, opt, out=out, run_name="demo-torch", track_updates=True) as tracker,
        Monitor(model, TAIYI_CONFIG, out=tracker) as monitor,
    ):
        for step in range(steps):
            x, y = next(batches)
            loss = model.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            monitor.track(step)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            tracker.log_scalars(loss=loss, lr=sched.get_last_lr()[0], grad_norm=grad_norm)
            opt.step()
            sched.step()
            tracker.step()
            if bar is not None:
                bar.update(1)
                if step % 10 == 0 or step == steps - 1:
                    bar.set_postfix(loss=f"{loss.item():.3f}")
    if bar is not None:
        bar.close()
    print(
        f"tandv demo: {steps} steps in {time.perf_counter() - t0:.1f} s, "
        f"final loss {loss.item():.3f}"
    )
    assert tracker.out_path is not None  # set when the `with` block closed the log
    return Path(tracker.out_path)
