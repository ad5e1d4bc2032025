"""`shardwise train --model DIR --lora-r`: checkpoints hold only the adapters, their optimizer state and the
trainer state, plus the identity of the base in DIR. A resume reads the base from DIR again and continues bit for
bit (fp32 base; bf16 base under slow; 2 ranks); a resume over other weights, or without DIR's weights, fails before
training on every rank naming --model; a ws2 checkpoint resumes at ws3 with the adapters and optimizer resharded
exactly (slow). ``shardwise export`` of the run writes the peft adapter directory and, with --merge, the merged model,
whose config states the dtype written.

One 2-rank spawn runs the default training cases (``_runs``); the exports are single-process, in the test process."""

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

STEPS = 4


def _config(root, model_dir, base_dtype, **kw) -> TrainConfig:
    return TrainConfig(model=model_dir, data=str(root / "text.txt"), steps=STEPS, batch_size=2, seq_len=16,
                       eval_every=0, log_every=1, save_every=2, warmup_steps=1, lr=1e-2, progress=False,
                       lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"], lora_base_dtype=base_dtype,
                       **kw)


def _resume_dir(src_run: str, dst_run: str) -> None:
    """A run directory holding only ``src_run``'s step-2 checkpoint: where an interrupted run would stand."""
    shutil.rmtree(dst_run, ignore_errors=True)
    os.makedirs(dst_run)
    shutil.copytree(os.path.join(src_run, "step-00000002"), os.path.join(dst_run, "step-00000002"))


def _runs(rank, world, root, model_dir, other_dir, base_dtypes, refusals):
    import torch.distributed as dist

    from shardwise.trainer.loop import train

    root = pathlib.Path(root)
    starts, errors = {}, {}
    for base_dtype in base_dtypes:
        cfg = _config(root, model_dir, base_dtype)
        train(dataclasses.replace(cfg, out=str(root / f"unbroken-{base_dtype}")))
        if rank == 0:
            _resume_dir(str(root / f"unbroken-{base_dtype}"), str(root / f"resumed-{base_dtype}"))
        dist.barrier()
        summary = train(dataclasses.replace(cfg, out=str(root / f"resumed-{base_dtype}"), resume="latest"))
        starts[base_dtype] = summary["start_step"]
    if not refusals:
        return starts, errors
    cfg = dataclasses.replace(_config(root, model_dir, "fp32"), resume="latest")
    for case, changes in {"other base": {"model": other_dir},
                          "no weights": {"model": os.path.join(model_dir, "config.json")},
                          "other base dtype": {"lora_base_dtype": "bf16"}}.items():
        if rank == 0:
            _resume_dir(str(root / "unbroken-fp32"), str(root / "refused"))
        dist.barrier()
        errors[case] = error_of(lambda changes=changes: train(dataclasses.replace(cfg, out=str(root / "refused"),
                                                                                   **changes)))
    return starts, errors


def _reshard(rank, world, root, model_dir):
    """Load the ws2 run's step-2 checkpoint at this world size (the frozen base from DIR) and save it again."""
    from shardwise.checkpoint import load_checkpoint, save_checkpoint
    from shardwise.trainer.loop import build_optimizer, build_sharded_model
    from shardwise.hf.model_spec import resolve_model

    cfg = _config(pathlib.Path(root), model_dir, "fp32")
    spec = resolve_model(cfg.model)
    model = build_sharded_model(cfg, spec, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    ckpt = os.path.join(root, "unbroken-fp32", "step-00000002")
    extra = load_checkpoint(ckpt, model, optimizer, frozen_base=spec.frozen_base())
    save_checkpoint(os.path.join(root, f"resaved-ws{world}"), model, optimizer, step=2, extra=extra,
                    frozen_base=spec.frozen_base())


def _checkpoint_tensors(ckpt):
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".safetensors"):
            out.update({f"{name}:{k}": v for k, v in load_file(os.path.join(ckpt, name)).items()})
    return out


def _metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-ckpt")
    model_dir, other_dir = hf_dirs.make_base_and_other(root)
    return root, model_dir, other_dir


@pytest.fixture(scope="module")
def runs(model_dirs):
    """fp32 base: unbroken, resumed, and the refused resumes (one 2-rank spawn)."""
    root, model_dir, other_dir = model_dirs
    starts, errors = run_distributed(_runs, 2, str(root), model_dir, other_dir, ["fp32"], True)[0]
    return root, model_dir, starts, errors


@pytest.fixture(scope="module")
def bf16_runs(model_dirs):
    root, model_dir, other_dir = model_dirs
    starts, _ = run_distributed(_runs, 2, str(root), model_dir, other_dir, ["bf16"], False)[0]
    return root, starts


def test_checkpoints_hold_only_the_adapters_and_the_base_identity(runs):
    from shardwise.hf.weight_files import weights_identity

    root, model_dir, _, _ = runs
    manifest = json.loads((root / "unbroken-fp32" / "step-00000004" / "manifest.json").read_text())
    assert manifest["params"] and all(".lora_A." in n or ".lora_B." in n for n in manifest["params"])
    assert set(manifest["optimizer"]["state"]) == set(manifest["params"])
    assert manifest["frozen_base"] == {"source": os.path.abspath(model_dir), "weights_sha256": weights_identity(model_dir),
                                       "dtype": "float32"}


