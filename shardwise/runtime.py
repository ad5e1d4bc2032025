"""The per-step runtime: module hooks that unshard before compute, reshard after, prefetch the next unit,
and reduce-scatter gradients the moment a unit's backward is done.

Order of events for one unit under full_shard (forward order recorded on the previous step)::

    pre-forward     all-gather (or wait for the prefetched one) -> start next unit's all-gather -> bind views
    post-forward    bind shards back -> free gathered buffer -> hook the outputs for backward
    pre-backward    (first gradient reaching an output) re-gather -> start previous unit's all-gather
    post-backward   (UnshardParams.backward: every parameter's gradient is ready) pack + reduce-scatter
                    (async) -> free gathered buffer
    end of backward wait all reduce-scatters -> grads land in .grad of the shard parameters

A unit with no trainable parameters (frozen) has no ``UnshardParams`` backward to tell it its backward is
done. If gradients flow through it to earlier units it is re-gathered in backward, so it gets another
signal: a multi-grad hook on its inputs, which fires once the gradients w.r.t. all of them exist, i.e.
after the unit's own backward. Without it a frozen middle block would stay gathered until the end of
backward.

[Note: gathered parameters are autograd outputs] Module parameters during forward are the outputs of
``UnshardParams``, whose inputs are the shard parameters. Autograd therefore calls its backward exactly
once per forward, after the last use of any of the unit's parameters, handing over all of their gradients
together: that is the post-backward hook, with no per-parameter hooks and no guessing.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Optional

import torch

from shardwise.flat_buffer import FlatGroup, PendingReduce
from shardwise.mixed_precision import MixedPrecision, cast_floating, iter_tensors
from shardwise.plan import UnitPlan
from shardwise.strategy import Groups, Strategy


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class BackwardTicket:
    """One forward of a unit whose backward is still owed: counts the trainable groups not yet reduced."""

    __slots__ = ("unit", "remaining")

    def __init__(self, unit: "Unit", remaining: int):
        self.unit, self.remaining = unit, remaining


class UnshardParams(torch.autograd.Function):
    """Identity from shard parameters to full-shape views of the gathered buffer; see the Note above."""

    @staticmethod
    def forward(ctx, group: FlatGroup, ticket: BackwardTicket, *shard_params: torch.Tensor):
        ctx.group, ctx.ticket = group, ticket
        ctx.set_materialize_grads(False)  # unused parameters arrive as None, not as zero tensors
        return tuple(group.full_views())

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        ctx.ticket.unit.post_backward(ctx.group, grads, ctx.ticket)
        return (None, None) + (None,) * len(grads)


class Unit:
    """Runtime state of one unit: its flat groups and the hooks on its module."""

    def __init__(self, plan: UnitPlan, groups: list[FlatGroup], model: "ModelRuntime"):
        self.plan = plan
        self.groups = groups
        self.model = model
        self.trainable = [g for g in groups if g.plan.requires_grad]
        self.reshard_after_forward = model.strategy.reshard_after_forward and not plan.is_root
        self.owed_backwards = 0
        # A stack (a unit may call itself): per running forward, its ticket and whether a frozen unit's
        # inputs carry the post-backward hook.
        self._tickets: list[tuple[Optional[BackwardTicket], bool]] = []
        # (params dict, name, group index, param index) for every registration of every parameter
        self._slots = [
            (ref.module._parameters, ref.name, gi, pi)
            for gi, g in enumerate(groups)
            for pi, spec in enumerate(g.plan.params)
            for ref in spec.refs
        ]

    @property
    def label(self) -> str:
        return self.plan.label

    # ---- memory -----------------------------------------------------------------------------------
    def unshard(self, wait: bool = True) -> None:
        for g in self.groups:
            g.begin_unshard()
        if wait:
            for g in self.groups:
                g.wait_unshard()

    def reshard(self) -> None:
        for g in self.groups:
            g.reshard()

    # ---- module attributes ------------------------------------------------------------------------
    def bind_full(self) -> Optional[BackwardTicket]:
        ticket = None
        if torch.is_grad_enabled() and self.trainable:
            ticket = BackwardTicket(self, len(self.trainable))
        views = []
        for g in self.groups:
            if ticket is not None and g.plan.requires_grad:
                views.append(UnshardParams.apply(g, ticket, *g.shard_params))
            else:
                views.append(g.full_views())
        for params, name, gi, pi in self._slots:
            params[name] = views[gi][pi]
        return ticket

    def bind_sharded(self) -> None:
        for params, name, gi, pi in self._slots:
            params[name] = self.groups[gi].shard_params[pi]

    # ---- hooks ------------------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        m = self.model
        if self.plan.is_root:
            m.begin_forward()
        nxt = m.record_and_next(self)
        self.unshard(wait=False)
        if nxt is not None:
            nxt.unshard(wait=False)  # issued now, waited on at its own pre-forward: overlaps our compute
        self.unshard(wait=True)
        ticket = self.bind_full()
        mp = m.mixed_precision
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = cast_floating(args, mp.param_dtype), cast_floating(kwargs, mp.param_dtype)
        hooked = False
        if ticket is None and torch.is_grad_enabled() and m.phase is not Phase.BACKWARD:
            hooked = self._signal_when_input_grads_ready(args, kwargs)
        self._tickets.append((ticket, hooked))
        return args, kwargs

    def _signal_when_input_grads_ready(self, args, kwargs) -> bool:
        """Frozen unit: call ``backward_done`` once the gradients w.r.t. its inputs are computed."""
        needing = list({id(t): t for t in iter_tensors((args, kwargs)) if t.requires_grad}.values())
        if not needing:
            return False  # no gradient flows through this unit: backward never re-gathers it
        torch.autograd.graph.register_multi_grad_hook(needing, lambda grads: self.backward_done(), mode="all")
        return True

    def post_forward(self, module, args, kwargs, output):
        ticket, input_grads_hooked = self._tickets.pop()
        grad_enabled = torch.is_grad_enabled()
        self.bind_sharded()
        m = self.model
        if m.phase is Phase.BACKWARD:
            pass  # activation-checkpoint recompute: its backward is next, keep the parameters gathered
        elif grad_enabled:
            if ticket is not None or input_grads_hooked:
                self.owed_backwards += 1
            for t in iter_tensors(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
            if self.reshard_after_forward:
                self.reshard()
        else:
            self.reshard()  # inference: nothing will need these parameters again this step
        if self.plan.is_root:
            m.end_forward(grad_enabled)
        return output

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        m = self.model
        m.begin_backward()
        self.unshard(wait=False)
        prev = m.previous_in_forward(self)
        if prev is not None:
            prev.unshard(wait=False)
        self.unshard(wait=True)
        return None

    def post_backward(self, group: FlatGroup, grads, ticket: BackwardTicket) -> None:
        m = self.model
        pending = group.reduce_grads(grads, sync=m.require_grad_sync)
        if pending is not None:
            m.add_pending(pending)
        ticket.remaining -= 1
        if ticket.remaining == 0:
            self.backward_done()

    def backward_done(self) -> None:
        """One forward's backward is complete; free the parameters once no other forward still owes one."""
        self.owed_backwards -= 1
        if self.owed_backwards <= 0:
            self.owed_backwards = 0
            self.reshard()


