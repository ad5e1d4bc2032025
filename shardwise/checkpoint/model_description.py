"""The model a checkpoint says it holds (``manifest["model"]``): written by ``save`` (``describe``), and
compared with a model (``compare_with_model``) by the trainer's preflight and by export, which rebuilds the
described model on the meta device first (hf/rebuild.py).

``export`` writes the description out as ``config.json`` (Hugging Face) or ``shardwise_model.json``, so a
description that disagrees with the tensors would produce a model directory that loads wrongly, or not
at all. Rebuilding on meta allocates nothing, but a hostile description could still ask for millions of
layers; the size is therefore checked against the manifest's parameter count first.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import torch.nn as nn


def describe(model: nn.Module) -> dict:
    """What export needs to rebuild the model elsewhere: a Hugging Face config, or a shardwise GPT config."""
    desc: dict[str, Any] = {"class": f"{type(model).__module__}.{type(model).__qualname__}"}
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):  # peft LoRA: the base, and the adapters' config
        return {**describe(model.get_base_model()), "class": desc["class"], "peft_config": _adapter_config(model)}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict") and hasattr(config, "model_type"):
        desc["hf_config"] = json.loads(config.to_json_string(use_diff=False))
        desc["hf_architectures"] = [type(model).__name__]
    elif config is not None and dataclasses.is_dataclass(config):
        desc["config"] = dataclasses.asdict(config)
    return desc


def _adapter_config(model: nn.Module) -> dict:
    """A peft model's one adapter config as plain JSON (sets as sorted lists), read through peft's public
    ``peft_config`` mapping so that this module needs no peft import (hf/lora.py applies the adapters)."""
    (config,) = model.peft_config.values()
    return json.loads(json.dumps(config.to_dict(), default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))


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
