"""load_pretrained into a 4-bit base: a checkpoint that transformers + bitsandbytes saved in 4 bits loads at
world sizes 1-3 to exactly its bytes (each rank copying only its byte ranges); a fp32 directory quantised on
load gives those same bytes; and a pre-quantised checkpoint whose quant_state disagrees with its tensors or
with the model (shape, block size, nf4/fp4, absmax length; a declared shape of 2**40 weights in a file of a few
kB, before anything is sized from it), or whose config.json says another quant type than its tensors, is
refused in one line naming the file and tensor.

MoE (Qwen3-MoE, experts as QuantExperts): the files hold one tensor per expert and projection
(``mlp.experts.{e}.gate_proj.weight``), which transformers 5 fuses on load and which its bitsandbytes 4-bit
load leaves in high precision, while transformers 4 (experts as Linears) saved them as bitsandbytes 4-bit
weights. Three directories give exactly the bytes of quantising the fp32 model in one process: the fp32
one (quantised on load), transformers 5.24's own 4-bit save (attention copied, experts quantised on load)
and a per-expert pre-quantised one in transformers 4's layout (all copied); a per-expert tensor that
disagrees with its quant_state is refused naming it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from harness import run_distributed
from hf_dirs import make_model_dir, tiny_config
from parity_utils import run_scenarios, scenario, spawn_once

STORED = ("weight", "absmax", "nested_absmax", "offset")


def save_4bit(src: str, dst: str, quant_type: str = "nf4", double_quant: bool = True) -> str:
    """What a user downloads as a "bnb-4bit" model: transformers' own 4-bit save of ``src`` (on CPU)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, device_map="cpu",
                                                 dtype=torch.float32)
    model.save_pretrained(dst)
    return dst


def expected_bytes(directory: str) -> dict[str, torch.Tensor]:
    """HF name of each 4-bit module (``model.layers.0.mlp.down_proj``) + stored name -> its bytes."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(directory, "model.safetensors"))
    out = {}
    for key, t in sd.items():
        if key.endswith(".weight.absmax"):
            base = key[: -len(".weight.absmax")]
            state = json.loads(bytes(sd[f"{base}.weight.quant_state.bitsandbytes__nf4"].tolist()))
            out[f"{base}.weight"] = sd[f"{base}.weight"].view(torch.uint8).reshape(-1)
            out[f"{base}.absmax"] = t.reshape(-1).view(torch.uint8)
            out[f"{base}.nested_absmax"] = sd[f"{base}.weight.nested_absmax"].view(torch.uint8)
            out[f"{base}.offset"] = torch.tensor([state["nested_offset"]], dtype=torch.float32).view(torch.uint8)
        elif not any(s in key for s in (".absmax", ".quant_map", ".nested_", ".quant_state")) and t.is_floating_point():
            out[key] = t
    return out


def meta_quantised(settings, family: str = "llama"):
    import shardwise
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(family, 320, bos_token_id=0, eos_token_id=0,
                                                             pad_token_id=1))
    shardwise.quantize_model(model, settings)
    return model


def _load(directory: str, quant_type: str = "nf4", double_quant: bool = True,
          family: str = "llama") -> dict[str, torch.Tensor]:
    """Meta-build the tiny ``family`` model, quantise, add LoRA, shard, load ``directory``; the full state
    dict (rank 0) under HF names (``.base_layer`` dropped, adapters left out)."""
    import shardwise

    from shardwise.hf.lora import LoraSettings, apply_lora, lora_param_init_fn, pretrained_name

    settings = shardwise.QuantSettings(quant_type, double_quant)
    model = apply_lora(meta_quantised(settings, family), LoraSettings(r=4, target_modules=("q_proj", "v_proj")))
    shardwise.shard(model, param_init_fn=lora_param_init_fn(model, shardwise.skip_weight_init(model)))
    shardwise.load_pretrained(model, directory, rename=pretrained_name, quantization=settings)
    sd = shardwise.full_state_dict(model)
    return {pretrained_name(k): v for k, v in sd.items() if pretrained_name(k) is not None}


def _errors(directory: str) -> dict[str, str]:
    out = {}
    for name, path in sorted(_broken_dirs(directory).items()):
        try:
            _load(path, "fp4" if name == "fp4_model" else "nf4")
            out[name] = "loaded"
        except Exception as e:  # noqa: BLE001 - the message is what the test reads
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _broken_dirs(directory: str) -> dict[str, str]:
    root = os.path.join(directory, "broken")
    return {n: os.path.join(root, n) for n in ("state_shape", "absmax_length", "fp4_model", "blocksize",
                                                "huge_state_shape", "config_fp4")}


def make_broken_dirs(prequantised: str, root: str) -> None:
    """Copies of the pre-quantised checkpoint, each damaged one way (fp4_model: intact tensors, config.json
    without its quantization_config, the model is fp4)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(prequantised, "model.safetensors"))
    key = "model.layers.1.mlp.up_proj.weight"
    cases = {}
    cases["state_shape"] = _state_edit(sd, key, shape=[44, 96])  # the same element count, another shape
    cases["absmax_length"] = {f"{key}.absmax": sd[f"{key}.absmax"][:-1].clone()}
    cases["fp4_model"] = {}
    cases["blocksize"] = _state_edit(sd, key, blocksize=128)
    # 2**40 weights declared by a file of a few kB: refused before anything is sized from it (an allocation
    # of the packed bytes alone would be 512 GiB, and kill this test)
    cases["huge_state_shape"] = _state_edit(sd, key, shape=[1 << 20, 1 << 20])
    cases["config_fp4"] = {}
    for name, edits in cases.items():
        d = _broken_dirs(root)[name]
        os.makedirs(d)
        with open(os.path.join(prequantised, "config.json")) as f:
            config = json.load(f)
        if name == "config_fp4":  # the tensors are nf4, config.json says fp4
            config["quantization_config"]["bnb_4bit_quant_type"] = "fp4"
        if name == "fp4_model":  # no quantization_config to contradict the model first: the tensors must
            del config["quantization_config"]
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        save_file({**sd, **edits}, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})


