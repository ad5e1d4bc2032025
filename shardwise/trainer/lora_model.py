"""``--lora-r``: the trainer's model wrapped by peft LoRA (``shardwise.hf.lora``) before it is sharded."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.trainer.config import ConfigError, TrainConfig
from shardwise.hf.model_spec import ModelSpec


def wrap_lora(cfg: TrainConfig, spec: ModelSpec, model: nn.Module, init_fn: Callable[[nn.Module], None] | None,
              on_meta: bool) -> tuple[nn.Module, Callable[[nn.Module], None] | None]:
    """(peft model, its ``param_init_fn``). Before shard(): the frozen base then costs no gradient memory or
    traffic. On meta, the adapters are initialised inside shard() the way peft initialises them."""
    from shardwise.hf.lora import LoraSettings, apply_lora, lora_param_init_fn

    if spec.kind != "hf":
        raise ConfigError(f"--lora-r {cfg.lora_r}: LoRA needs a Hugging Face model (--model DIR or "
                          f"PATH/config.json); {spec.name} is a shardwise GPT preset")
    if cfg.load_in_4bit:  # QLoRA: the Linears become 4-bit before peft wraps them
        from shardwise.hf.quantization import quantize_model

        if spec.weights_dir is None:
            raise ConfigError(f"--load-in-4bit: {spec.name} has no weights to quantise (a config.json only); give "
                              f"--model DIR with the pretrained weights")
        quantize_model(model, quant_settings(cfg))
    settings = LoraSettings(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                            target_modules=tuple(cfg.lora_target_modules),
                            base_dtype=torch.bfloat16 if cfg.lora_base_dtype == "bf16" else None)
    model = apply_lora(model, settings)
    return model, (lora_param_init_fn(model, init_fn) if on_meta else None)


def quant_settings(cfg: TrainConfig):
    """The 4-bit settings of a ``--load-in-4bit`` run (None without it)."""
    if not cfg.load_in_4bit:
        return None
    from shardwise.hf.quantization import QuantSettings

    return QuantSettings(cfg.bnb_4bit_quant_type, cfg.bnb_4bit_use_double_quant)


def run_frozen_base(cfg: TrainConfig, spec: ModelSpec, recorded: dict | None = None) -> dict | None:
    """The ``frozen_base`` record of a LoRA run's base (--model DIR's weights, quantised as --load-in-4bit
    says): what its checkpoints record and what a resume, generate or export compares them with. None
    without --lora-r, or over a random base (whose checkpoints keep the base itself)."""
    return spec.frozen_base(recorded, quant_settings(cfg)) if cfg.lora_r else None
