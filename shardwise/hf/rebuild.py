"""Rebuild the model a checkpoint describes (``manifest["model"]``, written by checkpoint/model_description.py)
on the meta device: a shardwise GPT, a transformers model from its config, or a peft model over one. Export
uses it to check the tensors against the model before writing a model directory that would load wrongly.

Rebuilding on meta allocates nothing, but a hostile description could still ask for millions of layers;
the size is therefore checked against the manifest's parameter count first.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from shardwise.checkpoint.model_description import compare_with_model
from shardwise.checkpoint.schema import numel_of, short
from shardwise.errors import ShardwiseError

GPT_CLASS = "shardwise.models.gpt.GPT"


def description_problem(manifest: dict) -> Optional[str]:
    """Why the manifest's tensors are not the model its description rebuilds, or None if they are (or if
    the description cannot be rebuilt here: a custom class, or no transformers installed)."""
    try:
        model = rebuild_on_meta(manifest)
    except ShardwiseError as e:
        return str(e)
    if model is None:
        return None
    problem = compare_with_model(model, manifest)
    return f"the tensors are not the model the manifest describes: {problem}" if problem else None


def rebuild_on_meta(manifest: dict) -> Optional[nn.Module]:
    """The model the manifest describes, on meta (a peft model for a LoRA run); None when it cannot be
    rebuilt here. Raises ShardwiseError for a description that cannot be right."""
    desc = manifest["model"]
    total = sum(numel_of(p["shape"]) for p in manifest["params"].values())
    if desc["class"] == GPT_CLASS and "config" in desc:
        return _gpt_on_meta(desc["config"], total)
    if "hf_config" in desc:
        model = _hf_on_meta(desc, len(manifest["params"]))
        if model is not None and "peft_config" in desc:
            from shardwise.hf.lora import peft_model_from_dict

            model = peft_model_from_dict(model, desc["peft_config"])
        return model
    return None


def _gpt_on_meta(config: dict, total_numel: int) -> nn.Module:
    from shardwise.models.gpt import GPT, GPTConfig

    fields = {f.name: f.type for f in dataclasses.fields(GPTConfig)}
    if set(config) != set(fields):
        raise ShardwiseError(f"model.config has keys {sorted(config)}, a GPTConfig has {sorted(fields)}")
    for key, kind in fields.items():
        value = config[key]
        ok = isinstance(value, bool) if kind in (bool, "bool") else (type(value) is int and value >= 1)
        if not ok:
            raise ShardwiseError(f"model.config[{key!r}] = {short(value)} is not a valid GPTConfig value")
    cfg = GPTConfig(**config)
    if cfg.n_embd % cfg.n_head:
        raise ShardwiseError(f"model.config: n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
    # Exact and cheap: a config whose size differs from the tensors' is refused before building anything.
    if cfg.num_params != total_numel:
        raise ShardwiseError(f"model.config describes a GPT of {cfg.num_params} parameters; the checkpoint holds "
                             f"{total_numel}")
    with torch.device("meta"):
        return GPT(cfg)


def _hf_on_meta(desc: dict, num_tensors: int) -> Optional[nn.Module]:
    try:
        import transformers
    except ImportError:  # nothing to check against; the tensors were still verified against the manifest
        return None
    raw = dict(desc["hf_config"])
    model_type = raw.pop("model_type", None)
    archs = desc.get("hf_architectures") or raw.get("architectures") or []
    if not isinstance(model_type, str) or not archs:
        raise ShardwiseError("model.hf_config has no model_type or architectures")
    cls = getattr(transformers, archs[0], None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise ShardwiseError(f"model.hf_architectures names {short(archs[0])}, which is not a transformers model class")
    try:
        config = transformers.AutoConfig.for_model(model_type, **raw)
    except Exception as e:  # transformers raises ValueError, KeyError, TypeError... for a bad config
        raise ShardwiseError(f"model.hf_config is not a valid {short(model_type)} config: {type(e).__name__}: "
                             f"{str(e)[:200]}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None) or 0
    if not isinstance(layers, int) or layers > num_tensors:
        raise ShardwiseError(f"model.hf_config asks for {short(layers)} layers, more than the checkpoint's "
                             f"{num_tensors} tensors could hold")
    try:
        with torch.device("meta"):
            return cls._from_config(config)
    except Exception as e:
        raise ShardwiseError(f"model.hf_config cannot be built as {archs[0]}: {type(e).__name__}: {str(e)[:200]}") from None
