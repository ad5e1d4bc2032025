"""shardwise.hf.sharded_load.load_sharded: a model directory straight into a sharded model.

Measured per rank, in the same processes: the peak resident memory a load adds is about 1/N of the model
(its own pieces, plus one module's temporaries while the shards are filled), where ``from_pretrained`` on
every rank adds a whole copy per rank once its weights are written (mapped from the file
until then). The loaded model is ``from_pretrained``'s, piece for piece.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytest.importorskip("transformers")

from harness import run_distributed
from hf_dirs import tiny_config

# 8 blocks of ~3.2M parameters and small embeddings (~105 MB in fp32): no single module is a large share of
# the model, so a per-rank share shows against a whole copy.
BIG = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=8, vocab_size=1000)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _added_peak_bytes(load) -> tuple[object, int]:
    """(what ``load()`` returns, the most resident memory it added at any moment), from the kernel's peak
    counter reset right before (Linux: /proc/self/clear_refs 5)."""
    from shardwise.engine.base.host_memory import release_freed_host_memory

    gc.collect()
    release_freed_host_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kib("VmRSS")
    result = load()
    return result, (_rss_kib("VmHWM") - before) * 1024


def _written_whole(model_dir: str):
    """What a DDP run holds on every rank: ``from_pretrained``'s model, every parameter written once (the
    weights ``from_pretrained`` maps from the file take memory of their own when they are first written,
    as training does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1)
    return model


def _measure(rank: int, world: int, model_dir: str) -> dict:
    import shardwise
    from shardwise.hf.sharded_load import load_sharded
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # the imports a first build does, outside the measurement
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model, ours = _added_peak_bytes(lambda: load_sharded(model_dir, units="auto"))
    sd = shardwise.full_state_dict(model)
    del model
    ref, theirs = _added_peak_bytes(lambda: _written_whole(model_dir))
    same = rank != 0 or all(torch.equal(v, ref.state_dict()[k]) for k, v in sd.items())
    model_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    return {"ours": ours, "whole_copy": theirs, "model": model_bytes, "same": same}


@pytest.fixture(scope="module")
def big_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = str(tmp_path_factory.mktemp("big") / "llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", **BIG)).save_pretrained(directory)
    return directory


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_load_from_a_directory_adds_about_one_nth_of_the_model_per_rank(world, big_dir):
    for r in run_distributed(_measure, world, big_dir, timeout_s=180):
        assert r["same"], "the loaded model is from_pretrained's"
        share = r["ours"] / r["model"]
        # 1/N, plus the largest module's parameters allocated whole while the shards are filled (~3%), plus
        # allocator slack
        assert share <= 1 / world + 0.15, r
        assert r["whole_copy"] >= 0.9 * r["model"], r  # the whole copy per rank it replaces
