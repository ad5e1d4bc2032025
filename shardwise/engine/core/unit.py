"""The per-step runtime: hooks that unshard a unit before its code runs, reshard it after, prefetch the next
unit, and reduce-scatter gradients the moment a unit's backward is done.

Order of events for one unit under full_shard (forward order recorded on the previous step)::

    enter (pre-forward)   all-gather (or wait for the prefetched one) -> start next unit's all-gather -> bind views
    exit (post-forward)   bind shards back -> free gathered buffer -> hook the outputs for backward
    pre-backward          (first gradient reaching an output) re-gather -> start previous unit's all-gather
                          -> bind views again (any recompute now sees full parameters)
    post-backward         (UnshardParams.backward: every parameter's gradient is ready) pack + reduce-scatter
                          (async) -> bind shards -> free gathered buffer
    end of backward       wait all reduce-scatters -> grads land in .grad of the shard parameters

[Note: gathered parameters are autograd outputs] Module parameters during forward are the outputs of
``UnshardParams`` (one per flat group, its autograd input an empty anchor leaf). Autograd therefore calls
its backward exactly once per forward, after the last use of any of the group's parameters, handing over all of their gradients
together: that is the post-backward hook, with no per-parameter hooks and no guessing. It is also how a
backward is noticed from inside autograd whatever the model returns (a dataclass, a custom object): the
first ``UnshardParams.backward`` of a pass queues the end-of-backward callback if no output hook did.

[Note: entries] A unit's parameters are needed whenever code that uses them runs, not only in the unit's
own forward: ``generate()`` of an encoder-decoder calls the encoder alone, ``model.head(x)`` calls a
module whose weight lives in the root unit, activation checkpointing (ours, ``torch.utils.checkpoint`` in
either mode, Hugging Face's, which checkpoints ``forward`` and so bypasses module hooks) re-runs a unit's
code inside backward. So every module that holds a unit's parameters (directly or below it) carries the
unit's entry hooks, and a call to any of them while the unit is not entered enters it. Entries nest as a
stack of frames per unit; the post-forward hook is registered with ``always_call`` so an exception in
forward (a caught OOM, the early stop of non-reentrant checkpointing) still pops its frame and rebinds.
Inside backward (the autograd engine is running) an entry is a *recompute*: it binds the unit's backward
views (one ``UnshardParams`` per unit per backward, so a reentrant recompute reduces once) and keeps the
unit gathered for its backward, which follows.
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING, Optional

import torch

from shardwise.errors import ShardwiseError
from shardwise.engine.core.flat_group import FlatGroup, GatherState
from shardwise.engine.base import collectives
from shardwise.engine.base.mixed_precision import cast_floating
from shardwise.engine.base.torch_internals import autograd_engine_running, storage_held_only_by
from shardwise.engine.base.nested import iter_tensors
from shardwise.engine.base.plan import UnitPlan
from shardwise.engine.core.copy_refusal import refuse_deepcopy, refuse_pickle

if TYPE_CHECKING:
    from shardwise.engine.core.runtime import ModelRuntime


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class BackwardTicket:
    """One forward of a unit whose backward is still owed: counts the trainable groups not yet reduced."""

    __slots__ = ("unit", "remaining", "versions")

    def __init__(self, unit: "Unit", remaining: int, versions: list):
        self.unit, self.remaining = unit, remaining
        # Each trainable group's shard_version() when its views were made: a backward through views whose
        # shards were written in place since (optimizer.step() between forward and backward) is refused, as
        # torch refuses a backward through a tensor modified in place after it was saved.
        self.versions = versions


class UnshardParams(torch.autograd.Function):
    """Identity from a unit's shards to full-shape views of the gathered buffer; see the Note above.

    Its one autograd input is the group's ``grad_anchor`` (an empty leaf), not the shard parameters: the
    gradients reach the shards through the reduce-scatter, and an autograd edge to each shard parameter
    would make the engine run its AccumulateGrad node (and the parameter's post-accumulate-grad hooks)
    with no gradient, before the real one is handed out."""

    @staticmethod
    def forward(ctx, group: FlatGroup, ticket: BackwardTicket, anchor: torch.Tensor, mark_frozen: bool = True):
        ctx.group, ctx.ticket = group, ticket
        ctx.set_materialize_grads(False)  # unused parameters arrive as None, not as zero tensors
        views = group.full_views()
        frozen = [v for v, p in zip(views, group.shard_params) if not group.factory.requires_grad(p)]
        if frozen and mark_frozen:  # frozen after shard(): no gradient is computed for it, none handed out
            ctx.mark_non_differentiable(*frozen)
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        ctx.ticket.unit.post_backward(ctx.group, grads, ctx.ticket)
        return None, None, None, None


class FrameKind(enum.Enum):
    FORWARD = "forward"  # a forward (or an entry through a submodule) outside backward
    RECOMPUTE = "recompute"  # code of the unit re-run inside backward (activation checkpointing)
    PASS = "pass"  # a submodule called while its unit's parameters are already bound: nothing to do
    SUMMON = "summon"  # summon_full_params: full master-dtype parameters bound for a block of user code


class UnitState(enum.Enum):
    """Where a unit is, one member per situation (as FSDP2's ``TrainingState``): read from what its modules
    are bound to and why (``Unit.state``: the innermost entry that bound views, else the backward's views,
    else the shards). The first four have the parameters bound to full-shape views."""

    FORWARD = "forward"  # an entry outside backward (its forward, or a module of it called alone): gathered views
    RECOMPUTE = "recompute"  # its code re-runs inside backward (activation checkpointing), on the backward views
    SUMMONED = "summoned"  # summon_full_params: full master-dtype parameters bound for a block of user code
    BACKWARD = "backward"  # its backward runs: views bound from the pre-backward hook until backward_done
    OWES_BACKWARD = "owes_backward"  # shards bound; a forward's backward is still owed (gathered or not: see
    #                                 reshard_after_exit)
    IDLE = "idle"  # shards bound, nothing owed: between steps (still gathered only where ZeRO-1/2 keep it)


PARAMS_BOUND = frozenset({UnitState.FORWARD, UnitState.RECOMPUTE, UnitState.SUMMONED, UnitState.BACKWARD})
_BOUND_BY = {FrameKind.FORWARD: UnitState.FORWARD, FrameKind.RECOMPUTE: UnitState.RECOMPUTE,
             FrameKind.SUMMON: UnitState.SUMMONED}  # (a PASS entry binds nothing)


def entry_kind(submodule: bool, in_backward: bool, params_bound: bool, entries_open: bool) -> FrameKind:
    """What an entry into a unit is (see [Note: entries]):

        submodule  params bound  in backward or entries open  ->  kind
        yes        yes           yes                              PASS (an outer binding serves it)
        otherwise, in backward                                    RECOMPUTE
        otherwise                                                 FORWARD
    """
    if submodule and params_bound and (in_backward or entries_open):
        return FrameKind.PASS
    return FrameKind.RECOMPUTE if in_backward else FrameKind.FORWARD


def reshard_after_exit(kind: FrameKind, failed: bool, grad_enabled: bool, outputs_hooked: bool,
                       owed_backwards: int, params_bound: bool, reshards_after_forward: bool) -> bool:
    """Whether a unit frees its gathered parameters when an entry of ``kind`` exits. ``params_bound``:
    after the exit's rebind (another entry, or the backward, still binds views); ``owed_backwards``: counting
    this forward's own; ``reshards_after_forward``: the strategy's choice (full_shard, not the root).

        kind              params bound  failed  grad  outputs hooked  ->  reshard
        PASS, RECOMPUTE   any           any     any   any                 no: it bound nothing / its backward is next
        FORWARD, SUMMON   yes           any     any   any                 no: an outer entry or the backward uses them
                          no            no      yes   yes                 reshards_after_forward (pre-backward
                                                                          gathers again)
                          no            otherwise                         owed_backwards == 0: nothing needs them
                                                                          this step; else an output autograd
                                                                          reaches without our hook would need
                                                                          them before we knew: kept for the backward
    """
    if kind in (FrameKind.PASS, FrameKind.RECOMPUTE) or params_bound:
        return False
    if not failed and grad_enabled and outputs_hooked:
        return reshards_after_forward
    return owed_backwards == 0


class Frame:
    """One entry into a unit still in progress."""

    __slots__ = ("kind", "views", "ticket", "inputs_signal_backward", "outer_exc", "top_level")

    def __init__(self, kind: FrameKind, outer_exc):
        self.kind = kind
        self.views: Optional[list] = None
        self.ticket: Optional[BackwardTicket] = None
        self.inputs_signal_backward = False  # a frozen unit's inputs carry its post-backward signal
        self.outer_exc = outer_exc  # the exception being handled around this call, if any (see exit)
        self.top_level = False  # the root forward that starts a step


class Unit:
    """Runtime state of one unit: its flat groups, its entry frames and its bindings."""

    # The first engine object copy.deepcopy(model) / torch.save(model) reach (through module hooks).
    __deepcopy__, __reduce_ex__ = refuse_deepcopy, refuse_pickle

    def __init__(self, plan: UnitPlan, groups: list[FlatGroup], runtime: "ModelRuntime"):
        self.plan = plan
        self.flat_groups = groups  # one per (dtype, requires_grad) of the unit's parameters
        for g in groups:
            g.unit = self
        self.runtime = runtime
        self.reshard_after_forward = runtime.strategy.reshard_after_forward and not plan.kept_after_forward
        self.owed_backwards = 0
        self.frames: list[Frame] = []
        self.backward_views: Optional[list] = None  # bound from pre-backward until post-backward
        # The forward (runtime.forward_count) whose backward released this unit early: see [Note: releasing a
        # unit in backward]; its backward's prefetch then skips it.
        self.released_after_forward: Optional[int] = None
        # The forward whose outputs carry this unit's pre-backward hook: only then is it prefetched in backward
        # (a frozen embedding's output needs no gradient: its backward never comes, a prefetch would hold it).
        self.hooked_in_forward: Optional[int] = None
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
        for g in self.flat_groups:
            g.begin_unshard()
        if wait:
            for g in self.flat_groups:
                g.wait_unshard()

    def reshard(self) -> None:
        for g in self.flat_groups:
            g.reshard()

    # ---- module attributes ------------------------------------------------------------------------
    def make_views(self, trainable: Optional[list[bool]] = None) -> tuple[list, Optional[BackwardTicket]]:
        """Full-shape views of every group; trainable groups' views are ``UnshardParams`` outputs under a
        new ticket when autograd records. Which groups are trainable is read now (requires_grad may have
        changed since shard()), and a parameter frozen now gets a view that needs no gradient; unless
        ``trainable`` says which groups are, and then every view of those needs one (``refill_after_write``)."""
        mark_frozen = trainable is None
        if trainable is None:
            trainable = [g.any_requires_grad() for g in self.flat_groups] if torch.is_grad_enabled() else None
        ticket = None
        if trainable is not None and any(trainable):
            versions = [g.shard_version() if rg else None for g, rg in zip(self.flat_groups, trainable)]
            ticket = BackwardTicket(self, sum(trainable), versions)
        views = []
        for g, rg in zip(self.flat_groups, trainable or [False] * len(self.flat_groups)):
            views.append(UnshardParams.apply(g, ticket, g.grad_anchor, mark_frozen) if rg else g.full_views())
        return views, ticket

    def bind(self, views: Optional[list]) -> None:
        """Bind ``views`` (one list per group) to every registration, or the shards when None."""
        if views is None:
            for params, name, gi, pi in self._slots:
                params[name] = self.flat_groups[gi].shard_params[pi]
        else:
            for params, name, gi, pi in self._slots:
                params[name] = views[gi][pi]

    def bind_sharded(self) -> None:
        self.bind(None)

    def _binding(self) -> tuple[UnitState, Optional[list]]:
        """The unit's state and the views it binds (None: the shards): the innermost live entry's views,
        else the backward views, else the shards."""
        for f in reversed(self.frames):
            if f.views is not None:
                return _BOUND_BY[f.kind], f.views
        if self.backward_views is not None:
            return UnitState.BACKWARD, self.backward_views
        return (UnitState.OWES_BACKWARD if self.owed_backwards else UnitState.IDLE), None

    @property
    def state(self) -> UnitState:
        return self._binding()[0]

    def rebind(self) -> None:
        """Bind what the unit's state needs (``_binding``)."""
        self.bind(self._binding()[1])

    def params_bound(self) -> bool:
        return self.state in PARAMS_BOUND

    def check_intact(self) -> None:
        """Shard parameters must still be the views of the flat shard that shard() made them. A dtype
        conversion of whole groups (``model.half()``, ``.to(dtype)``, ``.double()``) is followed: the group
        moves to a new flat shard. Anything else (``p.data = ...``, ``.to(device)``, a replaced parameter)
        would leave forward computing with the old values while the optimizer updates the new ones: refused."""
        for params, name, gi, pi in self._slots:
            g = self.flat_groups[gi]
            p = g.shard_params[pi]
            if params.get(name) is not p:  # replaced, or moved (parametrize, weight_norm, prune move it)
                raise ShardwiseError(
                    f"parameter {g.plan.params[pi].fqn!r} of unit {self.label!r} was "
                    f"{'replaced' if name in params else 'removed from its module'} after shardwise.shard() "
                    f"(torch.nn.utils.parametrize, weight_norm, spectral_norm and prune do this, and "
                    f"torch.func.functional_call given tensors other than the model's own parameters); apply them "
                    f"and other changes of parameters before shard(), or load values with "
                    f"shardwise.load_full_state_dict / shardwise.summon_full_params(writeback=True)")
        for g in self.flat_groups:
            bad = g.changed_param()
            if bad is None:
                continue
            dtype = g.converted_dtype()
            if dtype is not None:
                g.adopt_conversion(dtype)  # model.to(dtype) / .double() / .half(): follow it, as FSDP2 does
                continue
            raise ShardwiseError(
                f"parameter {g.plan.params[bad].fqn!r} of unit {self.label!r} was changed after "
                f"shardwise.shard() ({g.factory.describe(g.shard_params[bad])}; its shard is "
                f"{g.plan.dtype} on {g.shard.device}): assigning p.data, converting only some parameters and "
                f".to(device) are not supported on a sharded model; do them before shard(), load values with "
                f"shardwise.load_full_state_dict or shardwise.summon_full_params(writeback=True)")

    # ---- entries (see [Note: entries]) --------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        return self.enter(args, kwargs, submodule=False)

    def pre_submodule(self, module, args, kwargs):
        return self.enter(args, kwargs, submodule=True)

    def enter(self, args, kwargs, submodule: bool):
        m = self.runtime
        in_backward = autograd_engine_running()
        kind = entry_kind(submodule, in_backward, self.params_bound(), bool(self.frames))
        if kind is FrameKind.PASS:
            self.frames.append(Frame(FrameKind.PASS, sys.exc_info()[1]))
            return None
        frame = Frame(kind, sys.exc_info()[1])
        if self.plan.is_root and not in_backward and not any(f.kind is FrameKind.FORWARD for f in self.frames):
            frame.top_level = True
            try:
                m.begin_forward()  # may recover from a failed step, which clears every unit's frames
            except BaseException:
                self.frames.append(Frame(FrameKind.PASS, frame.outer_exc))  # for the always-called exit
                raise
        self.frames.append(frame)  # before anything else can fail: the always-called exit pops it
        if not frame.top_level and not in_backward and m.phase is not Phase.FORWARD and not self.frames[:-1]:
            m.agree_kept_copies()  # a unit entered on its own, outside a root forward (see runtime.py)
        if not self.params_bound() and m.phase is not Phase.FORWARD:
            self.check_intact()  # inside the root's forward, settle() checked every unit already
        if in_backward:
            m.begin_backward()
            self.unshard(wait=True)
            self.bind_backward_views()
            frame.views = self.backward_views
        else:
            nxt = m.record_and_next(self)
            self.unshard(wait=False)
            if nxt is not None:
                nxt.unshard(wait=False)  # issued now, waited on at its own entry: overlaps our compute
            self.unshard(wait=True)
            frame.views, frame.ticket = self.make_views()
            self.bind(frame.views)
        mp = m.mixed_precision
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = cast_floating(args, mp.param_dtype), cast_floating(kwargs, mp.param_dtype)
        if frame.kind is FrameKind.FORWARD and frame.ticket is None and torch.is_grad_enabled():
            frame.inputs_signal_backward = self._signal_when_input_grads_ready(args, kwargs)
        return args, kwargs

    def refill_after_write(self) -> None:  # (called through refill_units_stepped)
        """An optimizer step wrote the shards while an entry binds this unit's gathered parameters (a method
        registered with ``register_forward_method`` that steps inside, as Lightning's manual optimisation does
        in ``training_step``): gather them again and bind new views under a new ticket, so the code after the
        step computes with the new values, as a module's parameters do in one process. Graphs recorded before
        the step keep the old ticket, and their backward is refused (``_refuse_written_since_forward``), as
        torch refuses a backward through a parameter modified in place."""
        frame = next((f for f in reversed(self.frames) if f.views is not None), None)
        if frame is None or frame.kind is not FrameKind.FORWARD:
            return
        for g in self.flat_groups:
            g.refill()
        # The groups that were trainable at the entry stay so, every parameter with a view that needs a
        # gradient: code after the step may unfreeze what was frozen at the step (Lightning's toggle_optimizer
        # around a GAN's two steps), and a frozen parameter's gradient is never handed out
        # (GradSink.accumulate reads requires_grad then).
        trainable = ([v is not None for v in frame.ticket.versions] if frame.ticket is not None
                     else [False] * len(self.flat_groups))  # (entered without autograd: views without)
        frame.views, frame.ticket = self.make_views(trainable)
        self.rebind()

    def _signal_when_input_grads_ready(self, args, kwargs) -> bool:
        """Frozen unit: call ``backward_done`` once the gradients w.r.t. its inputs are computed."""
        needing = list({id(t): t for t in iter_tensors((args, kwargs)) if t.requires_grad}.values())
        if not needing:
            return False  # no gradient flows through this unit: backward never re-gathers it
        torch.autograd.graph.register_multi_grad_hook(needing, lambda grads: self.backward_done(), mode="all")
        return True

    def post_forward(self, module, args, kwargs, output):
        """Registered with ``always_call``: runs after a forward that raised, too (then ``sys.exc_info()``
        holds a different exception than it did at entry)."""
        if not self.frames:
            return None  # recovered in between: nothing of this entry is left
        frame = self.frames.pop()
        failed = sys.exc_info()[1] is not frame.outer_exc
        if frame.kind is FrameKind.PASS:
            return None
        m = self.runtime
        self.rebind()
        grad_enabled, outputs_hooked = torch.is_grad_enabled(), False
        if frame.kind is not FrameKind.RECOMPUTE and not failed and grad_enabled:
            if frame.ticket is not None or frame.inputs_signal_backward:
                self.owed_backwards += 1  # backward_done will say when this forward's backward is over
            # Outputs that need a gradient: the unit's backward will run (a frozen unit too, when gradients
            # pass through it or through units inside it, e.g. a frozen root around trainable blocks).
            outputs_hooked = self._hook_outputs(output)
            if outputs_hooked:
                self.hooked_in_forward = m.forward_count
        if reshard_after_exit(frame.kind, failed, grad_enabled, outputs_hooked, self.owed_backwards,
                              self.params_bound(), self.reshard_after_forward):
            self.reshard()
        if frame.top_level:
            if failed:
                m.abandon_forward()
            else:
                m.end_forward(torch.is_grad_enabled())
        return None

    def _hook_outputs(self, output) -> bool:
        """Register the pre-backward hook on every output tensor whose gradient flows back into the unit;
        False if none. An output that requires grad but has no ``grad_fn`` is a leaf of the graph (peft's
        ``enable_input_require_grads`` makes the input embedding's output one): its gradient stops there, so
        nothing in backward reads this unit's parameters through it."""
        hooked = False
        for t in iter_tensors(output):
            if t.requires_grad and t.grad_fn is not None:
                t.register_hook(self._pre_backward_hook)
                hooked = True
        return hooked

    # ---- backward ---------------------------------------------------------------------------------
    def bind_backward_views(self) -> None:
        """Views for this unit's backward, made once per backward with autograd recording, so a reentrant
        recompute's graph reaches ``UnshardParams`` (a non-reentrant one's never runs: no harm)."""
        if self.backward_views is None:
            with torch.enable_grad():
                self.backward_views, _ = self.make_views()
        if not any(f.views is not None for f in self.frames):
            self.bind(self.backward_views)

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        m = self.runtime
        _refuse_double_backward(self.label)
        m.begin_backward()
        self._release_unread_units()
        self.unshard(wait=False)
        prev = m.previous_in_forward(self)
        if prev is not None and prev.released_after_forward != m.forward_count \
                and prev.hooked_in_forward == m.forward_count:
            prev.unshard(wait=False)
        self.unshard(wait=True)
        self.bind_backward_views()
        return None

    def post_backward(self, group: FlatGroup, grads, ticket: BackwardTicket) -> None:
        m = self.runtime
        _refuse_double_backward(self.label)
        _refuse_written_since_forward(group, ticket.versions[self.flat_groups.index(group)], self.label)
        m.begin_backward()
        self._release_unread_units()
        final = self.owed_backwards <= 1  # no other forward of this unit still owes a backward
        ticket.remaining -= 1
        if ticket.remaining == 0:
            # Every gradient of the unit is computed, so nothing reads its parameters any more: free them
            # before the gradients are packed, not after (one gathered unit less at that moment).
            self.backward_done()
        m.make_room_for_reduction()  # the oldest flat freed before this one is allocated
        pending = group.reduce_grads(grads, sync=m.require_grad_sync)
        if pending is not None:
            pending.final = final
            m.add_pending(pending)

    # [Note: releasing a unit in backward] A unit's gathered parameters stay bound from its pre-backward until
    # its last gradient is computed. For a block both ends are close; not for the root of a GPT: its head runs
    # first in backward, its last gradient (the embeddings') comes last, and an embedding's backward reads only
    # the indices. Whether anything can still read the gathered memory is counted, not guessed: at every
    # backward event of the model (a pre-backward, a post-backward), a unit in its backward whose gathered
    # storage no tensor holds but the engine's own (the buffer, its collective alias, the bound backward
    # views, each held only by its Python object) is resharded and its modules bound to their shards, as
    # between forward and backward. Every node still to run that reads the parameters holds a saved tensor
    # on that storage, so a unit still needed is never freed; a recompute enters the unit, which gathers it
    # again; a stray reference (retain_graph, a view kept by user code) only keeps it gathered. Its remaining
    # gradients still reach UnshardParams and are reduced as usual. Code that reads a parameter by module
    # attribute in backward, outside an entry, sees its shard, as for any unit between forward and backward.
    # The references come from the graph and the program, so the ranks release alike, and so gather alike at a
    # later entry. Cost: two reference counts per group of each unit in its backward, per event.
    def _release_unread_units(self) -> None:
        for u in self.runtime.units:
            u._release_if_unread()

    def _release_if_unread(self) -> None:
        if self.frames or self.backward_views is None:
            return  # not in its backward, or an entry (a recompute) binds it now
        for g, views in zip(self.flat_groups, self.backward_views):
            if g.aliases_shard or g.keep_gathered or g.state is not GatherState.GATHERED:
                return  # nothing to free (no_shard), kept by the strategy (ZeRO-1/2), or a gather in flight
            if not storage_held_only_by(g.gathered, list(views)):
                return
        self.backward_views = None
        self.released_after_forward = self.runtime.forward_count
        self.rebind()  # its shards: nothing may keep a view of the memory freed next
        self.reshard()

    def backward_done(self) -> None:
        """One forward's backward is complete; free the parameters once no other forward still owes one."""
        self.owed_backwards -= 1
        if self.owed_backwards <= 0:
            self.owed_backwards = 0
            self.drop_backward_views()
            if not self.frames:
                self.reshard()

    def drop_backward_views(self) -> None:
        self.backward_views = None
        self.rebind()

    def reset(self) -> None:
        """Back to the state between steps: no entries (but summon_full_params blocks), nothing gathered."""
        self.frames[:] = [f for f in self.frames if f.kind is FrameKind.SUMMON]
        self.owed_backwards = 0
        self.drop_backward_views()
        self.reshard()


def _refuse_double_backward(label: str) -> None:
    # Gradients are computed under grad mode only for create_graph=True (double backward): the graph of the
    # gradient would hold views of buffers that this very backward frees.
    if torch.is_grad_enabled():
        raise ShardwiseError(
            f"backward with create_graph=True (double backward, e.g. a gradient penalty) reached unit "
            f"{label!r}: shardwise frees gathered parameters during backward and does not support it; "
            f"compute higher-order gradients outside the sharded model")


def _refuse_written_since_forward(group: FlatGroup, versions: tuple, label: str) -> None:
    now = group.shard_version()
    if now == versions:
        return
    changed = [i for i, (a, b) in enumerate(zip(versions[1:], now[1:])) if a != b]
    fqn = group.plan.params[changed[0] if changed else 0].fqn
    raise ShardwiseError(
        f"parameter {fqn!r} of unit {label!r} was modified in place after the forward this backward "
        f"differentiates (optimizer.step() or a write under torch.no_grad() before loss.backward()): the "
        f"backward would use the new values. Plain PyTorch raises 'one of the variables needed for gradient "
        f"computation has been modified by an inplace operation' here; call backward before changing parameters")


def refill_units_stepped(groups) -> None:
    """After an optimizer step wrote the shards of ``groups``: each of their units that an entry binds in a
    forward (a method registered with ``register_forward_method`` that steps inside, as Lightning's manual
    optimisation does in ``training_step``) gathers its new shards (``Unit.refill_after_write``), so the code
    after the step computes with the new values, as in one process. Every rank takes the same step at the
    same point, so every rank refills alike. Not inside a backward (an optimizer stepping in backward: the
    graph still running reads the gathered values it recorded) and not from a thread beside the training
    thread (the offload worker: no collective may start there)."""
    if autograd_engine_running() or not collectives.may_issue_here():
        return
    for unit in {id(g.unit): g.unit for g in groups if g.unit is not None}.values():
        if unit.params_bound():
            unit.refill_after_write()
