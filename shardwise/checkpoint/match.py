"""Does a (verified) manifest describe the model and optimizer it is about to be loaded into?

Everything a load restores is checked here first, so a load either restores the checkpoint exactly or
raises before touching the model: parameter names with their tied aliases, shapes and dtypes; persistent
buffers (names, shapes, dtypes); and, with an optimizer, its class, its param groups (the same parameters
by name), every hyperparameter (the same keys, values of the same kind, finite, and in the range the
optimizer's constructor would accept), and every per-element state tensor's dtype (torch's
``load_state_dict`` would silently cast a floating-point state to the parameter's dtype).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from shardwise.checkpoint.format import dtype_name
from shardwise.checkpoint.frozen_base import mismatch
from shardwise.checkpoint.model_index import (frozen_dtype, optimizer_class_name, optimizer_param_names,
                                              persistent_buffers, trains, unique_params)
from shardwise.checkpoint.schema import short
from shardwise.checkpoint.values import decode, decode_scalar_tensor
from shardwise.errors import ShardwiseError

# Hyperparameters whose range torch's optimizers check in their constructors (load_state_dict does not).
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "lr_decay", "initial_accumulator_value", "alpha")


def saved_name_of(spec, saved: dict, alias_of: dict) -> Optional[str]:
    """The manifest's name for a model parameter (it may be stored under one of its tied names)."""
    for ref in spec.refs:
        if ref.fqn in saved:
            return ref.fqn
        if ref.fqn in alias_of:
            return alias_of[ref.fqn]
    return None


def alias_map(manifest: dict) -> dict[str, str]:
    return {a: name for name, p in manifest["params"].items() for a in p["aliases"]}


def check_model(ckpt: Path, manifest: dict, rt, model: nn.Module, optimizer, frozen_base: Optional[dict] = None) -> None:
    """Raise a ShardwiseError naming ``ckpt`` if the manifest does not describe this model and optimizer (for an
    adapter-only checkpoint: its trainable parameters, over the frozen base ``frozen_base`` of the model)."""
    if "frozen_base" in manifest:
        why = mismatch(manifest["frozen_base"], frozen_base, frozen_dtype(rt))
        if why:
            raise ShardwiseError(f"{ckpt}: {why}")
    problems = _param_problems(manifest, rt) + _buffer_problems(manifest, model, rt)
    if optimizer is not None:
        problems += _optimizer_problems(manifest, rt, optimizer)
    if len(problems) > 6:
        problems = problems[:6] + [f"and {len(problems) - 6} more differences"]
    if problems:
        raise ShardwiseError(f"{ckpt}: checkpoint of a different model: " + "; ".join(problems))


def _param_problems(manifest: dict, rt) -> list[str]:
    saved, alias_of = manifest["params"], alias_map(manifest)
    omits_frozen = "frozen_base" in manifest
    problems, missing, seen = [], [], set()
    for spec, g, i in unique_params(rt):
        name = saved_name_of(spec, saved, alias_of)
        if name is None:
            if not (omits_frozen and not trains(g, i)):
                missing.append(spec.fqn)
            continue
        seen.add(name)
        entry = saved[name]
        if list(spec.shape) != list(entry["shape"]):
            problems.append(f"{spec.fqn}: shape {tuple(entry['shape'])} in the checkpoint, {tuple(spec.shape)} in the model")
        elif dtype_name(spec.dtype) != entry["dtype"]:
            problems.append(f"{spec.fqn}: dtype {entry['dtype']} in the checkpoint, {dtype_name(spec.dtype)} in the model")
        model_names, saved_names = {r.fqn for r in spec.refs}, {name, *entry["aliases"]}
        if model_names != saved_names:
            # Tied differently: loading would give two parameters one value, or one parameter two.
            problems.append(f"{spec.fqn}: tied to {sorted(saved_names - {spec.fqn}) or 'nothing'} in the checkpoint, "
                            f"to {sorted(model_names - {spec.fqn}) or 'nothing'} in the model")
    unexpected = [n for n in saved if n not in seen]
    if unexpected:
        problems.insert(0, f"parameters in the checkpoint but not in the model: {_listing(unexpected)}")
    if missing:
        problems.insert(0, f"parameters missing from the checkpoint: {_listing(missing)}")
    return problems


