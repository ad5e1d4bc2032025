"""From ``--model`` (a GPT preset or a Hugging Face config.json) to what the trainer and the memory planner
need: a builder (on any device, meta included), the sharding units, an init function for meta builds, the
loss, and the numbers the metrics line uses (parameter count, FLOPs per token)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.hf.presets import ARCH_PRESETS
from shardwise.errors import ShardwiseError
from shardwise.engine.hf_init import hf_param_init_fn
from shardwise.engine.base.plan import AUTO_WITH_HEAD
from shardwise.models.gpt import GPT, PRESETS, Block, GPTConfig
from shardwise.hf.pretrained import load_pretrained, skip_weight_init
from shardwise.checkpoint.files import RUN_MODEL_FILES, copy_model_files
from shardwise.hf.weight_files import weight_file_names
from shardwise.hf import config_model as hf_model

IGNORE_INDEX = -100  # a target the loss skips (torch's cross_entropy default ignore_index)

# Hugging Face models above this many parameters are built on the meta device and materialised shard by
# shard; below it an eager build is cheaper than the bookkeeping and exercises HF's own init directly.
META_BUILD_MIN_PARAMS = 200_000_000


class ModelError(ValueError):
    """A --model value that names no preset and no usable config.json."""


@dataclass
class ModelSpec:
    name: str
    kind: str  # "gpt" or "hf"
    config: object  # GPTConfig or a transformers PretrainedConfig
    vocab_size: int
    max_seq_len: Optional[int]
    n_layer: int
    hidden: int
    weights_dir: Optional[str] = None  # a Hugging Face model directory with weights: loaded after shard()
    source: str = ""  # what --model named

    def build(self, device: torch.device | str = "cpu") -> nn.Module:
        """The model with random weights on ``device`` ('meta': shapes only)."""
        if self.kind == "gpt":
            with torch.device(device):
                return GPT(self.config)
        return hf_model.build_hf_model(self.config, device)

    def param_init_fn(self, model: nn.Module, device: torch.device) -> Optional[Callable[[nn.Module], None]]:
        """What ``shard`` calls per module of a meta-built model (None: the modules' reset_parameters)."""
        if self.weights_dir is not None:
            return skip_weight_init(model)  # load_weights overwrites every parameter: no random init first
        return None if self.kind == "gpt" else hf_param_init_fn(model, device)

    def save_model_files(self, out: str) -> None:
        """Keep the model directory's tokenizer files in the run directory, for ``shardwise export``."""
        if self.kind == "hf" and os.path.isdir(self.source):
            copy_model_files(self.source, os.path.join(out, RUN_MODEL_FILES))

    def load_weights(self, model: nn.Module, quantization=None) -> None:
        """After ``shard()``: each rank reads its shards of the pretrained weights (``shardwise.load_pretrained``;
        a peft-wrapped model's base under the base's names; ``quantization``: the 4-bit base's settings)."""
        if self.weights_dir is not None:
            load_pretrained(model, self.weights_dir, quantization=quantization)

    def frozen_base(self, recorded: Optional[dict] = None, quantization=None) -> Optional[dict]:
        """The record an adapter-only checkpoint keeps of its base (``checkpoint.frozen_base``): the weights
        directory, their identity and, for a 4-bit base, its ``QuantSettings``; None for a random base
        (config.json only), whose checkpoints must keep the base itself, since no file could give it back.
        ``recorded``: the record of the checkpoint about to be loaded (its identity may be the older,
        file-layout one: ``weight_files.identity_for``)."""
        if self.weights_dir is None:
            return None
        from shardwise.hf.sharded_load import base_record_of

        return base_record_of(self.weights_dir, quantization, recorded)

    def units(self, model: nn.Module, auto_wrap: str, cls_names: list[str]):
        """The ``units=`` argument for ``shardwise.shard`` from the Accelerate-style wrap settings: the classes
        named, else GPT's Block, else ``"auto+head"`` (a Hugging Face model's ``_no_split_modules`` blocks, and
        its untied embedding and head each a unit: ``engine.base.plan``, the one place that decides; the head
        may be a unit because the trainer's loss goes through it, ``lm_logits``)."""
        if auto_wrap == "no_wrap":
            return None
        if cls_names:
            return classes_named(model, cls_names, "--transformer-layer-cls-to-wrap")
        return {Block} if self.kind == "gpt" else AUTO_WITH_HEAD

    def num_params(self, model: nn.Module) -> int:
        seen, total = set(), 0
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        return total

    def flops_per_token(self, num_params: int, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls forward and backward plus 12·L·H·T for attention
        (the PaLM / torchtitan formula)."""
        return 6.0 * num_params + 12.0 * self.n_layer * self.hidden * seq_len

    def build_on_meta(self, num_params: int) -> bool:
        """GPT presets always: their meta init reproduces the eager init exactly, and no rank then ever holds
        the whole model. Hugging Face models from META_BUILD_MIN_PARAMS up, and always with pretrained weights."""
        return self.kind == "gpt" or num_params >= META_BUILD_MIN_PARAMS or self.weights_dir is not None


def classes_named(model: nn.Module, cls_names, label: str) -> set[type]:
    """The module classes of ``model`` named ``cls_names`` (units given by class name, as Accelerate's
    ``transformer_layer_cls_to_wrap`` gives them); ModelError naming ``label`` and the classes present."""
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in cls_names if n not in present]
    if missing:
        raise ModelError(f"{label} {','.join(cls_names)}: {', '.join(missing)} not in {type(model).__name__}; "
                         f"module classes present: {', '.join(sorted(present))}")
    return {present[n] for n in cls_names}


def resolve_model(name: str) -> ModelSpec:
    """A preset name or a path to a Hugging Face config.json -> ModelSpec (nothing allocated)."""
    if name in PRESETS:
        cfg = GPTConfig(**PRESETS[name])
        return ModelSpec(name, "gpt", cfg, cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd)
    if name.endswith(".json") or os.path.isdir(name) or os.path.sep in name:
        if not os.path.exists(name):
            if _looks_like_hub_id(name):
                import difflib

                close = difflib.get_close_matches(name.split("/")[1].lower(), list(ARCH_PRESETS), n=1, cutoff=0.7)
                hint = f" (the architecture preset {close[0]!r}?)" if close else ""
                raise ModelError(f"unknown model {name!r}{hint}: not a directory here, and shardwise downloads "
                                 f"nothing; {_valid_models()}")
            raise ModelError(f"model config {name!r} does not exist")
        gpt = _shardwise_gpt_config(name)
        if gpt is not None:
            return ModelSpec(os.path.basename(name), "gpt", gpt, gpt.vocab_size, gpt.block_size, gpt.n_layer, gpt.n_embd)
        try:
            cfg = hf_model.load_hf_config(name)
        except hf_model.HFConfigError as e:
            raise ModelError(str(e)) from None
        return _hf_spec(f"{cfg.model_type}:{os.path.basename(os.path.normpath(name))}", cfg, _weights_dir(name), name)
    if name in ARCH_PRESETS:
        return _hf_spec(name, hf_model.hf_config_from_dict(ARCH_PRESETS[name], f"preset {name!r}"))
    raise ModelError(f"unknown model {name!r}; {_valid_models()}")


def _valid_models() -> str:
    return (f"valid: {', '.join(PRESETS)}, the architecture presets {', '.join(ARCH_PRESETS)} (random init), a "
            f"Hugging Face model directory or config.json")


def _looks_like_hub_id(name: str) -> bool:
    """``org/name`` as on the Hugging Face Hub (``meta-llama/Llama-2-70b-hf``): one slash, no path syntax."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not name.endswith(".json")


def _hf_spec(name: str, cfg, weights_dir: Optional[str] = None, source: str = "") -> ModelSpec:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return ModelSpec(name, "hf", cfg, int(text.vocab_size), hf_model.hf_max_positions(cfg),
                     hf_model.hf_num_layers(cfg), hf_model.hf_hidden_size(cfg), weights_dir, source or name)


def _weights_dir(path: str) -> Optional[str]:
    """``path`` when it is a model directory holding weights (a config.json path means random init)."""
    if not os.path.isdir(path):
        return None
    try:
        return path if weight_file_names(Path(path)) is not None else None
    except ShardwiseError as e:  # pickle weights only, or a damaged index
        raise ModelError(str(e)) from None


def _shardwise_gpt_config(path: str) -> Optional[GPTConfig]:
    """A config.json with ``"model_type": "shardwise-gpt"`` and GPTConfig fields: a GPT of any shape."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") != "shardwise-gpt":
        return None
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return GPTConfig(**fields)
    except TypeError as e:
        raise ModelError(f"{path}: {e}; GPTConfig fields: {', '.join(GPTConfig.__dataclass_fields__)}") from None


def lm_logits(spec: ModelSpec, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """(B, T, vocab) next-token logits of a GPT preset or a Hugging Face causal LM."""
    if spec.kind == "gpt":
        return model(inputs).logits
    return model(input_ids=inputs, use_cache=False).logits


def lm_loss(spec: ModelSpec, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
            reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy in fp32 over the targets that are not ``IGNORE_INDEX`` (``reduction``:
    their mean or their sum). ``targets`` are already shifted (targets[t] = inputs[t + 1])."""
    logits = lm_logits(spec, model, inputs)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction=reduction)
