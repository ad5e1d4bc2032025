"""A gradient reduction in flight: one flat group's reduce-scatter (or ZeRO-1's all-reduce), then the
all-reduce across replicas, the division by the data-parallel size, and the hand-out to ``.grad``.

The runtime keeps a bounded queue of these (``ModelRuntime.add_pending``): ``finish`` is called in order, so
at most that many unsharded gradient buffers are alive at once, plus the one being packed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from shardwise.engine.base import collectives
from shardwise.engine.base.torch_internals import resize_storage
from shardwise.engine.checks.fingerprint import Stamp

if TYPE_CHECKING:
    from shardwise.engine.core.flat_group import FlatGroup


class PendingReduce:
    """A reduce-scatter in flight. ``finish`` waits, all-reduces across replicas, scales, and hands out grads.

    ``out_buffer`` holds the reduced gradient in its first ``out_numel`` elements, then room for the replica
    all-reduce's in-band fingerprint."""

    def __init__(self, group: "FlatGroup", flat: Optional[torch.Tensor], out_buffer: torch.Tensor, out_numel: int,
                 work, divide_by: int, stamp: Optional[Stamp] = None, op: str = "reduce_scatter",
                 out_offset: int = 0):
        self.group, self.flat, self.work, self.divide_by, self.stamp = group, flat, work, divide_by, stamp
        self.out_buffer, self.out_numel, self.out_offset, self.op = out_buffer, out_numel, out_offset, op
        self.final = True  # the group gets no other gradient in this backward (runtime.post_backward says)

    def finish(self, discard: bool = False) -> None:
        """Complete the reduction (every rank issued it) and hand out the gradient, or drop it (``discard``:
        the backward that produced it raised)."""
        g = self.group
        g.fingerprint.wait(self.work, g._what(self.op), self.stamp, self.flat)
        if self.flat is not None and self.flat.untyped_storage().data_ptr() != self.out_buffer.untyped_storage().data_ptr():
            # Its memory is freed now: collectives keep the finished work (and so this tensor) referenced for
            # a while ([Note: a gloo worker must never free a Python object] in collectives.py).
            resize_storage(self.flat, 0)
        self.flat = None  # the unsharded gradient buffer dies here (ZeRO-1: lives on behind the grad views)
        if discard:
            self.out_buffer = None
            return
        out = self.out_buffer.narrow(0, self.out_offset, self.out_numel)
        if g.pgs.replicate is not None:
            stamp = g.fingerprint.announce("all_reduce", self.out_numel, out.dtype)
            if stamp is None:
                work = collectives.all_reduce_sum(out, g.pgs.replicate, async_op=True)
            else:
                work = collectives.all_reduce_sum(self.out_buffer, g.pgs.replicate, async_op=True,
                                                  header=stamp.header)
            g.fingerprint.wait(work, g._what("all_reduce"), stamp, self.out_buffer)
        if self.divide_by != 1:
            out.div_(self.divide_by)
        g.sink.deliver(g, out, self.final)  # to .grad (through the host under CPU offload): seams.py
        self.out_buffer = None
