"""Filling the shards at shard() time: from an eager model, from the meta device, from rank 0.

One spawn at world size 3. Equality here is bitwise (``torch.equal``): these paths copy values, they do
no arithmetic, so any difference at all is a bug.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import shardwise
from harness import run_distributed
from models import Block, GPT, MixedDtypeBlock, MixedDtypeNet, tiny_gpt_config
from parity_utils import run_scenarios, scenario, sharded_param_errors, spawn_once

WORLD_SIZE = 3


def _differences(sd: dict, expected: dict) -> list[str]:
    """Keys whose values are not bitwise equal (or whose key lists differ)."""
    if list(sd) != list(expected):
        return [f"keys differ: {sorted(set(sd) ^ set(expected))}"]
    return [k for k in expected if not (sd[k].dtype == expected[k].dtype and torch.equal(sd[k], expected[k]))]


def _meta_init(rank, ws):
    out = {}
    for tie in (False, True):
        cfg = tiny_gpt_config(tie_weights=tie)
        torch.manual_seed(0)
        eager = GPT(cfg)
        with torch.device("meta"):
            model = GPT(cfg)
        torch.manual_seed(0)  # the same seed as the eager build: shard() consumes the RNG in module order
        shardwise.shard(model, units={Block})
        sd = shardwise.full_state_dict(model)
        out[f"tie={tie}"] = dict(
            diffs=_differences(sd, eager.state_dict()) if rank == 0 else [],
            devices=sorted({str(p.device) for p in model.parameters()}),
            still_tied=(model.lm_head.weight is model.wte.weight) == tie,
        )
    return out


def _constant_init(module: nn.Module) -> None:
    for p in module._parameters.values():
        if p is not None:
            nn.init.constant_(p, 0.25)


def _meta_init_with_param_init_fn(rank, ws):
    with torch.device("meta"):
        model = GPT(tiny_gpt_config())
    shardwise.shard(model, units={Block}, param_init_fn=_constant_init)
    sd = shardwise.full_state_dict(model)
    return dict(not_constant=[k for k, v in sd.items() if not torch.all(v == 0.25)] if rank == 0 else [],
                n_keys=len(sd))


def _build(seed: int, meta: bool, factory):
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return factory()
    return factory()


def _sync_module_states(rank, ws):
    out = {}
    for name, factory, units in [("gpt", lambda: GPT(tiny_gpt_config()), {Block}),
                                 ("with_buffers", MixedDtypeNet, {MixedDtypeBlock})]:
        expected = _build(0, False, factory)  # what rank 0 builds
        # rank 0: seed 0; rank 1: another seed; rank 2: the meta device
        model = _build(rank, rank == 2, factory)
        shardwise.shard(model, units=units, sync_module_states=True)
        errs = sharded_param_errors(model, expected)
        buffers = {n: torch.equal(b, expected.get_buffer(n)) for n, b in model.named_buffers()}
        sd = shardwise.full_state_dict(model)
        out[name] = dict(shard_errs={k: v for k, v in errs.items() if v != 0.0}, buffers=buffers,
                         diffs=_differences(sd, expected.state_dict()) if rank == 0 else [],
                         devices=sorted({str(t.device) for t in list(model.parameters()) + list(model.buffers())}))
    return out


def _eager_copy(rank, ws):
    torch.manual_seed(0)
    initial = MixedDtypeNet()
    model = shardwise.shard(copy.deepcopy(initial), units={MixedDtypeBlock})
    errs = sharded_param_errors(model, initial)
    return dict(shard_errs={k: v for k, v in errs.items() if v != 0.0})


SCENARIOS = {
    "meta_init": _meta_init,
    "param_init_fn": _meta_init_with_param_init_fn,
    "sync_module_states": _sync_module_states,
    "eager_copy": _eager_copy,
}


class Rotary(nn.Module):
    """A parameter-less module whose buffer is computed in __init__ (RoPE's inv_freq): on meta, nothing
    can recompute it, so shard() must refuse instead of leaving garbage that differs per rank."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)


class WithRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.rotary = Rotary()


def _init_rotary(module: nn.Module) -> None:
    if isinstance(module, Rotary):
        module.inv_freq.copy_(Rotary().inv_freq)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _meta_buffers(rank, ws):
    out = {}
    with torch.device("meta"):
        model = WithRotary()
    try:
        shardwise.shard(model, units={nn.Linear})
        out["default"] = "no error"
    except shardwise.ShardwiseError as e:
        out["default"] = str(e)
    with torch.device("meta"):
        model = WithRotary()
    shardwise.shard(model, units={nn.Linear}, param_init_fn=_init_rotary)
    out["param_init_fn"] = (model.rotary.inv_freq - Rotary().inv_freq).abs().max().item()
    return out


SCENARIOS["meta_buffers"] = _meta_buffers


def _materialize_worker(rank, ws):
    return run_scenarios(SCENARIOS, rank, ws)


@spawn_once
def report() -> list:
    return run_distributed(_materialize_worker, WORLD_SIZE)


def test_a_meta_buffer_no_init_writes_is_a_named_error_and_param_init_fn_fills_it():
    """RoPE-style buffer of a parameter-less module built on meta: a ShardwiseError naming it on every rank,
    not uninitialised memory; with a param_init_fn that writes it, the exact values."""
    for r in report():
        out = scenario(r, "meta_buffers")
        assert "rotary.inv_freq (Rotary)" in out["default"] and "param_init_fn" in out["default"], out
        assert out["param_init_fn"] == 0.0


@pytest.mark.parametrize("tie", [False, True])
def test_meta_device_model_materialises_bitwise_equal_to_eager_build_with_same_seed(tie):
    """GPT built on meta and materialised by shard() equals GPT built eagerly with the same seed, bit for bit."""
    for rank, res in enumerate(report()):
        r = scenario(res, "meta_init")[f"tie={tie}"]
        assert r["diffs"] == [], f"rank {rank}: values differ for {r['diffs']}"
        assert r["devices"] == ["cpu"], f"rank {rank}: parameters left on {r['devices']}"
        assert r["still_tied"]


def test_param_init_fn_initialises_meta_parameters():
    """param_init_fn(module) replaces reset_parameters() for every module that owns parameters."""
    r = scenario(report()[0], "param_init_fn")
    assert r["n_keys"] > 0 and r["not_constant"] == []


@pytest.mark.parametrize("model", ["gpt", "with_buffers"])
def test_sync_module_states_gives_every_rank_rank0_weights_and_buffers(model):
    """sync_module_states=True: ranks built with seed 0, seed 1 and on meta end with rank 0's weights and buffers."""
    for rank, res in enumerate(report()):
        r = scenario(res, "sync_module_states")[model]
        assert r["shard_errs"] == {}, f"rank {rank}: shards differ from rank 0's model: {r['shard_errs']}"
        assert all(r["buffers"].values()), f"rank {rank}: buffers differ: {r['buffers']}"
        assert r["diffs"] == [], f"rank {rank}: full_state_dict differs for {r['diffs']}"
        assert r["devices"] == ["cpu"]


def test_eager_model_shards_hold_exact_slices_of_its_parameters():
    """Sharding an eagerly built model copies each rank's slice exactly (three dtypes, frozen and trainable)."""
    for rank, res in enumerate(report()):
        assert scenario(res, "eager_copy")["shard_errs"] == {}, f"rank {rank}"
