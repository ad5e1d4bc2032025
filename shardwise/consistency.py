"""Catching ranks that disagree about what they communicate, before it turns into a hang or mixed data.

Every collective a sharded model issues carries a *fingerprint* from every rank: which call this is (a
per-model sequence number), the operation, the unit, the flat group, the element count and the phase
(forward / backward / other). Every rank ends up with all ranks' fingerprints; if they differ, every rank
raises the same ``ShardwiseError`` naming the unit, the operation and which ranks are where.

Two ways to carry the fingerprint:

* **In band** (gloo, where all-gather and reduce-scatter run as one all-reduce, see collectives.py): the
  fingerprint rides inside the data collective itself. The buffer gets a header of ``SLOT`` elements per
  rank after the data; each rank writes its fingerprint, as base-256 digits, into its own slot and zeros
  into the others, so the sum delivers every rank's fingerprint to every rank. Digits 0-255 are exact in
  bf16, fp16, fp32 and fp64, and x + 0 is exact, so the table arrives intact whatever the data dtype. No
  extra message, no extra thread wakeup: a separate exchange per collective cost ~9% of a step on a
  2-core CPU box, almost all of it scheduling the extra gloo work, not bytes.
  The same goes for the all-reduce across replicas (no_shard, hybrid strategies) on gloo.
* **Out of band** (NCCL, gloo with native all-gather / reduce-scatter): a
  tiny all-gather of the same values on a dedicated gloo group, on the CPU, so under NCCL waiting on it
  never waits on the GPU streams that carry the data. It has the same size on every rank whatever they
  are about to do, so it cannot itself mismatch. It is issued together with its collective and
  checked before that collective's result is used, so it adds no stall of its own.

Either way the table is checked before the collective's result is used, so mixed-up data is never
consumed. A rank that died or skipped ahead makes the collective fail (peer closed) or time out after the
process group's timeout, also with a clear message. Ranks that disagree about a collective's *size* are
stopped by gloo itself ("Received data size doesn't match expected size"), which aborts the process
before any fingerprint can be read; sizes follow from the sharding plan, whose hash every rank compares at
``shard()`` time, so that takes two ranks calling different units of different sizes at the same moment.
Turn the check off with ``SHARDWISE_CHECK_COLLECTIVES=0``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from shardwise import collectives
from shardwise.errors import ShardwiseError

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast_buffers", "clip_grad_norm", "state_dict",
       "summon_full_params", "checkpoint")
MODEL = 256**3 - 1  # the unit field of a collective that belongs to the model as a whole, not to one unit
PHASES = ("idle", "forward", "backward")

# In-band header layout per rank: a marker digit (so an unstamped, all-zero slot never reads as a valid
# fingerprint), then each fingerprint field as little-endian base-256 digits of these widths.
_FIELD_DIGITS = (4, 1, 3, 1, 5, 1)  # seq, op, unit, group, numel, phase
SLOT = 1 + sum(_FIELD_DIGITS)  # 16 elements per rank


def _encode(values: Sequence[int]) -> list[int]:
    digits = [1]
    for v, width in zip(values, _FIELD_DIGITS):
        v %= 256**width  # seq wraps after 4G collectives; numel beyond 2^40 is reported modulo
        digits.extend((v >> (8 * i)) & 0xFF for i in range(width))
    return digits


def _decode(digits: Sequence[int]) -> list[int]:
    values, at = [], 1
    for width in _FIELD_DIGITS:
        values.append(sum(int(d) << (8 * i) for i, d in enumerate(digits[at:at + width])))
        at += width
    return values


class Stamp:
    """The in-band header of one collective: what this rank wrote, and which global rank owns each slot."""

    __slots__ = ("header", "mine", "slot_ranks")

    def __init__(self, header: torch.Tensor, mine: torch.Tensor, slot_ranks: list[int]):
        self.header, self.mine, self.slot_ranks = header, mine, slot_ranks


def checks_enabled() -> bool:
    return os.environ.get("SHARDWISE_CHECK_COLLECTIVES", "1") not in ("0", "false", "False", "")


class CollectiveChecker:
    def __init__(self, unit_labels: Sequence[str], phase_fn: Callable[[], str]):
        self.unit_labels = list(unit_labels)
        self.phase_fn = phase_fn
        self.world = dist.get_world_size()
        self.group = side_group() if self.world > 1 else None
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

    def check_now(self, op: str, numel: int, unit: int = MODEL, group: int = 0) -> None:
        """Agree, before issuing it, on a collective outside the unit schedule (clipping, buffer broadcast,
        state dicts, checkpoint agreement). Blocking, and on the side group whose exchange has the same size
        whatever each rank is about to do: two ranks calling different collectives of different sizes would
        otherwise meet in one collective that gloo aborts ("Received data size doesn't match") before any
        fingerprint could be read. One tiny exchange per call; these calls are rare (at most once a step)."""
        self.check(op, unit, group, numel)
        self.verify()

    def stamp(self, op: str, unit: int, group: int, numel: int, slot_ranks: list[int], my_slot: int,
              dtype: torch.dtype, device: torch.device) -> Stamp:
        """The in-band fingerprint for a collective about to run as an all-reduce among ``slot_ranks``
        (global ranks, in group order): a ``ranks x SLOT`` header, slot ``my_slot`` filled and the others
        zero, to be summed with the data."""
        self.verify()  # an earlier out-of-band exchange must be settled first: calls are checked in order
        self.seq += 1
        values = [self.seq, OPS.index(op), unit, group, numel, PHASES.index(self.phase_fn())]
        mine = torch.tensor(_encode(values), dtype=dtype)
        header = torch.zeros(len(slot_ranks), SLOT, dtype=dtype)
        header[my_slot] = mine
        return Stamp(header.view(-1).to(device), mine.to(device), slot_ranks)

    def verify_stamp(self, stamp: Stamp, buffer: torch.Tensor) -> None:
        """After the collective: every rank's slot of the header at the end of ``buffer`` must hold the same
        fingerprint as this rank's."""
        n = stamp.header.numel()
        table = buffer.narrow(0, buffer.numel() - n, n).view(-1, SLOT)
        if bool((table == stamp.mine).all()):
            return
        rows = {r: _decode(row) for r, row in zip(stamp.slot_ranks, table.to(torch.int64).tolist())}
        self._raise_disagreement(rows)

    def verify(self) -> None:
        """Wait for the last fingerprint exchange; raise on every rank if the ranks disagree."""
        if self._pending is None:
            return
        work, everyone, values = self._pending
        self._pending = None
        collectives.wait(work, what=lambda: f"the consistency exchange before {self._describe(values)}",
                         group=self.group)
        table = everyone.view(self.world, len(values))
        if bool((table == table[0]).all()):
            return
        self._raise_disagreement(dict(enumerate(table.tolist())))

    def _raise_disagreement(self, rows: dict[int, list[int]]) -> None:
        """``rows``: global rank -> the fingerprint it sent."""
        by_call: dict[tuple, list[int]] = {}
        for r, row in rows.items():
            by_call.setdefault(tuple(row), []).append(r)
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
        what = OPS[op] if 0 <= op < len(OPS) else f"operation #{op}"
        if unit == MODEL:
            return f"{what} of the model ({numel} elements, {PHASES[phase]}, call {seq})"
        label = self.unit_labels[unit] if 0 <= unit < len(self.unit_labels) else f"#{unit}"
        return f"{what} of unit {label!r} (flat group {group}, {numel} elements, {PHASES[phase]}, call {seq})"


