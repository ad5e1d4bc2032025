"""A unit is released in backward once nothing can read its gathered parameters ([Note: releasing a unit in
backward], ``shardwise/engine/core/unit.py``): the root of a GPT (its head runs first in backward, its last
gradient, the embedding's, comes last) is freed after the head's backward, not at the end, and nothing that
still reads a unit's memory ever sees it freed:

* GPT, head tied or not: the root holds no gathered bytes from the second block's backward on; parity with
  one process under SGD with momentum and AdamW, the engine clean after every backward.
* A root weight kept by a custom autograd Function as a ``ctx`` attribute (not saved for backward) and read
  after the blocks' backward: the root stays gathered; parity.
* Root code under activation checkpointing (reentrant and not) recomputed after the release: it gathers the
  root again for its recompute; parity.
* ``backward(retain_graph=True)``: the saved tensors stay, so the root stays gathered; parity.

One spawn per world size runs every scenario.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import shardwise
from harness import run_distributed
from models import GPT, Block, gpt_loss, tiny_gpt_config
from parity_utils import (assert_parity, make_batches, run_scenarios, scenario, simple_step, spawn_once,
                          train_pair)

VOCAB = tiny_gpt_config().vocab_size
STEPS = 3


def _train(initial: nn.Module, loss_step, rank: int, world: int, optimizer: str = "sgd") -> dict:
    """Train a sharded copy of ``initial`` beside one process; record, at each block's backward (in backward
    order), the root unit's gathered bytes."""
    from shardwise.engine.core.runtime import runtime_of

    model = shardwise.shard(copy.deepcopy(initial), units={Block})
    root = next(u for u in runtime_of(model).units if u.plan.is_root)
    seen = []
    for block in model.modules():
        if isinstance(block, Block):
            block.register_full_backward_pre_hook(
                lambda *_: seen.append(sum(g.gathered.untyped_storage().nbytes() for g in root.flat_groups)))
    metrics = train_pair(model, copy.deepcopy(initial), loss_step, make_batches(STEPS, VOCAB), rank, world,
                         optimizer=optimizer)
    return {"metrics": metrics, "root_bytes": seen}


def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_gpt_config(**overrides))


class _GainKeptOnCtx(torch.autograd.Function):
    """x * w, with ``w`` kept as a ctx attribute, not saved for backward: autograd's saved tensors do not
    see it, only the reference it holds."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.x, ctx.w = x, w
        return x * w

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.w, (grad * ctx.x).sum(dim=(0, 1))


class _GainedGPT(GPT):
    """GPT with a root gain after the embeddings, applied by ``_GainKeptOnCtx``: the root's weight is read
    again after every block's backward."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, cfg.n_embd))

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = _GainKeptOnCtx.apply(x, self.gain)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.lm_head(self.ln_f(x)).view(-1, self.config.vocab_size),
                                           targets.reshape(-1))


class _CheckpointedStemGPT(GPT):
    """GPT with a root Linear after the embeddings under activation checkpointing: its recompute runs after
    every block's backward, so it enters the root once the head's backward has released it."""

    def __init__(self, cfg, reentrant: bool):
        super().__init__(cfg)
        self.stem = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.reentrant = reentrant

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = checkpoint(self.stem, x, use_reentrant=self.reentrant)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.lm_head(self.ln_f(x)).view(-1, self.config.vocab_size),
                                           targets.reshape(-1))


def _loss(model, x, y):
    return model(x, y)


def _retained_step(model, batch, _step, take):
    """Two backwards through one graph: the first retains it (and so every saved tensor)."""
    x, y = batch
    loss = gpt_loss(model, take(x), take(y))
    loss.backward(retain_graph=True)
    loss.backward()
    return loss.detach()


def _scenarios():
    out = {}
    for tie in (False, True):
        for opt in ("sgd", "adamw"):
            out[f"gpt tie={tie} {opt}"] = (lambda r, w, tie=tie, opt=opt:
                                           _train(_gpt(tie_weights=tie), simple_step(gpt_loss), r, w, opt))
    out["ctx attribute"] = lambda r, w: _train(_seeded(_GainedGPT), simple_step(_loss), r, w)
    for reentrant in (False, True):
        out[f"recompute reentrant={reentrant}"] = (lambda r, w, reentrant=reentrant: _train(
            _seeded(_CheckpointedStemGPT, reentrant), simple_step(_loss), r, w))
    out["retain_graph"] = lambda r, w: _train(_gpt(), _retained_step, r, w)
    return out


def _seeded(cls, *args):
    torch.manual_seed(0)
    return cls(tiny_gpt_config(), *args)


def _worker(rank, world):
    return run_scenarios(_scenarios(), rank, world)


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def world(request):
    return request.param


@spawn_once
def _report(world: int) -> list:
    return run_distributed(_worker, world)


N_BLOCKS = tiny_gpt_config().n_layer


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_gpt_root_is_released_after_the_heads_backward_with_parity(world, tie, opt):
    for rank_report in _report(world):
        out = scenario(rank_report, f"gpt tie={tie} {opt}")
        # AdamW: the attention key bias, whose exact gradient is zero, is noise-bound (test_parity.py's tolerances)
        assert_parity(out["metrics"], label=f"tie={tie} {opt}", param_rtol=1e-3 if opt == "adamw" else None)
        per_step = [out["root_bytes"][i:i + N_BLOCKS] for i in range(0, STEPS * N_BLOCKS, N_BLOCKS)]
        assert len(per_step) == STEPS and all(len(s) == N_BLOCKS for s in per_step), out["root_bytes"]
        for seen in per_step:
            # (the first block's module hook runs before its unit's pre-backward, the first check after the head)
            assert seen[0] > 0 and seen[1:] == [0] * (N_BLOCKS - 1), seen


def test_a_root_weight_kept_on_a_ctx_attribute_keeps_the_root_gathered(world):
    for rank_report in _report(world):
        out = scenario(rank_report, "ctx attribute")
        assert_parity(out["metrics"], label="ctx attribute")
        assert len(out["root_bytes"]) == STEPS * N_BLOCKS and all(b > 0 for b in out["root_bytes"]), out


@pytest.mark.parametrize("reentrant", [False, True])
def test_root_code_recomputed_after_the_release_gathers_the_root_again(world, reentrant):
    for rank_report in _report(world):
        out = scenario(rank_report, f"recompute reentrant={reentrant}")
        assert_parity(out["metrics"], label=f"recompute reentrant={reentrant}")
        assert out["root_bytes"][-1] == 0, out["root_bytes"]  # released before the stem's recompute


def test_a_retained_graph_keeps_the_root_gathered(world):
    for rank_report in _report(world):
        out = scenario(rank_report, "retain_graph")
        assert_parity(out["metrics"], label="retain_graph")
        first = out["root_bytes"][:N_BLOCKS]  # the first backward of the first step retains the graph
        assert all(b > 0 for b in first), out["root_bytes"]
