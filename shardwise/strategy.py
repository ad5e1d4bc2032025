"""Sharding strategies and the process groups they communicate over.

A strategy is two facts: how many ranks a parameter is split across (the *shard* group) and whether the
gathered parameters are freed between forward and backward (``reshard_after_forward``). Replication across
the *replicate* group (DDP-style all-reduce of the already reduce-scattered gradient shard) covers
``no_shard`` and the hybrid strategies.
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
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2: parameters stay gathered from forward to backward
    NO_SHARD = "no_shard"  # DDP
    HYBRID_SHARD = "hybrid_shard"  # ZeRO-3 inside a shard group, replicated across groups
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"

    @property
    def reshard_after_forward(self) -> bool:
        return self in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)

    @property
    def is_hybrid(self) -> bool:
        return self in (Strategy.HYBRID_SHARD, Strategy.HYBRID_SHARD_ZERO2)

    @classmethod
    def parse(cls, value: Union[str, "Strategy"]) -> "Strategy":
        if isinstance(value, Strategy):
            return value
        if isinstance(value, str):
            # FSDP1 spells the last one ShardingStrategy._HYBRID_SHARD_ZERO2: the leading underscore is dropped.
            key = value.strip().lower().lstrip("_")
            for s in cls:
                if s.value == key:
                    return s
        valid = ", ".join(s.value for s in cls)
        raise ShardwiseError(f"strategy={value!r} is not a sharding strategy; valid: {valid} (upper case accepted)")


@dataclass(frozen=True)
class Groups:
    """The process groups a sharded model talks over. ``None`` means a group of one rank (no communication)."""

    shard: Optional[dist.ProcessGroup]
    replicate: Optional[dist.ProcessGroup]
    shard_size: int
    shard_rank: int
    replicate_size: int
    device_type: str

    @property
    def data_parallel_size(self) -> int:
        """How many ranks see different data: the divisor that turns summed gradients into the mean."""
        return self.shard_size * self.replicate_size


def resolve_groups(strategy: Strategy, mesh) -> Groups:
    """Map (strategy, mesh) to shard/replicate groups, rejecting a mesh of the wrong dimensionality."""
    if not dist.is_available() or not dist.is_initialized():
        raise ShardwiseError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "(or launch with torchrun) before shardwise.shard()"
        )
    if mesh is None:
        if strategy.is_hybrid:
            mesh = _default_hybrid_mesh()
        else:
            return _groups_1d(strategy, dist.group.WORLD, _default_device_type())
    ndim = mesh.ndim
    if strategy.is_hybrid:
        if ndim != 2:
            raise ShardwiseError(
                f"strategy={strategy.value!r} needs a 2-D DeviceMesh with dims ('replicate', 'shard'); "
                f"got a {ndim}-D mesh {tuple(mesh.shape)}"
            )
        names = mesh.mesh_dim_names or ("replicate", "shard")
        rep, shd = (mesh.get_group(names[0]), mesh.get_group(names[1]))
        return Groups(
            shard=shd if dist.get_world_size(shd) > 1 else None,
            replicate=rep if dist.get_world_size(rep) > 1 else None,
            shard_size=dist.get_world_size(shd),
            shard_rank=dist.get_rank(shd),
            replicate_size=dist.get_world_size(rep),
            device_type=mesh.device_type,
        )
    if ndim != 1:
        raise ShardwiseError(
            f"strategy={strategy.value!r} shards over one mesh dimension but got a {ndim}-D mesh "
            f"{tuple(mesh.shape)}; use strategy='hybrid_shard' or 'hybrid_shard_zero2' for a 2-D mesh"
        )
    return _groups_1d(strategy, mesh.get_group(), mesh.device_type)


def _groups_1d(strategy: Strategy, group, device_type: str) -> Groups:
    size = dist.get_world_size(group)
    if strategy == Strategy.NO_SHARD:
        return Groups(None, group if size > 1 else None, 1, 0, size, device_type)
    return Groups(group if size > 1 else None, None, size, dist.get_rank(group), 1, device_type)


def _default_device_type() -> str:
    from shardwise.device import compute_device

    return compute_device([]).type


def _default_hybrid_mesh():
    """Shard inside a node, replicate across nodes: the layout HSDP users mean by default."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local <= 0 or world % local:
        raise ShardwiseError(
            f"hybrid strategies need mesh=a 2-D DeviceMesh; could not infer one from WORLD_SIZE={world} "
            f"and LOCAL_WORLD_SIZE={local}"
        )
    return init_device_mesh(_default_device_type(), (world // local, local), mesh_dim_names=("replicate", "shard"))
