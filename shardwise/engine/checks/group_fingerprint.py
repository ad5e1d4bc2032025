"""How one flat group's collectives are fingerprinted (fingerprint.py holds the fingerprint itself).

The flat group's data path asks two things and nothing else: how much room to leave after the data in the
buffer a collective writes (``room_*``), and, around each collective, ``announce`` before issuing it (a
``Stamp`` to carry in band, or None) and ``wait`` for it (the wait, then the in-band check before anyone
reads the result). Where the collective runs as a gloo all-reduce the fingerprint rides in band: every rank
writes its fingerprint into its own slot of the header after the data and the sum hands everyone the
table, at no extra message. Everywhere else (NCCL, gloo's native all-gather / reduce-scatter) it is
recorded for the side exchange, compared once per phase and at the end of backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardwise.engine.base import collectives
from shardwise.engine.base.device import backend_for
from shardwise.engine.checks.fingerprint import SLOT, CollectiveChecker, Stamp
from shardwise.engine.base.strategy import ProcessGroups


def carries_digits(dtype: torch.dtype) -> bool:
    """Whether a sum in ``dtype`` delivers the in-band fingerprint digits 0-255 exactly: each slot holds one
    rank's digit and zeros from the others, so even uint8 does (bool and int8 do not)."""
    return dtype.is_floating_point or dtype in (torch.uint8, torch.int16, torch.int32, torch.int64)


class GroupFingerprint:
    """The fingerprints of one flat group's collectives, in band where the collective can carry them. A group
    whose collectives are not checked has ``flat_group.Unchecked`` instead, with the same four names."""

    room_gathered = room_grad_flat = room_grad_shard = 0  # elements after each buffer's data, where in band

    def __init__(self, checker: CollectiveChecker, ids: tuple[int, int], pgs: ProcessGroups,
                 device: torch.device, dtype: torch.dtype, all_reduce_grads: bool):
        self.checker, self.ids, self.device = checker, ids, device
        self._in_band: dict[str, tuple[list[int], int]] = {}  # op -> (global ranks of its group, my slot)
        shard, replicate = pgs.shard, pgs.replicate
        if not carries_digits(dtype):
            return  # the side exchange checks these groups' collectives
        if shard is not None and collectives.gathers_by_all_reduce(shard, device):
            self._in_band["all_gather"] = self._in_band["reduce_scatter"] = (
                dist.get_process_group_ranks(shard), pgs.shard_rank)
            self.room_gathered = len(self._in_band["all_gather"][0]) * SLOT
        if replicate is not None and backend_for(replicate, device) == "gloo":
            self._in_band["all_reduce"] = (dist.get_process_group_ranks(replicate), dist.get_rank(replicate))
            self.room_grad_shard = len(self._in_band["all_reduce"][0]) * SLOT  # after the grad shard
        if all_reduce_grads and backend_for(shard, device) == "gloo":
            # ZeRO-1's gradient all-reduce runs over the shard group (no replicas): a gloo all-reduce always.
            self._in_band["all_reduce"] = (dist.get_process_group_ranks(shard), pgs.shard_rank)
            self.room_grad_flat = len(self._in_band["all_reduce"][0]) * SLOT
        elif shard is None:
            self.room_grad_flat = self.room_grad_shard  # the grad flat is itself what the replicas all-reduce
        else:
            self.room_grad_flat = self.room_gathered  # its reduce-scatter

    def announce(self, op: str, numel: int, dtype: torch.dtype) -> Optional[Stamp]:
        """Fingerprint the collective about to be issued: the header it must carry in band, or None when it
        is recorded for the side exchange."""
        unit, group = self.ids
        if op in self._in_band:
            ranks, my_slot = self._in_band[op]
            return self.checker.stamp(op, unit, group, numel, ranks, my_slot, dtype, self.device)
        self.checker.check(op, unit, group, numel)
        return None

    def wait(self, work, what: str, stamp: Optional[Stamp], buffer: Optional[torch.Tensor]) -> None:
        """Wait for a collective; an in-band fingerprint arrives with the data and is checked before the
        result is used. Out-of-band ones are compared at the next compare point, before any gradient is
        handed out (fingerprint.py)."""
        collectives.wait(work, what=what)
        if stamp is not None:
            self.checker.verify_stamp(stamp, buffer)
