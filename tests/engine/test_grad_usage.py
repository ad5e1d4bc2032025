"""No gradient means ``p.grad is None`` (engine/core/grad_usage.py), as in one process on the global batch.

One model holds every way a parameter goes without a gradient in a step: a ``Linear`` never called, a layer
whose output only feeds a ``torch.no_grad()`` block (and the layer inside it), a layer dropped on every
rank at some steps, a whole unit skipped at one step, and a layer used on one rank's data only. After every
backward each parameter's ``p.grad is None`` must be what one process has (DDP's, for the layer used on one
rank: the reference runs each rank's slice as its own loss, and averages), and training with AdamW and
SGD-momentum must match: both move a parameter that gets a zero gradient instead of none. Under ``no_sync``
a parameter used in any micro-batch on any rank is used.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from harness import run_distributed
from parity_utils import (assert_parity, local_slice, make_batches, parity_check, run_scenarios, scenario,
                          spawn_once)

VOCAB, D = 11, 7  # a block holds 5 * 56 + 7 = 287 elements, the root 221: no world size 2-4 divides either
STEPS = 3
SKIPPED_UNIT = (1, 2)  # (step, block): a whole unit that does not run, on every rank
BRANCH_RANK = 1  # the rank whose data takes the branch through ``rank_branch``


class UsageBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d, bias=False)
        self.upstream = nn.Linear(d, d)  # feeds only the no_grad block: no gradient
        self.under_no_grad = nn.Linear(d, d)  # runs under torch.no_grad(): no gradient
        self.unused = nn.Linear(d, d)  # never called
        self.dropped = nn.Linear(d, d)  # left out at some steps on every rank (layer drop)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, drop: bool) -> torch.Tensor:
        x = self.norm(x)
        with torch.no_grad():
            context = torch.tanh(self.under_no_grad(self.upstream(x)))
        y = x + self.out(torch.tanh(x + context))
        return y if drop else y + self.dropped(y)


class UsageNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([UsageBlock(D) for _ in range(3)])
        self.rank_branch = nn.Linear(D, D)  # used on BRANCH_RANK's slice only
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, targets, step: int, branch: bool):
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            if (step, i) != SKIPPED_UNIT:
                x = block(x, drop=(step + i) % 2 == 0)
        if branch:
            x = x + self.rank_branch(x)
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _slices(x, y, sharded: bool, rank: int, ws: int):
    """(rank, inputs, targets) of what this side runs: the rank's own slice, or (the reference, as DDP
    does) every rank's slice as a loss of its own."""
    ranks = [rank] if sharded else range(ws)
    return [(r, local_slice(x, r, ws), local_slice(y, r, ws)) for r in ranks]


def _none_grads(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.grad is None]


def _step_recording(rank, ws, seen: dict, micro_batches: int):
    """A loss step that records which parameters have no gradient after backward, on each side. With
    ``micro_batches`` > 1 the sharded side accumulates under ``model.no_sync()`` but for the last one, and
    the rank branch is taken in the first micro-batch only."""

    def step(model, batch, step_i, take):
        sharded = take(batch[0]) is not batch[0]
        x, y = batch
        n = x.shape[0] // micro_batches
        total = 0.0
        for m in range(micro_batches):
            xm, ym = x[m * n:(m + 1) * n], y[m * n:(m + 1) * n]
            parts = [model(xs, ys, step_i, branch=r == BRANCH_RANK and m == 0)
                     for r, xs, ys in _slices(xm, ym, sharded, rank, ws)]
            loss = sum(parts) / len(parts) / micro_batches
            if sharded and m < micro_batches - 1:
                with shardwise.no_sync(model):
                    loss.backward()
            else:
                loss.backward()
            total = total + loss.detach()
        seen.setdefault("sharded" if sharded else "reference", []).append(_none_grads(model))
        return total

    return step


def _usage_scenario(strategies, micro_batches: int):
    def run(rank, ws):
        out = {}
        for strategy in strategies:
            for optimizer in ("sgd", "adamw"):
                torch.manual_seed(0)
                seen: dict = {}
                batches = make_batches(STEPS, VOCAB, global_batch=12 * micro_batches)
                metrics = parity_check(UsageNet(), _step_recording(rank, ws, seen, micro_batches), batches, rank, ws,
                                       optimizer=optimizer, shard_kwargs=dict(units={UsageBlock}, strategy=strategy))[0]
                out[f"{strategy}/{optimizer}"] = dict(metrics=metrics, none=seen)
        return out

    return run


def _train_stepping_in_backward(model, rank, ws, side: str, counts: dict):
    """Train with the optimizer inside backward, as torch's tutorial writes it: an AdamW per parameter,
    stepped by its post-accumulate-grad hook (or, with an offload optimizer, its step in backward)."""
    names = {p: n for n, p in model.named_parameters()}
    optimizers = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in model.parameters()}

    def hook(p):
        counts[side][names[p]] = counts[side].get(names[p], 0) + 1
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    for i, (x, y) in enumerate(make_batches(STEPS, VOCAB)):
        parts = [model(xs, ys, i, branch=r == BRANCH_RANK) for r, xs, ys in _slices(x, y, side != "reference", rank, ws)]
        (sum(parts) / len(parts)).backward()


