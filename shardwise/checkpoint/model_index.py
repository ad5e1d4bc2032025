"""Where a sharded model's state lives: its unique parameters with their flat groups, the optimizer's
parameters by name, and the persistent buffers. Names, not object identities, are what a checkpoint
records, so that a differently sharded model can find its pieces again."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

from shardwise.errors import ShardwiseError
from shardwise.engine.core.flat_group import FlatGroup
from shardwise.engine.base.plan import ParamSpec
from shardwise.engine.state_dict import persistent_buffers as engine_persistent_buffers
from shardwise.engine.surface.optimizer_guard import adopt_successors


def unique_params(rt) -> Iterator[tuple[ParamSpec, FlatGroup, int]]:
    """Every parameter once (tied ones under their first name), with its flat group and index in it."""
    for unit in rt.units:
        for group in unit.flat_groups:
            for i, spec in enumerate(group.plan.params):
                yield spec, group, i


def trains(group: FlatGroup, i: int) -> bool:
    """Whether parameter ``i`` of ``group`` trains now: its shard parameter's ``requires_grad``, which the
    user may have changed since ``shard()`` (the plan's ``spec.requires_grad`` is the value at planning).
    What a checkpoint stores and checks follows this, so a parameter unfrozen after ``shard()`` is saved."""
    return group.shard_params[i].requires_grad


def frozen_dtype(rt) -> str | None:
    """The one dtype of the model's frozen floating-point parameters now (None when none, or several)."""
    from shardwise.checkpoint.format import dtype_name

    names = {dtype_name(s.dtype) for s, g, i in unique_params(rt) if not trains(g, i) and s.dtype.is_floating_point}
    return names.pop() if len(names) == 1 else None


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer class a checkpoint records and checks: the algorithm whose state it holds. An
    ``offload_optimizer`` holds exactly its inner class's state (one instance per flat group, one shared
    ``state``), so its checkpoints and a plain optimizer's of that class are interchangeable."""
    from shardwise.optim.offload_optimizer import OffloadOptimizer

    if isinstance(optimizer, OffloadOptimizer):
        return optimizer.optimizer_cls.__name__
    return type(optimizer).__name__


def optimizer_param_names(rt, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(shard parameter) -> fqn, for every parameter the optimizer holds (all must be the model's)."""
    adopt_successors(optimizer)  # built before shard() and not stepped yet: it holds the shard parameters now
    by_id = {id(group.shard_params[i]): spec.fqn for spec, group, i in unique_params(rt)}
    out = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in by_id:
                retired = getattr(p, "_shardwise_retired", None)
                hint = (f" (parameter {retired!r} from before shardwise.shard(); build the optimizer after shard())"
                        if retired else "")
                raise ShardwiseError(f"{type(optimizer).__name__}.param_groups[{gi}] holds a tensor of shape "
                                     f"{tuple(p.shape)} that is not a shard parameter of this model{hint}")
            out[id(p)] = by_id[id(p)]
    return out


def persistent_buffers(model: nn.Module, rt) -> list[tuple[str, torch.Tensor]]:
    """(fqn, tensor) for the buffers ``state_dict()`` would save, in state-dict order."""
    order = {k: i for i, k in enumerate(rt.state_dict_keys)}
    out = dict((fqn, b) for fqn, b in engine_persistent_buffers(model) if fqn in order)
    return sorted(out.items(), key=lambda kv: order[kv[0]])
