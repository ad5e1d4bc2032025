"""`estimate-memory` for the fine-tuning question: offline architecture presets, LoRA (frozen base: no
gradients, no optimizer state), and a verdict (fits / fewest ranks that fit / CPU offload and its host
memory) that agrees with the per-buffer breakdown it prints."""

import json
from dataclasses import replace

import pytest

from shardwise.planner.memory import PlanInputs, fewest_ranks_that_fit, main, plan_memory
from shardwise.trainer.config import TrainConfig

pytest.importorskip("peft")

# Parameter counts published with the models (model cards / safetensors metadata).
KNOWN_PARAMS = {"llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248, "mistral-7b": 7_241_732_096,
                "qwen2.5-7b": 7_615_616_512}


def estimate(argv):
    """`shardwise estimate-memory ARGV` as the CLI runs it (the trainer's defaults passed in)."""
    return main(argv, TrainConfig())


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "llama-2-7b" else pytest.mark.slow)
                                  for n in sorted(KNOWN_PARAMS)])
def test_preset_shapes_give_the_published_parameter_count(name):
    plan = plan_memory(PlanInputs(name, 1, batch_size=1, seq_len=8))
    assert plan.num_params == plan.trainable_params == KNOWN_PARAMS[name]


def test_lora_keeps_gradients_and_adam_state_for_adapters_only():
    cache: dict = {}
    lora_inputs = PlanInputs("llama-3.2-1b", 1, batch_size=1, seq_len=8, lora_r=8,
                             lora_target_modules=("q_proj", "v_proj"))
    full = plan_memory(replace(lora_inputs, lora_r=0, lora_target_modules=()), _cache=cache)
    lora = plan_memory(lora_inputs, _cache=cache)
    hidden, kv_width, layers, r = 2048, 8 * 64, 16, 8  # 8 key/value heads of 64
    adapters = layers * ((r * hidden + hidden * r) + (r * hidden + kv_width * r))  # q and v: A and B each
    assert lora.trainable_params == adapters
    assert lora.num_params == full.num_params + adapters
    # one rank, fp32: no padding, so the shrink factor is exactly trainable / all parameters
    assert full.optim_shard_bytes == 2 * 4 * full.num_params and lora.optim_shard_bytes == 2 * 4 * adapters
    assert lora.grad_shard_bytes == 4 * adapters
    assert lora.optim_shard_bytes / full.optim_shard_bytes == pytest.approx(adapters / full.num_params)
    # a bf16 base halves the frozen weights and leaves the fp32 adapters alone
    bf16 = plan_memory(replace(lora_inputs, lora_base_dtype="bf16"), _cache=cache)
    assert bf16.param_shard_bytes == 2 * full.num_params + 4 * adapters
    assert bf16.optim_shard_bytes == lora.optim_shard_bytes


CASES = {  # full fine-tuning with fp32 masters (default run), and issue #12's 70B with LoRA on a bf16 base (slow)
    "llama-2-7b": {"dtype": "fp32"},
    "llama-2-70b": {"dtype": "bf16", "lora_r": 16},
}


@pytest.mark.parametrize("model", ["llama-2-7b", pytest.param("llama-2-70b", marks=pytest.mark.slow)])
def test_fine_tuning_on_four_24gb_gpus_verdict_matches_the_breakdown(model, capsys):
    """Does it fit on 4 GPUs of 24 GB (bf16 compute, activation checkpointing)? If not: the fewest ranks that
    fit, and CPU offload with its host memory -- all consistent with the printed breakdown."""
    case = CASES[model]
    inputs = PlanInputs(model, 4, mixed_precision="bf16", activation_checkpointing=True, batch_size=1,
                        seq_len=2048, **case)
    args = ["--model", model, "--world-size", "4", "--dtype", case["dtype"], "--mixed-precision", "bf16",
            "--activation-checkpointing", "--batch-size", "1", "--seq-len", "2048", "--device-memory", "24GB"]
    args += ["--lora-r", str(case["lora_r"])] if "lora_r" in case else []
    assert estimate(args + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["fits"] is False and p["total_bytes"] > 24e9
    assert p["total_bytes"] == max(p["backward_peak_bytes"], p["optimizer_step_peak_bytes"])
    if "lora_r" in case:
        assert p["trainable_params"] < 0.001 * p["num_params"]
    assert p["optim_shard_bytes"] == 2 * p["grad_shard_bytes"]
    # CPU offload moves exactly the shards, gradients and optimizer state to host memory ...
    assert p["offload_host_bytes"] == p["param_shard_bytes"] + p["grad_shard_bytes"] + p["optim_shard_bytes"]
    # ... and every peak on the device loses at least the parameter and optimizer shards
    assert p["offload_device_bytes"] <= p["total_bytes"] - p["param_shard_bytes"] - p["optim_shard_bytes"]
    # the suggested rank count is the fewest that fit, by the same plan
    n = p["min_world_size"]
    cache: dict = {}
    assert plan_memory(replace(inputs, world_size=n), _cache=cache).total_bytes <= 24e9
    assert plan_memory(replace(inputs, world_size=n - 1), _cache=cache).total_bytes > 24e9
    assert estimate(args) == 0
    text = capsys.readouterr().out
    assert "does NOT fit" in text and f"--world-size {n}" in text and "of host memory per rank" in text
    if "lora_r" in case:
        assert "LoRA r=16" in text and "no gradients or optimizer state" in text


def test_no_rank_count_fits_when_activations_alone_exceed_the_device():
    inputs = PlanInputs("qwen2.5-0.5b", 1, batch_size=4, seq_len=2048, dtype="bf16", mixed_precision="bf16")
    cache: dict = {}
    assert plan_memory(inputs, _cache=cache).activation_bytes > 4e9  # fp32 logits over 152k tokens alone: 5 GB
    assert fewest_ranks_that_fit(inputs, int(4e9), cache) is None


def test_lora_on_a_gpt_preset_is_refused(capsys):
    assert estimate(["--model", "gpt-small", "--world-size", "2", "--lora-r", "8"]) == 2
    assert "--lora-r needs a Hugging Face model" in capsys.readouterr().err
