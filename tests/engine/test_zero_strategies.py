"""ZeRO-1 (``shard_optim``) and DeepSpeed's ZeRO-2 (``shard_optim_grad``): full parameters kept on every
rank across steps, optimizer state (and for ZeRO-2 gradients) sharded.

What they must do, and what this file checks, at world sizes 1-4 (3 gives uneven shards):
- train exactly like a single process on the global batch (fp32 SGD+momentum to 1e-6), also with tied
  weights, frozen parameters and no_sync gradient accumulation;
- communicate as ZeRO-1/2 do: no all-gather in forward or backward, one per flat group after each optimizer
  step (not per micro-batch); one reduce-scatter (ZeRO-2) or all-reduce (ZeRO-1) per group in backward;
- never compute with stale parameters: the kept copy is refilled after an optimizer step, an in-place edit
  of the shards under ``no_grad``, ``load_full_state_dict`` and ``load_checkpoint``;
- hold what they promise in memory: the gathered parameters stay allocated between steps; ZeRO-2's gradient
  is the 1/N shard, ZeRO-1 keeps the whole reduced gradient behind its shard views.
AdamW and clipping parity are in test_parity.py, bf16 mixed precision in test_mixed_precision.py, resharding
checkpoints across strategies in checkpoint/test_checkpoint_reshard.py.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from harness import run_distributed
from models import GPT, Block, gpt_loss, tiny_gpt_config
from parity_utils import (
    CollectiveCounter,
    assert_parity,
    is_sharded,
    make_batches,
    parity_check,
    run_scenarios,
    scenario,
    simple_step,
    spawn_once,
)

import shardwise
from shardwise.engine.core.runtime import runtime_of
from shardwise.engine.surface.pieces import local_of

STRATEGIES = ("shard_optim", "shard_optim_grad")
STEPS = 3
VOCAB = tiny_gpt_config().vocab_size


def _initial(**cfg) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_gpt_config(**cfg))


def _sgd(strategy, freeze=False, **cfg):
    """Plain training (``freeze``: a whole block and the position embedding frozen before shard())."""
    def run(rank, ws):
        initial = _initial(**cfg)
        if freeze:
            for p in [*initial.blocks[1].parameters(), initial.wpe.weight]:
                p.requires_grad_(False)
        metrics, _, _ = parity_check(initial, simple_step(gpt_loss), make_batches(STEPS, VOCAB),
                                     rank, ws, shard_kwargs={"units": {Block}, "strategy": strategy})
        return metrics
    return run


def _accumulate(strategy):
    """Two micro-batches per step, the first under no_sync; counts collectives per optimizer step."""
    def run(rank, ws):
        initial = _initial()
        counts = []

        def step(model, batch, _step, take):
            x, y = batch
            half = x.shape[0] // 2
            sharded = is_sharded(model)
            with CollectiveCounter() as c:
                if sharded:
                    with shardwise.no_sync(model):
                        gpt_loss(model, take(x[:half]), take(y[:half])).mul(0.5).backward()
                else:
                    gpt_loss(model, take(x[:half]), take(y[:half])).mul(0.5).backward()
                loss = gpt_loss(model, take(x[half:]), take(y[half:])).mul(0.5)
                loss.backward()
            if sharded:
                counts.append(dict(c.calls))
            return loss.detach() * 2

        batches = make_batches(STEPS, VOCAB, global_batch=24)
        metrics, model, _ = parity_check(initial, step, batches, rank, ws,
                                         shard_kwargs={"units": {Block}, "strategy": strategy})
        groups = sum(len(u.flat_groups) for u in runtime_of(model).units)
        return {"metrics": metrics, "counts": counts, "groups": groups}
    return run


def _refresh(strategy, root):
    """Every way the shards change between steps reaches the next forward (optimizer steps: the parity runs)."""
    def run(rank, ws):
        from shardwise.checkpoint import load_checkpoint, save_checkpoint
        initial = _initial()
        x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
        model = shardwise.shard(copy.deepcopy(initial), units={Block}, strategy=strategy)
        ref = copy.deepcopy(initial)
        out = {}

        def compare(label):
            with torch.no_grad():
                a, b = model(x).logits, ref(x).logits
            out[label] = ((a - b).norm() / b.norm()).item()

        def edit(fn):
            with torch.no_grad():
                for p in list(model.parameters()) + list(ref.parameters()):
                    fn(p)

        compare("first forward")
        edit(lambda p: p.mul_(0.5))  # outside any optimizer: caught by the version counters
        compare("in-place edit under no_grad")
        full = shardwise.full_state_dict(model)
        shardwise.load_full_state_dict(model, {k: v + 1.0 for k, v in full.items()} if rank == 0 else {})
        edit(lambda p: None)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(1.0)
        compare("load_full_state_dict")
        path = f"{root}/{strategy}"
        save_checkpoint(path, model, step=1)
        saved = copy.deepcopy(ref.state_dict())
        edit(lambda p: p.mul_(-2.0))
        compare("edit before load_checkpoint")
        load_checkpoint(path, model)
        ref.load_state_dict(saved)
        compare("load_checkpoint")
        return out
    return run


def _memory(strategy):
    def run(rank, ws):
        initial = _initial()
        model = shardwise.shard(copy.deepcopy(initial), units={Block}, strategy=strategy)
        x = torch.randint(0, VOCAB, (2, 8))
        gpt_loss(model, x, x).backward()
        rt = runtime_of(model)
        kept = all(g.gathered.untyped_storage().nbytes() > 0 for g in rt.flat_groups())
        grad_bytes = {local_of(p.grad).untyped_storage().nbytes() for p in model.parameters() if p.grad is not None}
        groups = [g for g in rt.flat_groups()]
        return {"kept": kept, "grad_bytes": sorted(grad_bytes),
                "shard_bytes": sorted({4 * g.plan.shard_numel for g in groups}),
                "full_bytes": sorted({4 * g.plan.padded_numel for g in groups})}
    return run


def _worker(rank, ws, root):
    scenarios = {}
    for s in STRATEGIES:
        scenarios[f"{s}/sgd"] = _sgd(s)
        scenarios[f"{s}/tied"] = _sgd(s, tie_weights=True)
        scenarios[f"{s}/frozen"] = _sgd(s, freeze=True)
        scenarios[f"{s}/accumulate"] = _accumulate(s)
        scenarios[f"{s}/refresh"] = _refresh(s, root)
        scenarios[f"{s}/memory"] = _memory(s)
    return run_scenarios(scenarios, rank, ws)


@spawn_once
def report(world_size: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        return run_distributed(_worker, world_size, root)[0]


# 2 runs by default; 1 (nothing to communicate), 3 (uneven shards; AdamW and clipping parity at 3 run by
# default in test_parity.py) and 4 with -m slow.
CASES = [pytest.param(ws, s, id=f"ws{ws}-{s}", marks=[pytest.mark.slow] if ws != 2 else [])
         for ws in (1, 2, 3, 4) for s in STRATEGIES]


@pytest.mark.parametrize("world_size,strategy", CASES)
@pytest.mark.parametrize("case", ["sgd", "tied", "frozen"])
def test_trains_like_one_process_on_the_global_batch(world_size, strategy, case):
    assert_parity(scenario(report(world_size), f"{strategy}/{case}"), label=f"{strategy} {case}")


@pytest.mark.parametrize("world_size,strategy", CASES)
def test_accumulation_matches_and_gathers_once_per_optimizer_step(world_size, strategy):
    r = scenario(report(world_size), f"{strategy}/accumulate")
    assert_parity(r["metrics"], label=f"{strategy} no_sync")
    if world_size == 1:
        assert all(sum(c.values()) == 0 for c in r["counts"]), r["counts"]  # nothing to communicate
        return
    groups = r["groups"]
    for step, c in enumerate(r["counts"]):
        # Step 0 gathers at its first forward (nothing was gathered yet); later steps right after the
        # optimizer step: once per group either way, never again in the second micro-batch or in backward
        # (whether a kept copy is refilled rides in each forward's start agreement: no collective of its own;
        # which parameters got a gradient is agreed on the control group, core/grad_usage.py: not data, not counted).
        assert c["all_gather_into"] == groups, (step, c)
        if strategy == "shard_optim":
            assert c["all_reduce_sum"] == groups and c["reduce_scatter_into"] == 0, (step, c)
        else:
            assert c["reduce_scatter_into"] == groups and c["all_reduce_sum"] == 0, (step, c)


@pytest.mark.parametrize("world_size,strategy", CASES)
def test_kept_parameters_follow_every_change_of_the_shards(world_size, strategy):
    r = scenario(report(world_size), f"{strategy}/refresh")
    for label, err in r.items():
        assert err <= 1e-6, f"{label}: logits off by {err:.2e} (stale parameters?)"


@pytest.mark.parametrize("world_size,strategy", [c for c in CASES if c.values[0] > 1])
def test_memory_kept_between_steps(world_size, strategy):
    r = scenario(report(world_size), f"{strategy}/memory")
    assert r["kept"], "the gathered parameters must stay allocated between steps"
    # Every .grad is a view of its group's reduced gradient: the 1/N shard (ZeRO-2), or the whole
    # all-reduced gradient (ZeRO-1).
    expected = r["shard_bytes"] if strategy == "shard_optim_grad" else r["full_bytes"]
    assert r["grad_bytes"] == expected
