"""Full (unsharded) state dicts with the original names: gathered one flat group at a time, so no rank
holds more than one unit's full parameters beyond the CPU copy rank 0 is building."""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise import collectives
from shardwise.errors import ShardwiseError
from shardwise.materialize import fill_group_from_rank0


def _buffer_entries(model: nn.Module, keys: set[str]) -> dict[str, tuple[nn.Module, str]]:
    out = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for n in mod._buffers:
            fqn = f"{mod_name}.{n}" if mod_name else n
            if fqn in keys:
                out[fqn] = (mod, n)
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0 gets ``{name: full CPU tensor}`` (keys and order of the unsharded ``state_dict()``); others ``{}``.

    Tied parameters appear under each of their names as the same tensor, as in ``nn.Module.state_dict``.
    Every rank must call it: it communicates.
    """
    from shardwise.api import runtime_of

    rt = runtime_of(model)
    is_rank0 = dist.get_rank() == 0
    if rt.checker is not None:
        rt.checker.check_now("state_dict", len(rt.units))
    by_name: dict[str, torch.Tensor] = {}
    for u in rt.units:
        for g in u.groups:
            full = g.shard if g.groups.shard is None else g.gather_full()
            if is_rank0:
                for spec in g.plan.params:
                    t = full.narrow(0, spec.offset, spec.numel).view(spec.shape).detach().to("cpu", copy=True)
                    for ref in spec.refs:
                        by_name[ref.fqn] = t
            del full
    if not is_rank0:
        return {}
    keys = rt.state_dict_keys
    buffers = _buffer_entries(model, set(keys))
    out = {}
    for k in keys:
        if k in by_name:
            out[k] = by_name[k]
        elif k in buffers:
            mod, n = buffers[k]
            out[k] = mod._buffers[n].detach().to("cpu", copy=True)
    return out


def _validate(rt, model: nn.Module, sd: Mapping[str, torch.Tensor]) -> str:
    expected: dict[str, torch.Size] = {}
    for spec in rt.plan.params():
        for ref in spec.refs:
            expected[ref.fqn] = spec.shape
    for k, (mod, n) in _buffer_entries(model, set(rt.state_dict_keys)).items():
        expected[k] = mod._buffers[n].shape
    problems = []
    missing = [k for k in expected if k not in sd]
    extra = [k for k in sd if k not in expected]
    if missing:
        problems.append(f"missing keys: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    if extra:
        problems.append(f"unexpected keys: {', '.join(extra[:10])}{' ...' if len(extra) > 10 else ''}")
    for k, shape in expected.items():
        if k in sd:
            v = sd[k]
            if not isinstance(v, torch.Tensor):
                problems.append(f"{k}: expected a tensor, got {type(v).__name__}")
            elif v.shape != shape:
                problems.append(f"{k}: shape {tuple(v.shape)} does not match the model's {tuple(shape)}")
    return "; ".join(problems)


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict into a sharded model. Rank 0's dict is what counts; other ranks may pass {}.

    Keys are checked on rank 0 and a mismatch raises ``ShardwiseError`` on every rank (no hang)."""
    from shardwise.api import runtime_of

    rt = runtime_of(model)
    is_rank0 = dist.get_rank() == 0
    if rt.checker is not None:
        rt.checker.check_now("state_dict", len(rt.units))
    problem = collectives.broadcast_text(_validate(rt, model, state_dict) if is_rank0 else None, src=0)
    if problem:
        raise ShardwiseError(f"load_full_state_dict: {problem}")
    for u in rt.units:
        for g in u.groups:
            fill_group_from_rank0(g, rt.device, lambda spec: state_dict[spec.fqn])
    for k, (mod, n) in _buffer_entries(model, set(rt.state_dict_keys)).items():
        b = mod._buffers[n]
        if is_rank0:
            b.copy_(state_dict[k])
        dist.broadcast(b, src=0)
