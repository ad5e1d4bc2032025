"""Dynamic loss scaling for fp16 when gradients are sharded.

``torch.amp.GradScaler`` decides from the gradients a rank *holds* whether the step overflowed. With
sharded gradients each rank holds a different 1/N: one rank can see an inf in its shard while the others
see none, so one rank skips the step and halves its scale while the others step, and the replicas of
the model silently diverge. ``ShardedGradScaler`` makes every rank agree: the found-inf flags are
max-reduced over the process group before anyone steps, so all ranks skip together and keep one scale.
A rank whose shard holds no gradient at all still takes part (and gets a flag), so the step cannot hang
or fail on it.

    scaler = shardwise.ShardedGradScaler()            # device from the process group's backend
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                        # before clipping, as with torch's scaler
    shardwise.clip_grad_norm_(model, 1.0)
    scaler.step(optimizer)
    scaler.update()
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardwise.engine.base import collectives
from shardwise.engine.base.device import compute_device
from shardwise.engine.logical_shapes import flat_group_of


class ShardedGradScaler(torch.amp.GradScaler):
    def __init__(self, device: Optional[str] = None, *, process_group: Optional[dist.ProcessGroup] = None,
                 init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        # Where the gradients (and so the found-inf flags) live: the device shard() computes on by default.
        flag_device = compute_device([], process_group) if dist.is_initialized() else torch.device("cpu")
        if device is None:
            device = flag_device.type
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group
        self._flag_device = flag_device

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self._enabled:
            self._agree_on_overflow(optimizer)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer):
        # The path fused optimizers take instead of unscale_ (torch.amp.GradScaler.step).
        found = super()._check_inf_per_device(optimizer)
        self._agree_on_overflow(optimizer)
        return found

    def _agree_on_overflow(self, optimizer: torch.optim.Optimizer) -> None:
        """Max-reduce the found-inf flags over the group and write the verdict back into every flag."""
        if not dist.is_initialized() or dist.get_world_size(self.process_group) == 1:
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        flag = torch.zeros((), dtype=torch.float32, device=self._flag_device)
        for f in found.values():
            flag = torch.maximum(flag, f.to(self._flag_device, torch.float32))
        # Agreed first through the sharded model's fingerprint exchange: a scaler stepped on one rank only
        # is a named error on every rank, not a vote paired with another rank's next collective.
        collectives.run_agreed(_checker_of(optimizer), "overflow_vote", dist.all_reduce, flag, op=dist.ReduceOp.MAX,
                               group=self.process_group, what="the fp16 overflow vote")
        if not found:  # this rank's shard holds no gradient: record the group's verdict anyway
            found[self._flag_device] = flag
        for f in found.values():
            f.copy_(flag)


def _checker_of(optimizer: torch.optim.Optimizer):
    """The fingerprint checker of the sharded model whose parameters ``optimizer`` steps (the first one's,
    if several: they share one side exchange), or None: no shard parameter, or checks off."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            flat_group = flat_group_of(p)
            if flat_group is not None:
                return flat_group.checker
    return None
