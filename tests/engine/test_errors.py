"""Misuse raises ``shardwise.ShardwiseError`` on every rank, naming the thing at fault; it never hangs.

The distributed cases run in one spawn at world size 2: each case builds a fresh model, provokes the error
on every rank, and records what each rank raised. A case that raised on one rank only would leave the other
waiting in a collective; the harness's collective timeout turns that into a failure, not a hang.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardwise
from harness import run_distributed
from parity_utils import spawn_once
from models import Block, GPT, gpt_loss, tiny_gpt_config
from shardwise import ShardwiseError, Strategy
WORLD_SIZE = 2
VOCAB = tiny_gpt_config().vocab_size


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_gpt_config())


def _shard_twice():
    model = shardwise.shard(_gpt(), units={Block})
    shardwise.shard(model, units={Block})


def _unit_class_absent():
    shardwise.shard(_gpt(), units={Block, nn.GRU})


def _mesh_2d_for_1d_strategy():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    shardwise.shard(_gpt(), units={Block}, strategy="full_shard", mesh=mesh)


def _mesh_1d_for_hybrid_strategy():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    shardwise.shard(_gpt(), units={Block}, strategy="hybrid_shard", mesh=mesh)


def _optimizer_stepped_before_shard():
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    gpt_loss(model, x, x).backward()
    opt.step()  # its momentum buffers: whole tensors of the originals, different on each rank
    shardwise.shard(model, units={Block})
    x = torch.randint(0, VOCAB, (2, 8))
    gpt_loss(model, x, x).backward()
    opt.step()


def _part_on_meta_part_on_cpu():
    model = _gpt()
    with torch.device("meta"):
        model.blocks[1] = Block(model.config)
    shardwise.shard(model, units={Block})


def _bad_state_dict(edit):
    def case():
        model = shardwise.shard(_gpt(), units={Block})
        sd = {}
        if torch.distributed.get_rank() == 0:
            sd = dict(_gpt().state_dict())
            edit(sd)
        shardwise.load_full_state_dict(model, sd)

    return case


def _drop_head(sd):
    del sd["lm_head.weight"]


def _add_bogus(sd):
    sd["bogus.weight"] = torch.zeros(3)


def _misshape(sd):
    sd["blocks.1.mlp.c_fc.weight"] = torch.zeros(7, 5)


def _unknown_strategy():
    shardwise.shard(_gpt(), units={Block}, strategy="zero4")


CASES = {
    "shard_twice": _shard_twice,
    "unit_class_absent": _unit_class_absent,
    "mesh_2d_for_1d_strategy": _mesh_2d_for_1d_strategy,
    "mesh_1d_for_hybrid_strategy": _mesh_1d_for_hybrid_strategy,
    "optimizer_stepped_before_shard": _optimizer_stepped_before_shard,
    "part_on_meta_part_on_cpu": _part_on_meta_part_on_cpu,
    "state_dict_missing_key": _bad_state_dict(_drop_head),
    "state_dict_extra_key": _bad_state_dict(_add_bogus),
    "state_dict_wrong_shape": _bad_state_dict(_misshape),
    "unknown_strategy": _unknown_strategy,
}


def _upper_case_strategy_name() -> str:
    model = shardwise.shard(_gpt(), units={Block}, strategy="FULL_SHARD")
    x = torch.randint(0, VOCAB, (2, 8))
    gpt_loss(model, x, x).backward()
    return shardwise.engine.core.runtime.runtime_of(model).strategy.value


def _errors_worker(rank, ws):
    out = {}
    for name, case in CASES.items():
        try:
            case()
            out[name] = "no error"
        except ShardwiseError as e:
            out[name] = f"ShardwiseError: {e}"
        except Exception as e:  # noqa: BLE001 - the wrong exception type is itself a failure, reported as text
            out[name] = f"{type(e).__name__}: {e}"
    out["upper_case"] = _upper_case_strategy_name()
    return out


@spawn_once
def report() -> list:
    return run_distributed(_errors_worker, WORLD_SIZE)


def raised_on_every_rank(case: str, *fragments: str) -> None:
    """Assert every rank raised ShardwiseError for ``case`` with a message containing all ``fragments``."""
    for rank, res in enumerate(report()):
        text = res[case]
        assert text.startswith("ShardwiseError: "), f"rank {rank}: {text}"
        for f in fragments:
            assert f in text, f"rank {rank}: {f!r} not in {text!r}"


def test_shard_called_twice_is_rejected():
    """shard() on an already sharded model raises, naming the model class."""
    raised_on_every_rank("shard_twice", "already called", "GPT")


def test_unit_class_absent_from_model_is_named():
    """units={..., nn.GRU} on a model without a GRU raises, naming GRU."""
    raised_on_every_rank("unit_class_absent", "GRU", "do not occur")


def test_2d_mesh_for_1d_strategy_is_rejected():
    """full_shard on a 2-D mesh raises, naming the strategy and pointing at the hybrid strategies."""
    raised_on_every_rank("mesh_2d_for_1d_strategy", "full_shard", "2-D", "hybrid_shard")


def test_1d_mesh_for_hybrid_strategy_is_rejected():
    """hybrid_shard on a 1-D mesh raises, naming the strategy and the 2-D mesh it needs."""
    raised_on_every_rank("mesh_1d_for_hybrid_strategy", "hybrid_shard", "2-D")


def test_optimizer_that_stepped_differently_on_each_rank_before_shard_fails_at_its_next_step():
    """An optimizer holding a different state on each rank for the pre-shard parameters raises at its next
    step(), naming a parameter (one holding the same state everywhere, or none, takes the shard parameters
    and its elements of the state: test_user_idioms.py)."""
    raised_on_every_rank("optimizer_stepped_before_shard", "wte.weight", "differs across ranks")


def test_parameters_on_meta_and_cpu_are_rejected():
    """A model partly on meta and partly on CPU raises, naming one parameter on each device."""
    raised_on_every_rank("part_on_meta_part_on_cpu", "blocks.1.", "on meta", "on cpu")


def test_load_full_state_dict_missing_key_raises_on_every_rank():
    """Rank 0's dict lacks a key (others pass {}): every rank raises, naming the key."""
    raised_on_every_rank("state_dict_missing_key", "missing", "lm_head.weight")