def _state_edit(sd: dict, key: str, **changes) -> dict:
    """The quant_state JSON blob of weight ``key`` with ``changes`` made to it."""
    name = f"{key}.quant_state.bitsandbytes__nf4"
    state = {**json.loads(bytes(sd[name].tolist())), **changes}
    return {name: torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)}


def write_per_expert_4bit(src: str, dst: str) -> None:
    """``src`` (transformers 5's 4-bit save of a MoE model: experts in fp32) with every expert weight
    replaced by its bitsandbytes 4-bit tensors, as transformers 4's Linear4bit experts saved them."""
    import bitsandbytes.functional as F
    import torch._dynamo
    from safetensors.torch import load_file, save_file

    torch._dynamo.config.disable = True  # bitsandbytes' default CPU ops are torch.compile'd: seconds per shape
    out = {}
    for key, t in load_file(os.path.join(src, "model.safetensors")).items():
        if ".mlp.experts." not in key:
            out[key] = t
            continue
        packed, state = F.quantize_4bit(t, blocksize=64, compress_statistics=True, quant_type="nf4")
        out[key] = packed
        out.update({f"{key}.{k}": v for k, v in state.as_dict(packed=True).items()})
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


MOE_DIRS = ("moe_fp32", "moe_q4_transformers5", "moe_q4_per_expert")


def _worker(rank, ws, root):
    scenarios = {"prequantised": lambda r, w: _load(os.path.join(root, "q4")),
                 "quantise_on_load": lambda r, w: _load(os.path.join(root, "fp32"))}
    scenarios.update({d: (lambda r, w, d=d: _load(os.path.join(root, d), family="qwen3_moe")) for d in MOE_DIRS})
    if ws == 3:
        scenarios["errors"] = lambda r, w: _errors(root)
    return run_scenarios(scenarios, rank, ws)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("q4load"))
    make_model_dir(os.path.join(root, "fp32"), "llama", tokenizer=False)
    save_4bit(os.path.join(root, "fp32"), os.path.join(root, "q4"))
    make_broken_dirs(os.path.join(root, "q4"), root)
    make_model_dir(os.path.join(root, "moe_fp32"), "qwen3_moe", tokenizer=False)
    save_4bit(os.path.join(root, "moe_fp32"), os.path.join(root, "moe_q4_transformers5"))
    write_per_expert_4bit(os.path.join(root, "moe_q4_transformers5"), os.path.join(root, "moe_q4_per_expert"))
    return root


@pytest.fixture(scope="module")
def moe_expected(dirs):
    """The fp32 MoE model quantised in one process: every 4-bit byte and high-precision weight."""
    import shardwise
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(dirs, "moe_fp32"), dtype=torch.float32)
    shardwise.quantize_model(model, shardwise.QuantSettings())
    return model.state_dict()


@spawn_once
def _report(ws: int, root: str) -> dict:
    return run_distributed(_worker, ws, root, timeout_s=240)[0]


WORLD_SIZES = [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3]


def _assert_bytes_equal(loaded: dict, expected: dict, label: str) -> None:
    quant = [k for k in expected if k.endswith(STORED[1:]) or k + ".absmax" in expected]
    assert quant, "the checkpoint holds no 4-bit weights"
    for key, want in expected.items():
        got = loaded[key]
        assert got.dtype == want.dtype and torch.equal(got.reshape(-1), want.reshape(-1)), f"{label}: {key} differs"


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_a_transformers_4bit_checkpoint_loads_to_exactly_its_bytes(ws, dirs):
    expected = expected_bytes(os.path.join(dirs, "q4"))
    _assert_bytes_equal(scenario(_report(ws, dirs), "prequantised"), expected, f"ws {ws} pre-quantised")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_quantise_on_load_gives_the_pre_quantised_bytes(ws, dirs):
    expected = expected_bytes(os.path.join(dirs, "q4"))
    loaded = scenario(_report(ws, dirs), "quantise_on_load")
    _assert_bytes_equal(loaded, expected, f"ws {ws} quantised on load")


