"""``shardwise train --model DIR`` with a Hugging Face model directory: the weights are loaded (each rank its
shards), training at learning rate 0 leaves them untouched, and ``shardwise export`` writes a directory that
``from_pretrained`` and ``AutoTokenizer`` load, with weights bitwise equal to the input. Directory problems are
found before any worker starts; a directory with config.json and no weights keeps the random init."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_dirs
from harness import run_distributed

from shardwise.trainer.config import TrainConfig
from shardwise.hf.model_spec import ModelError, resolve_model


def _train_worker(rank, world, cfg_values):
    from shardwise.trainer.loop import train

    return train(TrainConfig(**cfg_values))


def _tensors(directory):
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_lr0_run_exports_the_input_weights_bitwise(tmp_path):
    """Qwen2 (tied lm_head absent from the file), index-sharded, stored in bf16: fp32 masters hold the bf16
    values exactly, so the fp32 export equals the input bit for bit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise.hf.export import export_checkpoint

    model_dir = hf_dirs.make_model_dir(str(tmp_path / "qwen2"), "qwen2", shards=True, dtype=torch.bfloat16)
    data = tmp_path / "text.txt"
    data.write_text(" ".join(hf_dirs.CORPUS) * 4)
    cfg = TrainConfig(model=model_dir, data=str(data), steps=1, lr=0.0, warmup_steps=0, batch_size=2, seq_len=16,
                      eval_every=0, log_every=1, progress=False, out=str(tmp_path / "run"))
    run_distributed(_train_worker, 2, dataclasses.asdict(cfg))
    out = tmp_path / "exported"
    export_checkpoint(tmp_path / "run", out)

    given, exported = _tensors(model_dir), _tensors(out)
    assert sorted(given) == sorted(exported)
    unequal = [k for k in given if not torch.equal(given[k].float(), exported[k].float())]
    assert not unequal, unequal
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in reference.state_dict().items())
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == hf_dirs.CHAT_TEMPLATE and tok("fox").input_ids == \
        AutoTokenizer.from_pretrained(model_dir)("fox").input_ids


def test_weights_checked_before_workers_and_config_only_dir_is_random_init(tmp_path):
    from shardwise.trainer.preflight import check_before_launch

    model_dir = hf_dirs.make_model_dir(str(tmp_path / "llama"), "llama", tokenizer=False)
    assert resolve_model(model_dir).weights_dir == model_dir
    assert resolve_model(os.path.join(model_dir, "config.json")).weights_dir is None  # the file: random init
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), config_only)
    assert resolve_model(str(config_only)).weights_dir is None

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(ModelError, match="pytorch_model.bin.*save_pretrained"):
        resolve_model(str(pickled))

    bad_index = tmp_path / "bad-index"
    shutil.copytree(model_dir, bad_index)
    (bad_index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    data = tmp_path / "text.txt"
    data.write_text("hello world " * 200)
    cfg = TrainConfig(model=str(bad_index), data=str(data), seq_len=16, out=str(tmp_path / "run"))
    with pytest.raises(ModelError, match=r"--model.*not a plain file name"):
        check_before_launch(cfg, world_size=2, local_ranks=2, launching=True)
