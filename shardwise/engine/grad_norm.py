"""Gradient-norm clipping over every shard on every rank: ``clip_grad_norm_`` and its pieces, which the
offload optimizer (optim/offload_optimizer.py) also uses to clip group by group as gradients land."""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.base import collectives
from shardwise.engine.core.flat_group import FlatGroup
from shardwise.engine.core.runtime import ModelRuntime, runtime_of
from shardwise.engine.surface.pieces import local_of, local_only
from shardwise.errors import ShardwiseError


def _shard_grads(rt: ModelRuntime) -> Iterator[torch.Tensor]:
    for g in rt.flat_groups():
        yield from group_grads(g)


def group_grads(group: FlatGroup) -> list[torch.Tensor]:
    """This rank's elements of the gradients a flat group's shard parameters hold (plain tensors), in parameter
    order (the norm's summation order)."""
    with local_only():
        return [local_of(p.grad) for p in group.shard_params if p.grad is not None]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm (over every shard on every rank) is at most ``max_norm``.
    Returns the global norm before clipping, the same on every rank."""
    rt = runtime_of(model)
    consumer = rt.transfers.consumer if rt.transfers is not None else None
    if consumer is not None and consumer.steps_in_backward:
        raise ShardwiseError(
            "shardwise.clip_grad_norm_ on a model whose offload_optimizer steps each unit during backward: the "
            "steps already used the gradients; pass max_grad_norm= to shardwise.offload_optimizer instead")
    grads = list(_shard_grads(rt))
    norm_type = float(norm_type)
    total = global_grad_norm(rt, grad_norm_terms(grads, norm_type), norm_type)
    scale_grads(grads, clip_coefficient(max_norm, total))
    return total


def grad_norm_terms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each local gradient piece's part of the global norm (fp32): its norm, or its largest magnitude for
    the inf-norm. Computed per piece, so a group's terms can be computed as soon as its gradients land
    (optim/offload_optimizer.py) and still sum exactly as ``clip_grad_norm_``'s."""
    # ``grads``: this rank's elements (plain tensors, group_grads), so their own norms: global_grad_norm sums
    # them over the ranks once.
    if math.isinf(norm_type):
        # A rank's piece of a parameter may be empty (max() of nothing raises): only non-empty pieces count.
        return [g.detach().abs().max().float() for g in grads if g.numel()]
    # One foreach kernel over the pieces, not a Python loop of norms per parameter per step.
    return list(torch._foreach_norm(grads, norm_type, dtype=torch.float32)) if grads else []


def global_grad_norm(rt: ModelRuntime, terms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm over every shard on every rank, from this rank's ``grad_norm_terms`` in model order."""
    device = rt.device
    if math.isinf(norm_type):
        local = torch.stack(terms).max() if terms else torch.zeros((), device=device)
        local = local.to(device)
        if rt.pgs.shard is not None:
            collectives.run_agreed(rt.checker, "clip_grad_norm", dist.all_reduce, local, op=dist.ReduceOp.MAX,
                                   group=rt.pgs.shard, what="clip_grad_norm_'s max-reduce")
        return local
    if terms:
        local = torch.stack(terms).pow(norm_type).sum().to(device)
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    # Shards are disjoint within a shard group and identical across replicas: sum over the shard group only.
    if rt.pgs.shard is not None:
        collectives.run_agreed(rt.checker, "clip_grad_norm", collectives.all_reduce_sum, local, group=rt.pgs.shard,
                               what="clip_grad_norm_'s sum")
    return local.pow(1.0 / norm_type)


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def scale_grads(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
