"""One flat group's buffers (``shardwise/engine/flat_group.py``), strategy by strategy: their sizes, dtypes and
lifetimes, measured on the buffers themselves.

A two-unit model (``Linear(4, 5)``: 25 elements, ``Linear(5, 3)``: 18) is sharded with every 1-D strategy
and trained one step; every unit's forward records the storage its weight is a view of (the gathered buffer),
and every collective the groups issue is recorded with its buffer's size and dtype. Expected figures come
from first principles, not from the plan: at world size N a group of n elements pads to P = ceil(n / N) * N
and each rank holds S = P / N, nothing more (the ranks agree on each collective before it is issued, in
exchanges of their own: 10 int64 per rank on the control group). One spawn at world size 2, one at 1.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn

import shardwise
from harness import run_distributed
from parity_utils import assert_engine_clean, run_scenarios, scenario, spawn_once
from shardwise.engine.base import collectives
from shardwise.engine.surface.pieces import local_of
from shardwise.engine.core.runtime import runtime_of

GROUP_NUMELS = (25, 18)  # Linear(4, 5) and Linear(5, 3): weight + bias
F32, BF16 = torch.float32, torch.bfloat16


class ProbeLinear(nn.Linear):
    """Records, inside its own forward, the storage its weight is a view of (the gathered buffer)."""

    def forward(self, x):
        self.seen = (self.weight.untyped_storage().nbytes(), self.weight.dtype)
        return super().forward(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(ProbeLinear(4, 5), nn.Tanh(), ProbeLinear(5, 3))


class _RecordCollectives:
    """(operation, elements of the buffer it runs on, dtype) of every flat-group collective while active; the
    buffer is the all-gather's output, the reduce-scatter's input and the all-reduce's tensor."""

    def __enter__(self):
        self.seen, self._saved = set(), {}
        for name in ("all_gather_into", "reduce_scatter_into", "all_reduce_sum"):
            original = self._saved[name] = getattr(collectives, name)

            def record(*args, _name=name, _orig=original, **kwargs):  # the arguments passed on as they came
                buffer = args[1] if _name == "reduce_scatter_into" else args[0]
                self.seen.add((_name, buffer.numel(), str(buffer.dtype)))
                return _orig(*args, **kwargs)

            setattr(collectives, name, record)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(collectives, name, original)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _one_step(strategy: str, mixed_precision=None, checks: bool = True):
    def run(rank, ws):
        os.environ["SHARDWISE_CHECK_COLLECTIVES"] = "1" if checks else "0"  # read by shard()
        try:
            model = shardwise.shard(_model(), units={ProbeLinear}, strategy=strategy,
                                    mixed_precision=mixed_precision)
        finally:
            del os.environ["SHARDWISE_CHECK_COLLECTIVES"]
        groups = list(runtime_of(model).flat_groups())
        out = {"shard": [(g.shard.numel(), str(g.shard.dtype)) for g in groups],
               "gathered_numel": [g.gathered.numel() for g in groups],
               "aliases_shard": [g.gathered is g.shard for g in groups],
               "before_forward": [_nbytes(g.gathered) for g in groups]}
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
        with _RecordCollectives() as rec:
            loss = model(x).pow(2).mean()
            out["in_forward"] = [(m.seen[0], str(m.seen[1])) for m in (model[0], model[2])]
            out["after_forward"] = [_nbytes(g.gathered) for g in groups]
            loss.backward()
        assert_engine_clean(model)
        out["after_backward"] = [_nbytes(g.gathered) for g in groups]
        # (a gradient is a piece: its elements' storage, the reduced shard, is what it holds)
        out["grad"] = [sorted({(_nbytes(local_of(p.grad)), str(p.grad.dtype)) for p in g.shard_params})
                       for g in groups]
        out["collectives"] = sorted(rec.seen)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        out["after_step"] = [_nbytes(g.gathered) for g in groups]
        return out

    return run


