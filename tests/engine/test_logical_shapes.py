"""shardwise.param_info / named_param_infos / num_parameters: the unsharded model's names and shapes, and each
rank's piece, for every kind of unit (tied weights, frozen parameters, several dtypes in one unit)."""

from __future__ import annotations

import types

import pytest
import torch

from harness import run_distributed
from models import GPT, Block, LoRABlock, LoRANet, MiniBlock, MixedDtypeBlock, MixedDtypeNet, SharedAcrossUnits
from models import tiny_gpt_config
from parity_utils import spawn_once

MODELS = {
    "gpt_tied": (lambda: GPT(tiny_gpt_config(tie_weights=True)), {Block}),
    "shared_across_units": (SharedAcrossUnits, {MiniBlock}),
    "lora_frozen": (LoRANet, {LoRABlock}),
    "mixed_dtypes": (MixedDtypeNet, {MixedDtypeBlock}),
}


def _worker(rank: int, world_size: int) -> dict:
    import shardwise
    from shardwise.engine.surface.pieces import local_of
    from shardwise.trainer.loop import build_optimizer

    out = {}
    for name, (factory, units) in MODELS.items():
        torch.manual_seed(0)
        model = factory()
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        all_names = {n: [] for n in full}
        for n, p in model.named_parameters(remove_duplicate=False):
            first = next(k for k, v in model.named_parameters() if v is p)
            all_names[first].append(n)
        shardwise.shard(model, units=units)
        infos = list(shardwise.named_param_infos(model))
        assert [n for n, _ in infos] == list(full), name
        pieces = {}
        for (n, info), p in zip(infos, model.parameters()):
            assert info.name == n and info.shape == full[n].shape and info.numel == full[n].numel(), (name, n)
            assert list(info.names) == all_names[n], (name, n, info.names)
            assert p.shape == full[n].shape and p.numel() == info.numel, (name, n)  # a parameter reads whole
            mine = local_of(p)  # this rank's elements
            assert mine.numel() == info.local_numel, (name, n)
            want = full[n].reshape(-1)[info.offset:info.offset + info.local_numel]
            assert torch.equal(mine.detach(), want), f"{name}: {n}'s shard is not elements [offset, offset+local)"
            pieces[n] = (info.offset, info.local_numel, info.numel)
        assert shardwise.num_parameters(model) == sum(t.numel() for t in full.values())
        assert shardwise.num_parameters(model, only_trainable=True) == sum(
            p.numel() for n, p in full.items() if dict(factory().named_parameters())[n].requires_grad)
        cfg = types.SimpleNamespace(weight_decay=0.1, lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, optimizer="adamw",
                                    cpu_offload=False)
        decay = {id(p) for p in build_optimizer(model, cfg).param_groups[0]["params"]}
        muon = build_optimizer(model, types.SimpleNamespace(**{**vars(cfg), "optimizer": "muon"}))
        on_muon = {id(p) for g in muon.param_groups if g["use_muon"] for p in g["params"]}
        assert on_muon and on_muon <= decay, f"{name}: the trainer's Muon took a non-matrix or nothing"
        decayed = sorted(n for n, p in model.named_parameters() if id(p) in decay)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert decayed == sorted(n for n in trainable if full[n].dim() >= 2), (name, decayed)
        out[name] = pieces
    try:
        shardwise.param_info(torch.nn.Parameter(torch.zeros(3)))
        raise AssertionError("param_info accepted a parameter that is not a shard")
    except shardwise.ShardwiseError as e:
        assert "not a shardwise shard parameter" in str(e)
    return out


@spawn_once
def _report(world_size: int) -> list[dict]:
    return run_distributed(_worker, world_size)


@pytest.mark.parametrize("world_size", [pytest.param(w, marks=pytest.mark.slow) for w in (1, 2)] + [3] +
                         [pytest.param(4, marks=pytest.mark.slow)])
def test_param_info_names_shapes_and_ranges_match_the_unsharded_model(world_size):
    """Every rank sees the full model's names and shapes (including trainer's decay grouping by shape); the
    ranks' element ranges tile every parameter exactly once, in rank order."""
    per_rank = _report(world_size)
    for name in MODELS:
        for param, (_, _, numel) in per_rank[0][name].items():
            ranges = [per_rank[r][name][param][:2] for r in range(world_size)]
            covered = [i for off, n in ranges for i in range(off, off + n)]
            assert covered == list(range(numel)), f"{name}: {param}'s pieces {ranges} do not tile {numel} elements"
