"""Catching ranks that are about to issue different collectives, before anything of two sizes reaches the wire.

Every collective a sharded model issues has a *fingerprint*: which call it is (a per-model sequence number),
the operation, the unit, the flat group, the element count and the phase. Ranks agree on fingerprints
*before* issuing, over the control group (device.py: gloo, host tensors), so a disagreement is a
``ShardwiseError`` on every rank naming the unit, the operation and which ranks are where, and never two
collectives of different sizes paired at the wire (gloo aborts the process on that) or two of the same size
summing unrelated data.

[Note: one exchange per phase] Agreeing on each collective would cost one CPU round trip over every rank per
collective, with the ranks in lock step at every issue. Instead the ranks agree once per *phase* (a root
forward with grad, one without, a backward) on what the whole phase will issue: the sequence of fingerprints
the last phase of that kind issued (its hash and length ride in the phase's start exchange). Each collective
is then compared with that sequence locally: while equal, it is issued with no traffic at all; at the first
difference (or with no agreed sequence: the first step, a rank whose last phase was cut short) the rank
exchanges that collective's fingerprint before issuing it, and so on for the rest of the phase. A legitimate
change (another order, one more unit, the first forward after an optimizer step refilling ZeRO-1/2's kept
copies) happens on every rank alike, so every rank exchanges alike. A rank that differs *alone* waits in an
exchange on the control group while the others wait in a data collective on the data group: nothing of two
sizes meets, and the stall watchdog's probe (watchdog.py, after ``PROBE_S``) finds the ranks' last
collectives differing at one call number and raises the disagreement on every waiting rank. Ranks that
disagree at the start of a phase (one evaluates while the others train on) fail at once: the start exchange
has the same size for everyone. Collectives user code starts outside the unit schedule (clipping, state dicts,
a tensor hook's gradient gather, ...) are exchanged one by one (``check_now``): they are few.

Every control collective is either one of these fixed-size exchanges or comes right after one that agreed on
it (``collectives.run_agreed``), so even two ranks in two different agreements only ever pair exchanges of
one size. ``SHARDWISE_CHECK_COLLECTIVES=0`` turns the check off.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import deque
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from shardwise.engine.base import collectives, flags, watchdog
from shardwise.engine.base.device import control_group
from shardwise.errors import ShardwiseError

# A piece pickled (torch.save of model.state_dict()) gathers the whole: on one rank only, this names it.
PICKLE_PIECES = ("torch.save of a sharded model's state_dict() pieces (the model's or its optimizer's: every "
                 "rank must call it; or use shardwise.save_whole_model / shardwise.full_state_dict)")
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast_buffers", "clip_grad_norm", "state_dict",
       "summon_full_params", "checkpoint", "kept_copy_agreement", "grad_reduction",
       "optimizer_state_check", "tensor_hook_gather", "overflow_vote", "load_state_dict", "phase_start",
       "buffer_changes", "plan_check", "muon_exchange", "host_reduction", "save_whole_model", "initial_weights",
       "rng_state", "grad_usage", "piece_gather", PICKLE_PIECES)
MODEL = 256**3 - 1  # the unit field of a collective that belongs to the model as a whole, not to one unit
PHASES = ("idle", "forward", "forward without grad", "backward")
RING = 16  # collectives each rank remembers for stall reports
RING_SHOWN = 4  # of which a stall report shows the last few per rank
# An exchange: (checker, call, op, unit, group, numel, phase, expected sequence's hash and length, flag words).
# Ranks agree when the first seven fields are equal; the flag words are OR-ed (every rank learns every rank's).
# Word 0 carries a phase's flags; an OR of up to FLAG_WORDS words rides in the exchange itself (``or_words``:
# the usage marks of a backward, one bit a parameter), so it costs no collective of its own.
FLAG_WORDS = 16
_FLAGS = 9
_FIELDS = _FLAGS + FLAG_WORDS
_AGREED = 7


def checks_enabled() -> bool:
    return flags.enabled(flags.CHECK_COLLECTIVES, default=True)


class CollectiveChecker:
    """The fingerprints of one model's collectives (``ident`` 0: collectives of no model, see
    ``check_collective``). Every rank makes its checkers in the same order (``shard()`` is collective)."""

    def __init__(self, unit_labels: Sequence[str], phase_fn: Callable[[], str]):
        self.unit_labels = list(unit_labels)
        self.phase_fn = phase_fn  # the runtime's phase when no phase of ours is open ("idle" for checkpoints)
        self.world = dist.get_world_size()
        self.group = control_group()
        self.seq = 0
        self.ring: deque = deque(maxlen=RING)  # this rank's last collectives, for stall reports
        self._expected: dict[str, list[tuple]] = {}  # phase kind -> the fingerprints its last phase issued
        self._phase: Optional[str] = None  # the open phase's kind
        self._issued: list[tuple] = []  # its fingerprints so far
        self._on_track = False  # every one of them was the agreed sequence's
        self.ident = _register(self)

    # ---- phases --------------------------------------------------------------------------------------
    def begin_phase(self, kind: str, flags_: int = 0) -> int:
        """A phase starts (``kind``: one of ``PHASES`` but idle): the ranks agree that each starts this phase
        and on the sequence of collectives it is expected to issue (see the module's Note); returns the OR of
        every rank's ``flags_`` (stale kept copies, changed buffers: runtime.py)."""
        self.end_phase()
        expected = self._expected.get(kind, [])
        table = self._exchange("phase_start", MODEL, 0, 0, kind, _hash(expected), len(expected), [flags_])
        same = bool((table[:, 7:9] == table[0, 7:9]).all())  # every rank expects the same sequence
        self._phase, self._issued, self._on_track = kind, [], same and bool(expected)
        return _or(table[:, _FLAGS])

    def end_phase(self) -> None:
        """The open phase is over (ended, abandoned or recovered from): what it issued is what the next phase
        of its kind is expected to issue."""
        if self._phase is not None:
            self._expected[self._phase] = self._issued
            self._phase = None

    def before_issue(self, op: str, unit: int, group: int, numel: int) -> None:
        """The data collective ``op`` of ``unit``'s flat group ``group`` is about to be issued: compared with the
        agreed sequence, or exchanged (see the module's Note)."""
        if self.group is None:
            return
        if self._phase is not None:
            fingerprint = (OPS.index(op), unit, group, numel)
            expected = self._expected.get(self._phase, [])
            k = len(self._issued)
            self._issued.append(fingerprint)
            self._on_track = self._on_track and k < len(expected) and expected[k] == fingerprint
            if self._on_track:
                self._note(op, unit, group, numel, self._phase)
                return
        self._exchange(op, unit, group, numel, self._phase or self.phase_fn())

    def check_now(self, op: str, numel: int, unit: int = MODEL, group: int = 0, flags_: int = 0) -> int:
        """Agree, before issuing it, on a collective outside the unit schedule (clipping, state dicts,
        summon, a tensor hook's gather, ...): one exchange, the same size whatever each rank is about to do.
        Returns the OR of every rank's ``flags_``. A call made of several collectives (a state dict) agrees
        once, here; one collective is agreed and issued by ``collectives.run_agreed``."""
        if self.group is None:
            return flags_
        return self.or_words(op, numel, [flags_], unit, group)[0]

    def or_words(self, op: str, numel: int, words: Sequence[int], unit: int = MODEL, group: int = 0) -> list[int]:
        """``check_now`` whose exchange also ORs ``words`` (at most ``FLAG_WORDS`` non-negative int64s) over
        every rank: an agreement that needs nothing but an OR is done in the check's own exchange."""
        if len(words) > FLAG_WORDS:
            raise ValueError(f"or_words: {len(words)} words, at most {FLAG_WORDS} ride in an exchange")
        if self.group is None:
            return list(words)
        table = self._exchange(op, unit, group, numel, self._phase or self.phase_fn(), flags_=words)
        ored = [0] * len(words)
        for row in table[:, _FLAGS:_FLAGS + len(words)].tolist():
            ored = [a | b for a, b in zip(ored, row)]
        return ored

    # ---- the exchange --------------------------------------------------------------------------------
    def _note(self, op: str, unit: int, group: int, numel: int, phase: str) -> list[int]:
        self.seq += 1
        values = [self.seq, OPS.index(op), unit, group, numel, PHASES.index(phase)]
        self.ring.append(values)
        return values

    def _exchange(self, op: str, unit: int, group: int, numel: int, phase: str, expected_hash: int = 0,
                  expected_len: int = 0, flags_: Sequence[int] = (0,)) -> torch.Tensor:
        values = [self.ident] + self._note(op, unit, group, numel, phase) + [expected_hash, expected_len]
        values += list(flags_) + [0] * (FLAG_WORDS - len(flags_))
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = torch.empty(self.world * _FIELDS, dtype=torch.int64)
        collectives.all_gather_into(everyone, mine, self.group, async_op=False,
                                    what=lambda: f"the agreement before {self._describe(values[1:7])}")
        table = everyone.view(self.world, _FIELDS)
        if bool((table[:, :_AGREED] == table[0, :_AGREED]).all()):
            return table
        raise ShardwiseError(self._disagreement({r: tuple(row) for r, row in enumerate(table.tolist())}))

    def _disagreement(self, rows: dict[int, Optional[tuple]]) -> str:
        """``rows``: global rank -> the exchange it sent (ident first), or its last collective (None: none)."""
        idents = {row[0] for row in rows.values() if row is not None}
        by_call: dict = {}
        for r, row in rows.items():
            by_call.setdefault(None if row is None else tuple(row[:_AGREED]), []).append(r)
        parts = []
        for call, ranks in by_call.items():
            if call is None:
                parts.append(f"ranks {ranks} have not issued that call")
                continue
            model = f"model #{call[0]}'s " if len(idents) > 1 else ""
            parts.append(f"ranks {ranks} are at {model}{_checker_of(call[0], self)._describe(call[1:7])}")
        return ("ranks disagree about the next collective (did one rank run an extra forward, evaluate alone, "
                "skip backward, catch an exception the others did not, or take a different branch?): "
                + "; ".join(parts))

    def _describe(self, v: Sequence[int]) -> str:
        seq, op, unit, group, numel, phase = v
        what = OPS[op] if 0 <= op < len(OPS) else f"operation #{op}"
        what += _USER_CALLS.get(what, "")
        phase_name = PHASES[phase] if 0 <= phase < len(PHASES) else f"phase #{phase}"
        if what == "phase_start":
            return f"the start of a {phase_name} (call {seq})"
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


def _hash(fingerprints: Sequence[tuple]) -> int:
    """A 63-bit FNV-1a hash of a sequence of fingerprints (fits an int64 tensor)."""
    h = 0
    for values in fingerprints:
        for v in values:
            h = ((h ^ (v & _MASK)) * 0x100000001B3) & _MASK
    return h


_MASK = 2**63 - 1


def _or(column: torch.Tensor) -> int:
    out = 0
    for v in column.tolist():
        out |= v
    return out


# ---- what the stall watchdog reads (watchdog.py cannot import this module: it is imported by it) --------
_checkers: list = []  # weak references, in creation order: the same order on every rank
_created = [0]  # checkers made so far in this process: the same count on every rank (shard() is collective)
_lock = threading.Lock()


def _register(checker: CollectiveChecker) -> int:
    with _lock:
        _checkers[:] = [ref for ref in _checkers if ref() is not None]
        _checkers.append(weakref.ref(checker))
        _created[0] += 1
    watchdog.set_ring_source(_rings, _diagnose)
    return _created[0]


def _live() -> dict[int, CollectiveChecker]:
    return {c.ident: c for c in (ref() for ref in list(_checkers)) if c is not None}


def _checker_of(ident: int, default: CollectiveChecker) -> CollectiveChecker:
    return _live().get(ident, default)


def _rings() -> dict:
    """This rank's recent collectives per live checker, for its line of a stall report (watchdog thread:
    the main thread may append meanwhile; copying a deque is one C call under the GIL, retried if it changed
    during it)."""
    out = {}
    for ident, c in _live().items():
        for _ in range(3):
            try:
                out[str(ident)] = {"ring": list(c.ring)}
                break
            except RuntimeError:
                continue
    return out


def _diagnose(rings: dict[int, dict]) -> tuple[str | None, list[str]]:
    """From every rank's ``_rings()`` (global rank -> it): the disagreement, if two ranks' last collectives
    differ at one call number, and one line per rank of its last collectives, named. Only the newest
    checker's rings are shown unless an older one proves a disagreement."""
    checkers = _live()
    found, sections = None, []
    for ident in sorted(checkers, reverse=True):
        c = checkers[ident]
        per_rank = {r: ring.get(str(ident)) for r, ring in rings.items() if ring and ring.get(str(ident))}
        if not per_rank:
            continue
        diverged = _ring_difference(c, per_rank) if len(per_rank) > 1 else None
        latest = {r: v["ring"][-1] for r, v in per_rank.items() if v["ring"]}
        behind = None
        if diverged is None and len({v[0] for v in latest.values()}) > 1:
            low = min(v[0] for v in latest.values())
            behind = (f"ranks {sorted(r for r, v in latest.items() if v[0] == low)} are behind: their last "
                      f"collective is call {low}, the others' is call {max(v[0] for v in latest.values())}")
        rows = [f"rank {r}'s last collectives: " + "; ".join(c._describe(v) for v in last)
                for r in sorted(per_rank) if (last := per_rank[r]["ring"][-RING_SHOWN:])]
        if diverged is not None or not sections:
            sections.append(([behind] if behind else []) + rows)
        found = found or diverged
        if found:
            break
    return found, [line for rows in sections[-1:] for line in rows]


def _ring_difference(checker: CollectiveChecker, per_rank: dict[int, dict]) -> str | None:
    """Two ranks whose last collectives hold the same call number with different fingerprints parted there.
    A rank whose ring ends before that call has not issued it; one whose ring starts after it is left out."""
    by_call: dict[int, dict[int, tuple]] = {}
    for r, v in per_rank.items():
        for row in v["ring"]:
            by_call.setdefault(row[0], {})[r] = tuple(row)
    for seq in sorted(by_call):
        at = by_call[seq]
        if len(set(at.values())) > 1:
            rows = {r: ((checker.ident,) + at[r]) if r in at else None for r, v in per_rank.items()
                    if r in at or not v["ring"] or v["ring"][-1][0] < seq}
            return checker._disagreement(rows)
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


def check_same_plan(description: str) -> None:
    """At shard() time, before any other collective: every rank must have built the same sharding plan (same
    names, shapes, dtypes, units, strategy), or their collectives would pair up wrong buffers. One exchange
    of the plan's digest, the same size as every other exchange."""
    group = control_group()
    if group is None:
        return
    digest = int.from_bytes(hashlib.sha256(description.encode()).digest()[:7], "little")
    world = dist.get_world_size()
    mine = torch.tensor([0, 0, OPS.index("plan_check"), MODEL, 0, digest, 0] + [0] * (_FIELDS - _AGREED),
                        dtype=torch.int64)
    everyone = torch.empty(world * _FIELDS, dtype=torch.int64)
    collectives.all_gather_into(everyone, mine, group, async_op=False, what="the sharding-plan check in shard()")
    table = everyone.view(world, _FIELDS)
    if bool((table[:, :_AGREED] == table[0, :_AGREED]).all()):
        return
    groups: dict[tuple, list[int]] = {}
    for r, row in enumerate(table.tolist()):
        groups.setdefault(tuple(row[:_AGREED]), []).append(r)
    listing = "; ".join(f"ranks {ranks}: " + (f"plan {row[5]:014x}" if row[2] == OPS.index("plan_check") else
                                              "not in shard()") for row, ranks in groups.items())
    raise ShardwiseError(
        f"ranks built different models or sharding plans ({listing}); every rank must construct the same "
        f"model and call shard() with the same units and strategy"
    )
