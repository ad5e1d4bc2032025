"""QLoRA on a sharded 4-bit MoE base (Qwen3-MoE, 4 experts, top 2): the fused experts are stored as
QuantExperts (each expert's gate, up and down matrix in bitsandbytes' 4-bit format, uint8 parameters),
sharded like any frozen parameter, each rank holding ~1/N of all quantised bytes, every expert byte held by
exactly one rank, with no gradient and no optimizer state; and training LoRA on the attention projections
at world sizes 1-4 equals one process running the same quantised model through the same dequantisation
code (fp32 compute, 1e-6): SGD with momentum, and AdamW with activation checkpointing. (No optimizer state
can reach the base: only the adapters require grad, asserted below.)"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from harness import run_distributed
from parity_utils import assert_parity, make_batches, run_scenarios, scenario, simple_step, spawn_once, train_pair
from qlora_models import MOE_TARGETS, VOCAB, lm_loss, quantised_lora_model

STEPS = 3


def moe_model():
    return quantised_lora_model("qwen3_moe", targets=MOE_TARGETS)


def _parity(rank, ws, optimizer, **shard_kwargs):
    """Parity of a few steps; then, per rank, the uint8 bytes it holds (all 4-bit weights) against the total,
    its share of the experts' bytes, and that none of them has a gradient or optimizer state."""
    import shardwise
    from shardwise.engine.runtime import runtime_of
    from shardwise.quant.experts import QuantExperts

    initial = moe_model()
    ref = copy.deepcopy(initial)
    model = copy.deepcopy(initial)
    modules = [m for m in model.modules() if isinstance(m, QuantExperts)]
    total_expert_bytes = sum(p.numel() for m in modules for p in m.parameters())
    total_bytes = sum(p.numel() for p in model.parameters() if p.dtype == torch.uint8)
    model = shardwise.shard(model, units="auto", **shard_kwargs)
    out = train_pair(model, ref, simple_step(lm_loss), make_batches(STEPS, VOCAB), rank, ws, optimizer=optimizer)
    experts = [p for m in modules for p in m.parameters()]  # the shard parameters now
    groups = [g for u in runtime_of(model).units for g in u.flat_groups if g.plan.dtype == torch.uint8]
    out["bytes"] = {
        "expert_dtypes": sorted({str(p.dtype) for p in experts}),
        "local_expert_bytes": sum(shardwise.param_info(p).local_numel for p in experts),
        "total_expert_bytes": total_expert_bytes,
        "local_bytes": sum(g.shard.numel() for g in groups),
        "total_bytes": total_bytes,
        "frozen": all(not p.requires_grad and p.grad is None for p in experts)
                  and all(not g.plan.requires_grad for g in groups),
        "trainable_only_lora": all("lora_" in n for n, p in model.named_parameters() if p.requires_grad),
    }
    return out


def _worker(rank, ws):
    return run_scenarios({
        "sgd": lambda r, w: _parity(r, w, "sgd"),
        "adamw_ckpt": lambda r, w: _parity(r, w, "adamw", activation_checkpointing=True),
    }, rank, ws)


@spawn_once
def _report(ws: int) -> list:
    return run_distributed(_worker, ws, timeout_s=240)


WORLD_SIZES = [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3,
               pytest.param(4, marks=pytest.mark.slow)]  # ws 3 (uneven shards) in the default run


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("case", ["sgd", "adamw_ckpt"])
def test_moe_qlora_training_equals_single_process_on_the_same_quantised_model(ws, case):
    assert_parity(scenario(_report(ws)[0], case), rtol=1e-6, label=f"ws {ws} qwen3-moe {case}")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_experts_are_4bit_bytes_split_across_ranks_and_frozen(ws):
    reports = [scenario(r, "sgd")["bytes"] for r in _report(ws)]
    first = reports[0]
    assert first["expert_dtypes"] == ["torch.uint8"], first
    assert first["total_expert_bytes"] > first["total_bytes"] / 2, "the experts should be most of the 4-bit bytes"
    # every expert byte is held by exactly one rank
    assert sum(r["local_expert_bytes"] for r in reports) == first["total_expert_bytes"], reports
    for rank, r in enumerate(reports):
        # one uint8 group per unit, each padded to a multiple of ws: at most ws - 1 bytes of padding per unit
        assert r["local_bytes"] <= r["total_bytes"] / ws + 4 * ws, (rank, r["local_bytes"], r["total_bytes"])
        assert r["frozen"] and r["trainable_only_lora"], (rank, r)
