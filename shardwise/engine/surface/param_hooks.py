"""Tensor hooks on sharded parameters (``p.register_hook``): run on the full gradient, as in one process.

Gradients reach shard parameters through the reduce-scatter, never through autograd's AccumulateGrad node,
so autograd never runs their tensor hooks; we do, when a group's reduced gradient is handed out. A hook
must see what it sees in one process: the parameter's whole gradient of the global batch, in its full
shape (a pruning mask, a per-row clip, a normalisation by its norm). So when any parameter of a flat group
has hooks, the group's reduced gradient is all-gathered once, every rank runs the hooks on the same full
tensor (a hook that raises, raises on every rank), and keeps its piece of the result. Hooks registered on
the parameter before ``shard()`` are moved onto the shard parameter (the same dict: their handles still
remove them). Under ``no_sync`` the hooks would see the sum of the micro-batches, where torch runs them on
each: refused (``refuse_under_no_sync``).
"""

from __future__ import annotations

from typing import Optional

import torch

from shardwise.engine.base import collectives
from shardwise.errors import ShardwiseError


def tensor_hooks(p: torch.Tensor) -> Optional[dict]:
    """``p.register_hook``'s hooks. Private attribute ``_backward_hooks`` (checked on torch 2.11 and 2.13)."""
    return p._backward_hooks


def adopt_tensor_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Give shard parameter ``new`` the tensor hooks and post-accumulate-grad hooks of the parameter ``old``
    it replaces: the same dicts, so a handle from ``old.register_hook`` still removes its hook."""
    if tensor_hooks(old):
        new._backward_hooks = old._backward_hooks
    post = post_accumulate_grad_hooks(old)
    if post:
        new._post_accumulate_grad_hooks = post


def post_accumulate_grad_hooks(p: torch.Tensor) -> dict | None:
    """``p.register_post_accumulate_grad_hook``'s hooks. Private attribute ``_post_accumulate_grad_hooks``
    (checked on torch 2.11 and 2.13)."""
    return getattr(p, "_post_accumulate_grad_hooks", None)


def has_tensor_hooks(group) -> bool:
    return any(p.requires_grad and tensor_hooks(p) for p in group.shard_params)


def refuse_under_no_sync(group) -> None:
    hooked = [s.fqn for s, p in zip(group.plan.params, group.shard_params) if p.requires_grad and tensor_hooks(p)]
    if hooked:
        raise ShardwiseError(
            f"parameter {hooked[0]!r} has a tensor hook (p.register_hook) and this backward runs under "
            f"shardwise.no_sync: gradients are summed before any hook can run, so a hook that is not linear "
            f"would see another gradient than in plain PyTorch; accumulate without no_sync or remove the hook")


def full_grad(group, grad_shard: torch.Tensor) -> torch.Tensor:
    """The group's whole reduced gradient (padded flat), gathered from every rank's ``grad_shard``."""
    if group.pgs.shard is None:
        return grad_shard  # a group of one rank: the shard is the whole flat
    src = grad_shard.narrow(0, 0, group.plan.shard_numel).to(group.device)
    full = torch.empty(group.plan.padded_numel, dtype=src.dtype, device=group.device)
    # Agreed first: a hook registered on one rank only would gather alone (collectives.run_agreed).
    collectives.run_agreed(group.checker, "tensor_hook_gather", collectives.all_gather_into, full, src,
                           group=group.pgs.shard, unit=group.ids[0],
                           what=f"the gradient of unit {group.plan.unit_fqn or '<root>'!r} for its tensor hooks")
    return full


def hooked_piece(p: torch.Tensor, spec, full: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Run ``p``'s hooks on its full gradient (a view of ``full``); this rank's piece of the result."""
    grad = full.narrow(0, spec.offset, spec.numel).view(spec.shape)
    for hook in list(tensor_hooks(p).values()):
        out = hook(grad)
        if out is not None:
            if out.shape != grad.shape:
                raise ShardwiseError(f"a tensor hook on parameter {spec.fqn!r} returned shape {tuple(out.shape)} "
                                     f"for a gradient of shape {tuple(grad.shape)}")
            grad = out
    return grad.reshape(-1)[lo:hi]


def run_post_accumulate_grad_hooks(p: torch.Tensor) -> None:
    """Hooks from ``p.register_post_accumulate_grad_hook`` (optimizer-in-backward). Autograd runs them from
    its AccumulateGrad node, which shard gradients bypass (they are views of the reduced flat shard), so we
    run them when the gradient is handed out, as torch FSDP2 does. Private attribute
    ``_post_accumulate_grad_hooks`` (checked on torch 2.11 and 2.13)."""
    hooks = post_accumulate_grad_hooks(p)
    if hooks:
        for hook in list(hooks.values()):
            hook(p)


