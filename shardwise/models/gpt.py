"""A small GPT (nanoGPT-shaped), kept free of any parallelism.

Every parameter is initialised inside its own module's ``reset_parameters`` (GPT-2 style: normal(0, 0.02),
residual projections scaled by 1/sqrt(2 * n_layer), zero biases). That is what lets a model built on the
meta device and materialised module by module by ``shardwise.shard`` be bit-identical to one built eagerly
with the same seed: both consume the RNG in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level by default
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = True
    tie_weights: bool = False

    @property
    def num_params(self) -> int:
        d, v, t, l = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        b = 1 if self.bias else 0
        per_block = 12 * d * d + b * 11 * d + 2 * d  # attn qkv+proj, mlp fc+proj, 2 LayerNorms
        head = 0 if self.tie_weights else v * d
        return v * d + t * d + l * per_block + d + b * d + head


# name -> GPTConfig keyword arguments. Sizes in the names are approximate parameter counts.
PRESETS: dict[str, dict] = {
    "gpt-tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=128),
    "gpt-small": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),  # ~0.9M
    # The three sizes measured in ../shared/REFERENCE.md (vocabulary 8192, untied head).
    "gpt-34m": dict(n_layer=8, n_head=8, n_embd=512, block_size=256, vocab_size=8192),
    "gpt-170m": dict(n_layer=12, n_head=16, n_embd=1024, block_size=128, vocab_size=8192),
    "gpt-480m": dict(n_layer=16, n_head=16, n_embd=1536, block_size=128, vocab_size=8192),
    "gpt-1b": dict(n_layer=24, n_head=16, n_embd=2048, block_size=1024, vocab_size=50304),
    "gpt-1.5b": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304),
}


class GPTOutput(NamedTuple):
    logits: torch.Tensor
    loss: Optional[torch.Tensor]


class Linear(nn.Linear):
    """nn.Linear with GPT-2 initialisation done in reset_parameters (so meta init reproduces it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02, **kw):
        self.init_std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias, **kw)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = cfg.n_head
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """One transformer block: the natural FSDP unit."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPT":
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; valid: {', '.join(PRESETS)}")
        return cls(GPTConfig(**{**PRESETS[name], **overrides}))

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> GPTOutput:
        B, T = idx.shape  # (B, T) token ids
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return GPTOutput(logits, loss)
