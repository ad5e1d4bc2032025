"""Whose defaults a run takes: shardwise's, or Hugging Face Trainer's for a command line ported from
``run_clm.py`` / TRL (``TrainConfig.defaults``: auto picks by the spelling of the command line). The banner
states which (``defaults_note``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from shardwise.trainer.config import TrainConfig


# What ``defaults = "huggingface"`` changes: HF TrainingArguments' and run_clm.py's values where they differ from
# ours (seq_len: run_clm's block_size, min(1024, the model's positions), filled in by ``resolve``).
HF_DEFAULTS: dict[str, Any] = {"lr": 5e-5, "lr_schedule": "linear", "min_lr_ratio": 0.0, "warmup_steps": 0,
                               "weight_decay": 0.0, "adam_beta2": 0.999, "batch_size": 8}
HF_MAX_BLOCK_SIZE = 1024


def with_defaults(values: dict[str, Any], argv: Sequence[str], default_model: str, default_seq_len: int) -> dict[str, Any]:
    """``values`` (TOML + command line) with ``defaults`` resolved to shardwise or huggingface and, for the
    latter, HF's values under them (seq_len: run_clm's block size for the model)."""
    values = dict(values)
    if values.get("defaults", "auto") == "auto":
        values["defaults"] = "huggingface" if hf_spelled(argv) else "shardwise"
    if values["defaults"] == "huggingface":
        values = {**HF_DEFAULTS, **values}
        if "seq_len" not in values:
            values["seq_len"] = _hf_block_size(values.get("model", default_model), default_seq_len)
    return values


def hf_spelled(argv: Sequence[str]) -> bool:
    """Does the command line spell any option the Hugging Face way (underscores, or --fsdp / --bf16 / --fp16)?"""
    from shardwise.trainer.hf_args import HF_ONLY_FLAGS

    names = [a[2:].partition("=")[0] for a in argv if a.startswith("--")]
    return any("_" in n or n.lower() in HF_ONLY_FLAGS for n in names)


def _hf_block_size(model: str, fallback: int) -> int:
    """run_clm.py's default block size: the model's positions, at most 1024 (128 when the model cannot be read:
    the launcher's checks then name the problem)."""
    from shardwise.hf.model_spec import ModelError, resolve_model

    try:
        positions = resolve_model(model).max_seq_len
    except (ModelError, OSError, ValueError):
        return fallback
    return min(HF_MAX_BLOCK_SIZE, positions or HF_MAX_BLOCK_SIZE)


def defaults_note(cfg: TrainConfig) -> str:
    """The banner's statement of the optimisation settings and whose defaults filled them."""
    whose = ("Hugging Face Trainer's (HF spellings on the command line; --defaults shardwise for shardwise's)"
             if cfg.defaults == "huggingface" else "shardwise's (--defaults huggingface for the HF Trainer's)")
    decay = "flat" if cfg.lr_schedule == "constant" else f"{cfg.lr_schedule} decay to {cfg.lr * cfg.min_lr_ratio:g}"
    return (f"lr {cfg.lr:g}, {cfg.warmup_steps} warm-up steps, {decay} | AdamW betas ({cfg.adam_beta1:g}, "
            f"{cfg.adam_beta2:g}), weight decay {cfg.weight_decay:g} | batch {cfg.batch_size}, seq-len "
            f"{cfg.seq_len} | defaults: {whose}")
