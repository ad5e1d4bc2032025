"""The sharding plan: pure bookkeeping, checked without processes or memory (models on the meta device)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from models import (TINY_GPT, WORLD_SIZES, Block, GPT, LoRABlock, LoRANet, MiniBlock, MixedDtypeBlock, MixedDtypeNet,
                    SharedAcrossUnits, tiny_gpt_config)
from shardwise import ShardwiseError
from shardwise.models.gpt import MLP
from shardwise.engine.base.plan import build_plan, resolve_unit_modules


def meta(factory):
    with torch.device("meta"):
        return factory()


def owners(plan) -> dict[str, str]:
    """fqn of every registration -> label of the unit that owns the parameter."""
    return {r.fqn: u.label for u in plan.units for s in u.params() for r in s.refs}


TEST_MODELS = {
    "gpt": (lambda: GPT(tiny_gpt_config()), {Block}),
    "gpt_tied": (lambda: GPT(tiny_gpt_config(tie_weights=True)), {Block}),
    "shared_across_units": (SharedAcrossUnits, {MiniBlock}),
    "lora": (LoRANet, {LoRABlock}),
    "mixed_dtypes": (MixedDtypeNet, {MixedDtypeBlock}),
}


@pytest.mark.parametrize("name", list(TEST_MODELS))
@pytest.mark.parametrize("shard_size", [1, 2, 3, 4, 7])
def test_every_parameter_is_laid_out_once_and_every_element_has_exactly_one_owner_rank(name, shard_size):
    """Each unique parameter is in one group, back to back from offset 0; the ranks' shards partition each one."""
    factory, units = TEST_MODELS[name]
    model = meta(factory)
    plan = build_plan(model, units, shard_size)
    unique = {id(p) for p in model.parameters()}
    specs = list(plan.params())
    assert len(specs) == len(unique)
    for g in plan.groups():
        offset = 0
        for s in g.params:
            assert s.offset == offset
            offset += s.numel
        assert g.numel == offset
        assert g.padded_numel == g.shard_numel * shard_size
        assert g.numel <= g.padded_numel < g.numel + shard_size
        for s in g.params:
            pieces = [s.local_range(*g.shard_range(r)) for r in range(shard_size)]
            covered = [i for lo, hi in pieces for i in range(lo, hi)]
            assert covered == list(range(s.numel)), f"{s.fqn}: ranks' pieces do not partition the parameter"


@pytest.mark.parametrize("name", list(TEST_MODELS))
def test_test_models_have_no_flat_group_that_divides_by_the_tested_world_sizes(name):
    """Test setup: every trainable buffer leaves a remainder at world sizes 2, 3, 4 (shards cut parameters)."""
    factory, units = TEST_MODELS[name]
    plan = build_plan(meta(factory), units, 1)
    for g in plan.groups():
        if g.requires_grad:
            assert all(g.numel % ws for ws in WORLD_SIZES), f"{name}: {g.unit_fqn or '<root>'} has {g.numel} elements"


def test_gpt_units_are_blocks_in_order_then_the_root_last():
    """units={Block}: one unit per block in module order, then the root unit (label '<root>') owning the rest."""
    plan = build_plan(meta(lambda: GPT(tiny_gpt_config())), {Block}, 3)
    assert [u.label for u in plan.units] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert plan.root.is_root and plan.units[-1] is plan.root
    own = owners(plan)
    assert own["blocks.1.mlp.c_fc.weight"] == "blocks.1"
    assert own["wte.weight"] == own["lm_head.weight"] == own["ln_f.bias"] == "<root>"


def test_tied_weight_is_one_parameter_with_two_names_in_the_root():
    """GPT(tie_weights=True): wte.weight and lm_head.weight are one ParamSpec with two refs, laid out once."""
    plan = build_plan(meta(lambda: GPT(tiny_gpt_config(tie_weights=True))), {Block}, 3)
    tied = [s for s in plan.params() if len(s.refs) > 1]
    assert len(tied) == 1
    assert [r.fqn for r in tied[0].refs] == ["wte.weight", "lm_head.weight"]
    assert owners(plan)["lm_head.weight"] == "<root>"
    d, v, t = TINY_GPT["n_embd"], TINY_GPT["vocab_size"], TINY_GPT["block_size"]
    assert sum(g.numel for g in plan.root.groups) == d * (v + t + 2)  # the head's weight is not counted twice


def test_parameter_shared_by_two_units_belongs_to_their_innermost_common_ancestor():
    """A Linear used in blocks.0 and blocks.1 belongs to the root, not to either block."""
    plan = build_plan(meta(SharedAcrossUnits), {MiniBlock}, 2)
    own = owners(plan)
    assert own["blocks.0.proj.weight"] == own["blocks.1.proj.weight"] == "<root>"
    assert own["blocks.2.proj.weight"] == "blocks.2"  # not shared: stays in its block
    assert own["blocks.0.fc.weight"] == "blocks.0"


def test_nested_units_own_their_parameters_and_the_outer_unit_the_rest():
    """units={Block, MLP}: each MLP is its own unit inside its Block's unit; the Block keeps attention and norms."""
    plan = build_plan(meta(lambda: GPT(tiny_gpt_config())), {Block, MLP}, 2)
    own = owners(plan)
    assert own["blocks.0.mlp.c_fc.weight"] == "blocks.0.mlp"
    assert own["blocks.0.attn.c_attn.weight"] == "blocks.0"
    assert [u.label for u in plan.units][:2] == ["blocks.0", "blocks.0.mlp"]


