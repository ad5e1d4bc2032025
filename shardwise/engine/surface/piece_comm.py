"""The two collectives a piece ever issues: ``combine`` (a reduction's per-rank partials) and ``gather`` (the
whole tensor, for code that must hold it: a plain tensor written from pieces, pickling, ``.item()``).

Both are user code's calls, outside the unit schedule, so the ranks agree on each first (``check_now`` on the
model's checker, fingerprint.py): a call made on one rank only (``if rank == 0: print(p.grad.norm())``,
``if rank == 0: torch.save(model.state_dict(), f)``) meets the other ranks' next compare, or the stall
watchdog's probe, and every rank raises the disagreement naming it, instead of hanging or pairing with
another rank's collective. Every collective of a piece goes through ``_run``: one place to move them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.engine.base import collectives
from shardwise.engine.surface.layout import Layout, checker_of, group_of

HOW = ("sum", "max", "min", "prod")  # the reduce op, in the fingerprint's group field
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}
_GATHER = len(HOW)  # the fingerprint's group field of a gather


def _run(key: int, name: str, field: int, numel: int, collective, /, *args, what: str, **kwargs) -> None:
    """Agree on one collective of the pieces of ``key``'s shard group (``name``, ``field`` and ``numel``: its
    fingerprint), then run it."""
    group, _device = group_of(key)
    checker = checker_of(key)
    if checker is not None:
        checker.check_now(name, numel, group=field)
    collectives.run_and_wait(collective, *args, group=group, what=what, **kwargs)


def combine(values: torch.Tensor, key: int, how: str, what: str) -> torch.Tensor:
    """``values`` (this rank's partial results, any shape) reduced over ``key``'s shard group (``how``: sum,
    max, min or prod), on ``values``' device. Floating values travel in float32 (float64 stays float64),
    integers and booleans in int64."""
    _group, device = group_of(key)
    if values.is_floating_point():
        wide = torch.float64 if values.dtype == torch.float64 else torch.float32
    else:
        wide = torch.int64
    buf = values.detach().to(device=device, dtype=wide).contiguous()
    _run(key, "grad_reduction", HOW.index(how), buf.numel(), dist.all_reduce, buf, op=_OPS[how], what=what)
    return buf.to(values.device)


def gather(local: torch.Tensor, layout: Layout, what: str, op: str = "piece_gather") -> torch.Tensor:
    """The whole tensor (a new plain tensor of ``layout.shape``) from every rank's ``local`` elements. ``op``:
    what the ranks agree on (fingerprint.OPS), named if one rank calls it alone."""
    if layout.is_whole:
        return local.detach().reshape(layout.shape).clone()
    _group, device = group_of(layout.key)
    sizes = [sum(n for _, n in runs) for runs in layout.runs]
    width = max(sizes)
    mine = torch.zeros(width, dtype=local.dtype, device=device)
    mine.narrow(0, 0, sizes[layout.rank]).copy_(local.detach())
    everyone = torch.empty(width * len(sizes), dtype=local.dtype, device=device)
    _run(layout.key, op, _GATHER, everyone.numel(), collectives.all_gather_into, everyone, mine,
         what=what)
    flat = torch.empty(layout.numel, dtype=local.dtype, device=device)
    for r in range(len(sizes)):
        layout.place(everyone.narrow(0, r * width, sizes[r]), flat, rank=r)
    return flat.view(layout.shape).to(local.device)
