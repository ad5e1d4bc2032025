"""shardwise.hf.lora: peft LoRA under shard() trains like a single-process peft model (fp32 base and bf16 base,
SGD with momentum and AdamW, world sizes 2 and 3), only adapters reach the trainer's optimizer, a meta-built
peft model is initialised as peft would (B = 0: it starts equal to its base), and the exports load with
peft (adapter directory) and with ``from_pretrained`` (merged) and give the trained model's logits.

One spawn per world size; the scenarios inside it are independent (``run_scenarios``)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from harness import run_distributed
from hf_dirs import tiny_config
from parity_utils import (
    assert_parity,
    make_batches,
    rel_err,
    run_scenarios,
    scenario,
    simple_step,
    spawn_once,
    train_pair,
)

VOCAB, STEPS = 97, 3
# What each world size runs: every optimizer with every base dtype, over the two spawns.
CASES = {2: [("sgd", torch.float32), ("adamw", torch.bfloat16)], 3: [("sgd", torch.bfloat16), ("adamw", torch.float32)]}
SETTINGS = dict(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
# A bf16 base computes in bf16 on both sides; the sharded run adds its ranks' fp32 adapter gradients in
# another order than the reference's one matmul, which bf16 activations downstream then round differently.
# fp32 AdamW: a gradient element that is rounding noise in both runs still takes an lr-sized step.
RTOL = {("sgd", torch.float32): 1e-6, ("adamw", torch.float32): 1e-5, ("sgd", torch.bfloat16): 2e-3,
        ("adamw", torch.bfloat16): 2e-3}


def _base(seed: int = 0, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", VOCAB), attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def _lm_loss(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits.float()


def _train(rank, ws, optimizer, base_dtype, out_dir=None):
    import shardwise
    from shardwise.engine.core.runtime import runtime_of
    from shardwise.hf.lora import LoraSettings, apply_lora, save_adapter, save_merged
    from shardwise.trainer.config import TrainConfig
    from shardwise.trainer.loop import build_optimizer

    clean_base = _base()
    torch.manual_seed(1)  # peft's adapter init draws from the global generator: the same on every rank
    initial = apply_lora(copy.deepcopy(clean_base), LoraSettings(**SETTINGS, base_dtype=base_dtype))
    # init_lora_weights=True leaves B = 0; give it values so that A's first gradient is not zero
    with torch.no_grad():
        for n, p in initial.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ref = copy.deepcopy(initial)
    model = shardwise.shard(copy.deepcopy(initial), units="auto")
    metrics = train_pair(model, ref, simple_step(_lm_loss), make_batches(STEPS, VOCAB), rank, ws, optimizer=optimizer)
    out = {"metrics": metrics, "rtol": RTOL[optimizer, base_dtype]}

    # the trainer's optimizer holds the adapter shards and nothing else
    opt = build_optimizer(model, TrainConfig())
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    specs = [(spec.fqn, id(p)) for g in runtime_of(model).flat_groups()
             for spec, p in zip(g.plan.params, g.shard_params)]
    out["optimizer_names_ok"] = all(("lora_" in fqn) == (pid in in_opt) for fqn, pid in specs)
    out["frozen_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})

    if out_dir is not None:  # export the trained model and load it back the two ways users do
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        x = make_batches(1, VOCAB, seed=99)[0][0]
        mine = _logits(model, x)  # collective: every rank runs the forward
        save_adapter(model, f"{out_dir}/adapter")
        save_merged(model, f"{out_dir}/merged")
        if rank == 0:
            base = copy.deepcopy(clean_base).to(base_dtype)
            peft_loaded = PeftModel.from_pretrained(base, f"{out_dir}/adapter")
            merged = AutoModelForCausalLM.from_pretrained(f"{out_dir}/merged")
            out["adapter_logits_err"] = rel_err(_logits(peft_loaded, x), mine)
            out["merged_logits_err"] = rel_err(_logits(merged, x), mine)
            out["adapter_keys_only"] = all("lora_" in k for k in peft_loaded.state_dict() if "lora_" in k)
    return out


def _meta_build(rank, ws):
    """A peft model built on meta and materialised inside shard(): adapters initialised the peft way."""
    import shardwise
    from shardwise.engine.hf_init import hf_param_init_fn
    from shardwise.hf.lora import LoraSettings, apply_lora, lora_param_init_fn

    model = apply_lora(_base(device="meta"), LoraSettings(**SETTINGS))
    init = lora_param_init_fn(model, hf_param_init_fn(model, torch.device("cpu")))
    torch.manual_seed(3)
    model = shardwise.shard(model, units="auto", param_init_fn=init)
    sd = shardwise.full_state_dict(model)
    x = make_batches(1, VOCAB, seed=5)[0][0]
    with_adapters = _logits(model, x)
    with model.disable_adapter():
        base_only = _logits(model, x)
    out = {"logits_equal_base": torch.equal(with_adapters, base_only)}
    if rank == 0:
        a = [v for k, v in sd.items() if "lora_A" in k]
        b = [v for k, v in sd.items() if "lora_B" in k]
        bound = 48 ** -0.5  # kaiming_uniform_(a=sqrt(5)): 1/sqrt(fan_in), fan_in = in_features >= hidden (48)
        out.update(n_a=len(a), b_zero=all(torch.count_nonzero(t) == 0 for t in b),
                   a_random=all(t.std() > 0 for t in a), a_bounded=all(t.abs().max() <= bound for t in a),
                   base_finite=all(torch.isfinite(v).all() for v in sd.values()))
    return out


def _worker(rank, ws, out_dir):
    scenarios = {f"{opt}-{str(dtype)[6:]}": (lambda r, w, opt=opt, dtype=dtype, i=i:
                                             _train(r, w, opt, dtype, out_dir if i == 0 else None))
                 for i, (opt, dtype) in enumerate(CASES[ws])}
    scenarios["meta"] = _meta_build
    return run_scenarios(scenarios, rank, ws)


@spawn_once
def _report(ws: int, out_dir: str) -> dict:
    return run_distributed(_worker, ws, out_dir, timeout_s=240)[0]


@pytest.fixture(scope="module")
def out_root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_lora_training_matches_single_process_peft(ws, out_root):
    report = _report(ws, str(out_root / f"ws{ws}"))
    for opt, dtype in CASES[ws]:
        r = scenario(report, f"{opt}-{str(dtype)[6:]}")
        assert_parity(r["metrics"], rtol=r["rtol"], label=f"ws {ws} {opt} base {dtype}")
        assert r["optimizer_names_ok"], "the trainer's optimizer must hold exactly the adapter shards"
        assert r["frozen_dtypes"] == [str(dtype)]


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_exported_adapter_and_merged_model_give_the_trained_logits(ws, out_root):
    report = _report(ws, str(out_root / f"ws{ws}"))
    opt, dtype = CASES[ws][0]
    r = scenario(report, f"{opt}-{str(dtype)[6:]}")
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert r["adapter_logits_err"] <= tol, r
    assert r["merged_logits_err"] <= (1e-5 if dtype == torch.float32 else 2e-2), r


def test_meta_built_peft_model_starts_equal_to_its_base(out_root):
    r = scenario(_report(2, str(out_root / "ws2")), "meta")
    assert r["logits_equal_base"] and r["b_zero"] and r["a_random"] and r["a_bounded"] and r["base_finite"], r
    assert r["n_a"] == 3 * 2  # three target modules in each of two layers


def _lora_on_pretrained(rank, world_size, directory):
    import shardwise
    from shardwise.hf.lora import LoraSettings, apply_lora, lora_param_init_fn, pretrained_name
    from transformers import AutoConfig, AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    model = apply_lora(model, LoraSettings(r=4, target_modules=("q_proj", "v_proj")))
    model = shardwise.shard(model, param_init_fn=lora_param_init_fn(model, shardwise.skip_weight_init(model)))
    shardwise.load_pretrained(model, directory, rename=pretrained_name)
    x = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (model(x).logits - ref(x).logits).abs().max().item()


def test_lora_model_loads_the_pretrained_base_and_starts_as_it(tmp_path):
    """The trainer's --model DIR --lora-r path: the base's shards come from the files (peft's names mapped by
    shardwise.hf.lora.pretrained_name), the adapters keep peft's init (B = 0): logits equal from_pretrained's."""
    from hf_dirs import make_model_dir

    directory = make_model_dir(str(tmp_path / "llama"), "llama")
    errs = run_distributed(_lora_on_pretrained, 2, directory)
    assert max(errs) == 0.0, errs


def test_target_modules_that_name_no_module_list_the_names_there_are():
    from transformers import AutoModelForCausalLM

    from shardwise.errors import ShardwiseError
    from shardwise.hf.lora import LoraSettings, apply_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", 64))
    with pytest.raises(ShardwiseError) as e:
        apply_lora(model, LoraSettings(r=2, target_modules=("qproj",)))
    assert "lora target_modules qproj:" in str(e.value)
    assert "module names in LlamaForCausalLM: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, " \
           "up_proj, v_proj" in str(e.value)


def test_target_modules_over_a_4bit_base_list_the_4bit_projections_too():
    """--lora-target-modules with a wrong name under --load-in-4bit: the QuantLinear projections are names
    LoRA can target, listed with the rest (not only embed_tokens and lm_head)."""
    from transformers import AutoModelForCausalLM

    import shardwise
    from shardwise.errors import ShardwiseError
    from shardwise.hf.lora import LoraSettings, apply_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", 64))
    shardwise.quantize_model(model, shardwise.QuantSettings("nf4"))
    with pytest.raises(ShardwiseError) as e:
        apply_lora(model, LoraSettings(r=2, target_modules=("qproj",)))
    assert "module names in LlamaForCausalLM: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, " \
           "up_proj, v_proj" in str(e.value)


def test_a_meta_built_peft_model_draws_its_adapters_as_peft_does_on_a_real_model():
    """get_peft_model on a meta-built model keeps the adapter values peft draws (after the same seed, those of
    get_peft_model on the real model); lora_param_init_fn puts them into the shards. Peft inits that read
    the base weights are refused on meta, by name."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from shardwise.errors import ShardwiseError
    from shardwise.hf.lora import apply_peft_config, lora_param_init_fn

    config = lambda **kw: LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **kw)
    real = _base()
    torch.manual_seed(3)
    real = apply_peft_config(real, config())
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("llama", VOCAB))
    torch.manual_seed(3)
    meta = apply_peft_config(meta, config())
    assert all(p.is_meta for p in meta.parameters())
    init = lora_param_init_fn(meta, None)
    adapters = 0
    for name, module in meta.named_modules():
        if "lora_A" in name and not list(module.children()):
            module.to_empty(device="cpu")
            init(module)
            assert torch.equal(module.weight, real.get_submodule(name).weight), name
            adapters += 1
    assert adapters == 4
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("llama", VOCAB))
    with pytest.raises(ShardwiseError, match=r"peft_config use_dora=True: this initialisation reads the base"):
        apply_peft_config(meta, config(use_dora=True))


