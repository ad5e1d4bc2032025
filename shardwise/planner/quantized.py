"""What a 4-bit base (``--load-in-4bit``) adds to a memory plan: the meta model's Linears become
``QuantLinear`` and its fused MoE experts ``QuantExperts`` (their uint8 stored bytes then form frozen flat
groups the plan shards like any other, scales included), and the forward and backward each hold one
dequantised matrix at a time."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.engine.base.plan import ShardingPlan
from shardwise.hf.quantization import QuantSettings, quantize_model
from shardwise.quant.experts import QUANT_MODULE_TYPES
from shardwise.quant.format import DEQUANT_CHUNK

# Layout4bit.dequantize's temporaries for one chunk: fp32 values per element and an int32 index per packed
# byte (two elements), beside the dequantised matrix itself.
DEQUANT_CHUNK_BYTES = DEQUANT_CHUNK * 4 + (DEQUANT_CHUNK // 2) * 4


def quantise_meta_model(model: nn.Module, quant_type: str, double_quant: bool, lora_r: int) -> None:
    if not lora_r:
        raise ValueError("--load-in-4bit needs --lora-r: a 4-bit base is frozen, only LoRA adapters train")
    quantize_model(model, QuantSettings(quant_type, double_quant))


def quantised_figures(model: nn.Module, plan: ShardingPlan, compute_itemsize: int) -> tuple[int, int, int]:
    """(this rank's share of the 4-bit bytes, packed data and scales; the transient of the largest
    dequantised matrix in compute dtype plus the dequantisation's chunk temporaries; how many more weights
    the model has than its parameters' element count says, since 4-bit parameters count bytes)."""
    shard = sum(g.shard_numel for g in plan.groups() if g.dtype == torch.uint8)
    quantised = [m for m in model.modules() if isinstance(m, QUANT_MODULE_TYPES)]  # MoE experts: one per projection
    largest = max((m.layout.numel for m in quantised), default=0)  # experts dequantise one expert's matrix at a time
    uncounted = sum(m.layout.numel * getattr(m, "num_experts", 1)
                    - sum(p.numel() for n, p in m.named_parameters() if n != "bias") for m in quantised)
    return shard, (largest * compute_itemsize + DEQUANT_CHUNK_BYTES) if largest else 0, uncounted
