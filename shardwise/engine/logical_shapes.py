"""Logical shapes of sharded parameters: each one's name in the unsharded model and where this rank's
elements sit in it.

After ``shardwise.shard()`` a parameter already reads as the whole tensor (``p.shape``, ``p.dim()``,
``p.numel()``: surface/pieces.py); this module answers what its metadata does not: the parameter's full name
(and its other names, for tied weights) and this rank's element range, from the plan (``ParamSpec`` +
``FlatGroup.local_slices``). It recomputes nothing.

    info = shardwise.param_info(p)     # ParamInfo(name='blocks.0.attn.c_attn.weight', shape=(75, 25), ...)
    local_of(p)  ==  full_param.reshape(-1)[info.offset : info.offset + info.local_numel]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from shardwise.engine.surface.shard_param import where_of
from shardwise.errors import ShardwiseError

@dataclass(frozen=True)
class ParamInfo:
    """One sharded parameter as the unsharded model has it, and this rank's piece of it.

    ``name``: its first registered name (``model.named_parameters()``'s); ``names``: every name it has (tied
    weights have several). ``shape``: the full logical shape. ``offset``/``local_numel``: this rank holds
    elements ``[offset, offset + local_numel)`` of the flattened full parameter (``local_numel`` may be 0).
    Within a shard group the pieces of the ranks, in shard-rank order, tile the parameter exactly once."""

    name: str
    names: tuple[str, ...]
    shape: torch.Size
    offset: int
    local_numel: int

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def ndim(self) -> int:
        return len(self.shape)


def layout_of(p: torch.Tensor):
    """``(FlatGroup, index)`` of a shard parameter; a ShardwiseError for any other tensor."""
    where = where_of(p)
    if where is None:
        raise ShardwiseError(f"a parameter of shape {tuple(p.shape)} is not a shardwise shard parameter: take "
                             f"parameters from model.parameters() after shardwise.shard(model)")
    return where


def flat_group_of(p: torch.Tensor):
    """The FlatGroup that shard parameter ``p`` belongs to, or None for any other tensor."""
    where = where_of(p)
    return where[0] if where is not None else None


def param_info(p: torch.Tensor) -> ParamInfo:
    """The logical name, full shape and this rank's element range of shard parameter ``p``."""
    group, i = layout_of(p)
    spec = group.plan.params[i]
    lo, hi, _ = group.local_slices[i]
    return ParamInfo(spec.fqn, tuple(r.fqn for r in spec.refs), torch.Size(spec.shape), lo, hi - lo)


def named_param_infos(model: nn.Module) -> Iterator[tuple[str, ParamInfo]]:
    """``(name, ParamInfo)`` for every parameter of a sharded ``model``, in ``named_parameters()`` order."""
    for name, p in model.named_parameters():
        yield name, param_info(p)


def num_parameters(model: nn.Module, only_trainable: bool = False) -> int:
    """Element count of the full (unsharded) model, the same on every rank (HF's ``num_parameters()``
    counts this rank's shards). Tied parameters count once."""
    return sum(param_info(p).numel for p in model.parameters() if p.requires_grad or not only_trainable)
