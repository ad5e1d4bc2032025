"""Catching ranks that disagree about what they communicate, before it turns into a hang or mixed data.

Every collective a sharded model issues is accompanied by a *fingerprint* exchange: each rank all-gathers a
few int64s saying which call this is (a per-model sequence number), the operation, the unit, the flat
group, the element count and the phase (forward / backward / other). The exchange has the same size on
every rank whatever they are about to do, so it cannot itself mismatch; if the fingerprints differ, every
rank raises the same ``ShardwiseError`` naming the unit, the operation and which ranks are where.

It runs on its own gloo process group, on the CPU: under NCCL waiting on it never waits on the GPU
streams that carry the data, so prefetch overlap is kept. It is issued together with its collective and
checked before that collective's result is used, so it adds no stall of its own. A rank that died or skipped ahead makes the
exchange fail (peer closed) or time out after the process group's timeout, also with a clear message.
Cost: one tiny all-gather per collective (measured in bench/README.md); turn it off with
``SHARDWISE_CHECK_COLLECTIVES=0``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from shardwise import collectives
from shardwise.errors import ShardwiseError

OPS = ("all_gather", "reduce_scatter", "all_reduce", "state_dict_gather", "state_dict_broadcast")
PHASES = ("idle", "forward", "backward")


def checks_enabled() -> bool:
    return os.environ.get("SHARDWISE_CHECK_COLLECTIVES", "1") not in ("0", "false", "False", "")


class CollectiveChecker:
    def __init__(self, unit_labels: Sequence[str], phase_fn: Callable[[], str]):
        self.unit_labels = list(unit_labels)
        self.phase_fn = phase_fn
        self.world = dist.get_world_size()
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.seq = 0
        self._pending = None  # (work, gathered fingerprints, my fingerprint) of the last exchange

    def check(self, op: str, unit: int, group: int, numel: int) -> None:
        """Start the fingerprint exchange for the collective about to be issued.

        The exchange runs alongside the collective instead of in front of it: a blocking exchange would
        stall every rank at every issue point (prefetches included) until the slowest arrived, which cost
        ~8% of a step on CPU. It is verified before the collective's result is used (``verify``) and
        before the next exchange starts, so mixed-up data is never consumed and a disagreement is
        reported at the first collective where it shows."""
        if self.group is None:
            return
        self.verify()
        self.seq += 1
        values = [self.seq, OPS.index(op), unit, group, numel, PHASES.index(self.phase_fn())]
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = torch.empty(self.world * len(values), dtype=torch.int64)
        try:
            work = collectives.all_gather_into(everyone, mine, self.group, async_op=True)
        except RuntimeError as e:
            raise self._peer_failed(values, e) from e
        self._pending = (work, everyone, values)

    def verify(self) -> None:
        """Wait for the last fingerprint exchange; raise on every rank if the ranks disagree."""
        if self._pending is None:
            return
        work, everyone, values = self._pending
        self._pending = None
        try:
            work.wait()
        except RuntimeError as e:
            raise self._peer_failed(values, e) from e
        table = everyone.view(self.world, len(values))
        if bool((table == table[0]).all()):
            return
        by_call: dict[tuple, list[int]] = {}
        for r in range(self.world):
            by_call.setdefault(tuple(table[r].tolist()), []).append(r)
        parts = [f"ranks {ranks} are at {self._describe(list(call))}" for call, ranks in by_call.items()]
        raise ShardwiseError(
            "ranks disagree about the next collective (did one rank run an extra forward, skip backward, "
            "or take a different branch?): " + "; ".join(parts)
        )

    def _peer_failed(self, values: list[int], e: Exception) -> ShardwiseError:
        return ShardwiseError(
            f"rank {dist.get_rank()}: the consistency exchange before {self._describe(values)} failed: "
            f"another rank died, left, or stopped communicating ({e})"
        )

    def _describe(self, v: list[int]) -> str:
        seq, op, unit, group, numel, phase = v
        label = self.unit_labels[unit] if 0 <= unit < len(self.unit_labels) else f"#{unit}"
        return f"{OPS[op]} of unit {label!r} (flat group {group}, {numel} elements, {PHASES[phase]}, call {seq})"


def check_same_plan(description: str, group: Optional[dist.ProcessGroup]) -> None:
    """At shard() time: every rank must have built the same sharding plan (same names, shapes, dtypes,
    units, strategy), or their collectives would pair up wrong buffers."""
    if group is None:
        return
    digest = int.from_bytes(hashlib.sha256(description.encode()).digest()[:7], "little")
    world = dist.get_world_size()
    everyone = torch.empty(world, dtype=torch.int64)
    collectives.all_gather_into(everyone, torch.tensor([digest], dtype=torch.int64), group, async_op=False)
    if bool((everyone == everyone[0]).all()):
        return
    groups: dict[int, list[int]] = {}
    for r, d in enumerate(everyone.tolist()):
        groups.setdefault(d, []).append(r)
    listing = "; ".join(f"ranks {ranks}: plan {d:014x}" for d, ranks in groups.items())
    raise ShardwiseError(
        f"ranks built different models or sharding plans ({listing}); every rank must construct the same "
        f"model and call shard() with the same units and strategy"
    )
