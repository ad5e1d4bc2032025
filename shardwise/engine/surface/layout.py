"""Where a piece's elements sit in its whole tensor: ``Layout``, and the registry of shard groups pieces use.

A sharded parameter (and its gradient, and what element-wise maths makes of either) is one rank's piece of a
whole tensor. Its ``Layout`` says which: the whole shape, and for every rank of the shard group the runs of
the *flattened* whole it holds, ``(start, length)``, sorted. Over the ranks of the group the runs partition
the whole exactly once (a rank may hold nothing). A parameter of a flat group holds one run per rank (the
plan's ranges, plan.py); ``torch.cat`` of pieces (``parameters_to_vector``) holds several. A rank's local
tensor is its runs' elements back to back, in order, so any contiguous range of the flattened whole is a
contiguous range of every rank's local tensor too (``select``).

The shard group itself does not ride on the layout, only its ``key`` in this process's registry: tensors
get pickled and deep-copied, process groups cannot be. Key 0: a group of one rank, whose pieces are whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

Runs = tuple[tuple[int, int], ...]

# key -> (shard process group, device its collectives run on)
_GROUPS: dict[int, tuple] = {}
# key -> the fingerprint.CollectiveChecker of the model whose pieces carry the key. Held for the life of the
# process (a checker is small and holds no reference to its model): a piece that outlives its model (a clone,
# an EMA copy, a parameter list kept for a comparison) must agree through the same checker on every rank, and
# a weak reference would die at each rank's own garbage-collection time, so one rank would agree before a
# collective and another would not (a hang).
_CHECKERS: dict[int, object] = {}


def register_group(group: dist.ProcessGroup, device: torch.device, checker=None) -> int:
    """The key under which pieces of ``group`` find it (one key per process group, device and model
    checker: ``checker`` agrees the pieces' collectives first, piece_comm.py)."""
    for key, (g, d) in _GROUPS.items():
        if g is group and d == device and checker_of(key) is checker:
            return key
    key = len(_GROUPS) + 1
    _GROUPS[key] = (group, device)
    if checker is not None:
        _CHECKERS[key] = checker
    return key


def group_of(key: int) -> tuple:
    """(process group, device) of a key."""
    return _GROUPS[key]


def checker_of(key: int):
    return _CHECKERS.get(key)


def same_group(a: int, b: int) -> bool:
    """Whether two keys name one shard group on one device (two models sharded over the same group have
    two keys: each its own checker)."""
    if a == b:
        return True
    if a == 0 or b == 0:
        return False
    (ga, da), (gb, db) = _GROUPS[a], _GROUPS[b]
    return ga is gb and da == db


@dataclass(frozen=True, eq=False)
class Layout:
    """One rank's piece of a whole tensor (see the module docstring). Two layouts are equal when they place
    the same elements on the same ranks of the same shard group: pieces of two models sharded alike (an EMA
    model, a reference) are operands of one another."""

    shape: torch.Size  # the whole tensor's
    runs: tuple[Runs, ...]  # per rank of the shard group: the (start, length) runs of the flattened whole it holds
    rank: int  # this rank's position in the shard group
    key: int = 0  # the shard group's registry key (0: a group of one rank)

    def __eq__(self, other) -> bool:
        return (isinstance(other, Layout) and self.shape == other.shape and self.runs == other.runs
                and self.rank == other.rank and same_group(self.key, other.key))

    def __hash__(self) -> int:
        return hash((tuple(self.shape), self.runs, self.rank))

    @staticmethod
    def whole(shape) -> "Layout":
        """The layout of a tensor that one rank holds entirely (no_shard, a group of one rank)."""
        shape = torch.Size(shape)
        return Layout(shape, (((0, shape.numel()),) if shape.numel() else (),), 0, 0)

    @property
    def mine(self) -> Runs:
        return self.runs[self.rank]

    @property
    def is_whole(self) -> bool:
        """This rank holds every element: no other rank holds any, nothing to combine."""
        return len(self.runs) == 1

    @property
    def local_numel(self) -> int:
        return sum(n for _, n in self.mine)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def reshaped(self, shape) -> "Layout":
        """The same elements of a whole of another shape with the same flat order (a view)."""
        return Layout(torch.Size(shape), self.runs, self.rank, self.key)

    def select(self, offset: int, numel: int, shape) -> tuple["Layout", int, int]:
        """The layout of the whole's flat range ``[offset, offset + numel)`` (of shape ``shape``), and where
        this rank's elements of it sit in its local tensor: ``(layout, local start, local length)``."""
        end = offset + numel
        runs, local_at, local_len = [], 0, 0
        for r, rank_runs in enumerate(self.runs):
            out, seen = [], 0
            for start, n in rank_runs:
                a, b = max(start, offset), min(start + n, end)
                if a < b:
                    if r == self.rank and not out:
                        local_at = seen + (a - start)
                    out.append((a - offset, b - a))
                    if r == self.rank:
                        local_len += b - a
                seen += n
            runs.append(tuple(out))
        return Layout(torch.Size(shape), tuple(runs), self.rank, self.key), local_at, local_len

    def positions(self, device=None) -> torch.Tensor:
        """This rank's flat indices into the whole, in local order (int64)."""
        parts = [torch.arange(s, s + n, device=device) for s, n in self.mine]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    def cut(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's elements of ``whole`` (a plain tensor broadcastable to ``shape``, on every rank alike),
        1-D in local order; a view where ``whole`` is contiguous. Only the rows that hold them are
        materialised for a broadcast (expanded) tensor."""
        if whole.shape != self.shape:
            whole = whole.expand(self.shape)
        parts = [_flat_range(whole, s, n) for s, n in self.mine]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else whole.new_empty(0)

    def place(self, local: torch.Tensor, flat: torch.Tensor, rank: Optional[int] = None) -> None:
        """Write ``local`` (rank ``rank``'s elements, default this rank's) into ``flat`` (the whole, flattened)."""
        at = 0
        for s, n in self.runs[self.rank if rank is None else rank]:
            flat.narrow(0, s, n).copy_(local.narrow(0, at, n))
            at += n


def concatenated(layouts: list[Layout], key: int, rank: int, world: int) -> Layout:
    """The layout of ``torch.cat`` along dimension 0 of wholes laid out by ``layouts`` (the result's shape is
    set by the caller): each one's runs shifted by the elements before it; adjacent runs merged."""
    runs: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    offset = 0
    for lay in layouts:
        for r, rank_runs in enumerate(lay.runs):
            for s, n in rank_runs:
                out = runs[r]
                if out and out[-1][0] + out[-1][1] == s + offset:
                    out[-1] = (out[-1][0], out[-1][1] + n)
                else:
                    out.append((s + offset, n))
        offset += lay.numel
    return Layout(torch.Size([offset]), tuple(tuple(r) for r in runs), rank, key)


def _flat_range(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Elements ``[start, start + n)`` of ``t`` flattened (row-major), 1-D, without materialising more of a
    non-contiguous ``t`` than the rows that hold them."""
    if t.is_contiguous():
        return t.reshape(-1).narrow(0, start, n)
    if t.dim() <= 1:
        return t.reshape(-1).narrow(0, start, n)
    row = t[0].numel() if t.shape[0] else 0
    if n == 0 or row == 0:
        return t.new_empty(0)
    first, last = start // row, (start + n - 1) // row
    if first == last:
        return _flat_range(t[first], start - first * row, n)
    rows = t.narrow(0, first, last - first + 1)
    return rows.reshape(-1).narrow(0, start - first * row, n)