def test_frozen_and_trainable_parameters_of_a_unit_get_separate_groups():
    """LoRA block: frozen base weights in a requires_grad=False group, adapters and norms in the trainable group."""
    plan = build_plan(meta(LoRANet), {LoRABlock}, 3)
    unit = plan.units[0]
    by_rg = {g.requires_grad: [s.fqn for s in g.params] for g in unit.groups}
    assert set(by_rg) == {True, False}
    assert all(".base." in n for n in by_rg[False])
    assert not any(".base." in n for n in by_rg[True])
    assert all(s.requires_grad == g.requires_grad for g in plan.groups() for s in g.params)


def test_parameters_of_different_dtypes_get_separate_groups():
    """One group per (dtype, requires_grad) in a unit: a buffer never mixes dtypes."""
    plan = build_plan(meta(MixedDtypeNet), {MixedDtypeBlock}, 2)
    groups = sorted((str(g.dtype), g.requires_grad) for g in plan.units[0].groups)
    assert groups == [("torch.bfloat16", False), ("torch.float32", True), ("torch.float64", True)]
    assert all(s.dtype == g.dtype for g in plan.groups() for s in g.params)
    assert all(g.nbytes == g.padded_numel * g.dtype.itemsize for g in plan.groups())


def test_plan_for_a_large_world_size_needs_no_memory():
    """A meta model plans for 1000 ranks: small groups are mostly padding, each rank's shard is one element or more."""
    plan = build_plan(meta(lambda: GPT(tiny_gpt_config())), {Block}, 1000)
    for g in plan.groups():
        assert g.shard_numel == -(-g.numel // 1000)


def test_units_auto_takes_the_children_of_the_largest_module_list():
    """units='auto' without _no_split_modules: the children of the largest nn.ModuleList (the GPT blocks)."""
    model = meta(lambda: GPT(tiny_gpt_config()))
    assert [n for n, _ in resolve_unit_modules(model, "auto")] == ["blocks.0", "blocks.1", "blocks.2"]


def test_units_auto_prefers_hugging_face_no_split_modules():
    """units='auto' on a model with _no_split_modules = ['MLP'] picks the classes named there."""
    model = meta(lambda: GPT(tiny_gpt_config()))
    model._no_split_modules = ["MLP"]
    assert [n for n, _ in resolve_unit_modules(model, "auto")] == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]


def test_units_callable_and_none():
    """units may be a predicate on modules; units=None makes the whole model one root unit."""
    model = meta(lambda: GPT(tiny_gpt_config()))
    found = resolve_unit_modules(model, lambda m: isinstance(m, nn.LayerNorm))
    assert [n for n, _ in found][:2] == ["blocks.0.ln_1", "blocks.0.ln_2"]
    plan = build_plan(model, None, 2)
    assert [u.label for u in plan.units] == ["<root>"]


def test_units_auto_without_repeated_blocks_makes_the_whole_model_one_unit():
    """units='auto' on a model with no ModuleList and no _no_split_modules (a CNN, an MLP) plans it as
    units=None does: one root unit (shard() says so: tests/engine/test_ddp_idioms.py)."""
    plan = build_plan(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), "auto", 2)
    assert [u.label for u in plan.units] == ["<root>"] and len(list(plan.params())) == 4


def test_units_may_be_the_modules_themselves_as_fsdp2_shards_each_layer():
    """units=[the blocks themselves] plans as units={Block}; a module, or classes and modules mixed, too; the
    model itself among them changes nothing (the root is always a unit)."""
    model = meta(lambda: GPT(tiny_gpt_config()))
    by_class = [n for n, _ in resolve_unit_modules(model, {Block})]
    assert [n for n, _ in resolve_unit_modules(model, list(model.blocks) + [model])] == by_class
    assert [n for n, _ in resolve_unit_modules(model, model.blocks[1])] == ["blocks.1"]
    mixed = [n for n, _ in resolve_unit_modules(model, [MLP, model.blocks[0]])]
    assert mixed == ["blocks.0", "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    assert build_plan(model, list(model.blocks), 2).units[0].label == build_plan(model, {Block}, 2).units[0].label


def test_a_module_outside_the_model_is_refused_by_name():
    model = meta(lambda: GPT(tiny_gpt_config()))
    with pytest.raises(ShardwiseError, match="not part of this GPT .first a Linear"):
        build_plan(model, [model.blocks[0], nn.Linear(2, 2)], 2)


@pytest.mark.parametrize("units,fragment", [("blocks", "'blocks'"), ({int}, "neither nn.Module classes"),
                                            ({Block, nn.GRU}, "GRU")])
def test_bad_units_argument_is_rejected_with_the_culprit_named(units, fragment):
    """An unknown units string, a non-module class, or a class absent from the model raises ShardwiseError naming it."""
    with pytest.raises(ShardwiseError, match=fragment):
        build_plan(meta(lambda: GPT(tiny_gpt_config())), units, 2)


def test_shard_size_must_be_positive():
    """build_plan(shard_size=0) raises ShardwiseError."""
    with pytest.raises(ShardwiseError, match="shard_size"):
        build_plan(nn.Linear(2, 2), None, 0)
