"""Checkpoint bytes of a LoRA run: full (base stored) against adapter-only (base recorded by identity).

Measured: a tiny Llama (tests/hf_dirs.py) trained 1 step by `shardwise train` at world size 1, once over a
directory with weights (adapter-only checkpoints) and once over its config.json alone (random base: the base is
stored), for an fp32 and a bf16 base; the bytes are those of the committed checkpoint directory (rank files,
manifest, commit record). Estimated: the same arithmetic for a 7B preset on the meta device, AdamW (two fp32 state
tensors per adapter element), without the JSON (kilobytes).

    PYTHONPATH=. python bench/lora_checkpoint_bytes.py [--preset llama-2-7b] [--r 16] [--targets q_proj,v_proj]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def measure_tiny(root: Path, r: int, targets: list[str]) -> list[tuple[str, str, int]]:
    import hf_dirs
    import torch.distributed as dist

    from shardwise.trainer.config import TrainConfig
    from shardwise.trainer.loop import train

    if not dist.is_initialized():  # one process, world size 1
        dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)

    model_dir = hf_dirs.make_model_dir(str(root / "llama"), "llama")
    (root / "text.txt").write_text(" ".join(hf_dirs.CORPUS) * 4)
    rows = []
    for base_dtype in ("fp32", "bf16"):
        for kind, model in (("full (random base)", os.path.join(model_dir, "config.json")),
                            ("adapter-only", model_dir)):
            out = root / f"{kind.split()[0]}-{base_dtype}"
            cfg = TrainConfig(model=model, data=str(root / "text.txt"), steps=1, batch_size=2, seq_len=16,
                              eval_every=0, log_every=1, progress=False, out=str(out), lora_r=r,
                              lora_target_modules=targets, lora_base_dtype=base_dtype)
            train(cfg)
            rows.append((base_dtype, kind, _dir_bytes(out / "step-00000001")))
    return rows


def estimate(preset: str, r: int, targets: list[str]) -> list[tuple[str, str, int]]:
    from shardwise.hf.presets import ARCH_PRESETS
    from shardwise.hf.lora import LoraSettings, apply_lora
    from shardwise.hf.config_model import build_hf_model, hf_config_from_dict

    model = apply_lora(build_hf_model(hf_config_from_dict(ARCH_PRESETS[preset], preset), "meta"),
                       LoraSettings(r=r, target_modules=tuple(targets)))
    seen, frozen, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            if p.requires_grad:
                trainable += p.numel()
            else:
                frozen += p.numel()
    adapters = trainable * 4 * 3  # fp32 adapter + AdamW exp_avg + exp_avg_sq
    return [("fp32", "full", adapters + frozen * 4), ("bf16", "full", adapters + frozen * 2),
            ("any", "adapter-only", adapters)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,v_proj")
    args = parser.parse_args()
    targets = args.targets.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure_tiny(Path(tmp), 4, targets)
    print("| model | base dtype | checkpoint | bytes |\n|---|---|---|---:|")
    for base_dtype, kind, n in rows:
        print(f"| tiny Llama (r=4, measured) | {base_dtype} | {kind} | {n:,} |")
    for base_dtype, kind, n in estimate(args.preset, args.r, targets):
        print(f"| {args.preset} (r={args.r}, estimate) | {base_dtype} | {kind} | {n / 1e9:.3f} GB |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