_side_groups: dict = {}


def side_group():
    """The gloo group of all ranks that carries fingerprint exchanges, made once per world (``new_group`` is
    itself a collective: every rank reaches its first use at the same point, a ``shard()`` or a checkpoint
    call). Every checker shares it, so two ranks checking different things pair up and disagree loudly."""
    key = id(dist.group.WORLD)
    if key not in _side_groups:
        _side_groups[key] = dist.new_group(backend="gloo", timeout=_world_timeout())
    return _side_groups[key]


def _world_timeout():
    """The timeout the user gave ``init_process_group``: ``new_group`` would otherwise default to gloo's 30
    minutes, and a stuck exchange would outlive every data collective. Private attributes, isolated here
    (checked on torch 2.13; None, the torch default, where they are missing)."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


_standalone: dict = {}


def check_collective(op: str, numel: int) -> None:
    """``check_now`` for collectives that belong to no sharded model (checkpoint agreement)."""
    if not checks_enabled() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    key = id(dist.group.WORLD)
    if key not in _standalone:
        _standalone[key] = CollectiveChecker([], lambda: "idle")
    _standalone[key].check_now(op, numel)


def check_same_plan(description: str, group: Optional[dist.ProcessGroup]) -> None:
    """At shard() time: every rank must have built the same sharding plan (same names, shapes, dtypes,
    units, strategy), or their collectives would pair up wrong buffers."""
    if group is None:
        return
    digest = int.from_bytes(hashlib.sha256(description.encode()).digest()[:7], "little")
    world = dist.get_world_size()
    everyone = torch.empty(world, dtype=torch.int64)
    collectives.all_gather_into(everyone, torch.tensor([digest], dtype=torch.int64), group, async_op=False,
                                what="the sharding-plan check in shard()")
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
