"""estimate-memory --load-in-4bit: the seed job (Llama-2-70B, 4 x 24 GB, bf16, activation checkpointing,
LoRA r 16, sequence 2048) fits with a 4-bit base where the bf16 base does not; the 4-bit base is ~0.52
bytes per weight split over the ranks, scales included; and --load-in-4bit without --lora-r is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from shardwise.planner.cli import main
from shardwise.planner.memory import PlanInputs, plan_memory
from shardwise.planner.quantized import dequant_chunk_bytes
from shardwise.usage import UsageError

SEED_JOB = PlanInputs("llama-2-70b", 4, mixed_precision="bf16", activation_checkpointing=True, batch_size=1,
                      seq_len=2048, dtype="bf16", lora_r=16, lora_base_dtype="bf16")


class _Defaults:
    batch_size, seq_len = 8, 128


def test_seed_job_fits_four_24gb_gpus_with_a_4bit_base_and_not_with_bf16():
    cache: dict = {}
    bf16 = plan_memory(SEED_JOB, _cache=cache)
    nf4 = plan_memory(replace(SEED_JOB, load_in_4bit=True), _cache=cache)
    assert bf16.total_bytes > 24 * 2**30 > nf4.total_bytes
    assert nf4.num_params == bf16.num_params  # 4-bit parameters are counted as weights, not bytes
    # packed nibbles + uint8 absmax + fp32 nested absmax (+ offset) of 68.45B quantised weights, over 4 ranks
    quantised = bf16.num_params - 524_288_000 - 161 * 8192  # less embeddings + lm_head and the norms
    per_rank = quantised * (0.5 + 1 / 64 + 4 / 16384) / 4
    assert abs(nf4.quantised_shard_bytes - per_rank) / per_rank < 0.001
    assert nf4.dequantised_weight_bytes >= 28672 * 8192 * 2  # the MLP's largest matrix in bf16
    # under activation checkpointing a decoder layer's recompute keeps its 7 dequantised matrices for its backward
    layer = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192
    assert nf4.recomputed_weight_bytes == layer * 2 + dequant_chunk_bytes("cuda", 28672 * 8192)
    assert plan_memory(replace(SEED_JOB, load_in_4bit=True, activation_checkpointing=False),
                       _cache=cache).recomputed_weight_bytes == 0
    assert nf4.trainable_params == bf16.trainable_params


def test_load_in_4bit_needs_lora():
    with pytest.raises(UsageError, match="--load-in-4bit needs --lora-r"):
        main(["--model", "llama-2-7b", "--world-size", "2", "--load-in-4bit"], _Defaults, 4096)
