"""Buffers (BatchNorm running statistics, counters, masks) kept alike on every rank.

Buffers are not sharded: every rank holds all of them and updates them in its own forward from its own
data, so BatchNorm's running statistics drift apart across ranks, evaluation differs per rank and a
checkpoint keeps rank 0's. DDP's default answer is to broadcast rank 0's buffers before every forward;
``shard(broadcast_buffers=True)`` (the default) does the same, for the buffers that changed.

At the start of every root forward each rank says, in the forward's start exchange, whether its buffers may
have changed since the last broadcast: a forward ran in training mode since (BatchNorm updates its running
statistics in place without moving their version counters), or a buffer was replaced or written (a new
tensor, or its version moved). Host state only: no look at the values. If so on any rank, rank 0's buffers
are broadcast, packed per dtype, over the shard groups, then over the replicate groups (a 2-D mesh), and
written through ``.data``: no version counter moves, so a buffer saved for backward by an earlier forward of
the same step (a RoPE cache, a mask) does not trip autograd's in-place check.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.base import collectives
from shardwise.engine.base.torch_internals import version_counter
from shardwise.engine.checks.fingerprint import MODEL


class BufferBroadcast:
    """The model's buffers, each tensor once; ``ModelRuntime.begin_forward`` asks ``before_forward`` and, when
    some rank's may have changed, calls ``broadcast``."""

    def __init__(self, model: nn.Module, runtime):
        self.runtime = runtime
        self.buffers = []  # (module, name) for every buffer, each tensor once
        seen = set()
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    self.buffers.append((module, name))
        self._synced: list = [None] * len(self.buffers)  # (tensor id, version) after the last broadcast
        self._trained = True  # the last forward may have written buffers (and nothing was broadcast yet)
        self.stages = [g for g in (runtime.pgs.shard, runtime.pgs.replicate) if g is not None]

    def before_forward(self) -> bool:
        """Whether this rank's buffers may differ from rank 0's now; notes what the forward about to run may
        write (BatchNorm in training mode)."""
        states = [_state(module._buffers.get(name)) for module, name in self.buffers]
        changed = self._trained or states != self._synced
        self._trained = any(module.training for module, _ in self.buffers)
        return changed

    def broadcast(self) -> None:
        """Every rank takes rank 0's buffers (collective, over the data groups)."""
        by_dtype: dict[torch.dtype, list] = {}
        for module, name in self.buffers:
            b = module._buffers.get(name)
            if b is not None:
                by_dtype.setdefault(b.dtype, []).append(b)
        for group in self.stages:
            for dtype, tensors in by_dtype.items():
                self._broadcast(group, dtype, tensors)
        self._synced = [_state(module._buffers.get(name)) for module, name in self.buffers]

    def _broadcast(self, group, dtype: torch.dtype, tensors: list) -> None:
        wire = torch.uint8 if dtype == torch.bool else dtype
        numel = sum(t.numel() for t in tensors)
        flat = torch.empty(numel, dtype=wire, device=self.runtime.device)
        if dist.get_rank(group) == 0:
            at = 0
            for t in tensors:
                flat.narrow(0, at, t.numel()).copy_(t.reshape(-1))
                at += t.numel()
        if self.runtime.checker is not None:
            dtype_tag = zlib.crc32(str(dtype).encode()) % 256
            self.runtime.checker.before_issue("broadcast_buffers", MODEL, dtype_tag, numel)
        collectives.run_and_wait(dist.broadcast, flat, src=dist.get_global_rank(group, 0), group=group,
                                 what=f"the broadcast of rank 0's {dtype} buffers")
        at = 0
        for t in tensors:
            t.data.copy_(flat.narrow(0, at, t.numel()).view(t.shape))  # .data: its version counter stays
            at += t.numel()


def _state(b) -> tuple | None:
    return None if b is None else (id(b), version_counter(b))

