"""Full (unsharded) state dicts with the original names: gathered one flat group at a time, so no rank
holds more than one unit's full parameters beyond the CPU copy rank 0 is building.

Keys are whatever ``model.state_dict()`` calls each tensor *now*, matched to our shards by identity:
state-dict hooks that rename keys (torch's checkpoint wrapper drops ``_checkpoint_wrapped_module.``,
peft adds its own) are honoured without knowing about them."""

from __future__ import annotations

from typing import Collection, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.base import collectives
from shardwise.errors import ShardwiseError
from shardwise.engine.materialize import fill_group_from_rank0


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every buffer ``model.state_dict()`` saves, in module order: the one enumeration of
    persistent buffers (checkpoints, pretrained loading). A buffer of a module reachable under two names
    appears under both, as in ``state_dict()``."""
    out = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for n, b in module._buffers.items():
            if b is not None and n not in module._non_persistent_buffers_set:
                out.append((f"{mod_name}.{n}" if mod_name else n, b))
    return out


def _entries(rt, model: nn.Module) -> dict[str, object]:
    """state_dict key -> ``(group, parameter index)`` for a sharded parameter, or the tensor itself for a
    buffer, in ``model.state_dict()`` order. Between steps every module holds its shard parameter, so
    ``state_dict(keep_vars=True)`` hands back exactly those objects."""
    where = {id(p): (g, i) for g in rt.flat_groups() for i, p in enumerate(g.shard_params)}
    return {k: where.get(id(v), v) for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor)}


def full_state_dict(model: nn.Module, *, keys: Optional[Collection[str]] = None) -> dict[str, torch.Tensor]:
    """Rank 0 gets ``{name: full CPU tensor}`` (keys and order of the unsharded ``state_dict()``); others ``{}``.

    Tied parameters appear under each of their names as the same tensor, as in ``nn.Module.state_dict``.
    ``keys``: only these names (the same on every rank: what peft saves of an adapter, say); only the flat
    groups holding one of them are gathered. Every rank must call it: it communicates.
    """
    from shardwise.engine.core.runtime import runtime_of

    rt = runtime_of(model)
    rt.settle()
    is_rank0 = dist.get_rank() == 0
    entries = _entries(rt, model)
    if keys is not None:
        keys = set(keys)
        entries = {k: e for k, e in entries.items() if k in keys}
    wanted = {id(e[0]) for e in entries.values() if isinstance(e, tuple)}
    groups = [g for g in rt.flat_groups() if keys is None or id(g) in wanted]
    if rt.checker is not None:
        rt.checker.check_now("state_dict", len(groups))  # the count tells a call for some keys from a full one
    full_of: dict[tuple[int, int], torch.Tensor] = {}
    for g in groups:
        full = g.shard if g.pgs.shard is None else g.gather_full()
        if is_rank0:
            for i, spec in enumerate(g.plan.params):
                full_of[id(g), i] = full.narrow(0, spec.offset, spec.numel).view(spec.shape).detach().to(
                    "cpu", copy=True)
        del full
    if not is_rank0:
        return {}
    out = {}
    for k, e in entries.items():
        out[k] = full_of[id(e[0]), e[1]] if isinstance(e, tuple) else e.detach().to("cpu", copy=True)
    return out


def _validate(entries: dict, sd: Mapping[str, torch.Tensor]) -> str:
    expected = {k: e[0].plan.params[e[1]].shape if isinstance(e, tuple) else e.shape for k, e in entries.items()}
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
    from shardwise.engine.core.runtime import runtime_of

    rt = runtime_of(model)
    rt.settle()
    is_rank0 = dist.get_rank() == 0
    entries = _entries(rt, model)
    if rt.checker is not None:
        # Agreed once for the whole load: every broadcast below follows from the model's structure, the same
        # on every rank, and rank 0's verdict on the keys is itself broadcast before anything depends on it.
        # Its own op: a rank loading while another saves must not pass as agreement.
        rt.checker.check_now("load_state_dict", len(rt.units))
    problem = collectives.broadcast_text(_validate(entries, state_dict) if is_rank0 else None, src=0)
    if problem:
        raise ShardwiseError(f"load_full_state_dict: {problem}")
    rt.shards_written()
    key_of = {}
    for k, e in entries.items():
        if isinstance(e, tuple):
            key_of.setdefault((id(e[0]), e[1]), k)
    for g in rt.flat_groups():
        index = {id(spec): i for i, spec in enumerate(g.plan.params)}
        fill_group_from_rank0(g, rt.device, lambda spec, g=g, index=index: state_dict[key_of[id(g), index[id(spec)]]])
    with torch.no_grad():
        for k, e in entries.items():
            if not isinstance(e, tuple):
                if is_rank0:
                    e.copy_(state_dict[k])
                collectives.run_and_wait(dist.broadcast, e, src=0, group=rt.pgs.world,
                                         what=f"rank 0's buffer {k!r}")
