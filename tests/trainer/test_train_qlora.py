"""`shardwise train --load-in-4bit --lora-r`: QLoRA from a bf16 Hugging Face directory quantised on load, 2
ranks: the loss falls, checkpoints hold only the adapters, a resume continues bit for bit; TRL's spellings
(--load_in_4bit, --bnb_4bit_quant_type, --use_bnb_nested_quant, --bnb_4bit_quant_storage) are accepted; a
4-bit base without --lora-r is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil

import pytest
import torch

pytest.importorskip("peft")

import hf_dirs
from harness import run_distributed

from shardwise.trainer.config import ConfigError, TrainConfig, resolve, validate

STEPS = 4


def _config(root, model_dir, **kw) -> TrainConfig:
    return TrainConfig(model=model_dir, data=str(root / "text.txt"), steps=STEPS, batch_size=2, seq_len=16,
                       eval_every=0, log_every=1, save_every=2, warmup_steps=1, lr=1e-2, progress=False,
                       lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj", "down_proj"],
                       load_in_4bit=True, **kw)


def _runs(rank, world, root, model_dir):
    import torch.distributed as dist

    from shardwise.trainer.loop import train

    root = pathlib.Path(root)
    cfg = _config(root, model_dir)
    train(dataclasses.replace(cfg, out=str(root / "unbroken")))
    if rank == 0:
        shutil.copytree(root / "unbroken" / "step-00000002", root / "resumed" / "step-00000002")
    dist.barrier()
    return train(dataclasses.replace(cfg, out=str(root / "resumed"), resume="latest"))["start_step"]


def _metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.mark.slow  # two 2-rank trainer runs
def test_qlora_run_trains_adapters_only_and_resumes_bitwise(tmp_path):
    model_dir = hf_dirs.make_model_dir(str(tmp_path / "llama"), "llama", dtype=torch.bfloat16)
    (tmp_path / "text.txt").write_text(" ".join(hf_dirs.CORPUS) * 4)
    assert run_distributed(_runs, 2, str(tmp_path), model_dir, timeout_s=300)[0] == 2
    a, b = _metrics(tmp_path / "unbroken"), _metrics(tmp_path / "resumed")
    assert a[STEPS]["loss"] < a[1]["loss"]
    for step in (3, 4):
        assert (a[step]["loss"], a[step]["grad_norm"]) == (b[step]["loss"], b[step]["grad_norm"]), step
    manifest = json.loads((tmp_path / "unbroken" / "step-00000004" / "manifest.json").read_text())
    assert manifest["params"] and all(".lora_A." in n or ".lora_B." in n for n in manifest["params"])


def test_trl_spellings_parse_and_a_4bit_base_needs_lora():
    cfg = resolve(["--model", "m", "--data", "d", "--lora-r", "8", "--load_in_4bit", "--bnb_4bit_quant_type", "fp4",
                      "--use_bnb_nested_quant", "--bnb_4bit_quant_storage", "bfloat16"])
    assert (cfg.load_in_4bit, cfg.bnb_4bit_quant_type, cfg.bnb_4bit_use_double_quant) == (True, "fp4", True)
    with pytest.raises(ConfigError, match=r"load.in.4bit=True is not valid; a 4-bit base is frozen.*--lora-r"):
        validate(TrainConfig(model="m", data="d", load_in_4bit=True))
