"""Model-wide runtime state shared by every unit of one sharded model (units are unit.py): the phase of
the step, the forward order that prefetch follows, the reductions in flight, the end of backward, recovery
after a failed backward, and the between-steps invariants.

[Note: recovery] A backward that raises never reaches its end-of-backward callback (autograd drops queued
callbacks on error). The next top-level forward finds the runtime still in its backward phase and
recovers: in-flight reductions are completed (every rank issued them) and dropped, as are the failed
pass's backward views, and every unit is resharded with its shards bound. A caught exception therefore
costs nothing but the gradients of the failed step, as in plain PyTorch after ``zero_grad()``.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.base import collectives, watchdog
from shardwise.engine.base.device import control_group
from shardwise.engine.core import grad_usage, reduction
from shardwise.engine.core.reduction import Reduction
from shardwise.engine.base.mixed_precision import MixedPrecision
from shardwise.engine.base.strategy import ProcessGroups, Strategy
from shardwise.engine.base.torch_internals import call_after_backward
from shardwise.engine.checks.fingerprint import CollectiveChecker
from shardwise.engine.core.flat_group import GatherState
from shardwise.engine.core.unit import FrameKind, Phase, Unit
from shardwise.engine.core.copy_refusal import refuse_deepcopy, refuse_pickle
from shardwise.errors import ShardwiseError


KEPT_STALE, BUFFERS_CHANGED = 1, 2  # what a rank says at a forward's start; the ranks OR them


class ModelRuntime:
    """State shared by all units of one sharded model: phase, forward order, pending reductions."""

    # Reductions left in flight while backward goes on: one overlaps the next unit's backward (FSDP2's
    # schedule); each one more holds another flat of the widest unit (measured: 52 MB at gpt-170m, 2 ranks).
    MAX_PENDING_REDUCES = 1
    # Unsharded gradient flats alive at once (what the planner counts): make_room_for_reduction finishes the
    # oldest reduction before FlatGroup.reduce_grads allocates the next flat, so the one being packed is
    # one of the MAX_PENDING_REDUCES.
    MAX_GRAD_FLATS_ALIVE = MAX_PENDING_REDUCES

    def __init__(self, strategy: Strategy, groups: ProcessGroups, mixed_precision: MixedPrecision, prefetch: bool,
                 *, plan=None, state_dict_keys: Optional[list[str]] = None, device: Optional[torch.device] = None,
                 transfers=None, check_collectives: bool = False):
        self.strategy = strategy
        self.pgs = groups  # the process groups it shards and replicates over
        self.mixed_precision = mixed_precision
        self.prefetch = prefetch
        self.units: list[Unit] = []
        self.phase = Phase.IDLE
        self.require_grad_sync = True
        self.forward_count = 0  # top-level forwards so far (micro-batches count one each)
        # Callables run at the start of every top-level forward (CPU offload: the last step's request order).
        self.before_forward: list = [transfers.rotate] if transfers is not None else []
        self._order: list[Unit] = []  # units in entry order, from the last completed forward
        self._last_index: dict[int, int] = {}
        self._recording: list[Unit] = []
        self._on_track = False  # this forward so far matches the recorded order
        self._pending: deque[Reduction] = deque()
        self.transfers = transfers  # offload_transfers.OffloadTransfers, under CPU offload
        # Every collective of the model agreed before it is issued (fingerprint.py), when the check is on. The
        # checker reads the phase through a weak reference: pieces that outlive the model keep its checker
        # (surface/layout.py), never the model.
        self.checker = CollectiveChecker([u.label for u in plan.units], _phase_reader(weakref.ref(self))) \
            if check_collectives and groups.data_parallel_size > 1 else None
        self.buffers = None  # buffer_broadcast.BufferBroadcast, when rank 0's buffers are broadcast
        self.plan = plan  # plan.ShardingPlan: the units, groups and parameters (checkpoints read it)
        self.state_dict_keys = state_dict_keys  # the model's state_dict names before sharding (state_dict.py)
        self.device = device  # the compute device

    # copy.deepcopy(model) and torch.save(model) reach this through every submodule's attribute: refused by
    # name instead of failing on a ProcessGroup pickle (copy_refusal.py).
    __deepcopy__, __reduce_ex__ = refuse_deepcopy, refuse_pickle

    def flat_groups(self):
        """Every flat group of the model, unit by unit in model order: the one walk over the model's memory
        (norms sum in this order, checkpoints and state dicts list parameters in it)."""
        for u in self.units:
            yield from u.flat_groups

    # ---- forward order and prefetch ---------------------------------------------------------------
    def begin_forward(self) -> None:
        """A top-level forward of the root starts a step: the ranks agree that it does, with or without grad
        (its start exchange), on whether kept copies are refilled and on whether buffers are broadcast."""
        self.settle()
        self.forward_count += 1
        watchdog.note_step()  # "outside shardwise since step N" in a stall report
        for fn in self.before_forward:
            fn()
        buffers_changed = self.buffers is not None and self.buffers.before_forward()
        mine = self._kept_stale_flag() | (BUFFERS_CHANGED if buffers_changed else 0)
        kind = "forward" if torch.is_grad_enabled() else "forward without grad"
        if self.checker is not None:
            agreed = self.checker.begin_phase(kind, mine)
        else:
            agreed = self._or_over_ranks(mine) if self._has_kept or self.buffers is not None else mine
        self.phase = Phase.FORWARD
        self._recording = []
        self._on_track = True
        self._refresh_kept(agreed)
        if self.buffers is not None and agreed & BUFFERS_CHANGED:
            self.buffers.broadcast()

    def record_and_next(self, unit: Unit) -> Optional[Unit]:
        """Note that ``unit`` runs now; return the unit expected to run next (to prefetch), if known."""
        if self.phase is not Phase.FORWARD:
            return None
        k = len(self._recording)
        self._recording.append(unit)
        self._on_track = self._on_track and k < len(self._order) and self._order[k] is unit
        if self.prefetch and self._on_track and k + 1 < len(self._order):
            return self._order[k + 1]
        return None

    def end_forward(self, grad_enabled: bool) -> None:
        if self.phase is not Phase.FORWARD:
            return
        self._order = self._recording
        self._last_index = {id(u): i for i, u in enumerate(self._order)}
        self._recording = []
        self.phase = Phase.IDLE
        if self.checker is not None:
            self.checker.end_phase()
        if not grad_enabled:
            for u in self.units:  # a prefetched unit that did not run must not stay gathered
                if not u.frames:
                    u.reshard()

    def abandon_forward(self) -> None:
        """The top-level forward raised: its graph is gone, so no backward will come for what it ran."""
        self._recording = []
        self.phase = Phase.IDLE
        if self.checker is not None:
            self.checker.end_phase()
        for u in self.units:
            if not u.frames:
                u.owed_backwards = 0
                u.drop_backward_views()
                try:
                    u.reshard()
                except ShardwiseError:
                    pass  # a prefetch that cannot finish (the process group failed): the forward's error says why

    def previous_in_forward(self, unit: Unit) -> Optional[Unit]:
        if not self.prefetch:
            return None
        i = self._last_index.get(id(unit))
        return self._order[i - 1] if i else None

    # ---- backward ---------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            call_after_backward(self.end_backward)  # once, after the last node of this backward pass
            if self.checker is not None:
                self.checker.begin_phase("backward")

    def make_room_for_reduction(self) -> None:
        """Finish the oldest reductions until one more may start: called before its flat is allocated."""
        while len(self._pending) >= self.MAX_PENDING_REDUCES:
            reduction.finish(self._pending.popleft())

    def add_pending(self, pending: Reduction) -> None:
        self._pending.append(pending)
        while len(self._pending) > self.MAX_PENDING_REDUCES:
            reduction.finish(self._pending.popleft())

    def finish_pending(self) -> None:
        while self._pending:
            reduction.finish(self._pending.popleft())

    def end_backward(self) -> None:
        self.finish_pending()
        if self.require_grad_sync:
            # A unit that ran in an earlier no_sync micro-batch but not in this one still holds its
            # accumulated gradient: reduce it now, in unit order (the same on every rank).
            for u in self.units:
                for g in u.flat_groups:
                    if g.has_unsynced_grad():
                        self.make_room_for_reduction()
                        self.add_pending(g.reduce_grads([None] * len(g.plan.params), sync=True))
            self.finish_pending()
            # ZeRO-1/2: the optimizer step that follows a synced backward changes the shards; refill the kept
            # parameters at the next unshard (also caught by an optimizer-step hook, but not every
            # optimizer is a torch.optim.Optimizer).
            self.shards_written()
        if self.transfers is not None:
            self.transfers.end_backward()  # every offloaded gradient on the host and handed out
        # Before backward returns, so no optimizer sees a gradient of a parameter no rank used (grad_usage.py).
        usage = self._agree_usage() if self.require_grad_sync else {}
        if self.checker is not None:
            self.checker.end_phase()
        for g in self.flat_groups():
            # Drops the gradients of parameters no rank used; (the surface's sink: then the gradients that
            # reached a parameter directly, a penalty).
            g.sink.end_backward(g, usage.get(id(g)))
        for u in self.units:
            u.owed_backwards = 0
            u.backward_views = None
            if not u.frames:
                u.bind_sharded()
                u.reshard()
        self.phase = Phase.IDLE

    def _agree_usage(self) -> dict[int, list[bool]]:
        """id(group) -> which of its parameters any rank's reductions gave a gradient since the last synced
        backward, for every group that reduced; every trainable group's marks travel, so the exchange has
        the same size on every rank whatever ran (grad_usage.py: agreed, on the control group)."""
        groups = [g for g in self.flat_groups() if g.plan.requires_grad]
        marks, reduced = [], {}
        for g in groups:
            used, g.used_this_backward = g.used_this_backward, None
            marks += used if used is not None else [False] * len(g.plan.params)
            if used is not None:
                reduced[id(g)] = used
        if self.pgs.data_parallel_size == 1:
            return reduced
        agreed = grad_usage.agree(marks, self.checker)
        at = 0
        for g in groups:
            n = len(g.plan.params)
            if id(g) in reduced:
                reduced[id(g)] = agreed[at:at + n]
            at += n
        return reduced

    # [Note: one path decides the shards were written] ZeRO-1/2 keep each unit's gathered parameters
    # across steps, so the kept copy goes stale whenever a shard is written: an optimizer step, a load
    # (state dict, checkpoint, load_pretrained), summon_full_params' writeback, user code writing through
    # the parameters. Refilling is an all-gather, so the verdict must be the same on every rank of the shard
    # group, or one rank gathers while another does not. So the verdict has one source, taken on the
    # training thread at every top-level entry: each rank's view from host state (``kept_copy_stale``:
    # writers' signals and version counters; never the values, which would be a host-device sync every
    # step) goes into the forward's start exchange, and the OR over the ranks sets ``refresh_due``. A
    # writer on another thread (the offload worker's optimizer steps) only raises a signal, read at the next
    # entry: whether a unit re-gathers never depends on when a thread ran.
    def agree_kept_copies(self) -> None:
        """The verdict for a unit entered on its own, outside a root forward (one exchange)."""
        if not self._has_kept:
            return
        mine = self._kept_stale_flag()
        if self.checker is not None:
            agreed = self.checker.check_now("kept_copy_agreement", 0, flags_=mine)
        else:
            agreed = self._or_over_ranks(mine)
        self._refresh_kept(agreed)

    @property
    def _has_kept(self) -> bool:
        return any(g.keep_gathered for g in self.flat_groups())

    def _kept_stale_flag(self) -> int:
        return KEPT_STALE if any(g.kept_copy_stale() for g in self.flat_groups()) else 0

    def _refresh_kept(self, agreed: int) -> None:
        if agreed & KEPT_STALE:
            for g in self.flat_groups():
                if g.keep_gathered:
                    g.refresh_due = True

    def _or_over_ranks(self, mine: int) -> int:
        """The OR of every rank's ``mine`` (collectives unchecked: no exchange carries it)."""
        if self.pgs.data_parallel_size == 1:
            return mine
        bits = torch.tensor([mine & KEPT_STALE, mine & BUFFERS_CHANGED], dtype=torch.int64)
        collectives.run_and_wait(dist.all_reduce, bits, op=dist.ReduceOp.MAX, group=control_group(),
                                 what="the agreement on kept copies and buffers")
        return sum(bits.tolist())

    def shards_written(self) -> None:
        """The shards were (or are about to be) written: gathered parameters kept across steps (ZeRO-1/2) are
        refilled at the next top-level entry. Called on every rank alike (loads, end of a synced backward)."""
        for g in self.flat_groups():
            g.written = True

    def settle(self) -> None:
        """Between steps: recover if the last forward or backward raised (see [Note: recovery]); free what a
        forward without its backward left gathered; follow a dtype conversion of the model, refuse other
        changes to its parameters (Unit.check_intact)."""
        stale = self.phase is Phase.BACKWARD or any(
            u.backward_views is not None or any(f.kind is not FrameKind.SUMMON for f in u.frames) for u in self.units)
        if stale:
            self.recover()
        for u in self.units:
            # A forward whose graph was dropped (no backward came) left units gathered for that backward (the
            # root; every unit under shard_grad_op); the shards may have been written since: free them, so the
            # next entry gathers again. (If that backward does come, its pre-backward hook gathers them.)
            if not u.frames and u.backward_views is None:
                u.reshard()
            if not u.params_bound():  # (bound: inside summon_full_params)
                u.check_intact()

    def recover(self) -> None:
        while self._pending:
            reduction.finish(self._pending.popleft(), discard=True)
        for g in self.flat_groups():
            g.used_this_backward = None
            g.sink.recover(g)
        if self.transfers is not None:
            self.transfers.recover()
        for u in self.units:
            u.reset()
        self.phase = Phase.IDLE
        if self.checker is not None:
            self.checker.end_phase()

    # ---- invariants -------------------------------------------------------------------------------
    def invariant_violations(self) -> list[str]:
        """What is not as it must be between steps (after a backward): the test harness asserts none."""
        problems = []
        if self.phase is not Phase.IDLE:
            problems.append(f"runtime phase is {self.phase.value}, not idle")
        if self._pending:
            problems.append(f"{len(self._pending)} reductions still in flight")
        if self.transfers is not None:
            problems += self.transfers.violations()
        for u in self.units:
            if u.frames:
                problems.append(f"unit {u.label!r} has {len(u.frames)} entries still open")
            if u.backward_views is not None:
                problems.append(f"unit {u.label!r} still holds backward views")
            if u.owed_backwards:
                problems.append(f"unit {u.label!r} still owes {u.owed_backwards} backward(s)")
            for params, name, gi, pi in u._slots:
                g = u.flat_groups[gi]
                if params[name] is not g.shard_params[pi]:
                    problems.append(f"{g.plan.params[pi].fqn!r} is not bound to its shard parameter")
            for g in u.flat_groups:
                if g.keep_gathered:  # ZeRO-1/2: gathered (or not yet gathered), never half-way
                    held = g.gathered.untyped_storage().nbytes()
                    gathered = g.state is GatherState.GATHERED
                    if g.state not in (GatherState.SHARDED, GatherState.GATHERED) or gathered != bool(held):
                        problems.append(f"unit {u.label!r} ({g.plan.dtype}) kept gathered is {g.state.value} "
                                        f"with {held} bytes of gathered storage")
                elif not g.aliases_shard and g.state is not GatherState.SHARDED:
                    problems.append(f"unit {u.label!r} ({g.plan.dtype}) is still {g.state.value}")
                elif not g.aliases_shard and g.gathered.untyped_storage().nbytes():
                    problems.append(f"unit {u.label!r} ({g.plan.dtype}) is sharded but holds "
                                    f"{g.gathered.untyped_storage().nbytes()} bytes of gathered storage")
                if self.require_grad_sync and g.has_unsynced_grad():
                    problems.append(f"unit {u.label!r} ({g.plan.dtype}) holds an unreduced gradient")
                bad = g.changed_param()
                if bad is not None:
                    problems.append(f"{g.plan.params[bad].fqn!r} is no longer a view of its flat shard")
        return problems


# The attribute shard() sets on every submodule of a sharded model, so runtime_of(any submodule) finds the
# runtime (summon_full_params(model.encoder), load_pretrained, checkpoints).
STATE_ATTR = "_shardwise"


def runtime_of(model: nn.Module) -> ModelRuntime:
    """The runtime of the sharded model that ``model`` is (or is a submodule of)."""
    rt = getattr(model, STATE_ATTR, None)
    if rt is None:
        raise ShardwiseError(f"{type(model).__name__} is not sharded: call shardwise.shard(model, ...) first")
    return rt


def _phase_reader(runtime_ref) -> Callable[[], str]:
    """The runtime's phase, or ``"idle"`` once it is gone."""
    def phase() -> str:
        runtime = runtime_ref()
        return runtime.phase.value if runtime is not None else "idle"
    return phase
