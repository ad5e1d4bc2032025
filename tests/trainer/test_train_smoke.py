"""End-to-end training runs: resume continues bit for bit, and (slow) the default command meets its bar."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from harness import run_distributed
from shardwise.trainer.config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train_worker(rank, world, cfg_values):
    from shardwise.trainer.loop import train

    return train(TrainConfig(**cfg_values))


def _records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.mark.parametrize("mixed_precision,optimizer,offload", [
    ("no", "adamw", True), ("fp16", "adamw", False), pytest.param("no", "muon", False, marks=pytest.mark.slow)])
def test_resume_continues_bit_for_bit(tmp_path, mixed_precision, optimizer, offload):
    """fp16 also restores the loss scale: a resumed run that restarted from the initial scale would skip
    or scale differently and drift. Muon's momentum and its AdamW moments come back the same way.
    ``offload``: the resumed run has ``--cpu-offload`` (shardwise.offload_optimizer: per-unit CPU steps,
    clipping inside its step) and still continues bit for bit from the plain run's checkpoint, its own
    step-6 checkpoint holding what the plain run's holds."""
    base = TrainConfig(model="gpt-tiny", steps=6, batch_size=2, seq_len=32, gradient_accumulation_steps=2,
                       eval_every=3, eval_batches=1, log_every=1, save_every=3, warmup_steps=2, progress=False,
                       mixed_precision=mixed_precision, optimizer=optimizer)
    unbroken = dataclasses.replace(base, out=str(tmp_path / "unbroken"))
    run_distributed(_train_worker, 2, dataclasses.asdict(unbroken))
    # "Crash" after step 3: a new run, in a new directory, resumed from the step-3 checkpoint.
    resumed = dataclasses.replace(base, out=str(tmp_path / "resumed"), cpu_offload=offload,
                                  resume=str(tmp_path / "unbroken" / "step-00000003"))
    results = run_distributed(_train_worker, 2, dataclasses.asdict(resumed))
    assert results[0]["start_step"] == 3
    a, b = _records(unbroken.out), _records(resumed.out)
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("loss", "grad_norm", "lr"):
            assert a[step][key] == b[step][key], (step, key)  # exact: same data, same RNG, same state
    assert a[6]["val_loss"] == b[6]["val_loss"]
    assert a[6]["val_loss"] < a[0]["val_loss"], "the run did not train"
    if offload:
        saved = [tmp_path / run / "step-00000006" for run in ("unbroken", "resumed")]
        for name in sorted(n.name for n in saved[0].iterdir() if n.suffix == ".safetensors"):
            assert (saved[0] / name).read_bytes() == (saved[1] / name).read_bytes(), name
    if mixed_precision == "fp16":
        # Scale and growth tracker carry on from the checkpoint (a fresh scaler would count from 0 again).
        scalers = [[e["value"]["grad_scaler"] for e in json.loads((tmp_path / run / "step-00000006" / "manifest.json")
                                                                   .read_text())["extra"]] for run in ("unbroken", "resumed")]
        assert scalers[0] == scalers[1] and scalers[0][0]["_growth_tracker"] == 6, scalers


@pytest.mark.slow  # the default run resumes --resume latest in place in trainer/test_lora_checkpoints.py
def test_resume_latest_in_the_same_run_dir(tmp_path):
    cfg = TrainConfig(model="gpt-tiny", steps=2, batch_size=2, seq_len=32, eval_every=0, log_every=1,
                      save_every=1, progress=False, out=str(tmp_path / "run"))
    run_distributed(_train_worker, 2, dataclasses.asdict(cfg))
    more = dataclasses.replace(cfg, steps=4, resume="latest")
    results = run_distributed(_train_worker, 2, dataclasses.asdict(more))
    assert results[0]["start_step"] == 2
    assert sorted(_records(cfg.out)) == [1, 2, 3, 4]  # appended, not restarted
    assert (tmp_path / "run" / "step-00000004").is_dir()


@pytest.mark.slow
def test_default_command_halves_the_validation_loss(tmp_path):
    """`shardwise train` with no arguments (only the run directory moved): 2 ranks, the stdlib corpus."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "shardwise", "train", "--out", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    vals = [rec["val_loss"] for rec in _records(str(out)).values() if "val_loss" in rec]
    assert vals[0] > 5.0  # about ln 256 at the start
    assert vals[-1] <= vals[0] / 2
    assert (out / "metrics.png").is_file()
