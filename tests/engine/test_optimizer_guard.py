"""Optimizers built before ``shard()`` (engine/surface/optimizer_guard.py): which ones take the shard
parameters when ``shard()`` returns, and which are left alone. The parity of such a run against DDP is a row
of tests/engine/test_user_idioms.py ("optimizer built before wrapping, its own parameters clipped")."""

from __future__ import annotations

import gc

import torch

import shardwise
from harness import run_distributed
from models import GPT, Block, tiny_gpt_config


def _before_and_after(rank: int, ws: int) -> dict:
    torch.manual_seed(0)
    first = GPT(tiny_gpt_config())
    stepped = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)  # state held for the originals
    x = torch.randint(0, first.config.vocab_size, (2, 8))
    first(x, x)[1].backward()
    stepped.step()
    originals = list(first.parameters())
    shardwise.shard(first, units={Block})
    orphan = torch.optim.SGD(originals, lr=0.1)  # no state, built from the retired originals
    del first, originals  # its shards go; the optimizer with state still holds its retired originals
    gc.collect()
    second = GPT(tiny_gpt_config())
    fresh = torch.optim.AdamW(second.parameters(), lr=1e-3)
    kept = list(second.parameters())  # a user's own list from before shard(): not an optimizer's
    shardwise.shard(second, units={Block})  # must not trip over the first model's optimizer
    model_ids = {id(p) for p in second.parameters()}
    return dict(fresh=all(id(p) in model_ids for g in fresh.param_groups for p in g["params"]),
                stepped_untouched=all(p.numel() == 0 for g in stepped.param_groups for p in g["params"]),
                orphan_untouched=all(p.numel() == 0 for g in orphan.param_groups for p in g["params"]),
                kept_retired=all(p.numel() == 0 for p in kept))


def test_shard_gives_its_parameters_to_optimizers_built_before_and_leaves_others_alone():
    """A stateless optimizer built before shard() holds the model's shard parameters when shard() returns;
    optimizers holding another, dead sharded model's originals (with state, or built from them after its
    shard()) are left as they are (no error at this shard(): their own first step names the problem), and so
    is a user's own list."""
    for result in run_distributed(_before_and_after, 2):
        assert result == dict(fresh=True, stepped_untouched=True, orphan_untouched=True, kept_retired=True)
