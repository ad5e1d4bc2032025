"""`shardwise train --lora-r`: peft LoRA on a Hugging Face config, bf16 base, 2 ranks: the run resumes bit for
bit, the base never moves, the adapters do, and the run directory's ``adapter/`` loads with peft."""

import dataclasses
import json
import os

import pytest
import torch

pytest.importorskip("peft")

from harness import run_distributed
from hf_dirs import tiny_config

from shardwise.trainer.config import TrainConfig


def _train_worker(rank, world, cfg_values):
    from shardwise.trainer.loop import train

    return train(TrainConfig(**cfg_values))


def _records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.mark.slow  # four trainer runs of 2 ranks: ~75 s of CPU
def test_lora_run_resumes_exactly_and_writes_a_peft_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", 256)
    config.save_pretrained(tmp_path / "model")
    base_cfg = TrainConfig(model=str(tmp_path / "model" / "config.json"), steps=4, batch_size=2, seq_len=16,
                           eval_every=0, log_every=1, save_every=2, warmup_steps=1, lr=1e-2, progress=False,
                           lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"], lora_base_dtype="bf16")
    unbroken = dataclasses.replace(base_cfg, out=str(tmp_path / "unbroken"))
    run_distributed(_train_worker, 2, dataclasses.asdict(unbroken))
    resumed = dataclasses.replace(base_cfg, out=str(tmp_path / "resumed"),
                                  resume=str(tmp_path / "unbroken" / "step-00000002"))
    assert run_distributed(_train_worker, 2, dataclasses.asdict(resumed))[0]["start_step"] == 2
    a, b = _records(unbroken.out), _records(resumed.out)
    for step in (3, 4):
        assert a[step]["loss"] == b[step]["loss"] and a[step]["grad_norm"] == b[step]["grad_norm"], step

    # The adapter directory holds only adapters, under peft's names, and peft loads it onto the same base
    # (the trainer's random init: from_config under the run's seed).
    torch.manual_seed(base_cfg.seed)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16)
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    model = PeftModel.from_pretrained(base, os.path.join(unbroken.out, "adapter"))
    from safetensors.torch import load_file

    saved = load_file(os.path.join(unbroken.out, "adapter", "adapter_model.safetensors"))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert len(saved) == 2 * 2 * 2  # q and v, A and B, two layers
    b_weights = [v for k, v in saved.items() if ".lora_B." in k]
    assert all(torch.count_nonzero(v) > 0 for v in b_weights)  # B starts at zero: it trained
    # the frozen base under the adapters is the one the run started from
    merged_names = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                    for k, v in model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(merged_names[k], v) for k, v in initial.items())