SCENARIOS = {
    "full_shard": _one_step("full_shard"),
    "shard_grad_op": _one_step("shard_grad_op"),
    "shard_optim": _one_step("shard_optim"),
    "shard_optim_grad": _one_step("shard_optim_grad"),
    "no_shard": _one_step("no_shard"),
    "full_shard_bf16": _one_step("full_shard", shardwise.MixedPrecision(param_dtype=BF16)),
    "shard_optim_grad_bf16_fp32_reduce": _one_step(
        "shard_optim_grad", shardwise.MixedPrecision(param_dtype=BF16, reduce_dtype=F32)),
    "full_shard_unchecked": _one_step("full_shard", checks=False),
}


def _worker(rank, ws):
    return run_scenarios(SCENARIOS, rank, ws)


@spawn_once
def report(ws: int) -> dict:
    return run_distributed(_worker, ws)[0]


def _padded(n: int, ws: int) -> int:
    return math.ceil(n / ws) * ws


STRATEGIES = ("full_shard", "shard_grad_op", "shard_optim", "shard_optim_grad", "no_shard")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_shard_holds_one_rank_s_share_in_the_master_dtype(strategy):
    """Every rank keeps P / N elements of every group (no_shard: all of it), in fp32, whatever is gathered."""
    r = scenario(report(2), strategy)
    ranks = 1 if strategy == "no_shard" else 2
    assert r["shard"] == [(_padded(n, ranks) // ranks, "torch.float32") for n in GROUP_NUMELS]
    assert r["gathered_numel"] == [_padded(n, ranks) for n in GROUP_NUMELS]


@pytest.mark.parametrize("strategy,after_forward,after_backward", [
    ("full_shard", False, False),  # freed after forward, re-gathered for backward, freed again
    ("shard_grad_op", True, False),  # kept from forward to backward, then freed
    ("shard_optim", True, True),  # ZeRO-1/2: kept across steps
    ("shard_optim_grad", True, True),
])
def test_the_gathered_buffer_lives_as_the_strategy_says(strategy, after_forward, after_backward):
    """The gathered storage (P elements) exists only while the strategy
    keeps the group gathered: never before the first forward, and it is resized to nothing when freed. An
    optimizer step does not free the kept copy of ZeRO-1/2 (the next forward refills it)."""
    r = scenario(report(2), strategy)
    full = [_padded(n, 2) * 4 for n in GROUP_NUMELS]
    assert r["before_forward"] == [0, 0]
    assert r["in_forward"] == [(b, "torch.float32") for b in full]
    assert r["after_forward"] == (full if after_forward else [0, 0])
    assert r["after_backward"] == (full if after_backward else [0, 0])
    assert r["after_step"] == r["after_backward"]
    assert r["aliases_shard"] == [False, False]


def test_without_sharding_the_gathered_buffer_is_the_shard():
    """no_shard: one rank per shard group, so the shard is the whole group and serves as the gathered buffer
    (nothing allocated, nothing freed)."""
    r = scenario(report(2), "no_shard")
    assert r["aliases_shard"] == [True, True]
    full = [n * 4 for n in GROUP_NUMELS]
    assert r["before_forward"] == r["after_forward"] == r["after_backward"] == full
    assert r["in_forward"] == [(b, "torch.float32") for b in full]


# The ranks' agreements before the collectives (checks/fingerprint.py): 25 int64 per rank, gathered. Once per
# synced backward the ranks OR which parameters got a gradient (core/grad_usage.py): with checks on, the OR
# rides in one such exchange (the model's 4 parameters: one word of its 16 flag words).
EXCHANGE = {("all_gather_into", 2 * 25, "torch.int64")}
# With checks off: one int64 word per rank gathered on the control group.
USAGE = {("all_gather_into", 2 * 1, "torch.int64")}


@pytest.mark.parametrize("strategy,grad_numel,collectives", [
    # .grad views: the reduce-scatter's output (S), or the whole all-reduced gradient
    ("full_shard", "shard", {"all_gather_into", "reduce_scatter_into"}),
    ("shard_grad_op", "shard", {"all_gather_into", "reduce_scatter_into"}),
    ("shard_optim_grad", "shard", {"all_gather_into", "reduce_scatter_into"}),
    ("shard_optim", "padded", {"all_gather_into", "all_reduce_sum"}),
    ("no_shard", "padded", {"all_reduce_sum"}),
])
def test_gradient_buffers_per_strategy(strategy, grad_numel, collectives):
    """In backward each group packs a P-element gradient and reduces it by the strategy's collective; every
    ``.grad`` is a view of the reduced result: the rank's S elements, or (ZeRO-1, no_shard) the whole
    buffer, kept alive behind the views."""
    r = scenario(report(2), strategy)
    ranks = 1 if strategy == "no_shard" else 2
    for n, grads in zip(GROUP_NUMELS, r["grad"]):
        numel = _padded(n, 2) // 2 if grad_numel == "shard" else _padded(n, ranks)
        assert grads == [(numel * 4, "torch.float32")], (n, grads)
    expected = {(op, _padded(n, ranks), "torch.float32") for n in GROUP_NUMELS for op in collectives}
    assert set(map(tuple, r["collectives"])) == expected | EXCHANGE


def test_mixed_precision_gathers_in_the_compute_dtype_and_reduces_in_the_reduce_dtype():
    """bf16 compute: the shard stays fp32; the gathered buffer, the all-gather and the packed gradient are
    bf16 (reduce dtype defaults to the compute dtype) or fp32 when reduce_dtype says so; the gradient handed
    to the optimizer is the master dtype's S elements."""
    fs = scenario(report(2), "full_shard_bf16")
    z2 = scenario(report(2), "shard_optim_grad_bf16_fp32_reduce")
    for r, reduce_dtype in ((fs, "torch.bfloat16"), (z2, "torch.float32")):
        assert r["shard"] == [(_padded(n, 2) // 2, "torch.float32") for n in GROUP_NUMELS]
        assert r["in_forward"] == [(_padded(n, 2) * 2, "torch.bfloat16") for n in GROUP_NUMELS]
        assert set(map(tuple, r["collectives"])) == (
            {("all_gather_into", _padded(n, 2), "torch.bfloat16") for n in GROUP_NUMELS}
            | {("reduce_scatter_into", _padded(n, 2), reduce_dtype) for n in GROUP_NUMELS} | EXCHANGE)
        assert r["grad"] == [[(_padded(n, 2) // 2 * 4, "torch.float32")] for n in GROUP_NUMELS]
    assert fs["after_backward"] == [0, 0]
    assert z2["after_backward"] == [_padded(n, 2) * 2 for n in GROUP_NUMELS]


def test_with_checks_off_the_collectives_are_the_data_alone():
    r = scenario(report(2), "full_shard_unchecked")
    assert r["in_forward"] == [(_padded(n, 2) * 4, "torch.float32") for n in GROUP_NUMELS]
    assert set(map(tuple, r["collectives"])) == {(op, _padded(n, 2), "torch.float32") for n in GROUP_NUMELS
                                                for op in ("all_gather_into", "reduce_scatter_into")
                                                } | USAGE


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_at_world_size_1_every_strategy_computes_in_the_shard_and_communicates_nothing(strategy):
    """One rank: no padding, no collective, no agreement; the gathered buffer is the shard itself and
    each ``.grad`` a view of the group's whole (unreduced) gradient."""
    r = scenario(report(1), strategy)
    full = [n * 4 for n in GROUP_NUMELS]
    assert r["shard"] == [(n, "torch.float32") for n in GROUP_NUMELS]
    assert r["aliases_shard"] == [True, True]
    assert r["before_forward"] == r["after_backward"] == full
    assert r["grad"] == [[(b, "torch.float32")] for b in full]
    assert r["collectives"] == []
