"""The model a checkpoint says it holds (``manifest["model"]``): written by ``save``, and used by ``export``,
which has no model of its own to check the tensors against, to rebuild that model on the meta device and
compare.

``export`` writes the description out as ``config.json`` (Hugging Face) or ``shardwise_model.json``, so a
description that disagrees with the tensors would produce a model directory that loads wrongly, or not
at all. Rebuilding on meta allocates nothing, but a hostile description could still ask for millions of
layers; the size is therefore checked against the manifest's parameter count first.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import torch
import torch.nn as nn

from shardwise.checkpoint.schema import numel_of, short
from shardwise.errors import ShardwiseError

GPT_CLASS = "shardwise.models.gpt.GPT"


def describe(model: nn.Module) -> dict:
    """What export needs to rebuild the model elsewhere: a Hugging Face config, or a shardwise GPT config."""
    desc: dict[str, Any] = {"class": f"{type(model).__module__}.{type(model).__qualname__}"}
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):  # peft LoRA: the base, and the adapters' config
        from shardwise.lora import peft_config_dict

        return {**describe(model.get_base_model()), "class": desc["class"], "peft_config": peft_config_dict(model)}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict") and hasattr(config, "model_type"):
        desc["hf_config"] = json.loads(config.to_json_string(use_diff=False))
        desc["hf_architectures"] = [type(model).__name__]
    elif config is not None and dataclasses.is_dataclass(config):
        desc["config"] = dataclasses.asdict(config)
    return desc


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
            from shardwise.lora import peft_model_from_dict

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


def compare_with_model(model: nn.Module, manifest: dict) -> Optional[str]:
    """How the manifest's tensors differ from ``model``'s (on any device, meta included), or None. Names
    (with ties) and shapes; not dtypes: training may keep weights in another dtype than the model was
    built in, and the tensors' dtypes are checked against the files and the sharded model elsewhere."""
    tied: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    adapters_only = "frozen_base" in manifest  # the frozen parameters are not stored (frozen_base.py)
    for name, p in model.named_parameters(remove_duplicate=False):
        if adapters_only and not p.requires_grad:
            continue
        tied.setdefault(id(p), []).append(name)
        shapes[id(p)] = tuple(p.shape)
    expected = {frozenset(names): shapes[key] for key, names in tied.items()}
    saved = {frozenset([name, *p["aliases"]]): tuple(p["shape"]) for name, p in manifest["params"].items()}
    problems = []
    missing = sorted(min(k) for k in expected.keys() - saved.keys())
    extra = sorted(min(k) for k in saved.keys() - expected.keys())
    if missing:
        problems.append(f"parameters (or ties) the model has but the checkpoint lacks: {', '.join(missing[:5])}")
    if extra:
        problems.append(f"parameters (or ties) in the checkpoint but not in the model: {', '.join(extra[:5])}")
    for names in expected.keys() & saved.keys():
        if expected[names] != saved[names]:
            problems.append(f"{min(names)}: shape {list(saved[names])} in the checkpoint, {list(expected[names])} "
                            f"in the model")
    persistent = {k for k in model.state_dict().keys()} - {n for names in tied.values() for n in names}
    buffers = {n: tuple(b.shape) for n, b in model.named_buffers() if n in persistent}
    if set(buffers) != set(manifest["buffers"]):
        problems.append(f"buffers {sorted(set(buffers) ^ set(manifest['buffers']))[:5]} differ between the "
                        f"checkpoint and the model")
    else:
        problems += [f"buffer {n}: shape {manifest['buffers'][n]['shape']} in the checkpoint, {list(s)} in the model"
                     for n, s in buffers.items() if tuple(manifest["buffers"][n]["shape"]) != s]
    return "; ".join(problems[:4]) or None
