"""Full state dicts: the unsharded model's keys and values, gathered to rank 0; loading one back.

One spawn at world size 3. Saving and loading copy values, so equality is bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch

import shardwise
from harness import run_distributed
from models import Block, GPT, MixedDtypeBlock, MixedDtypeNet, gpt_loss, tiny_gpt_config
from parity_utils import (assert_parity, is_sharded, make_batches, parity_check, run_scenarios, scenario, simple_step,
                          spawn_once)

WORLD_SIZE = 3
VOCAB = tiny_gpt_config().vocab_size

MODELS = {
    "gpt": (lambda: GPT(tiny_gpt_config()), {Block}),
    "gpt_tied": (lambda: GPT(tiny_gpt_config(tie_weights=True)), {Block}),
    "mixed_dtypes_and_buffers": (MixedDtypeNet, {MixedDtypeBlock}),
}


def _bitwise_differences(sd: dict, expected: dict) -> list[str]:
    if list(sd) != list(expected):
        return [f"keys (in order) differ: got {list(sd)}, expected {list(expected)}"]
    return [k for k in expected if not (sd[k].dtype == expected[k].dtype and sd[k].shape == expected[k].shape
                                        and torch.equal(sd[k], expected[k]))]


def _full_state_dict(rank, ws):
    out = {}
    for name, (factory, units) in MODELS.items():
        torch.manual_seed(0)
        unsharded = factory()
        model = shardwise.shard(copy.deepcopy(unsharded), units=units)
        sd = shardwise.full_state_dict(model)
        out[name] = dict(n_keys=len(sd), diffs=_bitwise_differences(sd, unsharded.state_dict()) if rank == 0 else [],
                         devices=sorted({str(v.device) for v in sd.values()}))
    return out


def _load_round_trip(rank, ws):
    out = {}
    for name, (factory, units) in MODELS.items():
        torch.manual_seed(0)
        model = shardwise.shard(factory(), units=units)
        torch.manual_seed(1)
        other = factory()  # different values, same structure
        sd = other.state_dict() if rank == 0 else {}
        shardwise.load_full_state_dict(model, sd)
        back = shardwise.full_state_dict(model)
        buffers_equal = all(torch.equal(b, other.get_buffer(n)) for n, b in model.named_buffers())
        out[name] = dict(diffs=_bitwise_differences(back, other.state_dict()) if rank == 0 else [],
                         buffers_equal=buffers_equal)
    return out


def _load_then_train(rank, ws):
    """An optimizer built before load_full_state_dict keeps training the loaded values (loading is in place)."""
    torch.manual_seed(1)
    loaded = GPT(tiny_gpt_config())
    torch.manual_seed(0)
    initial = GPT(tiny_gpt_config())

    def load_before_first_step(model, batch, step, take):
        if step == 0:
            if is_sharded(model):
                shardwise.load_full_state_dict(model, loaded.state_dict() if rank == 0 else {})
            else:
                model.load_state_dict(loaded.state_dict())
        return simple_step(gpt_loss)(model, batch, step, take)

    return parity_check(initial, load_before_first_step, make_batches(3, VOCAB), rank, ws,
                        shard_kwargs=dict(units={Block}))[0]


SCENARIOS = {"full_state_dict": _full_state_dict, "round_trip": _load_round_trip, "load_then_train": _load_then_train}


def _state_dict_worker(rank, ws):
    return run_scenarios(SCENARIOS, rank, ws)


@spawn_once
def report() -> list:
    return run_distributed(_state_dict_worker, WORLD_SIZE)


@pytest.mark.parametrize("model", list(MODELS))
def test_full_state_dict_on_rank0_equals_unsharded_state_dict(model):
    """full_state_dict: rank 0 gets the unsharded model's state_dict (same keys, same order, equal CPU tensors)."""
    r = scenario(report()[0], "full_state_dict")[model]
    assert r["diffs"] == [], r["diffs"]
    assert r["devices"] == ["cpu"]


def test_full_state_dict_is_empty_on_other_ranks():
    """full_state_dict returns {} on every rank but 0 (they take part in the gathers only)."""
    for rank in range(1, WORLD_SIZE):
        for name, r in scenario(report()[rank], "full_state_dict").items():
            assert r["n_keys"] == 0, f"rank {rank}, {name}: {r['n_keys']} keys"


@pytest.mark.parametrize("model", list(MODELS))
def test_load_full_state_dict_round_trips_bitwise(model):
    """load_full_state_dict(rank 0's dict, {} elsewhere), then full_state_dict returns it exactly, buffers too."""
    for rank, res in enumerate(report()):
        r = scenario(res, "round_trip")[model]
        assert r["diffs"] == [], f"rank {rank}: {r['diffs']}"
        assert r["buffers_equal"], f"rank {rank}: buffers not loaded"


def test_loading_in_place_keeps_existing_optimizer_training_the_loaded_weights():
    """An optimizer built before load_full_state_dict trains the loaded values (parity with a reference)."""
    assert_parity(scenario(report()[0], "load_then_train"))