class ModelRuntime:
    """State shared by all units of one sharded model: phase, forward order, pending reductions."""

    MAX_PENDING_REDUCES = 2  # bounds the unsharded gradient buffers alive at once

    def __init__(self, strategy: Strategy, groups: Groups, mixed_precision: MixedPrecision, prefetch: bool):
        self.strategy = strategy
        self.groups = groups
        self.mixed_precision = mixed_precision
        self.prefetch = prefetch
        self.units: list[Unit] = []
        self.phase = Phase.IDLE
        self.require_grad_sync = True
        self._order: list[Unit] = []  # units in pre-forward order, from the last completed forward
        self._last_index: dict[int, int] = {}
        self._recording: list[Unit] = []
        self._on_track = False  # this forward so far matches the recorded order
        self._pending: deque[PendingReduce] = deque()

    # ---- forward order and prefetch ---------------------------------------------------------------
    def begin_forward(self) -> None:
        if self.phase is Phase.BACKWARD:
            return
        self.phase = Phase.FORWARD
        self._recording = []
        self._on_track = True

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
        if self.phase is Phase.BACKWARD:
            return
        self._order = self._recording
        self._last_index = {id(u): i for i, u in enumerate(self._order)}
        self._recording = []
        self.phase = Phase.IDLE
        if not grad_enabled:
            for u in self.units:  # a prefetched unit that did not run must not stay gathered
                u.reshard()

    def previous_in_forward(self, unit: Unit) -> Optional[Unit]:
        if not self.prefetch:
            return None
        i = self._last_index.get(id(unit))
        return self._order[i - 1] if i else None

    # ---- backward ---------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            # Runs once, after the last node of this backward pass, in the autograd engine.
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def add_pending(self, pending: PendingReduce) -> None:
        self._pending.append(pending)
        while len(self._pending) > self.MAX_PENDING_REDUCES:
            self._pending.popleft().finish()

    def finish_pending(self) -> None:
        while self._pending:
            self._pending.popleft().finish()

    def end_backward(self) -> None:
        self.finish_pending()
        for u in self.units:
            u.reshard()
            u.owed_backwards = 0
        self.phase = Phase.IDLE