def _buffer_problems(manifest: dict, model: nn.Module, rt) -> list[str]:
    saved = manifest["buffers"]
    model_buffers = dict(persistent_buffers(model, rt))
    problems = []
    missing = [n for n in model_buffers if n not in saved]
    unexpected = [n for n in saved if n not in model_buffers]
    if missing:
        problems.append(f"buffers missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        problems.append(f"buffers in the checkpoint but not in the model: {_listing(unexpected)}")
    for name, buf in model_buffers.items():
        entry = saved.get(name)
        if entry is None:
            continue
        if list(entry["shape"]) != list(buf.shape):
            problems.append(f"buffer {name}: shape {tuple(entry['shape'])} in the checkpoint, {tuple(buf.shape)} in the model")
        elif entry["dtype"] != dtype_name(buf.dtype):
            problems.append(f"buffer {name}: dtype {entry['dtype']} in the checkpoint, {dtype_name(buf.dtype)} in the model")
    return problems


def _optimizer_problems(manifest: dict, rt, optimizer: torch.optim.Optimizer) -> list[str]:
    saved = manifest["optimizer"]
    if saved is None:
        return ["an optimizer was passed but the checkpoint holds no optimizer state"]
    cls = optimizer_class_name(optimizer)
    if saved["class"] != cls:
        return [f"optimizer state was saved from {saved['class']}, not {cls}"]
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        return [f"the optimizer has {len(optimizer.param_groups)} param groups, the checkpoint's had {len(groups)}"]
    names = optimizer_param_names(rt, optimizer)
    alias_of = alias_map(manifest)
    dtype_of = {spec.fqn: spec.dtype for spec, _g, _i in unique_params(rt)}
    problems = []
    for gi, (group, sgroup) in enumerate(zip(optimizer.param_groups, groups)):
        current = {alias_of.get(names[id(p)], names[id(p)]) for p in group["params"]}
        if current != set(sgroup["params"]):
            problems.append(f"optimizer param_groups[{gi}] holds different parameters than the checkpoint's "
                            f"(e.g. {_listing(sorted(current ^ set(sgroup['params'])), 3)})")
        problems += _option_problems(gi, group, sgroup["options"])
    for name, info in saved["state"].items():
        for sname, dt in info["tensors"].items():
            want = dtype_of.get(name)
            if want is not None and want.is_floating_point and dt != dtype_name(want):
                problems.append(f"optimizer state {sname!r} of {name} is {dt} in the checkpoint; the parameter is "
                                f"{dtype_name(want)} (loading would cast it)")
    return problems


def _option_problems(gi: int, group: dict, saved: dict) -> list[str]:
    keys = {k for k in group if k != "params"}
    where = f"optimizer param_groups[{gi}]"
    if set(saved) != keys:
        diff = sorted(set(saved) ^ keys)
        return [f"{where} has options {_listing(diff, 4)} in only one of the checkpoint and the optimizer"]
    problems = []
    for key in sorted(keys):
        value = decode_option(saved[key])
        why = _kind_problem(value, group[key]) or _range_problem(key, value)
        if why:
            problems.append(f"{where}[{key!r}] = {short(value)} in the checkpoint: {why}")
    return problems


def decode_option(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__scalar_tensor__"}:
        return decode_scalar_tensor(value["__scalar_tensor__"], "optimizer param_groups")
    return decode(value, _no_tensor)


def _no_tensor(key: str) -> torch.Tensor:  # pragma: no cover - the schema refuses tensors in options
    raise ShardwiseError(f"optimizer options refer to tensor {key!r}")


def _kind_problem(saved: Any, current: Any) -> Optional[str]:
    """Saved and current hyperparameters must be values of the same kind (None and bool mix: torch's
    ``foreach``/``fused`` flags are None until chosen)."""
    if isinstance(current, torch.Tensor):
        current = current.item() if current.dim() == 0 else current
    if isinstance(saved, torch.Tensor):
        saved = saved.item() if saved.dim() == 0 else saved
    if current is None or isinstance(current, bool):
        return None if saved is None or isinstance(saved, bool) else "expected true, false or null like the optimizer's"
    if isinstance(current, (int, float)):
        if isinstance(saved, bool) or not isinstance(saved, (int, float)):
            return "expected a number like the optimizer's"
        return None if math.isfinite(saved) else "not a finite number"
    if isinstance(current, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(current):
            return f"expected {len(current)} values like the optimizer's"
        for s, c in zip(saved, current):
            why = _kind_problem(s, c)
            if why:
                return why
        return None
    if isinstance(current, str):
        return None if isinstance(saved, str) else "expected a string like the optimizer's"
    return None  # some other kind torch keeps: nothing to compare against


def _range_problem(key: str, value: Any) -> Optional[str]:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if key in _NON_NEGATIVE and isinstance(value, (int, float)) and value < 0:
        return "must be >= 0"
    if key == "betas" and isinstance(value, (tuple, list)):
        if not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in value):
            return "betas must be in [0, 1)"
    return None


def _listing(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")

