"""Sharding strategies and the process groups they communicate over.

A strategy is a few facts: how many ranks a parameter's master copy and optimizer state are split across
(the *shard* group); whether the gathered parameters are freed between forward and backward
(``reshard_after_forward``) or kept gathered across steps (``keeps_params_gathered``: ZeRO-1/2, refreshed
by one all-gather after each optimizer step); and how gradients are reduced (reduce-scatter, or an
all-reduce of the whole gradient for ZeRO-1). Replication across the *replicate* group (DDP-style
all-reduce of the already reduce-scattered gradient shard) covers ``no_shard`` and the hybrid strategies.

  strategy (alias)          parameters between steps   gradient kept   collectives per unit and step
  full_shard (zero3)        1/N                        1/N             all-gather x2, reduce-scatter
  shard_grad_op             1/N                        1/N             all-gather, reduce-scatter
  shard_optim_grad (zero2)  full, compute dtype        1/N             reduce-scatter, all-gather after the step
  shard_optim (zero1)       full, compute dtype        full            all-reduce, all-gather after the step
  no_shard (ddp)            full                       full            all-reduce

Masters and optimizer state are 1/N in every row but ``no_shard``. The ZeRO-1/2 strategies have no hybrid
variant: their parameters are replicated on every rank already, so a hybrid layout would only shrink the
group that shards the optimizer state.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch.distributed as dist

from shardwise.errors import ShardwiseError


class Strategy(enum.Enum):
    FULL_SHARD = "full_shard"  # ZeRO-3
    SHARD_GRAD_OP = "shard_grad_op"  # FSDP's ZeRO-2: parameters gathered every step, kept forward to backward
    SHARD_OPTIM_GRAD = "shard_optim_grad"  # DeepSpeed's ZeRO-2: parameters stay gathered across steps
    SHARD_OPTIM = "shard_optim"  # ZeRO-1: like shard_optim_grad, full gradients all-reduced
    NO_SHARD = "no_shard"  # DDP
    HYBRID_SHARD = "hybrid_shard"  # ZeRO-3 inside a shard group, replicated across groups
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"

    @property
    def reshard_after_forward(self) -> bool:
        return self in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)

    @property
    def keeps_params_gathered(self) -> bool:
        """Full parameters (compute dtype) live across steps; one all-gather refreshes them after each
        optimizer step (ZeRO-1/2)."""
        return self in (Strategy.SHARD_OPTIM, Strategy.SHARD_OPTIM_GRAD)

    @property
    def all_reduces_grads(self) -> bool:
        """Gradients are all-reduced whole over the shard group and kept whole (ZeRO-1), not reduce-scattered."""
        return self is Strategy.SHARD_OPTIM

    @property
    def is_hybrid(self) -> bool:
        return self in (Strategy.HYBRID_SHARD, Strategy.HYBRID_SHARD_ZERO2)

    def shard_group_size(self, world_size: int, ranks_per_node: int) -> int:
        """How many ranks one parameter's shards are spread over: none for no_shard, one node's ranks for the
        hybrid strategies (replicated across nodes), every rank otherwise. ``resolve_groups`` lays the
        default groups out by it and the memory planner sizes shards by it."""
        if self is Strategy.NO_SHARD:
            return 1
        if self.is_hybrid:
            return max(1, min(world_size, ranks_per_node))
        return world_size

    @classmethod
    def parse(cls, value: Union[str, "Strategy"]) -> "Strategy":
        if isinstance(value, Strategy):
            return value
        if isinstance(value, str):
            # FSDP1 spells the last one ShardingStrategy._HYBRID_SHARD_ZERO2: the leading underscore is dropped.
            key = value.strip().lower().lstrip("_")
            key = ALIASES.get(key, key)
            for s in cls:
                if s.value == key:
                    return s
        valid = ", ".join([s.value for s in cls] + [f"{a} (= {v})" for a, v in ALIASES.items()])
        raise ShardwiseError(f"strategy={value!r} is not a sharding strategy; valid: {valid} (upper case accepted)")


# The ZeRO paper's stage numbers and DDP, as users type them.
ALIASES = {"zero1": "shard_optim", "zero2": "shard_optim_grad", "zero3": "full_shard", "ddp": "no_shard"}
STRATEGY_NAMES = tuple(s.value for s in Strategy)


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups a sharded model talks over. ``None`` means a group of one rank (no communication)."""

    shard: Optional[dist.ProcessGroup]
    replicate: Optional[dist.ProcessGroup]
    shard_size: int
    shard_rank: int
    replicate_size: int
    world: Optional[dist.ProcessGroup] = None  # every rank of the model: rank 0's values come over it

    @property
    def data_parallel_size(self) -> int:
        """How many ranks see different data: the divisor that turns summed gradients into the mean."""
        return self.shard_size * self.replicate_size


def resolve_groups(strategy: Strategy, mesh) -> ProcessGroups:
    """Map (strategy, mesh) to shard/replicate groups, rejecting a mesh of the wrong dimensionality."""
    if not dist.is_available() or not dist.is_initialized():
        raise ShardwiseError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "(or launch with torchrun) before shardwise.shard()"
        )
    if mesh is None:
        if strategy.is_hybrid:
            mesh = _default_hybrid_mesh(strategy)
        else:
            return _groups_1d(strategy, dist.group.WORLD)
    ndim = mesh.ndim
    if strategy.is_hybrid:
        if ndim != 2:
            raise ShardwiseError(
                f"strategy={strategy.value!r} needs a 2-D DeviceMesh with dims ('replicate', 'shard'); "
                f"got a {ndim}-D mesh {tuple(mesh.shape)}"
            )
        names = mesh.mesh_dim_names or ("replicate", "shard")
        rep, shd = (mesh.get_group(names[0]), mesh.get_group(names[1]))
        return ProcessGroups(
            shard=shd if dist.get_world_size(shd) > 1 else None,
            replicate=rep if dist.get_world_size(rep) > 1 else None,
            shard_size=dist.get_world_size(shd),
            shard_rank=dist.get_rank(shd),
            replicate_size=dist.get_world_size(rep),
        )
    if ndim != 1:
        raise ShardwiseError(
            f"strategy={strategy.value!r} shards over one mesh dimension but got a {ndim}-D mesh "
            f"{tuple(mesh.shape)}; use strategy='hybrid_shard' or 'hybrid_shard_zero2' for a 2-D mesh"
        )
    return _groups_1d(strategy, mesh.get_group())


def _groups_1d(strategy: Strategy, group) -> ProcessGroups:
    size = dist.get_world_size(group)
    if strategy.shard_group_size(size, size) == 1:  # no_shard, or one rank
        return ProcessGroups(None, group if size > 1 else None, 1, 0, size)
    return ProcessGroups(group, None, size, dist.get_rank(group), 1)


def _default_device_type() -> str:
    from shardwise.engine.base.device import compute_device

    return compute_device([]).type


def _default_hybrid_mesh(strategy: Strategy):
    """Shard inside a node, replicate across nodes: the layout HSDP users mean by default."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local <= 0 or world % local:
        raise ShardwiseError(
            f"hybrid strategies need mesh=a 2-D DeviceMesh; could not infer one from WORLD_SIZE={world} "
            f"and LOCAL_WORLD_SIZE={local}"
        )
    shard = strategy.shard_group_size(world, local)
    return init_device_mesh(_default_device_type(), (world // shard, shard), mesh_dim_names=("replicate", "shard"))
