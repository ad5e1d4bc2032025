"""A QLoRA run's adapter-only checkpoint across world sizes and settings:

- saved at 2 ranks, it loads at 1 (and at 3, slow, where the run then resumes and trains on) with the
  adapters and their AdamW state resharded exactly (re-saved, every stored tensor equal), the 4-bit base
  quantised again on load from --model DIR to exactly the bytes an in-process quantisation of DIR's weights
  gives;
- its manifest records the base's quantisation (nf4, double quantisation), and a resume that would put the
  adapters over another base is refused in one line naming the option and both values, before any worker
  starts (the launcher's preflight) and on every rank when a worker is started anyway: --bnb-4bit-quant-type
  fp4, --bnb-4bit-use-double-quant false, no --load-in-4bit, another --model DIR, and a plain LoRA run's
  checkpoint resumed with --load-in-4bit;
- `shardwise generate RUN` (world size 1: a third layout of the same checkpoint) re-quantises the base from
  DIR and applies the adapters: its greedy text equals single-process sampling through the same quantised
  model with the exported adapters.

One 2-rank spawn trains (QLoRA and plain LoRA, 2 steps each); the reshard to one rank, the refusals and
generate run in the test process (the 3-rank reshard and resume is a slow test)."""

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
from harness import error_of, run_distributed
from parity_utils import assembled_checkpoint

from shardwise.trainer.config import TrainConfig

TARGETS = ["q_proj", "v_proj", "down_proj"]
STEP2 = "step-00000002"


def _config(root, model_dir, **kw) -> TrainConfig:
    kw = {"load_in_4bit": True, "steps": 2, **kw}
    return TrainConfig(model=model_dir, data=str(root / "text.txt"), batch_size=2, seq_len=16, eval_every=0,
                       log_every=1, save_every=2, warmup_steps=1, lr=1e-2, progress=False, lora_r=4, lora_alpha=8,
                       lora_target_modules=TARGETS, **kw)


def _train_ws2(rank, world, root, model_dir):
    """The QLoRA run and a plain LoRA run (2 steps, checkpoint at 2); then a worker started anyway with
    --bnb-4bit-quant-type fp4 over the QLoRA checkpoint (the launcher's preflight skipped): every rank refuses."""
    from shardwise.trainer.loop import train

    root = pathlib.Path(root)
    train(_config(root, model_dir, out=str(root / "qlora")))
    train(_config(root, model_dir, out=str(root / "plain"), load_in_4bit=False))
    return error_of(lambda: train(_config(root, model_dir, out=str(root / "qlora"), resume=str(root / "qlora" / STEP2),
                                           steps=3, bnb_4bit_quant_type="fp4")))