def test_pretrained_files_accept_a_peft_wrapped_model_as_the_launcher_checks_it(tmp_path):
    """The launcher checks --model DIR's files against the meta-built peft model before any worker starts: the
    Hugging Face model inside peft's wrapper is found and its base read under the base's names (both layouts)."""
    from hf_dirs import make_model_dir
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.hf.lora import LoraSettings, apply_lora
    from shardwise.hf.pretrained import check_loadable
    from shardwise.hf.weight_files import file_layout_identity, identity_for, weights_identity

    single = make_model_dir(str(tmp_path / "one"), "llama", tokenizer=False)
    sharded = make_model_dir(str(tmp_path / "many"), "llama", tokenizer=False, shards=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(single))
    model = apply_lora(model, LoraSettings(r=2, target_modules=("q_proj", "v_proj")))
    for directory in (single, sharded):
        check_loadable(model, directory)
    assert weights_identity(single) == weights_identity(sharded)  # the same tensors, another file layout
    other = make_model_dir(str(tmp_path / "other"), "llama", tokenizer=False, seed=1)
    assert weights_identity(other) != weights_identity(single)
    # checkpoints written before the identity left the file layout still recognise their base (and only it)
    legacy = file_layout_identity(single)
    assert identity_for(single, legacy) == legacy and identity_for(other, legacy) == weights_identity(other)
