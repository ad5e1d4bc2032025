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
* **Out of band** (NCCL, gloo with native all-gather / reduce-scatter): nothing travels with the
  collective. Each rank folds the fingerprint into a running hash and appends it to a log of the
  fingerprints since the ranks last agreed (plus a short ring of its last ``RING`` collectives for stall
  reports). The ranks compare in one tiny all-gather of (call count, hash, log length) on a dedicated gloo
  group, on the CPU, at *compare points*: the first out-of-band collective of every phase (a forward, a
  backward, a call outside steps: the compare includes that collective and comes before it is issued), at
  the end of every forward, with or without grad (before its outputs reach the caller: a forward under
  grad need not be followed by a backward), at the end of backward after the last reduce-scatter's wait
  (so no gradient reaches an optimizer before the ranks agreed, a post-accumulate-grad hook included),
  and at every ``check_now``. That is four exchanges per training step whatever the number of units,
  where a per-collective exchange made ~240 CPU barriers a step for an 80-layer model. Only when the
  hashes differ (the rare path) do the ranks exchange their logs and every rank raises the same error
  naming the first collective where they part.
  Ranks that part *between* compare points may meet in mismatched native collectives: same sizes
  complete with mixed data (caught at the next compare, before any optimizer step), others hang, and a
  hang is the stall watchdog's (watchdog.py): after ``watchdog.PROBE_S`` seconds in a wait it has every
  rank post its log and its ring to the c10d store and, if they show ranks that parted (two logs, or two
  rings, holding different fingerprints for the same call), every waiting rank raises the same
  disagreement; else it reports who is behind at the stall threshold. The rings are what names a
  ``check_now`` made by one rank alone while the others gather in band (``if rank == 0:
  print(p.grad.norm())`` under gloo's default): in-band fingerprints are never logged. gloo's native
  collectives abort the process outright when the *sizes* differ ("Received data size doesn't match"); two ranks
  calling units of different sizes at a compare point are named before that can happen.

Either way, mixed-up data never reaches the weights: an in-band table is checked before the collective's
result is used, an out-of-band log before backward returns. A rank that died or skipped ahead makes the
collective fail (peer closed) or stall (the watchdog), also with a clear message. Ranks that disagree
about a collective's *size* in band are stopped by gloo itself, which aborts the process before any
fingerprint can be read; sizes follow from the sharding plan, whose hash every rank compares at
``shard()`` time, so that takes two ranks calling different units of different sizes at the same moment.
Turn the check off with ``SHARDWISE_CHECK_COLLECTIVES=0``.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import deque
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from shardwise.engine.base import collectives, flags, watchdog
from shardwise.errors import ShardwiseError

# A piece pickled (torch.save of model.state_dict()) gathers the whole: on one rank only, this names it.
PICKLE_PIECES = ("torch.save of a sharded model's state_dict() pieces (every rank must call it; or use "
                 "shardwise.save_whole_model / shardwise.full_state_dict)")
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast_buffers", "clip_grad_norm", "state_dict",
       "summon_full_params", "checkpoint", "kept_copy_agreement", "grad_reduction",
       "optimizer_state_check", "tensor_hook_gather", "overflow_vote", "load_state_dict", "initial_weights",
       "rng_state", "grad_usage", "save_whole_model", "piece_gather", PICKLE_PIECES)
MODEL = 256**3 - 1  # the unit field of a collective that belongs to the model as a whole, not to one unit
PHASES = ("idle", "forward", "backward")

# In-band header layout per rank: a marker digit (so an unstamped, all-zero slot never reads as a valid
# fingerprint), then each fingerprint field as little-endian base-256 digits of these widths.
_FIELD_DIGITS = (4, 1, 3, 1, 5, 1)  # seq, op, unit, group, numel, phase
SLOT = 1 + sum(_FIELD_DIGITS)  # 16 elements per rank
RING = 16  # collectives each rank remembers for stall reports
RING_SHOWN = 4  # of which a stall report shows the last few per rank
LOG_CAP = 4096  # out-of-band fingerprints before the ranks compare anyway (a loop outside steps)
LOG_SHOWN = 512  # out-of-band fingerprints a rank posts to a stall report


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
    return flags.enabled(flags.CHECK_COLLECTIVES, default=True)


