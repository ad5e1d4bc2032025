"""bench/gpu_offload.py: its dry run (the plan it would run on a GPU) works on a CPU-only machine."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import gpu_offload as go


def test_dry_run_prints_the_model_and_every_configuration(capsys):
    go.main(["--dry-run", "--model", "llama-1b", "--deepspeed-stage", "3"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "llama-1b" and plan["config"]["num_hidden_layers"] == go.SIZES["llama-1b"][1]
    assert plan["parameters"] == go.param_count("llama-1b")
    zero = plan["deepspeed"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"
    assert "offload_optimizer" in plan["shardwise"] and "CPUOffloadPolicy" in plan["fsdp2"]


@pytest.mark.slow  # builds the model through transformers' modeling code (seconds to import)
def test_parameter_count_matches_the_llama_transformers_builds():
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(go.llama_config("llama-tiny", 128))
    assert go.param_count("llama-tiny") == sum(p.numel() for p in model.parameters())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_a_real_run_without_cuda_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        go.main(["--model", "llama-tiny"])
