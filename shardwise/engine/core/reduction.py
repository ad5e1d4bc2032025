"""A gradient reduction in flight: one flat group's packed gradient on its way to ``.grad``.

``start`` makes one ``Reduction`` per synced backward of a group, by one function per path:

    no shard group   (no_shard, hybrid with one rank per shard group) nothing to communicate within the
                     group: the packed gradient is already this rank's whole shard
    ZeRO-1           (``all_reduce_grads``) one all-reduce of the whole packed gradient over the shard group;
                     this rank's chunk of the sum is its gradient shard, and the whole sum stays alive behind
                     the ``.grad`` views, as ZeRO-1 keeps full gradients
    reduce-scatter   (every other strategy) into a new gradient shard; the packed gradient is freed once the
                     collective has read it

``finish`` completes it: waits, frees the packed gradient, all-reduces across replicas (no_shard, hybrid),
divides by the data-parallel size, and hands the shard to the group's sink (core/seams.py). The runtime keeps
a bounded queue of these (``ModelRuntime.add_pending``) and finishes them in order, so at most that many
packed gradients are alive at once, plus the one being packed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from shardwise.engine.base import collectives
from shardwise.engine.base.torch_internals import resize_storage
from shardwise.engine.core import grad_usage

if TYPE_CHECKING:
    from shardwise.engine.core.flat_group import FlatGroup


@dataclasses.dataclass(eq=False)
class Reduction:
    """One group's gradient reduction; its fields say what is alive until ``finish``."""

    group: "FlatGroup" = dataclasses.field(repr=False)
    out: torch.Tensor = dataclasses.field(repr=False)  # the reduced gradient shard: what the .grad become views of
    divide_after: int = 1  # what the sum is still divided by once complete (1: it was divided before: _divisors)
    op: str = ""  # the collective in flight over the shard group ("": none)
    work: Any = None  # its handle (None: none)
    # the packed gradient the collective works on
    sent: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    frees_sent: bool = False  # finish frees ``sent`` (reduce-scatter; ZeRO-1's is the output itself)
    final: bool = True  # the group gets no other gradient in this backward (Unit.post_backward says)
    used: tuple = ()  # per parameter: whether this rank packed a gradient of it (grad_usage.py)


def _divisors(reduce_dtype: torch.dtype, data_parallel_size: int) -> tuple[int, int]:
    """(before the sum, after it): the one decision of where the mean over the data-parallel ranks divides.
    Low-precision sums divide first so they cannot overflow; fp32 divides once at the end, which keeps
    results closest to a single-process mean over the global batch."""
    if reduce_dtype.itemsize < 4 and data_parallel_size > 1:
        return data_parallel_size, 1
    return 1, data_parallel_size


def start(group: "FlatGroup", buffer: torch.Tensor, used: Sequence[bool]) -> Reduction:
    """Start reducing ``buffer`` (the group's packed gradient, padded numel); ``used``: which parameters this
    rank packed a gradient of."""
    before, after = _divisors(group.reduce_dtype, group.pgs.data_parallel_size)
    if before != 1:
        buffer.div_(before)
    if group.pgs.shard is None:
        r = _within_one_rank(group, buffer, after)
    elif group.all_reduce_grads:
        r = _all_reduce_whole(group, buffer, after)
    else:
        r = _reduce_scatter(group, buffer, after)
    r.used = tuple(used)
    return r


def _within_one_rank(group: "FlatGroup", buffer: torch.Tensor, divide_after: int) -> Reduction:
    return Reduction(group, buffer, divide_after)  # the packed gradient is itself what the replicas all-reduce


def _all_reduce_whole(group: "FlatGroup", buffer: torch.Tensor, divide_after: int) -> Reduction:
    # ZeRO-1: every rank gets the whole summed gradient; its gradient shard is a view of its chunk.
    group.announce("all_reduce", group.plan.padded_numel)
    work = collectives.all_reduce_sum(buffer, group.pgs.shard, async_op=True)
    return Reduction(group, buffer.narrow(0, group.shard_start, group.plan.shard_numel), divide_after,
                     op="all_reduce", work=work, sent=buffer)


def _reduce_scatter(group: "FlatGroup", buffer: torch.Tensor, divide_after: int) -> Reduction:
    out = torch.empty(group.plan.shard_numel, dtype=group.reduce_dtype, device=group.device)
    group.announce("reduce_scatter", group.plan.padded_numel)
    work = collectives.reduce_scatter_into(out, buffer, group.pgs.shard, async_op=True)
    return Reduction(group, out, divide_after, op="reduce_scatter", work=work, sent=buffer, frees_sent=True)


def finish(r: Reduction, discard: bool = False) -> None:
    """Complete the reduction (every rank issued it) and hand out the gradient, or drop it (``discard``: the
    backward that produced it raised)."""
    g = r.group
    if r.work is not None:
        collectives.wait(r.work, what=g._what(r.op), group=g.pgs.shard)
    if r.frees_sent:
        # Its memory is freed now: collectives keep the finished work (and so this tensor) referenced for
        # a while ([Note: a gloo worker must never free a Python object] in collectives.py).
        resize_storage(r.sent, 0)
    r.work = r.sent = None  # the packed gradient dies here (ZeRO-1: lives on behind the grad views)
    if discard:
        return
    if g.pgs.replicate is not None:
        g.announce("all_reduce", r.out.numel())
        work = collectives.all_reduce_sum(r.out, g.pgs.replicate, async_op=True)
        collectives.wait(work, what=g._what("all_reduce"), group=g.pgs.replicate)
    if r.divide_after != 1:
        r.out.div_(r.divide_after)
    g.used_this_backward = grad_usage.either(g.used_this_backward, r.used)  # (agreed at the end of backward)
    used = None
    if g.sink.wants_usage_at_hand_out(g):  # (its hand-out runs hooks or steps at once: agreed now)
        used = grad_usage.agree_now(r.used, g.checker, g.ids[0],
                                    f"the agreement on which parameters of unit {g.plan.unit_fqn or '<root>'!r} "
                                    f"got a gradient, before its hand-out")
    g.sink.deliver(g, r.out, r.final, used)  # to .grad (through the host under CPU offload): seams.py
