"""Small models for the test suite, each built to exercise one thing the engine must get right.

Sizes are chosen so that no unit's flat buffer divides evenly by the world sizes tested (2, 3, 4): every
shard boundary then falls inside some parameter and the last rank's shard ends in padding. ``test_plan``
checks that this stays true if someone edits the sizes.

Every model here is pure PyTorch; the loss functions take ``(model, x, y)`` so the parity helpers can
drive any of them the same way.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.models import GPT, Block, GPTConfig

# n_embd 25 (5 heads of 5), odd vocabulary-plus-positions: a Block holds 25 * (12 * 25 + 13) = 7825
# elements, the untied root 25 * (2 * 62 + 13 + 2) = 3475, the tied root 25 * (62 + 13 + 2) = 1925.
TINY_GPT = dict(vocab_size=62, block_size=13, n_layer=3, n_head=5, n_embd=25)
WORLD_SIZES = (2, 3, 4)  # the sizes no flat buffer may divide by


def tiny_gpt_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**TINY_GPT, **overrides})


def gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y).loss


class SkippableGPT(GPT):
    """A GPT whose forward can skip blocks: a unit that does not run at all in some steps."""

    def forward(self, idx, targets=None, skip: tuple[int, ...] = ()):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for i, block in enumerate(self.blocks):
            if i not in skip:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ---- a Linear shared by two different units ------------------------------------------------------------
class MiniBlock(nn.Module):
    """Residual MLP block; ``proj`` may be a Linear owned by another block (weights shared across units)."""

    def __init__(self, d: int, proj: nn.Linear | None = None):
        super().__init__()
        self.norm = nn.LayerNorm(d, bias=False)  # odd sizes: see the module docstring
        self.fc = nn.Linear(d, 2 * d + 1)
        self.out = nn.Linear(2 * d + 1, d)
        self.proj = proj if proj is not None else nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(torch.tanh(self.fc(self.norm(x))))
        return x + self.proj(h)


class EmbedBlocksHead(nn.Module):
    """embed -> blocks -> head -> cross-entropy: the skeleton the small test nets below share. Subclasses
    build ``embed``, ``blocks`` and ``head`` (in that order, which fixes their random init)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h).view(-1, self.head.out_features), y.view(-1))


class SharedAcrossUnits(EmbedBlocksHead):
    """Two MiniBlocks (two units) that share one ``proj`` Linear, between an embedding and a head."""

    def __init__(self, vocab: int = 29, d: int = 11):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        first = MiniBlock(d)
        self.blocks = nn.ModuleList([first, MiniBlock(d, proj=first.proj), MiniBlock(d)])
        self.head = nn.Linear(d, vocab)


# ---- frozen base weights beside trainable adapters (LoRA) ----------------------------------------------
class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update ``B @ A`` (both in the same unit as the base)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 3):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)  # nonzero so A gets gradients at step 1
        self.base.weight.requires_grad_(False)
        self.base.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


class LoRABlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d, bias=False)  # trainable, like the adapters
        self.up = LoRALinear(d, 2 * d + 3)
        self.down = LoRALinear(2 * d + 3, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LoRANet(EmbedBlocksHead):
    """Frozen embedding and head, LoRA blocks whose units mix frozen and trainable parameters."""

    def __init__(self, vocab: int = 31, d: int = 13, n_layer: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([LoRABlock(d) for _ in range(n_layer)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.embed.weight.requires_grad_(False)


# ---- parameters of several dtypes in one unit ----------------------------------------------------------
class MixedDtypeBlock(nn.Module):
    """fp32 weights, a trainable float64 gain and a frozen bfloat16 table in the same unit (three flat groups),
    plus a persistent buffer."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d, bias=False)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(d, dtype=torch.float64))
        self.table = nn.Parameter(torch.randn(d, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("shift", torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x)) * self.gain.to(x.dtype) + self.table.to(x.dtype) * 0.1 + self.shift * 0.01
        return x + h


class MixedDtypeNet(EmbedBlocksHead):
    def __init__(self, vocab: int = 23, d: int = 5, n_layer: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([MixedDtypeBlock(d) for _ in range(n_layer)])
        self.head = nn.Linear(d, vocab)


def forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss function for the models above whose forward(x, y) returns the loss itself."""
    return model(x, y)


__all__ = [
    "TINY_GPT", "WORLD_SIZES", "tiny_gpt_config", "gpt_loss", "SkippableGPT", "GPT", "Block",
    "MiniBlock", "SharedAcrossUnits", "LoRALinear", "LoRABlock", "LoRANet", "MixedDtypeBlock",
    "MixedDtypeNet", "forward_loss",
]
