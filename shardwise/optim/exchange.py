"""Whole matrices from 1-D shards and back: one bucketed all-to-all to the owners, one back, per step.

Each participating matrix j has one *owner* rank in the shard group; owners are chosen by cost
(``m * n * min(m, n)``, the Newton–Schulz flops up to a constant), largest first onto the least loaded rank
(LPT), so every rank orthogonalises about the same amount. Rank r holds elements ``[lo_r, hi_r)`` of each
flattened matrix, and the ranks' ranges tile it in rank order (plan.py), so the owner rebuilds a matrix by
concatenating the pieces it received in source-rank order.

    to owners     rank s sends, for each destination d, its pieces of the matrices d owns (in matrix order)
    owners        rebuild, orthogonalise (batched by shape), cut each result back into the senders' ranges
    back          the reverse all-to-all: rank s receives exactly its own pieces, in the order it sent them

Both all-to-alls carry the matrices in the Newton–Schulz dtype: torch casts the whole matrix to it before
anything else and adds the result to the parameter as it is, so sending the cast pieces is exact and, with
bf16, halves the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from shardwise.engine.base import collectives
# (indices of the matrices, the whole matrices) -> their orthogonalised results, on the owner
OrthogonalizeOwned = Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]]


@dataclass(frozen=True)
class ExchangePlan:
    """Who owns which matrix and how many elements every rank holds of each (the same on every rank)."""

    owners: tuple[int, ...]  # matrix -> owner shard rank
    pieces: tuple[tuple[int, ...], ...]  # matrix -> numel held by each shard rank (rank order)

    def owned_by(self, rank: int) -> list[int]:
        return [j for j, o in enumerate(self.owners) if o == rank]

    def send_splits(self, rank: int) -> list[int]:
        """Elements ``rank`` sends to each owner (the all-to-all's input splits on the way there)."""
        out = [0] * len(self.pieces[0]) if self.pieces else []
        for j, o in enumerate(self.owners):
            out[o] += self.pieces[j][rank]
        return out

    def recv_splits(self, rank: int) -> list[int]:
        """Elements ``rank`` receives from each source rank for the matrices it owns."""
        owned = self.owned_by(rank)
        return [sum(self.pieces[j][r] for j in owned) for r in range(len(self.pieces[0]))] if self.pieces else []


def assign_owners(costs: list[int], size: int) -> tuple[int, ...]:
    """Longest-processing-time-first: each matrix, most expensive first (ties: lower index first), goes
    to the least loaded rank (ties: lower rank). Deterministic, so every rank computes the same owners."""
    load = [0] * size
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(size), key=lambda r: (load[r], r))
        owners[j] = r
        load[r] += costs[j]
    return tuple(owners)


def exchange_and_orthogonalize(local: list[torch.Tensor], shapes: list[tuple[int, int]], plan: ExchangePlan,
                               rank: int, group, orthogonalize_owned: OrthogonalizeOwned,
                               dtype: torch.dtype, device: torch.device, checker=None) -> list[torch.Tensor]:
    """``local[j]``: this rank's 1-D piece of matrix j. Returns this rank's pieces (in ``dtype``, on ``local``'s
    device) of ``orthogonalize_owned(js, whole matrices js)``, computed on the owners. ``group`` None: one
    rank. ``device``: the model's compute device, where the exchange runs whatever ``local``'s device (host
    pieces under CPU offload: data groups move device tensors, device.py). ``checker``: the model's; the
    ranks agree on the exchange before it (a step on one rank alone is named, not paired)."""
    home = local[0].device if local else device
    if group is None:
        whole = [piece.to(dtype).view(shape) for piece, shape in zip(local, shapes)]
        return [o.reshape(-1) for o in orthogonalize_owned(list(range(len(local))), whole)]
    size = len(plan.pieces[0])
    send_splits, recv_splits = plan.send_splits(rank), plan.recv_splits(rank)
    order = [j for d in range(size) for j in plan.owned_by(d)]  # destination-major, matrix order within
    send = (torch.cat([local[j].to(dtype) for j in order]) if order else torch.empty(0, dtype=dtype)).to(device)
    recv = torch.empty(sum(recv_splits), dtype=dtype, device=device)
    if checker is not None:  # the second all-to-all follows from the first on every rank
        checker.check_now("muon_exchange", sum(sum(p) for p in plan.pieces))
    collectives.run_and_wait(dist.all_to_all_single, recv, send, recv_splits, send_splits, group=group,
                             what=f"Muon's all-to-all of {len(local)} matrices to their owners")

    owned = plan.owned_by(rank)
    by_source = recv.split(recv_splits)
    cursor = [0] * size
    whole = []
    for j in owned:
        parts = []
        for r in range(size):
            n = plan.pieces[j][r]
            parts.append(by_source[r].narrow(0, cursor[r], n))
            cursor[r] += n
        whole.append(torch.cat(parts).view(shapes[j]))
    results = orthogonalize_owned(owned, whole) if owned else []

    # Back: to each source rank, its range of each owned result, in the order it sent them.
    flat = [o.reshape(-1) for o in results]
    starts = [[sum(plan.pieces[j][:r]) for r in range(size)] for j in owned]
    back = [flat[k].narrow(0, starts[k][r], plan.pieces[j][r]) for r in range(size) for k, j in enumerate(owned)]
    back_send = torch.cat(back) if back else torch.empty(0, dtype=dtype, device=device)
    mine = torch.empty(sum(send_splits), dtype=dtype, device=device)
    collectives.run_and_wait(dist.all_to_all_single, mine, back_send, send_splits, recv_splits, group=group,
                             what=f"Muon's all-to-all of {len(local)} orthogonalised matrices back from their owners")
    mine = mine.to(home)
    out: list[torch.Tensor] = [None] * len(local)  # type: ignore[list-item]
    at = 0
    for j in order:
        n = plan.pieces[j][rank]
        out[j] = mine.narrow(0, at, n)
        at += n
    return out
