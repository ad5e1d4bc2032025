"""One model's initial weights on every rank (engine/initial_weights.py), as DistributedDataParallel gives.

Ranks seeded differently (nanoGPT's ``1337 + rank``) or built on the meta device end with rank 0's model,
bit for bit, and are told so; ``sync_module_states=False`` refuses them by name on every rank. One spawn at
world size 3; the checksum itself is tested in one process.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import shardwise
from harness import error_of, run_distributed
from models import GPT, Block, MixedDtypeBlock, MixedDtypeNet, tiny_gpt_config
from parity_utils import run_scenarios, scenario, sharded_param_errors, spawn_once
from shardwise.engine import initial_weights
from shardwise.engine.initial_weights import checksum

WORLD_SIZE = 3


# ---- the checksum -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_checksum_sees_every_element_and_its_position(dtype, monkeypatch):
    monkeypatch.setattr(initial_weights, "_CHUNK", 1000)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2_200, generator=g) * 100  # at least three chunks of words: the last one partial
    t = values > 0 if dtype == torch.bool else values.to(dtype)
    assert checksum(t) == checksum(t.clone()) and checksum(t.view(110, 20)) == checksum(t)
    flipped = t.clone()
    flipped[2_100] = ~t[2_100] if dtype == torch.bool else t[2_100] + 1
    assert checksum(flipped) != checksum(t), "one changed element in the last chunk"
    swapped = t.clone()
    i = int((t[:-1] != t[1:]).nonzero()[0])
    swapped[i], swapped[i + 1] = t[i + 1], t[i]
    assert checksum(swapped) != checksum(t), "two elements swapped"
    assert checksum(t[:-1]) != checksum(t), "one element fewer"
    assert 0 <= checksum(t) < 2**62


def test_checksum_reads_bits_not_values():
    assert checksum(torch.tensor([0.0])) != checksum(torch.tensor([-0.0]))
    assert checksum(torch.tensor([float("nan")])) == checksum(torch.tensor([float("nan")]))
    assert checksum(torch.zeros(4)[::2]) == checksum(torch.zeros(2)), "a strided view reads its elements"


# ---- across ranks ------------------------------------------------------------------------------------------
def _shard_noting_warnings(model, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardwise.shard(model, **kwargs)
    return [str(w.message) for w in caught if "initial weights" in str(w.message) or "meta device" in str(w.message)]


def _rank0_model(factory, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def _buffers_equal(model: nn.Module, expected: nn.Module) -> dict:
    return {n: bool(torch.equal(b, expected.get_buffer(n))) for n, b in model.named_buffers()}


def _per_rank_seeds(rank, ws):
    """nanoGPT's seeding: ``1337 + rank`` before the model is built; buffers differ too (BatchNorm-like running
    statistics written per rank), and with broadcast_buffers=False nothing else would make them agree."""
    out = {}
    for strategy in ("full_shard", "no_shard"):
        torch.manual_seed(1337 + rank)
        model = MixedDtypeNet()
        for b in model.buffers():
            if b.is_floating_point():
                b.fill_(float(rank))
        said = _shard_noting_warnings(model, units={MixedDtypeBlock}, strategy=strategy, broadcast_buffers=False)
        expected = _rank0_model(MixedDtypeNet, 1337)
        for b in expected.buffers():
            if b.is_floating_point():
                b.fill_(0.0)
        out[strategy] = dict(said=said, errs={k: v for k, v in sharded_param_errors(model, expected).items() if v},
                             buffers=_buffers_equal(model, expected))
    return out


def _same_seed(rank, ws):
    torch.manual_seed(0)
    model = GPT(tiny_gpt_config())
    return dict(said=_shard_noting_warnings(model, units={Block}))


def _refused_when_false(rank, ws):
    torch.manual_seed(1337 + rank)
    model = GPT(tiny_gpt_config())
    return dict(refusal=error_of(lambda: shardwise.shard(model, units={Block}, sync_module_states=False)))


def _same_seed_false(rank, ws):
    torch.manual_seed(0)
    model = GPT(tiny_gpt_config())
    return dict(refusal=error_of(lambda: shardwise.shard(model, units={Block}, sync_module_states=False)))


def _meta_with_per_rank_seeds(rank, ws):
    """Built on meta after ``manual_seed(1337 + rank)``: every rank initialises rank 0's values (the eager
    build with seed 1337), and afterwards draws from its own generator again (rank 0's advanced by the
    init, as an eager build advances it)."""
    torch.manual_seed(1337 + rank)
    with torch.device("meta"):
        model = GPT(tiny_gpt_config())
    said = _shard_noting_warnings(model, units={Block})
    drawn = torch.rand(4)
    expected = _rank0_model(lambda: GPT(tiny_gpt_config()), 1337)
    if rank == 0:
        own = torch.rand(4)  # the eager build advanced rank 0's generator just as shard()'s init did
    else:
        own = torch.rand(4, generator=torch.Generator().manual_seed(1337 + rank))
    return dict(said=said, errs={k: v for k, v in sharded_param_errors(model, expected).items() if v},
                own_rng=bool(torch.equal(drawn, own)))


def _rank_dependent_init(rank, ws):
    def init(module):
        for p in module._parameters.values():
            if p is not None:
                nn.init.constant_(p, float(rank))

    with torch.device("meta"):
        model = GPT(tiny_gpt_config())
    return dict(refusal=error_of(lambda: shardwise.shard(model, units={Block}, param_init_fn=init)))


def _meta_on_some_ranks(rank, ws):
    """Rank 2 builds on meta, ranks 0 and 1 for real with different seeds: rank 0's values, with a warning;
    rank 0 on meta while others are real: a named error."""
    torch.manual_seed(rank)
    if rank == 2:
        with torch.device("meta"):
            model = MixedDtypeNet()
    else:
        model = MixedDtypeNet()
    said = _shard_noting_warnings(model, units={MixedDtypeBlock})
    expected = _rank0_model(MixedDtypeNet, 0)
    errs = {k: v for k, v in sharded_param_errors(model, expected).items() if v}
    if rank == 0:
        with torch.device("meta"):
            other = MixedDtypeNet()
    else:
        other = MixedDtypeNet()
    return dict(said=said, errs=errs, buffers=_buffers_equal(model, expected),
                rank0_meta=error_of(lambda: shardwise.shard(other, units={MixedDtypeBlock})))


SCENARIOS = {
    "per_rank_seeds": _per_rank_seeds,
    "same_seed": _same_seed,
    "refused_when_false": _refused_when_false,
    "same_seed_false": _same_seed_false,
    "meta_with_per_rank_seeds": _meta_with_per_rank_seeds,
    "rank_dependent_init": _rank_dependent_init,
    "meta_on_some_ranks": _meta_on_some_ranks,
}


def _worker(rank, ws):
    return run_scenarios(SCENARIOS, rank, ws)


@spawn_once
def report() -> list:
    return run_distributed(_worker, WORLD_SIZE)


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_ranks_seeded_apart_train_rank0s_model_and_are_told_so(strategy):
    for rank, res in enumerate(report()):
        r = scenario(res, "per_rank_seeds")[strategy]
        assert r["errs"] == {}, f"rank {rank}: shards differ from rank 0's model: {r['errs']}"
        assert all(r["buffers"].values()), f"rank {rank}: buffers differ from rank 0's: {r['buffers']}"
        if rank == 0:
            (said,) = r["said"]
            assert "initial weights differ in" in said and "took rank 0's" in said, said
            assert "ranks 1, 2 differ from rank 0" in said and "(first 'blocks.0." in said, said
        else:
            assert r["said"] == [], "one line, on rank 0"


def test_ranks_seeded_alike_are_not_told_anything():
    assert all(scenario(res, "same_seed")["said"] == [] for res in report())
    assert all(scenario(res, "same_seed_false")["refusal"] == "no error" for res in report())


def test_sync_module_states_false_refuses_ranks_that_differ_on_every_rank():
    errors = {scenario(res, "refused_when_false")["refusal"] for res in report()}
    assert len(errors) == 1, errors
    (error,) = errors
    assert error.startswith("ShardwiseError: shard(sync_module_states=False): the ranks' initial weights differ")
    assert "blocks.0." in error and "Seed every rank alike" in error


def test_meta_init_gives_rank0s_values_whatever_each_ranks_seed_and_keeps_each_ranks_generator():
    for rank, res in enumerate(report()):
        r = scenario(res, "meta_with_per_rank_seeds")
        assert r["errs"] == {}, f"rank {rank}: meta init differs from the eager build with rank 0's seed: {r['errs']}"
        assert r["own_rng"], f"rank {rank}: its generator after shard() is not its own"
        assert r["said"] == []


def test_an_init_that_reads_the_rank_is_refused_on_every_rank():
    errors = {scenario(res, "rank_dependent_init")["refusal"] for res in report()}
    assert len(errors) == 1, errors
    (error,) = errors
    assert "meta-device init gives different values on different ranks" in error and "'blocks.0." in error


def test_ranks_on_meta_beside_real_ones_take_rank0s_values_unless_rank0_is_on_meta():
    for rank, res in enumerate(report()):
        r = scenario(res, "meta_on_some_ranks")
        assert r["errs"] == {} and all(r["buffers"].values()), f"rank {rank}: {r}"
        assert ("rank 2 built the model on the meta device" in r["said"][0]) if rank == 0 else r["said"] == []
        assert "rank 0 included" in r["rank0_meta"] and "sync_module_states=True" in r["rank0_meta"], r
