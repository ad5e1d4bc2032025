"""Everything a resumed run needs besides the weights, and the one place the trainer touches checkpoints.

A checkpoint holds the sharded model and optimizer (``shardwise.checkpoint``) plus, per rank, ``extra``:
the step, this rank's torch / numpy / Python RNG states, the data position, and under fp16 the loss
scaler's state. The data position *is*
the step (batches are a pure function of seed, step and rank, see ``data.py``) and so is the learning
rate (``schedule.py``); both are recorded with the seed and world size only to refuse or flag a resume
that could not be exact. Everything in ``extra`` is JSON or tensors: no pickle.

A checkpoint is checked before anything in it is used (``shardwise.checkpoint.verify``); ``extra`` is then
checked here, on every rank together, before it is applied: the keys the trainer needs, of the types it
writes, the step equal to the checkpoint's, and RNG states that a scratch generator accepts. A damaged or
hand-made ``extra`` therefore ends the run with one line naming the checkpoint, not a ``KeyError``.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.errors import ShardwiseError

_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


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
    """Restore this rank's RNG states (``check_extra`` has accepted them)."""
    rng = extra["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(_numpy_state(rng["numpy"]))
    random.setstate(_python_state(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.as_tensor(rng["cuda"], dtype=torch.uint8))


def save_training_state(run_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                        seed: int, train_tokens: int, grad_scaler: Optional[torch.amp.GradScaler] = None,
                        frozen_base: Optional[dict] = None) -> Path:
    """Save model, optimizer and this rank's ``extra`` as ``run_dir/step-XXXXXXXX``. Collective. With
    ``frozen_base`` (a LoRA run over ``--model DIR``'s weights) the frozen base is not stored, only its record."""
    extra = capture_extra(step, seed, dist.get_world_size(), train_tokens, grad_scaler)
    return _manager(run_dir).save(model, optimizer, step=step, extra=extra, frozen_base=frozen_base)


def restore_training_state(run_dir: str, resume: str, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                           seed: int, train_tokens: int,
                           grad_scaler: Optional[torch.amp.GradScaler] = None,
                           frozen_base: Optional[dict] = None) -> tuple[int, Optional[str]]:
    """Load the checkpoint ``resume`` names ('latest'/'auto', a checkpoint, or a run directory: its newest);
    return (step to continue after, a note for the user or None). ``resume=''`` or 'latest' with no
    checkpoint yet returns (0, note). Collective; raises ShardwiseError on every rank for a checkpoint that
    is damaged or does not fit."""
    from shardwise.checkpoint import checkpoint_info, load_checkpoint
    from shardwise.engine.checks import agree

    path = resume_path(run_dir, resume)
    if path is None:
        return 0, f"resume={resume}: no checkpoint in {run_dir} yet, starting fresh" if resume else None
    agree.agreed(lambda: check_frozen_base(path, frozen_base), f"checking {path}")
    agree.agreed(lambda: check_adapter_settings(path, model), f"checking {path}")
    extra = load_checkpoint(path, model, optimizer, frozen_base=frozen_base)
    step = agree.agreed(lambda: check_extra(extra, path, checkpoint_info(path).step, grad_scaler is not None),
                        f"checking {path}")
    notes = []
    if extra["seed"] != seed:
        notes.append(f"the checkpoint was trained with seed {extra['seed']}, this run uses {seed}")
    if extra["world_size"] != dist.get_world_size():
        notes.append(f"world size changed ({extra['world_size']} -> {dist.get_world_size()}): weights and "
                     f"optimizer are resharded exactly, but data order and RNG streams differ from an unbroken run")
    else:
        apply_extra(extra)  # the rank's own RNG states: only meaningful at the same world size
    if grad_scaler is not None:
        if "grad_scaler" in extra:
            grad_scaler.load_state_dict(extra["grad_scaler"])  # the same on every rank (ShardedGradScaler)
        else:
            notes.append("the checkpoint has no fp16 loss scale (it was not trained in fp16): starting from the "
                         "initial scale")
    if extra["data"]["train_tokens"] != train_tokens:
        notes.append("the training data differs from the checkpoint's (token count changed)")
    return step, ("; ".join(notes) or None)


def resume_path(run_dir: str, resume: str) -> Optional[Path]:
    """The checkpoint ``resume`` names ('latest'/'auto': the newest in ``run_dir``; a run directory: its
    newest; else the path itself); None to start fresh."""
    if not resume:
        return None
    if resume in ("latest", "auto", "true"):
        return _manager(run_dir).choose_latest()
    path = Path(resume)
    if not (path / "commit.json").exists() and not (path / "manifest.json").exists() and path.is_dir():
        path = _manager(resume).choose_latest() or path  # a run directory: its newest checkpoint
    return path


def recorded_base(run_dir: str, resume: str) -> Optional[dict]:
    """The ``frozen_base`` record of the checkpoint a resume would load (None: none, or it stores its base)."""
    from shardwise.checkpoint.verify import read_manifest

    path = resume_path(run_dir, resume)
    return None if path is None else read_manifest(path).get("frozen_base")


def check_frozen_base(path: Path, frozen_base: Optional[dict]) -> None:
    """An adapter-only checkpoint resumes only over its own base, read again from ``--model DIR``: refuse,
    naming the option, a resume without that directory's weights or with other weights (``load_checkpoint``
    would refuse it too, without naming the trainer's options)."""
    from shardwise.checkpoint.frozen_base import mismatch, quantization_of
    from shardwise.checkpoint.verify import read_manifest

    saved = read_manifest(path).get("frozen_base")
    if saved is None or mismatch(saved, frozen_base, None) is None:
        return  # (a changed --lora-base-dtype is load_checkpoint's message: it names both dtypes)
    if frozen_base is None:
        four_bit = " --load-in-4bit" if quantization_of(saved) else ""
        raise ShardwiseError(f"{path}: an adapter-only LoRA checkpoint over the weights of {saved['source']}; "
                             f"resume it with --model {saved['source']} (a directory with those weights) and the "
                             f"run's --lora-*{four_bit} options")
    if frozen_base["weights_sha256"] != saved["weights_sha256"]:
        raise ShardwiseError(f"--model {frozen_base['source']}: its weights (identity "
                             f"{frozen_base['weights_sha256'][:12]}...) are not the base {path} was trained over "
                             f"({saved['source']}, identity {saved['weights_sha256'][:12]}...)")
    raise ShardwiseError(quantization_change(path, quantization_of(saved), quantization_of(frozen_base)))


# The LoRA settings a checkpoint's adapters were trained with (its manifest's peft_config) and the options
# that set them: another value builds other adapters (other shapes, names or scale).
LORA_OPTIONS = {"r": "--lora-r", "lora_alpha": "--lora-alpha", "target_modules": "--lora-target-modules"}


def check_adapter_settings(path: Path, model: nn.Module) -> None:
    """A LoRA checkpoint resumes only into adapters built as it was trained: refuse, in one line naming the
    option and both values, a resume with another ``--lora-r``, ``--lora-alpha`` or target modules (the
    generic "different model" comparison would list every adapter tensor instead)."""
    from shardwise.checkpoint.verify import read_manifest

    saved = read_manifest(path)["model"].get("peft_config")
    configs = getattr(model, "peft_config", None)
    if saved is None or not configs:
        return
    (config,) = configs.values()
    for key, option in LORA_OPTIONS.items():
        was, now = _setting(saved.get(key)), _setting(getattr(config, key, None))
        if was != now:
            raise ShardwiseError(f"{option} {now}: {path} holds adapters trained with {option} {was}: resume with "
                                 f"{option} {was}, or start another run (--out)")


def _setting(value) -> str:
    """A LoRA setting as the command line spells it: 16, 32.0 -> 32, q_proj,v_proj."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(sorted(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# A 4-bit base's recorded settings (``QuantSettings.to_dict``) and the options that set them.
QUANT_OPTIONS = {"quant_type": "bnb_4bit_quant_type", "double_quant": "bnb_4bit_use_double_quant"}


def quantization_change(path: Path, saved: Optional[dict], given: Optional[dict]) -> str:
    """One line naming the option whose value differs from the one ``path``'s base was quantised with."""
    from shardwise.trainer.config import option_label

    if saved is None:
        return (f"--load-in-4bit: given, but {path} was trained without it (over the base in high precision); "
                f"the adapters belong to that base: resume without --load-in-4bit")
    if given is None:
        settings = " ".join(f"{option_label(o)} {saved.get(k)}" for k, o in QUANT_OPTIONS.items())
        return (f"--load-in-4bit: not given, but {path} was trained with it ({settings}); the adapters belong "
                f"to the base as quantised: resume with --load-in-4bit")
    key = next((k for k in QUANT_OPTIONS if saved.get(k) != given.get(k)), None)
    if key is None:
        return f"{path}: its 4-bit base was quantised with {saved}, this run's with {given}"
    option = option_label(QUANT_OPTIONS[key])
    return (f"{option} {given.get(key)}: {path} was trained over the base quantised with {option} {saved.get(key)}; "
            f"the adapters belong to the base as it was quantised: resume with {option} {saved.get(key)}")


def check_extra(extra: Any, path: Path, manifest_step: Optional[int], want_scaler: bool) -> int:
    """The step ``extra`` records, after checking that it is what ``capture_extra`` writes; else a
    ShardwiseError naming the checkpoint."""

    def bad(what: str) -> ShardwiseError:
        return ShardwiseError(f"{path}: the trainer state in this checkpoint's extra is not usable: {what}")

    if not isinstance(extra, dict):
        raise bad(f"expected a dict, found {type(extra).__name__} (saved by another program?)")
    for key, kinds in (("step", int), ("seed", int), ("world_size", int), ("data", dict), ("rng", dict)):
        if key not in extra:
            raise bad(f"it has no {key!r}")
        if not isinstance(extra[key], kinds) or isinstance(extra[key], bool):
            raise bad(f"{key!r} is {type(extra[key]).__name__}, not {kinds.__name__}")
    step = extra["step"]
    if step < 0 or (manifest_step is not None and step != manifest_step):
        raise bad(f"step {step}, but the checkpoint is of step {manifest_step}")
    if not 1 <= extra["world_size"] <= 2**20 or not 0 <= extra["seed"] < 2**32:
        raise bad(f"world_size {extra['world_size']} or seed {extra['seed']} out of range")
    tokens = extra["data"].get("train_tokens")
    if type(tokens) is not int or tokens < 0:
        raise bad("data.train_tokens is not a token count")
    _check_rng(extra["rng"], bad)
    if want_scaler and "grad_scaler" in extra:
        scaler = extra["grad_scaler"]
        if (not isinstance(scaler, dict) or set(scaler) != set(_SCALER_KEYS)
                or not all(type(v) in (int, float) and math.isfinite(v) and v >= 0 for v in scaler.values())
                or not scaler["scale"] > 0):
            raise bad(f"grad_scaler is not a loss-scaler state ({', '.join(_SCALER_KEYS)}: finite, scale > 0)")
    return step


def _check_rng(rng: dict, bad) -> None:
    """Each RNG state must be accepted by a scratch generator of its kind: the global ones stay untouched
    until every check has passed."""
    for key in ("torch", "numpy", "python"):
        if key not in rng:
            raise bad(f"rng has no {key!r} state")
    state = rng["torch"]
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.shape != torch.get_rng_state().shape:
        raise bad("rng.torch is not a torch RNG state (a uint8 tensor of torch.get_rng_state()'s size)")
    try:
        torch.Generator().set_state(state)
        np.random.RandomState().set_state(_numpy_state(rng["numpy"]))
        random.Random().setstate(_python_state(rng["python"]))
    except (TypeError, ValueError, IndexError, OverflowError, RuntimeError) as e:
        raise bad(f"rng holds an RNG state that torch, numpy or Python refuses ({str(e)[:100]})") from None


def _numpy_state(state: Any) -> tuple:
    if not isinstance(state, tuple) or len(state) != 5 or not isinstance(state[1], np.ndarray):
        raise ValueError("numpy state must be a 5-tuple with an array")
    if state[1].dtype != np.uint32 or state[1].shape != (624,):
        raise ValueError("numpy state array must be 624 uint32 values")
    return (state[0], state[1], *state[2:])


def _python_state(state: Any) -> tuple:
    if not isinstance(state, tuple) or len(state) != 3 or not isinstance(state[1], (tuple, list)):
        raise ValueError("Python random state must be a 3-tuple")
    return (state[0], tuple(state[1]), state[2])
