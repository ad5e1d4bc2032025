"""load_pretrained into a 4-bit MoE base (Qwen3-MoE, experts as QuantExperts). Hugging Face files hold one
tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``), which transformers 5 fuses on load
and which its bitsandbytes 4-bit load leaves in high precision; transformers 4 (experts as Linears) saved
them as bitsandbytes 4-bit weights. Each rank reads only its bytes of each expert, and three directories
give exactly the bytes of quantising the fp32 model in one process: the fp32 directory (quantised on load),
transformers 5.24's own 4-bit save (attention copied, experts quantised on load), and a per-expert
pre-quantised directory in transformers 4's layout (everything copied). A per-expert tensor that disagrees
with its quant_state is refused in one line naming it."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from harness import run_distributed
from hf_dirs import make_model_dir, tiny_config
from parity_utils import run_scenarios, scenario, spawn_once

DIRS = ("fp32", "q4_transformers5", "q4_per_expert")
CONFIG = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}


def _meta_quantised(settings):
    import shardwise
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", 320, **CONFIG))
    shardwise.quantize_model(model, settings)
    return model


def _load(directory: str) -> dict[str, torch.Tensor]:
    """Meta-build, quantise, LoRA on q/v, shard, load; the full state dict (rank 0) under the base's names."""
    import shardwise
    from shardwise.hf.lora import LoraSettings, apply_lora, lora_param_init_fn, pretrained_name

    settings = shardwise.QuantSettings()
    model = apply_lora(_meta_quantised(settings), LoraSettings(r=4, target_modules=("q_proj", "v_proj")))
    shardwise.shard(model, param_init_fn=lora_param_init_fn(model, shardwise.skip_weight_init(model)))
    shardwise.load_pretrained(model, directory, rename=pretrained_name, quantization=settings)
    sd = shardwise.full_state_dict(model)
    return {pretrained_name(k): v for k, v in sd.items() if pretrained_name(k) is not None}


def _worker(rank, ws, root):
    return run_scenarios({d: (lambda r, w, d=d: _load(os.path.join(root, d))) for d in DIRS}, rank, ws)


def write_per_expert_4bit(src: str, dst: str) -> None:
    """``src`` (transformers 5's 4-bit save: experts in fp32) with every expert weight replaced by its
    bitsandbytes 4-bit tensors, as transformers 4's Linear4bit experts saved them."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as F
    import torch._dynamo
    from safetensors.torch import load_file, save_file

    torch._dynamo.config.disable = True  # bitsandbytes' default CPU ops are torch.compile'd: seconds per shape
    sd = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for key, t in sd.items():
        if ".mlp.experts." not in key:
            out[key] = t
            continue
        packed, state = F.quantize_4bit(t, blocksize=64, compress_statistics=True, quant_type="nf4")
        out[key] = packed
        out.update({f"{key}.{k}": v for k, v in state.as_dict(packed=True).items()})
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.link(os.path.join(src, name), os.path.join(dst, name))
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from test_quantized_load import save_4bit

    root = str(tmp_path_factory.mktemp("q4moe"))
    make_model_dir(os.path.join(root, "fp32"), "qwen3_moe", tokenizer=False, **CONFIG)
    save_4bit(os.path.join(root, "fp32"), os.path.join(root, "q4_transformers5"))
    write_per_expert_4bit(os.path.join(root, "q4_transformers5"), os.path.join(root, "q4_per_expert"))
    return root


@pytest.fixture(scope="module")
def expected(dirs):
    """The fp32 model quantised in one process: every 4-bit byte and high-precision weight."""
    import shardwise
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(dirs, "fp32"), dtype=torch.float32)
    shardwise.quantize_model(model, shardwise.QuantSettings())
    return model.state_dict()


@spawn_once
def _report(ws: int, root: str) -> dict:
    return run_distributed(_worker, ws, root, timeout_s=240)[0]


WORLD_SIZES = [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("directory", DIRS)
def test_every_moe_directory_loads_to_the_bytes_of_quantising_in_one_process(ws, directory, dirs, expected):
    loaded = scenario(_report(ws, dirs), directory)
    experts = [k for k in expected if ".experts." in k]
    assert experts and all(expected[k].dtype == torch.uint8 for k in experts)
    assert set(loaded) == set(expected), set(loaded) ^ set(expected)
    for key, want in expected.items():
        assert torch.equal(loaded[key], want), f"ws {ws} {directory}: {key} differs"


def test_a_per_expert_tensor_disagreeing_with_its_quant_state_is_refused(dirs, tmp_path):
    import shardwise
    from safetensors.torch import load_file, save_file
    from shardwise.errors import ShardwiseError
    from shardwise.hf.pretrained import check_loadable

    src = os.path.join(dirs, "q4_per_expert")
    check_loadable(_meta_quantised(shardwise.QuantSettings()), src)  # intact: no complaint
    sd = load_file(os.path.join(src, "model.safetensors"))
    key = "model.layers.1.mlp.experts.2.up_proj.weight.absmax"
    sd[key] = sd[key][:-1].clone()
    os.link(os.path.join(src, "config.json"), tmp_path / "config.json")
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ShardwiseError, match=rf"model.safetensors: 'model.layers.1.mlp.experts.2.up_proj.weight': "
                                             rf"'{key}' is torch.uint8 \[29\], but the quant_state's shape \[40, 48\] "
                                             rf"needs 30 torch.uint8"):
        check_loadable(_meta_quantised(shardwise.QuantSettings()), str(tmp_path))
