"""Everything a resumed run needs besides the weights, and the one place the trainer touches checkpoints.

A checkpoint holds the sharded model and optimizer (``shardwise.checkpoint``) plus, per rank, ``extra``:
the step, this rank's torch / numpy / Python RNG states, the data position, and under fp16 the loss
scaler's state. The data position *is*
the step (batches are a pure function of seed, step and rank, see ``data.py``) and so is the learning
rate (``schedule.py``); both are recorded with the seed and world size only to refuse or flag a resume
that could not be exact. Everything in ``extra`` is JSON or tensors: no pickle.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn



def _manager(run_dir: str):
    from shardwise.checkpoint import CheckpointManager

    # Checkpoints sit directly in the run directory (step-XXXXXXXX/, latest), so `shardwise export RUN_DIR`
    # finds the newest one.
    return CheckpointManager(Path(run_dir))


def capture_extra(step: int, seed: int, world_size: int, train_tokens: int,
                  grad_scaler: Optional[torch.amp.GradScaler] = None) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "step": step,
        "seed": seed,
        "world_size": world_size,
        "data": {"kind": "step-indexed", "next_step": step + 1, "train_tokens": train_tokens},
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        extra["rng"]["cuda"] = torch.cuda.get_rng_state()
    if grad_scaler is not None:
        extra["grad_scaler"] = grad_scaler.state_dict()  # scale and growth tracker: floats and ints
    return extra


def apply_extra(extra: dict[str, Any]) -> None:
    rng = extra["rng"]
    torch.set_rng_state(torch.as_tensor(rng["torch"], dtype=torch.uint8))
    state = rng["numpy"]
    np.random.set_state((state[0], np.asarray(state[1], dtype=np.uint32), *state[2:]))
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.as_tensor(rng["cuda"], dtype=torch.uint8))


def save_training_state(run_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                        seed: int, train_tokens: int, grad_scaler: Optional[torch.amp.GradScaler] = None) -> Path:
    """Save model, optimizer and this rank's ``extra`` as ``run_dir/step-XXXXXXXX``. Collective."""
    extra = capture_extra(step, seed, dist.get_world_size(), train_tokens, grad_scaler)
    return _manager(run_dir).save(model, optimizer, step=step, extra=extra)


def restore_training_state(run_dir: str, resume: str, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                           seed: int, train_tokens: int,
                           grad_scaler: Optional[torch.amp.GradScaler] = None) -> tuple[int, Optional[str]]:
    """Load the checkpoint ``resume`` names ('latest' or a path); return (step to continue after, a note
    for the user or None). ``resume=''`` or 'latest' with no checkpoint yet returns (0, note). Collective."""
    from shardwise.checkpoint import load_checkpoint

    if not resume:
        return 0, None
    if resume in ("latest", "auto", "true"):
        found = _manager(run_dir).resume(model, optimizer)
        if found is None:
            return 0, f"resume=latest: no checkpoint in {run_dir} yet, starting fresh"
        _, extra = found
    else:
        extra = load_checkpoint(resume, model, optimizer)
    notes = []
    if extra.get("seed") != seed:
        notes.append(f"the checkpoint was trained with seed {extra.get('seed')}, this run uses {seed}")
    if extra.get("world_size") != dist.get_world_size():
        notes.append(f"world size changed ({extra.get('world_size')} -> {dist.get_world_size()}): weights and "
                     f"optimizer are resharded exactly, but data order and RNG streams differ from an unbroken run")
    else:
        apply_extra(extra)  # the rank's own RNG states: only meaningful at the same world size
    if grad_scaler is not None:
        if "grad_scaler" in extra:
            grad_scaler.load_state_dict(extra["grad_scaler"])  # the same on every rank (ShardedGradScaler)
        else:
            notes.append("the checkpoint has no fp16 loss scale (it was not trained in fp16): starting from the "
                         "initial scale")
    if extra.get("data", {}).get("train_tokens") != train_tokens:
        notes.append("the training data differs from the checkpoint's (token count changed)")
    return int(extra["step"]), ("; ".join(notes) or None)