class CollectiveChecker:
    def __init__(self, unit_labels: Sequence[str], phase_fn: Callable[[], str],
                 step_fn: Callable[[], int] = lambda: 0):
        self.unit_labels = list(unit_labels)
        self.phase_fn = phase_fn
        self.step_fn = step_fn  # the model's step counter: a new step is a compare point (see check)
        self.world = dist.get_world_size()
        self.group = side_group() if self.world > 1 else None
        self.seq = 0
        self.ring: deque = deque(maxlen=RING)  # this rank's last collectives, for stall reports
        self.log: list[list[int]] = []  # out-of-band fingerprints since the ranks last agreed
        self.hash = 0  # running hash of ``log`` (the ranks agree on everything before it)
        self._epoch: tuple[int, int] | None = None  # (step, phase) of the last out-of-band fingerprint
        self.ident = _register(self)  # names this checker's ring in stall reports

    def _fingerprint(self, op: str, unit: int, group: int, numel: int) -> list[int]:
        self.seq += 1
        values = [self.seq, OPS.index(op), unit, group, numel, PHASES.index(self.phase_fn())]
        self.ring.append(values)
        return values

    def check(self, op: str, unit: int, group: int, numel: int) -> None:
        """Record the out-of-band fingerprint of the collective about to be issued (see the module
        docstring): no communication, except at a compare point, where the ranks agree on everything
        recorded so far, this collective included, before it is issued."""
        if self.group is None:
            return
        values = self._fingerprint(op, unit, group, numel)
        self.log.append(values)
        self.hash = _mix(self.hash, values)
        epoch = (self.step_fn(), values[5])
        if epoch != self._epoch or len(self.log) >= LOG_CAP:
            self._epoch = epoch
            self.agree(f"the consistency exchange before {self._describe(values)}")

    def check_now(self, op: str, numel: int, unit: int = MODEL, group: int = 0) -> None:
        """Agree, before issuing it, on a collective outside the unit schedule (clipping, buffer broadcast,
        state dicts, checkpoint agreement). Blocking, and on the side group whose exchange has the same size
        whatever each rank is about to do: two ranks calling different collectives of different sizes would
        otherwise meet in one collective that gloo aborts ("Received data size doesn't match") before any
        fingerprint could be read. One tiny exchange per call; these calls are rare (a few a step at most:
        clipping, a GradScaler's inf check, a logged gradient norm). One collective is agreed and issued by
        ``collectives.run_agreed``; a call made of several (a state dict) agrees once, here."""
        if self.group is None:
            return
        values = self._fingerprint(op, unit, group, numel)
        self.log.append(values)
        self.hash = _mix(self.hash, values)
        self.agree(f"the consistency exchange before {self._describe(values)}")

    def agree(self, what: str = "the consistency exchange at the end of backward",
              payload: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The per-step compare: one all-gather of (seq, running hash, count) on the side group; every rank
        raises the same error if they differ. Free when nothing was recorded out of band since the last one
        (every rank then skips it alike: their logs have the same length when they agree), unless a
        ``payload`` rides along: a 1-D int64 tensor of the same size on every rank (the parameters' usage
        at the end of backward, core/grad_usage.py), exchanged in the same message; returns every rank's,
        one row per rank (None without a payload)."""
        if self.group is None or (not self.log and payload is None):
            return None
        extra = payload if payload is not None else torch.empty(0, dtype=torch.int64)
        mine = torch.cat([torch.tensor([self.seq, self.hash, len(self.log)], dtype=torch.int64), extra])
        everyone = torch.empty(self.world * mine.numel(), dtype=torch.int64)
        collectives.all_gather_into(everyone, mine, self.group, async_op=False, what=what)
        table = everyone.view(self.world, -1)
        if bool((table[:, :3] == table[0, :3]).all()):
            self.log.clear()
            self.hash = 0
            return table[:, 3:] if payload is not None else None
        self._raise_first_difference(int(table[:, 2].max()), what)

    def _raise_first_difference(self, longest: int, what: str) -> None:
        """Rare path: the hashes differ. Exchange the logs (padded to the longest, so the exchange has the
        same size everywhere) and name the first collective where the ranks part."""
        rows = torch.full((longest, len(_FIELD_DIGITS)), -1, dtype=torch.int64)
        if self.log:
            rows[: len(self.log)] = torch.tensor(self.log, dtype=torch.int64)
        everyone = torch.empty(self.world * rows.numel(), dtype=torch.int64)
        collectives.all_gather_into(everyone, rows.view(-1), self.group, async_op=False,
                                    what=f"the exchange of recent collectives after {what}")
        logs = {r: [row for row in log if row[0] >= 0] for r, log in
                enumerate(everyone.view(self.world, longest, -1).tolist())}
        self.log.clear()
        self.hash = 0
        raise ShardwiseError(self.first_difference(logs) or "ranks disagree about the collectives issued "
                             "(their running hashes differ, their recent collectives do not show where)")

    def first_difference(self, logs: dict[int, list[list[int]]]) -> str | None:
        """The disagreement at the first call where the ranks' logs (global rank -> fingerprints, from the
        same starting call) differ, or None. A rank with no fingerprint there is named as not there yet."""
        for i in range(max((len(v) for v in logs.values()), default=0)):
            at = {r: tuple(v[i]) if i < len(v) else None for r, v in logs.items()}
            if len(set(at.values())) > 1:
                return self._disagreement(at)
        return None

    def stamp(self, op: str, unit: int, group: int, numel: int, slot_ranks: list[int], my_slot: int,
              dtype: torch.dtype, device: torch.device) -> Stamp:
        """The in-band fingerprint for a collective about to run as an all-reduce among ``slot_ranks``
        (global ranks, in group order): a ``ranks x SLOT`` header, slot ``my_slot`` filled and the others
        zero, to be summed with the data."""
        values = self._fingerprint(op, unit, group, numel)
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
        rows = {r: tuple(_decode(row)) for r, row in zip(stamp.slot_ranks, table.to(torch.int64).tolist())}
        raise ShardwiseError(self._disagreement(rows))

    def _disagreement(self, rows: dict[int, tuple | None]) -> str:
        """``rows``: global rank -> the fingerprint it sent (None: it sent none at that call)."""
        by_call: dict[tuple | None, list[int]] = {}
        for r, row in rows.items():
            by_call.setdefault(row, []).append(r)
        parts = [f"ranks {ranks} are at {self._describe(list(call))}" if call is not None else
                 f"ranks {ranks} have not issued that call" for call, ranks in by_call.items()]
        return ("ranks disagree about the next collective (did one rank run an extra forward, skip backward, "
                "or take a different branch?): " + "; ".join(parts))

    def _describe(self, v: Sequence[int]) -> str:
        seq, op, unit, group, numel, phase = v
        what = OPS[op] if 0 <= op < len(OPS) else f"operation #{op}"
        what += _USER_CALLS.get(what, "")
        phase_name = PHASES[phase] if 0 <= phase < len(PHASES) else f"phase #{phase}"
        if unit == MODEL:
            return f"{what} of the model ({numel} elements, {phase_name}, call {seq})"
        label = self.unit_labels[unit] if 0 <= unit < len(self.unit_labels) else f"#{unit}"
        return f"{what} of unit {label!r} (flat group {group}, {numel} elements, {phase_name}, call {seq})"


# What user code starts each collective outside the unit schedule: the name a one-rank call is reported under.
_USER_CALLS = {
    "grad_reduction": " (p.grad.norm(), .sum(), clip_grad_norm_, GradScaler: every rank must call it)",
    "tensor_hook_gather": " (a p.register_hook hook runs on the gathered gradient: every rank must register it)",
    "overflow_vote": " (ShardedGradScaler.unscale_ / step: every rank must call it)",
    "state_dict": " (full_state_dict: every rank must call it, rank 0 gets the dict)",
    "load_state_dict": " (load_full_state_dict: every rank must call it)",
    "summon_full_params": " (every rank must enter it)",
}


def _mix(h: int, values: Sequence[int]) -> int:
    """Fold one fingerprint into a running 63-bit hash (FNV-1a over the fields; fits an int64 tensor)."""
    for v in values:
        h = ((h ^ (v & _MASK)) * 0x100000001B3) & _MASK
    return h


_MASK = 2**63 - 1


# ---- what the stall watchdog reads (watchdog.py cannot import this module: it is imported by it) --------
_checkers: list = []  # weak references, in creation order: the same order on every rank


_created = [0]  # checkers made so far in this process: the same count on every rank (shard() is collective)


def _register(checker: CollectiveChecker) -> str:
    _checkers[:] = [ref for ref in _checkers if ref() is not None]
    _checkers.append(weakref.ref(checker))
    _created[0] += 1
    watchdog.set_ring_source(_rings, _diagnose)
    return str(_created[0])


def _live() -> dict[str, CollectiveChecker]:
    return {c.ident: c for c in (ref() for ref in _checkers) if c is not None}


def _rings() -> dict:
    """This rank's recent collectives per live checker, for its line of a stall report (watchdog thread:
    the main thread may append meanwhile; copying a list or deque is one C call under the GIL, retried if
    a deque changed during it)."""
    out = {}
    for ident, c in _live().items():
        for _ in range(3):
            try:
                out[ident] = {"ring": list(c.ring), "log": list(c.log[-LOG_SHOWN:]), "log_len": len(c.log)}
                break
            except RuntimeError:
                continue
    return out


def _diagnose(rings: dict[int, dict]) -> tuple[str | None, list[str]]:
    """From every rank's ``_rings()`` (global rank -> it): the disagreement, if the ranks' out-of-band
    logs show one, and one line per rank of its last collectives, named. Only checkers with fingerprints
    not yet compared are shown, or else the newest (older models' rings are history)."""
    checkers = _live()
    pending = [i for i in checkers if any((ring or {}).get(i, {}).get("log_len") for ring in rings.values())]
    shown = pending or sorted(checkers, key=int)[-1:]
    found, sections = None, []  # per checker: (who is behind or None, each rank's last collectives)
    for i in shown:
        c = checkers[i]
        per_rank = {r: ring.get(i) for r, ring in rings.items() if ring and ring.get(i)}
        if not per_rank:
            continue
        full = [r for r, v in per_rank.items() if v["log_len"] <= LOG_SHOWN]
        if found is None and len(full) == len(per_rank) and len(per_rank) > 1:
            logs = {r: v["log"] for r, v in per_rank.items()}
            found = c.first_difference(logs) if _definite(logs) else None
        if found is None and len(per_rank) > 1:
            found = _ring_difference(c, per_rank)
        latest = {r: v["ring"][-1] for r, v in per_rank.items() if v["ring"]}
        behind = None
        if len({v[0] for v in latest.values()}) > 1:  # who is behind: the ranks with the fewest calls
            low = min(v[0] for v in latest.values())
            behind = (f"ranks {sorted(r for r, v in latest.items() if v[0] == low)} are behind: their last "
                      f"collective is call {low}, the others' is call {max(v[0] for v in latest.values())}")
        sections.append((behind, [f"rank {r}'s last collectives: " + "; ".join(c._describe(v) for v in last)
                                  for r in sorted(per_rank) if (last := per_rank[r]["ring"][-RING_SHOWN:])]))
    # Who is behind is the story only while no disagreement is proven: ranks that parted count their calls
    # differently without any of them being behind, and naming one would point at the wrong rank.
    lines = [line for behind, rows in sections for line in ([behind] if behind and found is None else []) + rows]
    return found, lines


def _ring_difference(checker: CollectiveChecker, per_rank: dict[int, dict]) -> str | None:
    """The disagreement the rings prove where the logs cannot (in-band collectives are never logged): two
    ranks whose rings hold the same call number with different fingerprints parted there. A rank whose
    ring ends before that call has not issued it; one whose ring starts after it is left out."""
    by_call: dict[int, dict[int, tuple]] = {}
    for r, v in per_rank.items():
        for row in v["ring"]:
            by_call.setdefault(row[0], {})[r] = tuple(row)
    for seq in sorted(by_call):
        at = by_call[seq]
        if len(set(at.values())) > 1:
            rows = {r: at.get(r) for r, v in per_rank.items()
                    if r in at or not v["ring"] or v["ring"][-1][0] < seq}
            return checker._disagreement(rows)
    return None


def _definite(logs: dict[int, list]) -> bool:
    """Whether the logs prove a disagreement rather than a rank that is merely behind: at the first call
    where they differ, two ranks sent different fingerprints."""
    for i in range(max((len(v) for v in logs.values()), default=0)):
        at = {tuple(v[i]) for v in logs.values() if i < len(v)}
        if len(at) > 1:
            return True
        if any(i >= len(v) for v in logs.values()):
            return False
    return False


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