def _at_hand_out(rank, ws):
    """A hand-out that acts at once: post-accumulate-grad hooks (optimizer in backward) run for exactly the
    parameters one process runs them for, and an offload optimizer stepping in backward leaves unused ones
    alone."""
    from parity_utils import sharded_param_errors, worst

    out = {}
    torch.manual_seed(0)
    initial = UsageNet()
    counts: dict = {"reference": {}, "sharded": {}}
    reference = copy.deepcopy(initial)
    _train_stepping_in_backward(reference, rank, ws, "reference", counts)
    for strategy in ("full_shard", "no_shard"):
        counts["sharded"] = {}
        model = shardwise.shard(copy.deepcopy(initial), units={UsageBlock}, strategy=strategy)
        _train_stepping_in_backward(model, rank, ws, "sharded", counts)
        out[f"hooks/{strategy}"] = dict(counts=dict(counts), err=worst(sharded_param_errors(model, reference)))
    ref, opt = copy.deepcopy(initial), None
    model = shardwise.shard(copy.deepcopy(initial), units={UsageBlock}, offload=shardwise.CPUOffload())
    opt = shardwise.offload_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for i, (x, y) in enumerate(make_batches(STEPS, VOCAB)):
        for side, m, o in (("reference", ref, ref_opt), ("sharded", model, opt)):
            parts = [m(xs, ys, i, branch=r == BRANCH_RANK) for r, xs, ys in _slices(x, y, side == "sharded", rank, ws)]
            (sum(parts) / len(parts)).backward()
            o.step()
            o.zero_grad()
    out["offload_in_backward"] = dict(err=worst(sharded_param_errors(model, ref)))
    return out


DEFAULT_STRATEGIES = ("full_shard", "shard_optim", "no_shard")
ALL_STRATEGIES = ("full_shard", "shard_grad_op", "shard_optim_grad", "shard_optim", "no_shard")


def _marks_in_their_own_all_gather(run):
    """``run`` with the usage marks too many to ride in the agreement's exchange (a model of more than
    ``FLAG_WORDS`` x 62 parameters): they travel in an all-gather of their own."""
    def patched(rank, ws):
        from shardwise.engine.core import grad_usage

        saved, grad_usage.FLAG_WORDS = grad_usage.FLAG_WORDS, 0
        try:
            return run(rank, ws)
        finally:
            grad_usage.FLAG_WORDS = saved

    return patched


def _worker(rank, ws, strategies):
    return run_scenarios({"one_backward": _usage_scenario(strategies, 1),
                          "no_sync": _usage_scenario(strategies, 2), "at_hand_out": _at_hand_out,
                          "marks_gathered": _marks_in_their_own_all_gather(_usage_scenario(("full_shard",), 1))},
                         rank, ws)


@spawn_once
def report(ws: int, strategies: tuple) -> list:
    return run_distributed(_worker, ws, strategies)


def _check(ws: int, strategies: tuple, name: str) -> None:
    for rank, res in enumerate(report(ws, strategies)):
        for key, r in scenario(res, name).items():
            assert r["none"]["sharded"] == r["none"]["reference"], (
                f"rank {rank} {key}: parameters without a gradient after each backward differ from one "
                f"process's:\n sharded   {r['none']['sharded']}\n reference {r['none']['reference']}")
            assert_parity(r["metrics"], label=f"rank {rank} {key}")


def test_the_model_exercises_every_way_of_going_without_a_gradient():
    """The reference itself: each pattern leaves its parameters without a gradient at the steps it should
    (so the comparison below compares something)."""
    seen: dict = {}
    torch.manual_seed(0)
    model = UsageNet()
    step = _step_recording(0, 2, seen, 1)
    for i, batch in enumerate(make_batches(STEPS, VOCAB)):
        step(model, batch, i, lambda t: t)
        model.zero_grad(set_to_none=True)
    none = seen["reference"]
    for i in range(STEPS):
        for b in range(3):
            assert {f"blocks.{b}.upstream.weight", f"blocks.{b}.under_no_grad.bias", f"blocks.{b}.unused.weight"} <= set(none[i])
            assert (f"blocks.{b}.dropped.weight" in none[i]) == ((i + b) % 2 == 0 or (i, b) == SKIPPED_UNIT)
        assert ("blocks.2.out.weight" in none[i]) == (i == SKIPPED_UNIT[0])
        assert "rank_branch.weight" not in none[i] and "head.weight" not in none[i]


@pytest.mark.parametrize("name", ["one_backward", "no_sync"])
def test_no_gradient_means_none_at_world_size_2(name):
    _check(2, DEFAULT_STRATEGIES, name)


def test_marks_too_many_for_the_agreement_travel_in_their_own_all_gather():
    _check(2, DEFAULT_STRATEGIES, "marks_gathered")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_backward", "no_sync"])
def test_no_gradient_means_none_at_world_size_3_every_strategy(name):
    _check(3, ALL_STRATEGIES, name)


def test_a_hand_out_that_acts_at_once_sees_only_what_some_rank_used():
    for rank, res in enumerate(report(2, DEFAULT_STRATEGIES)):
        r = scenario(res, "at_hand_out")
        for strategy in ("full_shard", "no_shard"):
            hooks = r[f"hooks/{strategy}"]
            assert hooks["counts"]["sharded"] == hooks["counts"]["reference"], (
                f"rank {rank} {strategy}: post-accumulate-grad hooks ran {hooks['counts']['sharded']}, one process "
                f"{hooks['counts']['reference']}")
            assert hooks["err"][1] <= 1e-6, f"rank {rank} {strategy}: optimizer in backward off at {hooks['err']}"
        assert r["offload_in_backward"]["err"][1] <= 1e-6, f"rank {rank}: {r['offload_in_backward']['err']}"
