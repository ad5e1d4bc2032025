"""fp16 loss scaling with sharded gradients: every rank skips an overflowing step together and keeps the
same scale, even when only one rank's shard holds the inf."""

from __future__ import annotations

import math

import pytest
import torch

import shardwise
from harness import run_distributed


def _one_step(rank: int, world: int, poison_rank: int) -> dict:
    torch.manual_seed(0)
    model = shardwise.shard(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)),
                            units={torch.nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = shardwise.ShardedGradScaler(init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(4, 8)).sum()).backward()
    if rank == poison_rank:
        from shardwise.engine.surface.pieces import local_of

        mine = next(local_of(p.grad) for p in model.parameters() if p.grad is not None and local_of(p.grad).numel())
        mine[0] = math.inf  # an overflow only this rank's shard sees (an element it holds)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    return {"stepped": changed, "scale": scaler.get_scale()}


@pytest.mark.parametrize("poison_rank", [pytest.param(None, marks=pytest.mark.slow), 1])
def test_an_overflow_in_one_ranks_shard_makes_every_rank_skip_and_back_off(poison_rank):
    results = run_distributed(_one_step, 3, poison_rank)
    if poison_rank is None:
        assert results == [{"stepped": True, "scale": 1024.0}] * 3
    else:
        assert results == [{"stepped": False, "scale": 512.0}] * 3
