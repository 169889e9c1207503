"""JAX/Flax demo: a small transformer learns to reverse sequences, tracked by tandv.

``tandv demo --framework jax`` calls :func:`run`. The task is synthetic (no downloads): each
example is a random token sequence and the target is the same sequence reversed, which a
two-layer transformer learns within a few hundred steps on a laptop CPU. Everything is
tracked every step: weights, gradients, Adam state, module outputs and their cotangents.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm

from tandv.track.jax import track

__all__ = ["Transformer", "run", "DEFAULT_STEPS"]

#: Training steps when the caller does not choose.
DEFAULT_STEPS = 300
VOCAB, SEQ, BATCH = 16, 12, 32


class Block(nn.Module):
    """Pre-norm transformer block: self-attention and an MLP, each with a residual."""

    dim: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(h)
        h = nn.LayerNorm(name="ln2")(x)
        h = nn.Dense(4 * self.dim, name="mlp_in")(h)
        return x + nn.Dense(self.dim, name="mlp_out")(nn.gelu(h))


class Transformer(nn.Module):
    """Token + position embedding, ``depth`` blocks, a final norm and a vocabulary head."""

    vocab: int = VOCAB
    dim: int = 64
    heads: int = 4
    depth: int = 2

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        pos = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (tokens.shape[-1], self.dim)
        )
        x = nn.Embed(self.vocab, self.dim, name="embed")(tokens) + pos
        for i in range(self.depth):
            x = Block(self.dim, self.heads, name=f"layers_{i}")(x)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="ln_f")(x))


def _batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(key, (BATCH, SEQ), 0, VOCAB)
    return tokens, tokens[:, ::-1]


def run(
    steps: int | None = None, out: str | os.PathLike | None = None, seed: int = 0, *, depth: int = 2
) -> Path:
    """Train the demo transformer for ``steps`` steps, tracking everything; returns the log path.

    Arguments:
        steps: training steps (default :data:`DEFAULT_STEPS`).
        out: log path (default: a new folder under ``tandv_logs/``).
        seed: seeds the initialization and the data.
        depth: transformer blocks (fewer compile faster).
    """
    steps = DEFAULT_STEPS if steps is None else steps
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected an int >= 1")
    model = Transformer(depth=depth)
    opt = optax.adamw(3e-3, weight_decay=1e-4)
    key = jax.random.key(seed)
    params = model.init(key, jnp.zeros((1, SEQ), jnp.int32))
    opt_state = opt.init(params)

    def loss_fn(p: dict, tokens: jax.Array, target: jax.Array) -> jax.Array:
        logits = model.apply(p, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()

    @jax.jit
    def update(p: dict, s: optax.OptState, key: jax.Array) -> tuple[Any, Any, Any, jax.Array]:
        tokens, target = _batch(key)
        loss, grads = jax.value_and_grad(loss_fn)(p, tokens, target)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, grads, loss

    with track(params, opt_state, out=out, run_name="jax-demo", track_updates=True) as tracker:
        bar = tqdm(range(steps), desc="tandv jax demo", unit="step")
        for step in bar:
            params, opt_state, grads, loss = tracker.intercept(
                update, params, opt_state, jax.random.fold_in(key, step)
            )
            tracker.log_scalars(loss=loss, lr=3e-3)
            tracker.step(params, opt_state, grads)
            if step % 20 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{float(loss):.3f}")
    assert tracker.out_path is not None  # set when the `with` block opened the log
    return Path(tracker.out_path)
