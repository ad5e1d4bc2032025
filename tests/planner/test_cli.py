"""``shardwise estimate-memory`` as a user runs it: the plan as text or JSON, the fit verdict and what would
fit, host memory under CPU offload stated as a positive figure, nothing but the plan on the output (no
third-party warnings), and one-line errors for a model it does not know."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hf_dirs import tiny_config
from shardwise.cli import main as shardwise_main
from shardwise.planner.memory import PlanInputs, plan_memory

REPO = Path(__file__).resolve().parents[2]


def estimate(argv):
    """`shardwise estimate-memory ARGV`, in this process: its exit status."""
    return shardwise_main(["estimate-memory", *argv])


def test_json_has_the_plan_fields(capsys):
    assert estimate(["--model", "gpt-small", "--world-size", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("param_shard_bytes", "grad_shard_bytes", "optim_shard_bytes", "gathered_unit_bytes",
                "activation_bytes", "total_bytes"):
        assert isinstance(plan[key], int) and plan[key] > 0, key
    assert plan["optim_shard_bytes"] == 2 * plan["grad_shard_bytes"]  # AdamW: two fp32 states per element
    assert plan["total_bytes"] == max(plan["backward_peak_bytes"], plan["optimizer_step_peak_bytes"])
    assert plan["optimizer_step_peak_bytes"] >= plan["param_shard_bytes"] + plan["grad_shard_bytes"] + plan["optim_shard_bytes"]
    assert plan["backward_peak_bytes"] >= plan["param_shard_bytes"] + plan["optim_shard_bytes"] + plan["activation_bytes"]


def test_human_readable_output(capsys):
    assert estimate(["--model", "gpt-34m", "--world-size", "4", "--mixed-precision", "bf16"]) == 0
    text = capsys.readouterr().out
    for row in ("parameter shards", "gradient shards", "optimizer shards", "largest unit, gathered",
                "prefetched unit, gathered", "activations", "total per rank"):
        assert row in text
    assert "host memory" not in text  # no offload, nothing in host memory


def test_fit_verdict_and_suggestions(capsys):
    assert estimate(["--model", "gpt-1b", "--world-size", "1", "--device-memory", "8GB"]) == 0
    text = capsys.readouterr().out
    assert "does NOT fit" in text and "what would fit:" in text and "--world-size" in text
    assert estimate(["--model", "gpt-1b", "--world-size", "64", "--device-memory", "80GB"]) == 0
    assert "fits in --device-memory" in capsys.readouterr().out


def test_cpu_offload_states_host_memory_as_a_positive_figure(capsys):
    args = ["--model", "gpt-34m", "--world-size", "4", "--cpu-offload", "--device-memory", "80GB"]
    assert estimate(args + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    host = p["param_shard_bytes"] + p["grad_shard_bytes"] + p["optim_shard_bytes"]
    assert p["offload_host_bytes"] == p["device_bytes_offloaded"] == host > 0
    assert p["offload_device_bytes"] == p["total_bytes"]
    assert estimate(args) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "host memory (CPU offload)" in line)
    figure = row.split(")", 1)[1].split("(")[0].strip()  # "  host memory (CPU offload)   58.28 MiB   (...)"
    assert figure[0].isdigit() and not figure.startswith("-"), row


def test_unknown_model_lists_the_presets_in_one_line(capsys):
    assert estimate(["--model", "meta-llama/Llama-2-70b-hf", "--world-size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--model" in err and "'meta-llama/Llama-2-70b-hf'" in err
    for preset in ("gpt-tiny", "llama-2-70b", "qwen2.5-7b"):
        assert preset in err


def test_lora_on_a_gpt_preset_is_refused(capsys):
    pytest.importorskip("peft")
    assert estimate(["--model", "gpt-small", "--world-size", "2", "--lora-r", "8"]) == 2
    assert "--lora-r needs a Hugging Face model" in capsys.readouterr().err


def test_nothing_but_the_plan_on_the_output(tmp_path):
    """transformers, peft and bitsandbytes warn while a LoRA model is built and run on meta (deprecations,
    optional kernels); the command prints the plan and nothing else. A fresh process, so first imports count."""
    pytest.importorskip("peft")
    tiny_config("llama", 320).save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "default"}
    out = subprocess.run([sys.executable, "-m", "shardwise", "estimate-memory", "--model", str(tmp_path),
                          "--world-size", "2", "--lora-r", "8", "--batch-size", "1", "--seq-len", "16"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout.startswith("memory plan per rank: llama:")


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