def test_bad_pre_quantised_checkpoints_are_refused_in_one_line(dirs):
    errors = scenario(_report(3, dirs), "errors")
    key = "'model.layers.1.mlp.up_proj.weight'"
    assert f"{key}: quant_state shape=[44, 96], the model's 4-bit module needs [88, 48]" in errors["state_shape"]
    assert "'model.layers.1.mlp.up_proj.weight.absmax' is torch.uint8 [65], but the quant_state's shape [88, 48] " \
           "needs 66 torch.uint8" in errors["absmax_length"]
    assert "quant_type='nf4', the model's 4-bit module needs 'fp4'" in errors["fp4_model"]
    assert f"{key}: quant_state blocksize=128, the model's 4-bit module needs 64" in errors["blocksize"]
    assert f"{key}: quant_state shape=[1048576, 1048576], the model's 4-bit module needs [88, 48]" \
        in errors["huge_state_shape"]
    assert "config.json: quantization_config bnb_4bit_quant_type='fp4', but the model's 4-bit modules are 'nf4'" \
        in errors["config_fp4"]
    for name, text in errors.items():
        assert text.startswith("ShardwiseError") and "\n" not in text.strip(), (name, text)
        assert ("config.json" if name == "config_fp4" else "model.safetensors") in text, (name, text)


def test_merge_refuses_a_base_directory_holding_only_4bit_weights(dirs, tmp_path):
    from shardwise.errors import ShardwiseError
    from shardwise.hf.export_lora import _checked_base_dir

    record = {"source": os.path.join(dirs, "q4"), "weights_sha256": "0" * 64, "dtype": "float32"}
    with pytest.raises(ShardwiseError, match=r"q4 holds only 4-bit \(bitsandbytes\) weights; --merge adds the adapters "
                                             r"to the high-precision weights: pass --base DIR"):
        _checked_base_dir(tmp_path / "ckpt", record, None)


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("directory", MOE_DIRS)
def test_every_moe_directory_loads_to_the_bytes_of_quantising_in_one_process(ws, directory, dirs, moe_expected):
    loaded = scenario(_report(ws, dirs), directory)
    experts = [k for k in moe_expected if ".experts." in k]
    assert experts and all(moe_expected[k].dtype == torch.uint8 for k in experts)
    assert set(loaded) == set(moe_expected), set(loaded) ^ set(moe_expected)
    for key, want in moe_expected.items():
        assert torch.equal(loaded[key], want), f"ws {ws} {directory}: {key} differs"


def test_a_per_expert_tensor_disagreeing_with_its_quant_state_is_refused(dirs, tmp_path):
    import shardwise
    from safetensors.torch import load_file, save_file
    from shardwise.errors import ShardwiseError
    from shardwise.hf.pretrained import check_loadable

    src = os.path.join(dirs, "moe_q4_per_expert")
    check_loadable(meta_quantised(shardwise.QuantSettings(), "qwen3_moe"), src)  # intact: no complaint
    sd = load_file(os.path.join(src, "model.safetensors"))
    key = "model.layers.1.mlp.experts.2.up_proj.weight.absmax"
    sd[key] = sd[key][:-1].clone()
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ShardwiseError, match=rf"model.safetensors: 'model.layers.1.mlp.experts.2.up_proj.weight': "
                                             rf"'{key}' is torch.uint8 \[29\], but the quant_state's shape \[40, 48\] "
                                             rf"needs 30 torch.uint8"):
        check_loadable(meta_quantised(shardwise.QuantSettings(), "qwen3_moe"), str(tmp_path))


def test_mixtral_expert_files_match_its_4bit_experts_through_transformers_renaming(tmp_path):
    """Mixtral's files name expert e's gate ``block_sparse_moe.experts.{e}.w1.weight`` (the model's module is
    ``mlp.experts``): the 4-bit experts take them under transformers' renaming, without its fusing; kept in
    high precision, they would need the fusing, which is refused naming the tensor."""
    import shardwise
    from shardwise.errors import ShardwiseError
    from shardwise.hf.pretrained import check_loadable
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)

    def meta(skip):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        shardwise.quantize_model(model, shardwise.QuantSettings(skip_modules=skip))
        return model

    check_loadable(meta(("lm_head",)), str(tmp_path))
    with pytest.raises(ShardwiseError, match=r"tensor 'model.layers.0.block_sparse_moe.experts.0.w\d.weight' needs "
                                             r"transformers' weight conversion"):
        check_loadable(meta(("lm_head", "experts")), str(tmp_path))
