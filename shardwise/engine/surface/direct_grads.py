"""Gradients that reach a shard parameter directly, not through its unit's reduction: a penalty computed from
the parameter itself (see [Note: gradients that reach a parameter directly] in shard_param.py). Each flat
group's sink holds them during backward; the end of backward adds them to ``p.grad``, after the reduced
gradients, so autograd never writes a shard gradient in the middle of backward."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from shardwise.engine.surface.param_hooks import post_accumulate_grad_hooks, tensor_hooks
from shardwise.engine.surface.pieces import local_only
from shardwise.errors import ShardwiseError


class DirectGrads:
    """One flat group's direct gradients of the running backward, by parameter index."""

    def __init__(self, on_arrival: Optional[Callable[[], None]] = None):
        self.pending: dict[int, torch.Tensor] = {}
        # The runtime's begin_backward: a backward that reaches only a penalty still ends with
        # ModelRuntime.end_backward, which hands these out.
        self.on_arrival = on_arrival

    def add(self, index: int, grad: torch.Tensor) -> None:
        """From the autograd engine (shard_param._DirectGrad.backward)."""
        if self.on_arrival is not None:
            self.on_arrival()
        prev = self.pending.get(index)
        self.pending[index] = grad if prev is None else prev + grad

    def drop(self) -> None:
        self.pending = {}

    def hand_out(self, group, sink) -> list[int]:
        """At the end of backward: add each to its parameter's ``p.grad`` through the group's ``sink`` (every
        rank alike); returns the indices of the parameters reached."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, {}
        consumer = group.transfers.consumer if group.transfers is not None else None
        if consumer is not None and consumer.steps_in_backward:
            raise ShardwiseError(
                f"a gradient reached parameter {group.plan.params[min(pending)].fqn!r} directly (a penalty computed "
                f"from the parameter itself after shard()) while shardwise.offload_optimizer steps each unit during "
                f"backward: the step ran without it; compute the penalty inside the model's forward")
        for i in pending:
            p = group.shard_params[i]
            with local_only():
                hooked = bool(tensor_hooks(p) or post_accumulate_grad_hooks(p))
            if hooked:
                raise ShardwiseError(
                    f"parameter {group.plan.params[i].fqn!r} has a tensor hook or a post-accumulate-grad hook and a "
                    f"gradient reached it directly (a penalty computed from the parameter itself after shard()): "
                    f"the hook ran on its reduced gradient without it; compute the penalty inside the model's "
                    f"forward, or remove the hook")
        accumulating = group.has_unsynced_grad()  # (drops a no_sync accumulation the user dropped first)
        for i, grad in sorted(pending.items()):
            p = group.shard_params[i]
            with local_only():
                grad = grad.to(device=p.device, dtype=p.dtype).clone(memory_format=torch.contiguous_format)
            sink.add_grad(p, grad)
        if accumulating:
            sink.mark_unsynced(group)  # the engine wrote these gradients itself: the no_sync marks move with them
        return sorted(pending)
