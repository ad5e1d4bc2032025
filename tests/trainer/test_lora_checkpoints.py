"""`shardwise train --model DIR --lora-r`: checkpoints hold only the adapters, their optimizer state and the
trainer state, plus the identity of the base in DIR. A resume reads the base from DIR again and continues bit for
bit (fp32 base and bf16 base, 2 ranks); a resume over other weights, or without DIR's weights, fails before
training on every rank naming --model; a ws2 checkpoint resumes at ws3 with the adapters and optimizer resharded
exactly. ``shardwise export`` of the run writes the peft adapter directory and, with --merge, the merged model,
whose config states the dtype written.

One 2-rank spawn runs every training case (``_runs``); the exports are single-process, in the test process."""

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


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _runs(rank, world, root, model_dir, other_dir):
    import torch.distributed as dist

    from shardwise.trainer.loop import train

    root = pathlib.Path(root)
    starts, errors = {}, {}
    for base_dtype in ("fp32", "bf16"):
        cfg = _config(root, model_dir, base_dtype)
        train(dataclasses.replace(cfg, out=str(root / f"unbroken-{base_dtype}")))
        if rank == 0:
            _resume_dir(str(root / f"unbroken-{base_dtype}"), str(root / f"resumed-{base_dtype}"))
        dist.barrier()
        summary = train(dataclasses.replace(cfg, out=str(root / f"resumed-{base_dtype}"), resume="latest"))
        starts[base_dtype] = summary["start_step"]
    cfg = dataclasses.replace(_config(root, model_dir, "fp32"), resume="latest")
    for case, changes in {"other base": {"model": other_dir},
                          "no weights": {"model": os.path.join(model_dir, "config.json")},
                          "other base dtype": {"lora_base_dtype": "bf16"}}.items():
        if rank == 0:
            _resume_dir(str(root / "unbroken-fp32"), str(root / "refused"))
        dist.barrier()
        errors[case] = _error_of(lambda: train(dataclasses.replace(cfg, out=str(root / "refused"), **changes)))
    return starts, errors


def _reshard(rank, world, root, model_dir):
    """Load the ws2 run's step-2 checkpoint at this world size (the frozen base from DIR) and save it again."""
    from shardwise.checkpoint import load_checkpoint, save_checkpoint
    from shardwise.trainer.loop import build_optimizer, build_sharded_model
    from shardwise.trainer.model_factory import resolve_model

    cfg = _config(pathlib.Path(root), model_dir, "fp32")
    spec = resolve_model(cfg.model)
    model = build_sharded_model(cfg, spec, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    ckpt = os.path.join(root, "unbroken-fp32", "step-00000002")
    extra = load_checkpoint(ckpt, model, optimizer, frozen_base=spec.frozen_base())
    save_checkpoint(os.path.join(root, f"resaved-ws{world}"), model, optimizer, step=2, extra=extra,
                    frozen_base=spec.frozen_base())


def _assembled(ckpt) -> dict:
    """Every stored parameter and optimizer state tensor, whole: its pieces concatenated in order."""
    from safetensors import safe_open

    manifest = json.loads((ckpt / "manifest.json").read_text())
    out = {}
    for name, p in manifest["params"].items():
        for label, key_of in [("param", lambda piece: piece["key"])] + [
                (s, lambda piece, s=s: piece["optim"][s]) for s in manifest["optimizer"]["state"][name]["tensors"]]:
            parts = []
            for piece in p["pieces"]:
                with safe_open(str(ckpt / piece["file"]), "pt") as f:
                    parts.append(f.get_tensor(key_of(piece)))
            out[f"{label}:{name}"] = torch.cat(parts)
    return out


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
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-ckpt")
    model_dir = hf_dirs.make_model_dir(str(root / "llama"), "llama", dtype=torch.bfloat16)
    other_dir = hf_dirs.make_model_dir(str(root / "llama-other"), "llama", seed=1, dtype=torch.bfloat16)
    (root / "text.txt").write_text(" ".join(hf_dirs.CORPUS) * 4)
    starts, errors = run_distributed(_runs, 2, str(root), model_dir, other_dir)[0]
    return root, model_dir, starts, errors


def test_checkpoints_hold_only_the_adapters_and_the_base_identity(runs):
    from shardwise.pretrained_files import weights_identity

    root, model_dir, _, _ = runs
    manifest = json.loads((root / "unbroken-fp32" / "step-00000004" / "manifest.json").read_text())
    assert manifest["params"] and all(".lora_A." in n or ".lora_B." in n for n in manifest["params"])
    assert set(manifest["optimizer"]["state"]) == set(manifest["params"])
    assert manifest["frozen_base"] == {"source": os.path.abspath(model_dir), "weights_sha256": weights_identity(model_dir),
                                       "dtype": "float32"}
    bf16 = json.loads((root / "unbroken-bf16" / "step-00000004" / "manifest.json").read_text())
    assert bf16["frozen_base"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("base_dtype", ["fp32", "bf16"])
def test_resume_reads_the_base_again_and_continues_bitwise(runs, base_dtype):
    root, _, starts, _ = runs
    assert starts[base_dtype] == 2
    a, b = _metrics(root / f"unbroken-{base_dtype}"), _metrics(root / f"resumed-{base_dtype}")
    for step in (3, 4):
        assert (a[step]["loss"], a[step]["grad_norm"]) == (b[step]["loss"], b[step]["grad_norm"]), step
    unbroken = _checkpoint_tensors(root / f"unbroken-{base_dtype}" / "step-00000004")
    resumed = _checkpoint_tensors(root / f"resumed-{base_dtype}" / "step-00000004")
    assert sorted(unbroken) == sorted(resumed) and any("optim/" in k for k in unbroken)
    assert all(torch.equal(unbroken[k], resumed[k]) for k in unbroken)


def test_resume_over_other_weights_or_without_them_is_refused_naming_the_option(runs):
    _, model_dir, _, errors = runs
    assert "ShardwiseError: --model" in errors["other base"] and "are not the base" in errors["other base"]
    assert f"resume it with --model {os.path.abspath(model_dir)}" in errors["no weights"]
    assert "held in float32, the model holds it in bfloat16" in errors["other base dtype"]
    assert all("\n" not in e for e in errors.values())


def test_adapter_only_checkpoint_saved_at_ws2_reshards_to_ws3(runs):
    root, model_dir, _, _ = runs
    run_distributed(_reshard, 3, str(root), model_dir)
    saved, resaved = _assembled(root / "unbroken-fp32" / "step-00000002"), _assembled(root / "resaved-ws3")
    assert json.loads((root / "resaved-ws3" / "manifest.json").read_text())["world_size"] == 3
    assert sorted(saved) == sorted(resaved) and any(k.startswith("exp_avg:") for k in saved)
    assert all(torch.equal(saved[k], resaved[k]) for k in saved)