def test_load_full_state_dict_extra_key_raises_on_every_rank():
    """Rank 0's dict has a key the model lacks: every rank raises, naming the key."""
    raised_on_every_rank("state_dict_extra_key", "unexpected", "bogus.weight")


def test_load_full_state_dict_wrong_shape_raises_on_every_rank():
    """Rank 0's dict has a mis-shaped tensor: every rank raises, naming the key and both shapes."""
    raised_on_every_rank("state_dict_wrong_shape", "blocks.1.mlp.c_fc.weight", "(7, 5)", "(100, 25)")


def test_unknown_strategy_name_is_rejected_with_the_valid_names():
    """strategy='zero4' raises, naming it and listing the valid strategies."""
    raised_on_every_rank("unknown_strategy", "'zero4'", "full_shard", "hybrid_shard_zero2")


def test_fsdp1_upper_case_strategy_names_are_accepted():
    """strategy='FULL_SHARD' (FSDP1 spelling) shards and trains like 'full_shard'."""
    assert [r["upper_case"] for r in report()] == ["full_shard"] * WORLD_SIZE


# ---- errors raised before any process group is needed (this process has none) --------------------------
def test_shard_without_process_group_explains_how_to_initialise():
    """shard() before init_process_group raises, saying to call init_process_group or use torchrun."""
    assert not torch.distributed.is_initialized()
    with pytest.raises(ShardwiseError, match="init_process_group"):
        shardwise.shard(_gpt(), units={Block})


@pytest.mark.parametrize("name,expected", [("full_shard", Strategy.FULL_SHARD), ("FULL_SHARD", Strategy.FULL_SHARD),
                                           ("SHARD_GRAD_OP", Strategy.SHARD_GRAD_OP),
                                           ("NO_SHARD", Strategy.NO_SHARD), ("HYBRID_SHARD", Strategy.HYBRID_SHARD),
                                           ("_HYBRID_SHARD_ZERO2", Strategy.HYBRID_SHARD_ZERO2),
                                           (Strategy.NO_SHARD, Strategy.NO_SHARD)])
def test_strategy_names_parse_in_either_case(name, expected):
    """Strategy.parse accepts our lower-case names, FSDP1's upper-case ones (incl. _HYBRID_SHARD_ZERO2) and enums."""
    assert Strategy.parse(name) is expected


def test_unknown_strategy_parse_error_lists_valid_names():
    """Strategy.parse('zero4') raises ShardwiseError listing every valid name."""
    with pytest.raises(ShardwiseError) as e:
        Strategy.parse("zero4")
    for s in Strategy:
        assert s.value in str(e.value)
