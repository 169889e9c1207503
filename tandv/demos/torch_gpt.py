"""A small GPT-style decoder in plain PyTorch, shared by the demo and the benchmarks.

Parameter names follow the common Llama-like layout so that log rows read naturally:
``embed.weight``, ``layers.0.attention.wq.weight``, ``layers.0.mlp.fc1.weight``,
``norm.weight``, ``head.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Attention", "MLP", "Block"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the decoder. The defaults are the benchmark's small configuration."""

    vocab_size: int = 512
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_mlp: int = 1024

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")


class Attention(nn.Module):
    """Causal multi-head self-attention with separate query/key/value/output projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), is_causal=True
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Two-layer feed-forward block with a GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_mlp)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.d_mlp, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.d_model)
        self.attention = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer: token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:  # Embedding has no bias
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.cfg.seq_len}")
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens`` against ``targets`` (same shape)."""
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
