"""Buffers (BatchNorm running statistics, counters, masks) kept alike on every rank.

Buffers are not sharded: every rank holds all of them and updates them in its own forward from its own
data, so BatchNorm's running statistics drift apart across ranks, evaluation differs per rank and a
checkpoint keeps rank 0's. DDP's default answer is to broadcast rank 0's buffers before every forward;
``shard(broadcast_buffers=True)`` (the default) does the same.

A buffer is written only where rank 0's values differ from its own (see ``_broadcast``), so two forwards
before one backward with a buffer saved for backward work as in plain torch. One collective per forward
for all buffers together: they are packed per dtype into one flat tensor, rank 0
writes its values and every other rank zeros, and a sum delivers rank 0's values everywhere (x + 0 is exact
in every dtype). Ranks agree on it first through the fingerprint side exchange (``check_now``), like every
collective outside the unit schedule. Over a 2-D mesh it runs over the shard groups, then over the
replicate groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.base import collectives
class BufferBroadcast:
    """Callable run at the start of every top-level forward (``ModelRuntime.before_forward``)."""

    def __init__(self, model: nn.Module, runtime):
        self.runtime = runtime
        self.buffers = []  # (module, name) for every buffer, each tensor once
        seen = set()
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    self.buffers.append((module, name))
        self.stages = [g for g in (runtime.pgs.shard, runtime.pgs.replicate) if g is not None]

    def __call__(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for module, name in self.buffers:
            b = module._buffers[name]
            if b is not None:
                by_dtype.setdefault(b.dtype, []).append(b)
        for group in self.stages:
            for dtype, tensors in by_dtype.items():
                self._broadcast(group, dtype, tensors)

    def _broadcast(self, group, dtype: torch.dtype, tensors: list[torch.Tensor]) -> None:
        wire = torch.uint8 if dtype == torch.bool else dtype  # bool has no sum
        numel = sum(t.numel() for t in tensors)
        flat = torch.zeros(numel, dtype=wire, device=self.runtime.device)
        if dist.get_rank(group) == 0:
            at = 0
            for t in tensors:
                flat.narrow(0, at, t.numel()).copy_(t.reshape(-1))
                at += t.numel()
        collectives.run_agreed(self.runtime.checker, "broadcast_buffers", collectives.all_reduce_sum, flat,
                               group=group, what=f"the broadcast of rank 0's {dtype} buffers")
        at = 0
        with torch.no_grad():
            for t in tensors:
                received = flat.narrow(0, at, t.numel()).view(t.shape)
                at += t.numel()
                # Written only where it differs: an in-place write bumps the buffer's version counter, and a
                # buffer saved for backward (a RoPE cache, a mask) by an earlier forward of the same step
                # must stay untouched, or that backward fails with torch's in-place error.
                if not torch.equal(t, received.to(t.dtype)):
                    t.copy_(received)