def _reshard(rank, world, root, model_dir, resume: bool):
    """Load the ws2 checkpoint at this world size (base from DIR), save it again; the full state dict (rank
    0). ``resume``: then resume the run at this world size and train on (its start step)."""
    import torch.distributed as dist

    import shardwise
    from shardwise.checkpoint import load_checkpoint, save_checkpoint
    from shardwise.hf.model_spec import resolve_model
    from shardwise.trainer.lora_model import run_frozen_base
    from shardwise.trainer.loop import build_optimizer, build_sharded_model, train

    root = pathlib.Path(root)
    cfg = _config(root, model_dir)
    spec = resolve_model(cfg.model)
    model = build_sharded_model(cfg, spec, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    base = run_frozen_base(cfg, spec)
    extra = load_checkpoint(root / "qlora" / STEP2, model, optimizer, frozen_base=base)
    save_checkpoint(root / f"resaved-ws{world}", model, optimizer, step=2, extra=extra, frozen_base=base)
    state = shardwise.full_state_dict(model)
    if not resume:
        return state, None
    if rank == 0:
        shutil.copytree(root / "qlora" / STEP2, root / f"resumed-ws{world}" / STEP2)
    dist.barrier()
    summary = train(_config(root, model_dir, out=str(root / f"resumed-ws{world}"), resume="latest", steps=3))
    return state, summary["start_step"]


def _reshard_in_this_process(root, model_dir):
    from shardwise.trainer.generate import one_process_group

    with one_process_group():
        return _reshard(0, 1, root, model_dir, False)


def _quantised_reference(model_dir: str, adapter_dir: str | None = None):
    """The run's model in one process, no shardwise engine: DIR's weights in fp32 (the run's base dtype),
    its Linears quantised here, LoRA around them, the exported adapters loaded."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import shardwise
    from shardwise.hf.lora import LoraSettings, apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shardwise.quantize_model(model, shardwise.QuantSettings("nf4", double_quant=True))
    model = apply_lora(model, LoraSettings(r=4, alpha=8, target_modules=tuple(TARGETS)))
    if adapter_dir is not None:
        result = set_peft_model_state_dict(model, load_file(os.path.join(adapter_dir, "adapter_model.safetensors")))
        assert not result.unexpected_keys, result.unexpected_keys
    return model.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora-resume")
    model_dir, other_dir = hf_dirs.make_base_and_other(root)
    worker_errors = run_distributed(_train_ws2, 2, str(root), model_dir, timeout_s=300)
    return root, model_dir, other_dir, worker_errors


def test_the_manifest_records_the_base_and_its_quantisation(runs):
    from shardwise.hf.weight_files import weights_identity

    root, model_dir, _, _ = runs
    manifest = json.loads((root / "qlora" / STEP2 / "manifest.json").read_text())
    assert manifest["frozen_base"] == {
        "source": os.path.abspath(model_dir), "weights_sha256": weights_identity(model_dir), "dtype": "float32",
        "quantization": {"quant_type": "nf4", "double_quant": True, "skip_modules": ["lm_head"]}}
    plain = json.loads((root / "plain" / STEP2 / "manifest.json").read_text())
    assert "quantization" not in plain["frozen_base"]


def _assert_resharded_over_the_same_base_bytes(root, model_dir, world, state):
    from shardwise.quant.linear import QuantLinear

    saved, resaved = assembled_checkpoint(root / "qlora" / STEP2), assembled_checkpoint(root / f"resaved-ws{world}")
    assert json.loads((root / f"resaved-ws{world}" / "manifest.json").read_text())["world_size"] == world
    assert sorted(saved) == sorted(resaved) and any(k.startswith("exp_avg:") for k in saved)
    assert all(torch.equal(saved[k], resaved[k]) for k in saved)
    # the base: quantised again on load at this world size, to the bytes one process makes of DIR's weights
    quantised = {n: m for n, m in _quantised_reference(model_dir).named_modules() if isinstance(m, QuantLinear)}
    assert len(quantised) == 7 * 2  # every Linear of both layers (lm_head kept)
    for name, module in quantised.items():
        for stored, want in module.stored().items():
            assert torch.equal(state[f"{name}.{stored}"], want), f"ws {world}: {name}.{stored}"


def test_a_ws2_checkpoint_reshards_to_one_rank_over_the_same_base_bytes(runs):
    root, model_dir, _, _ = runs
    state, _ = _reshard_in_this_process(root, model_dir)
    _assert_resharded_over_the_same_base_bytes(root, model_dir, 1, state)


@pytest.mark.slow  # a 3-rank spawn
def test_a_ws2_checkpoint_reshards_to_ws3_and_the_run_resumes_there(runs):
    root, model_dir, _, _ = runs
    state, start_step = run_distributed(_reshard, 3, str(root), model_dir, True, timeout_s=300)[0]
    _assert_resharded_over_the_same_base_bytes(root, model_dir, 3, state)
    assert start_step == 2 and (root / "resumed-ws3" / "step-00000003").is_dir()


def _preflight_error(cfg: TrainConfig) -> str:
    from shardwise.trainer.preflight import check_before_launch

    return error_of(lambda: check_before_launch(cfg, 2, 2, launching=False))


def test_a_resume_over_a_changed_base_is_refused_before_launch_naming_the_option(runs):
    root, model_dir, other_dir, worker_errors = runs
    qlora = _config(root, model_dir, out=str(root / "qlora"), resume=str(root / "qlora" / STEP2), steps=3)
    ckpt = root / "qlora" / STEP2
    errors = {
        "fp4": _preflight_error(dataclasses.replace(qlora, bnb_4bit_quant_type="fp4")),
        "no double quant": _preflight_error(dataclasses.replace(qlora, bnb_4bit_use_double_quant=False)),
        "no 4-bit": _preflight_error(dataclasses.replace(qlora, load_in_4bit=False)),
        "other DIR": _preflight_error(dataclasses.replace(qlora, model=other_dir)),
        "4-bit over plain": _preflight_error(dataclasses.replace(qlora, out=str(root / "plain"),
                                                                 resume=str(root / "plain" / STEP2))),
        "other r": _preflight_error(dataclasses.replace(qlora, lora_r=8)),
        "other alpha": _preflight_error(dataclasses.replace(qlora, lora_alpha=32)),
    }
    assert errors["fp4"] == (f"ShardwiseError: --bnb-4bit-quant-type fp4: {ckpt} was trained over the base "
                             f"quantised with --bnb-4bit-quant-type nf4; the adapters belong to the base as it was "
                             f"quantised: resume with --bnb-4bit-quant-type nf4")
    assert errors["no double quant"].startswith("ShardwiseError: --bnb-4bit-use-double-quant False: ")
    assert "quantised with --bnb-4bit-use-double-quant True" in errors["no double quant"]
    assert errors["no 4-bit"].startswith(f"ShardwiseError: --load-in-4bit: not given, but {ckpt} was trained with it "
                                         f"(--bnb-4bit-quant-type nf4 --bnb-4bit-use-double-quant True)")
    assert errors["other DIR"].startswith(f"ShardwiseError: --model {os.path.abspath(other_dir)}: its weights")
    assert f"not the base {ckpt} was trained over ({os.path.abspath(model_dir)}" in errors["other DIR"]
    assert errors["4-bit over plain"].startswith("ShardwiseError: --load-in-4bit: given, but ")
    assert "was trained without it" in errors["4-bit over plain"]
    assert errors["other r"] == (f"ShardwiseError: --lora-r 8: {ckpt} holds adapters trained with --lora-r 4: resume "
                                 f"with --lora-r 4, or start another run (--out)")
    assert errors["other alpha"].startswith("ShardwiseError: --lora-alpha 32: ") and "--lora-alpha 8:" in errors["other alpha"]
    assert all("\n" not in e for e in errors.values()), errors
    # a worker started without the preflight refuses on every rank, with the same line
    assert worker_errors == [errors["fp4"]] * 2


def test_generate_on_a_qlora_run_equals_one_process_through_the_same_quantised_model(runs, tmp_path):
    from shardwise.hf.export import export_checkpoint
    from shardwise.trainer import config as config_mod
    from shardwise.trainer.generate import _hf_generator, from_run, generate_text, one_process_group, sample
    from shardwise.trainer.jsonl_data import tokenizer_dir

    root, model_dir, _, _ = runs
    run = root / "qlora"
    config_mod.save(_config(root, model_dir, out=str(run)), str(run))
    got = generate_text(str(run), "The quick", max_new_tokens=8, temperature=0)

    export_checkpoint(run, tmp_path / "adapter")  # the peft adapter directory of the run's last checkpoint
    gen = _hf_generator(_quantised_reference(model_dir, str(tmp_path / "adapter")), tokenizer_dir(model_dir), False,
                        "reference")
    prompt = torch.tensor([gen.encode("The quick brown fox")])
    with one_process_group(), torch.no_grad():
        run_logits = from_run(run, "", False).logits(prompt)
        without_adapters = _quantised_reference(model_dir)(input_ids=prompt).logits
    torch.testing.assert_close(run_logits, gen.logits(prompt), rtol=1e-6, atol=1e-6)
    assert (run_logits - without_adapters).abs().max() > 1e-3  # the adapters matter: the comparison can fail
    ids = sample(gen, gen.encode("The quick"), 8, 0.0, 0, seed=0)
    if ids and ids[-1] == gen.eos_token_id:
        ids = ids[:-1]
    assert ids, "the reference sampled nothing: the comparison would be empty"
    assert got == gen.decode(ids)


def test_merge_of_a_qlora_run_adds_the_adapters_to_dirs_high_precision_weights_and_says_so(runs, tmp_path, capsys):
    """`export --merge` of a QLoRA run merges into DIR's original weights (never the 4-bit copy the run trained
    over), says so, and equals peft's merge_and_unload of the exported adapter over DIR's weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardwise.hf.export import export_checkpoint, export_main

    root, model_dir, _, _ = runs
    run = root / "qlora"
    export_checkpoint(run, tmp_path / "adapter")
    capsys.readouterr()
    assert export_main([str(run), str(tmp_path / "merged"), "--merge"]) == 0
    said = capsys.readouterr().out
    assert f"merged the adapters into the high-precision weights of {os.path.abspath(model_dir)}" in said
    assert "(the run trained over their 4-bit quantisation)" in said

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    assert sorted(merged) == sorted(reference)
    for name, want in reference.items():
        torch.testing.assert_close(merged[name], want, rtol=0, atol=0, msg=name)
