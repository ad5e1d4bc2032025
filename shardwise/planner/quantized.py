"""What a 4-bit base (``--load-in-4bit``) adds to a memory plan: the meta model's Linears become
``QuantLinear`` and its fused MoE experts ``QuantExperts`` (their uint8 stored bytes then form frozen flat
groups the plan shards like any other, scales included); a forward dequantises one matrix at a time, and
under activation checkpointing a unit's recompute keeps its dequantised weights for its backward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.engine.base.plan import ShardingPlan
from shardwise.hf.quantization import QuantSettings, quantize_model
from shardwise.quant.experts import QUANT_MODULE_TYPES
from shardwise.quant.format import dequant_chunk


def dequant_chunk_bytes(device_type: str, largest_numel: int) -> int:
    """``Layout4bit.dequantize``'s temporaries for its largest group of elements (a whole matrix when it is
    smaller than a group): an int32 index and an int64 pair of fp32 values per packed byte (two elements),
    beside the dequantised matrix itself."""
    packed_bytes = -(-min(dequant_chunk(device_type), largest_numel) // 2)
    return packed_bytes * (4 + 8)


@dataclass(frozen=True)
class QuantFigures:
    shard_bytes: int  # this rank's share of the 4-bit bytes, packed data and scales
    matrix_bytes: int  # the largest matrix dequantised in compute dtype + the dequantisation's temporaries
    recomputed_bytes: list[int]  # per checkpointed unit (plan order): its 4-bit weights dequantised in compute
    # dtype + those temporaries, what its recompute keeps for its backward (every expert, as if all were routed)
    uncounted: int  # how many more weights the model has than its parameters' element count says (bytes)


def quantise_meta_model(model: nn.Module, quant_type: str, double_quant: bool, lora_r: int) -> None:
    if not lora_r:
        raise ValueError("--load-in-4bit needs --lora-r: a 4-bit base is frozen, only LoRA adapters train")
    quantize_model(model, QuantSettings(quant_type, double_quant))


def quantised_figures(model: nn.Module, plan: ShardingPlan, compute_itemsize: int, device_type: str) -> QuantFigures:
    """What the 4-bit base of ``model`` adds, sharded by ``plan``, computing in ``compute_itemsize``-byte
    elements on a ``device_type`` device (its dequantisation temporaries)."""
    shard = sum(g.shard_numel for g in plan.groups() if g.dtype == torch.uint8)
    quantised = [m for m in model.modules() if isinstance(m, QUANT_MODULE_TYPES)]  # MoE experts: one per projection
    largest = max((m.layout.numel for m in quantised), default=0)  # experts dequantise one expert's matrix at a time
    uncounted = sum(m.layout.numel * getattr(m, "num_experts", 1)
                    - sum(p.numel() for n, p in m.named_parameters() if n != "bias") for m in quantised)
    temporaries = dequant_chunk_bytes(device_type, largest)
    recomputed = []
    for unit in (u for u in plan.units if u.checkpointed):
        owned = {id(r.module): r.module for p in unit.params() for r in p.refs
                 if r.name == "weight" and isinstance(r.module, QUANT_MODULE_TYPES)}
        weights = sum(m.layout.numel * getattr(m, "num_experts", 1) for m in owned.values())
        recomputed.append(weights * compute_itemsize + temporaries if weights else 0)
    return QuantFigures(shard, largest * compute_itemsize + temporaries, recomputed, uncounted)