def _assert_continues_bitwise(root, base_dtype):
    a, b = _metrics(root / f"unbroken-{base_dtype}"), _metrics(root / f"resumed-{base_dtype}")
    for step in (3, 4):
        assert (a[step]["loss"], a[step]["grad_norm"]) == (b[step]["loss"], b[step]["grad_norm"]), step
    unbroken = _checkpoint_tensors(root / f"unbroken-{base_dtype}" / "step-00000004")
    resumed = _checkpoint_tensors(root / f"resumed-{base_dtype}" / "step-00000004")
    assert sorted(unbroken) == sorted(resumed) and any("optim/" in k for k in unbroken)
    assert all(torch.equal(unbroken[k], resumed[k]) for k in unbroken)


def test_resume_reads_the_base_again_and_continues_bitwise(runs):
    root, _, starts, _ = runs
    assert starts["fp32"] == 2
    _assert_continues_bitwise(root, "fp32")


@pytest.mark.slow  # two more trainer runs of 2 ranks
def test_resume_with_a_bf16_base_continues_bitwise(bf16_runs):
    root, starts = bf16_runs
    assert starts["bf16"] == 2
    _assert_continues_bitwise(root, "bf16")
    manifest = json.loads((root / "unbroken-bf16" / "step-00000004" / "manifest.json").read_text())
    assert manifest["frozen_base"]["dtype"] == "bfloat16"


def test_resume_over_other_weights_or_without_them_is_refused_naming_the_option(runs):
    _, model_dir, _, errors = runs
    assert "ShardwiseError: --model" in errors["other base"] and "are not the base" in errors["other base"]
    assert f"resume it with --model {os.path.abspath(model_dir)}" in errors["no weights"]
    assert "held in float32, the model holds it in bfloat16" in errors["other base dtype"]
    assert all("\n" not in e for e in errors.values())


@pytest.mark.slow  # a 3-rank spawn
def test_adapter_only_checkpoint_saved_at_ws2_reshards_to_ws3(runs):
    root, model_dir, _, _ = runs
    run_distributed(_reshard, 3, str(root), model_dir)
    saved, resaved = assembled_checkpoint(root / "unbroken-fp32" / "step-00000002"), assembled_checkpoint(root / "resaved-ws3")
    assert json.loads((root / "resaved-ws3" / "manifest.json").read_text())["world_size"] == 3
    assert sorted(saved) == sorted(resaved) and any(k.startswith("exp_avg:") for k in saved)
    assert all(torch.equal(saved[k], resaved[k]) for k in saved)


def test_export_writes_the_peft_adapter_and_the_merged_model(runs, tmp_path, capsys):
    """The adapter directory equals what the trained model's save_adapter wrote and loads with peft onto the base
    from DIR; --merge gives what peft's merge_and_unload gives, bit for bit, and the logits of the adapted model.
    The base directory is stored in bf16 and the masters are fp32: the merged config says float32 (from_pretrained's
    default dtype "auto" loads fp32), and --dtype bf16 gives a bf16 model that loads as bf16."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardwise.hf.export import export_checkpoint, export_main

    root, model_dir, _, _ = runs
    run = root / "unbroken-fp32"
    assert export_main([str(run), str(tmp_path / "adapter")]) == 0
    exported = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    trained = load_file(str(run / "adapter" / "adapter_model.safetensors"))  # the live model's, by save_adapter
    assert sorted(exported) == sorted(trained) and all(torch.equal(exported[k], trained[k]) for k in trained)

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    x = torch.randint(0, base.config.vocab_size, (2, 12))
    with torch.no_grad():
        adapted = peft_model(input_ids=x).logits
    reference = peft_model.merge_and_unload().state_dict()

    capsys.readouterr()
    assert export_main([str(run), str(tmp_path / "merged"), "--merge"]) == 0
    assert f"merged the adapters into the high-precision weights of {model_dir}, in float32" in capsys.readouterr().out  # says which
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # dtype "auto": what the config says
    assert merged.dtype == torch.float32
    assert all(torch.equal(v, merged.state_dict()[k]) for k, v in reference.items())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, adapted, rtol=1e-5, atol=1e-5)

    export_checkpoint(run, tmp_path / "merged-bf16", merge=True, dtype=torch.bfloat16)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged-bf16").dtype == torch.bfloat16


def test_export_misuse_is_one_line(runs, tmp_path, capsys):
    from shardwise.hf.export import export_main

    root, _, _, _ = runs
    run = root / "unbroken-fp32"
    moved = tmp_path / "llama-other"
    shutil.copytree(root / "llama-other", moved)
    cases = {("--merge", "--base", str(moved)): "are not the base",
             ("--base", str(moved)): "--base: the base directory is read by --merge only"}
    for args, message in cases.items():
        assert export_main([str(run), str(tmp_path / "out"), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_generate_from_the_run_uses_the_base_and_the_adapters(runs, tmp_path):
    """`shardwise generate RUN` rebuilds the base from --model DIR under the adapter-only checkpoint: greedy text
    equal to the merged export's."""
    from shardwise.hf.export import export_checkpoint
    from shardwise.trainer import config as config_mod
    from shardwise.trainer.generate import generate_text

    root, model_dir, _, _ = runs
    run = root / "unbroken-fp32"
    config_mod.save(dataclasses.replace(_config(root, model_dir, "fp32"), out=str(run)), str(run))
    export_checkpoint(run, tmp_path / "merged", merge=True)
    from_run = generate_text(str(run), "The quick", max_new_tokens=6, temperature=0)
    assert from_run == generate_text(str(tmp_path / "merged"), "The quick", max_new_tokens=6, temperature=0)
