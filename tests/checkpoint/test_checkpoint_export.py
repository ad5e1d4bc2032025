"""Full-model export: from a checkpoint or a run directory, one file or several with an index, and for a
Hugging Face model a directory that ``AutoModelForCausalLM.from_pretrained`` loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from harness import run_distributed


def test_export_run_dir_sharded_with_index(run_dir, tmp_path):
    from shardwise import export_checkpoint
    path, results = run_dir
    expected = results[0][5]  # full state dict after step 4, the newest checkpoint in the run directory
    files = export_checkpoint(path, tmp_path / "out", max_shard_bytes=40_000)
    assert len(files) > 1
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    got = {}
    for f in files:
        got.update(load_file(f))
    assert set(index["weight_map"]) == set(got)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    # Tied lm_head.weight is written once, under its first name, as Hugging Face does.
    assert set(got) == set(expected) - {"lm_head.weight"}
    for k, v in got.items():
        assert torch.equal(v, expected[k]), k
    assert json.loads((tmp_path / "out" / "shardwise_model.json").read_text())["config"]["n_layer"] == 2


def test_export_cli_single_file(run_dir, tmp_path, capsys):
    from shardwise.hf.export import export_main

    from shardwise import export_checkpoint
    path, results = run_dir
    export_checkpoint(path, tmp_path / "o", max_shard_bytes=40_000)  # an earlier, sharded export
    assert export_main([str(path / "step-00000003"), str(tmp_path / "o"), "--dtype", "bf16"]) == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["model.safetensors", "shardwise_model.json"]
    got = load_file(tmp_path / "o" / "model.safetensors")
    assert got["wte.weight"].dtype == torch.bfloat16
    assert export_main([str(tmp_path), str(tmp_path / "o2")]) == 2
    assert "neither a shardwise checkpoint" in capsys.readouterr().err


def _save_hf(rank, world_size, root):
    import shardwise
    from shardwise.checkpoint import save_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        logits = model(ids).logits
    model = shardwise.shard(model)  # units from _no_split_modules: the decoder layers
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    save_checkpoint(f"{root}/hf-ckpt", model, opt, step=0)
    return reference, logits


def test_export_hugging_face_model_loads_with_from_pretrained(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from shardwise import export_checkpoint
    reference, logits = run_distributed(_save_hf, 2, str(tmp_path))[0]
    export_checkpoint(tmp_path / "hf-ckpt", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    state = model.state_dict()
    for k, v in reference.items():
        assert torch.equal(state[k], v), k
    with torch.no_grad():
        assert torch.equal(model(torch.arange(12).view(1, 12)).logits, logits)
