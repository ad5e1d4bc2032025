"""One flat group's memory: the persistent shard, the transient gathered buffer, and gradient reduction.

Buffer lifetimes (N = shard group size, P = padded numel of the group)::

    shard      P/N elements, master dtype, lives as long as the model (a new one when a dtype conversion
               is followed). Each parameter's piece of it is a plain 1-D view (``aliases``), which the
               user-facing parameter holds (seams.py), so the optimizer updates the shard in place and
               the next all-gather reads the updated values with no copy-in.
    gathered   P elements, compute dtype. Allocated by unshard (storage resized up), filled by one
               all-gather, freed by reshard (storage resized to 0). Module parameters are views of it
               (no copy-out). The storage object itself survives, so tensors autograd saved in forward
               point at valid memory again once backward re-gathers into it. ZeRO-1/2
               (``keep_gathered``): never freed; refilled by the first unshard after the ranks agreed
               the shards changed (an optimizer step, a synced backward, a load: see ``refresh_due``).
    grad flat  P elements, reduce dtype. Packed from the unit's gradients in backward, consumed by one
               reduce-scatter, freed when that finishes.
    grad shard P/N elements. The reduce-scatter output (reduction.py); the sink makes each parameter's
               ``.grad`` a view of it.
               ZeRO-1 (``all_reduce_grads``): the whole all-reduced gradient (P) stays alive behind these
               views, as ZeRO-1 keeps full gradients, until the ``.grad`` are dropped.
"""

from __future__ import annotations

import enum
import warnings
import weakref
from typing import Optional, Sequence

import torch
import torch.nn as nn

from shardwise.engine.base import collectives
from shardwise.engine.base.cpu_offload import CPUOffload
from shardwise.engine.base.mixed_precision import MixedPrecision
from shardwise.engine.base.plan import FlatGroupPlan
from shardwise.engine.base.strategy import ProcessGroups, Strategy
from shardwise.engine.checks.fingerprint import CollectiveChecker
from shardwise.engine.core import grad_usage, reduction
from shardwise.engine.base.torch_internals import resize_storage, version_counter
from shardwise.engine.core.seams import GradSink, ParamFactory
from shardwise.errors import ShardwiseError


class GatherState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather issued, not yet waited on
    GATHERED = "gathered"
    FAILED = "failed"  # the all-gather's wait raised before it completed: the buffer is never freed or reused


class FlatGroup:
    def __init__(
        self,
        plan: FlatGroupPlan,
        groups: ProcessGroups,
        device: torch.device,
        mixed_precision: MixedPrecision,
        offload: Optional[CPUOffload],
        strategy: Strategy,
        *,
        factory: Optional[ParamFactory] = None,
        sink: Optional[GradSink] = None,
        transfers=None,
        checker: Optional[CollectiveChecker] = None,
        ids: tuple[int, int] = (0, 0),
    ):
        self.plan = plan
        self.strategy = strategy
        self.all_reduce_grads = strategy.all_reduces_grads and groups.shard is not None  # ZeRO-1
        self.pgs = groups  # the process groups it shards and replicates over
        self.device = device
        self.offload = offload
        self.transfers = transfers  # offload_transfers.OffloadTransfers of the model under CPU offload
        self.mixed_precision = mixed_precision
        # The user-facing parameters come from the factory, and their gradients go to the sink (seams.py).
        self.factory = factory if factory is not None else ParamFactory()
        self.sink = sink if sink is not None else GradSink(transfers)
        self.checker = checker  # fingerprint.CollectiveChecker of the model, when collectives are checked
        self.ids = ids  # (unit index, group index within the unit)
        self.unit = None  # the core.unit.Unit this group belongs to (set by the Unit)
        start, end = plan.shard_range(groups.shard_rank)
        self.shard_start = start
        self.local_slices: list[tuple[int, int, int]] = []  # per param: (lo, hi) in the param, offset in shard
        for spec in plan.params:
            lo, hi = spec.local_range(start, end)
            self.local_slices.append((lo, hi, spec.offset + lo - start if hi > lo else 0))
        # The autograd input of this group's UnshardParams (unit.py): an empty leaf that needs a gradient.
        self.grad_anchor = torch.empty(0, device=device, requires_grad=True)
        self.shard_params: list[nn.Parameter] = []  # the user-facing parameters (the factory's), in plan order
        self._allocate(plan.dtype, [None] * len(plan.params))
        self._gather_work = None
        self._gather_src: Optional[torch.Tensor] = None  # keeps a cast/moved shard alive during the collective
        self._unsynced_grad: Optional[torch.Tensor] = None  # no_sync accumulation, unsharded, reduce dtype
        self._unsynced_used: Optional[list[bool]] = None  # which parameters it holds a gradient of (grad_usage.py)
        # Which parameters this rank's reductions handed out a gradient of since the last synced backward ended:
        # recorded by reduction.finish, agreed across ranks by ModelRuntime.end_backward (grad_usage.py).
        self.used_this_backward: Optional[list[bool]] = None
        self._warned_frozen = False

    def _allocate(self, dtype: torch.dtype, values: list[Optional[torch.Tensor]]) -> None:
        """(Re)build the shard in master ``dtype`` and the gathered buffer in its compute dtype; each shard
        parameter becomes its view of the new shard, holding ``values[i]`` (or zeros)."""
        plan = self.plan
        plan.dtype = dtype
        for spec in plan.params:
            spec.dtype = dtype
        self.param_dtype = self.mixed_precision.compute_dtype(dtype)
        self.reduce_dtype = self.mixed_precision.grad_reduce_dtype(dtype)
        if self.offload is not None:
            self.shard = self.offload.allocate(plan.shard_numel, dtype, self.device)
        else:
            self.shard = torch.empty(plan.shard_numel, dtype=dtype, device=self.device)
        self.shard.zero_()  # padding stays zero forever: checksums and exports are deterministic
        # The core's own handle on each parameter: a plain 1-D view of the shard (this rank's piece). The
        # user-facing parameter must keep holding it: a conversion after shard() (model.half(), p.data = ...)
        # moves its data, and forward would silently keep computing with the flat shard (see changed_param).
        self.aliases = [self.shard.narrow(0, at, hi - lo) for lo, hi, at in self.local_slices]
        for alias, value in zip(self.aliases, values):
            if value is not None:
                alias.copy_(value)
        if not self.shard_params:
            self.shard_params = [self.factory.make(self, i, alias, spec.requires_grad)
                                 for i, (alias, spec) in enumerate(zip(self.aliases, plan.params))]
        else:
            for p, alias in zip(self.shard_params, self.aliases):
                self.factory.rehome(p, alias)

        # With one rank per shard group, no cast and no offload, the "gathered" buffer *is* the shard:
        # nothing to communicate and nothing to free (no_shard / DDP).
        self.aliases_shard = gathered_aliases_shard(self.pgs.shard_size, dtype, self.param_dtype,
                                                    offloaded=self.offload is not None)
        if self.aliases_shard:
            self.gathered = self.shard
            self.state = GatherState.GATHERED
        else:
            self.gathered = torch.empty(plan.padded_numel, dtype=self.param_dtype, device=self.device)
            # Collectives write through a second tensor on the same storage: it has its own version
            # counter, so refilling the buffer in backward does not trip autograd's check that saved
            # tensors (views of `gathered`) were not modified in place.
            self.state = GatherState.SHARDED
            self._make_gathered_alias()
        # ZeRO-1/2 keep the gathered buffer across steps (nothing to keep when it is the shard itself).
        self.keep_gathered = self.strategy.keeps_params_gathered and not self.aliases_shard
        # ZeRO-1/2: the kept gathered buffer must be refilled at its next unshard. Set only where every rank
        # sets it alike (ModelRuntime.agree_kept_copies, on the training thread), never mid-step.
        self.refresh_due = True
        self.written = False  # a signal, from any thread: something wrote the shards (an optimizer step, a load)
        self._gathered_version: Optional[tuple] = None  # shard_version() when the kept buffer was filled
        if self.keep_gathered:
            _KEPT_GATHERED.add(self)

    def shard_version(self) -> tuple:
        """Changes whenever the shard is written in place (optimizer step, load, user code under no_grad)."""
        return (version_counter(self.shard),) + tuple(self.factory.version(p) for p in self.shard_params)

    def kept_copy_stale(self) -> bool:
        """ZeRO-1/2, this rank's view, from host state only (no look at the values: that would be a
        host-device sync every step): whether the kept gathered buffer may no longer hold the shards — a writer
        said so (``written``: optimizer steps, loads, summon's writeback, a synced backward) or the shards'
        version counters moved since it was filled (an in-place write through the parameters). Only
        ``ModelRuntime.agree_kept_copies`` asks, and it makes the verdict the same on every rank."""
        if not (self.keep_gathered and self.state is GatherState.GATHERED):
            return False
        return self.refresh_due or self.written or self.shard_version() != self._gathered_version

    def converted_dtype(self) -> Optional[torch.dtype]:
        """The floating dtype every shard parameter was converted to after shard() by ``model.to(dtype)``,
        ``.double()``, ``.half()`` (same device, same shape, new storage), or None if that is not what
        happened. Rank-independent: dtype, device and shape are the same on every rank."""
        converted = self._converted_values()
        return converted[0].dtype if converted else None

    def _converted_values(self) -> Optional[list[torch.Tensor]]:
        values = [self.factory.converted(p, alias) for p, alias in zip(self.shard_params, self.aliases)]
        if any(v is None for v in values) or len({v.dtype for v in values}) != 1:
            return None
        if not values[0].dtype.is_floating_point or not self.plan.dtype.is_floating_point:
            return None
        return values

    def adopt_conversion(self, dtype: torch.dtype) -> None:
        """Follow a whole-model dtype conversion made after shard() (as torch FSDP2 does): a new flat
        shard in ``dtype`` holding the converted values, the gathered buffer in the new compute dtype.
        Called at a step boundary (the group is sharded, or kept gathered, with no collective in flight)."""
        assert self.aliases_shard or self.state is GatherState.SHARDED or (
            self.keep_gathered and self.state is GatherState.GATHERED), self.state
        values = self._converted_values()
        assert values is not None and values[0].dtype == dtype, "adopt_conversion without a conversion"
        self._allocate(dtype, values)
        self.sink.convert(self, dtype)
        if self._unsynced_grad is not None:
            self._unsynced_grad = self._unsynced_grad.to(self.reduce_dtype)

    def _make_gathered_alias(self) -> None:
        """Collectives write through a second tensor on the gathered storage: it has its own version counter,
        so refilling the buffer in backward does not trip autograd's check that saved tensors (views of
        `gathered`) were not modified in place."""
        self.gathered_alias = torch.empty(0, dtype=self.param_dtype, device=self.device).set_(
            self.gathered.untyped_storage(), 0, (self.plan.padded_numel,), (1,))
        if self.state is not GatherState.GATHERED:
            resize_storage(self.gathered, 0)  # set_ grew the storage to fit: free it again

    def announce(self, op: str, numel: int) -> None:
        """A collective of this group is about to be issued: the ranks agree on it first (fingerprint.py)."""
        if self.checker is not None:
            self.checker.before_issue(op, *self.ids, numel)

    def _what(self, op: str) -> str:
        return f"{op} of unit {self.plan.unit_fqn or '<root>'!r} ({self.plan.dtype}, {self.plan.padded_numel} elements)"

    # ---- parameters -------------------------------------------------------------------------------
    def any_requires_grad(self) -> bool:
        """Read at every forward: parameters may be frozen or unfrozen after shard()."""
        return any(self.factory.requires_grad(p) for p in self.shard_params)

    def changed_param(self) -> Optional[int]:
        """Index of the first shard parameter whose data is no longer its piece of the flat shard, or None."""
        for i, (p, alias) in enumerate(zip(self.shard_params, self.aliases)):
            if not self.factory.is_intact(p, alias):
                return i
        return None

    def full_views(self) -> list[torch.Tensor]:
        """Fresh full-shape views of the gathered buffer, one per parameter (valid while gathered)."""
        g = self.gathered
        return [g.narrow(0, s.offset, s.numel).view(s.shape) for s in self.plan.params]

    def gather_full(self) -> torch.Tensor:
        """The whole group in its master dtype, in a new buffer on the compute device (padding included): for
        state dicts and summon_full_params. An offloaded shard is copied to the device for it (data groups
        move device tensors: device.py)."""
        shard = self.shard if self.shard.device == self.device else self.shard.to(self.device)
        if self.pgs.shard is None:
            return shard.clone() if shard is self.shard else shard
        full = torch.empty(self.plan.padded_numel, dtype=self.plan.dtype, device=self.device)
        self.announce("all_gather", self.plan.padded_numel)
        work = collectives.all_gather_into(full, shard, self.pgs.shard, async_op=True)
        collectives.wait(work, what=self._what("all_gather"), group=self.pgs.shard)
        return full

    # ---- unshard / reshard ------------------------------------------------------------------------
    def begin_unshard(self) -> None:
        if self.state is GatherState.FAILED:
            raise ShardwiseError(f"{self._what('all_gather')} failed earlier and never completed; the process "
                                 f"group is unusable from there on: restart the job")
        if self.state is GatherState.GATHERED and self.keep_gathered and self.refresh_due:
            self.state = GatherState.SHARDED  # ZeRO-1/2 after a step: refill the kept buffer
        if self.state is not GatherState.SHARDED:
            return
        resize_storage(self.gathered, self.plan.padded_numel * self.param_dtype.itemsize)
        src = self.shard
        if self.transfers is not None:
            src = self.transfers.shard_on_device(self)  # copied ahead on a side stream; waited here
        elif src.device != self.device:
            src = src.to(self.device, non_blocking=True)
        if src.dtype != self.param_dtype:
            src = src.to(self.param_dtype)
        if self.pgs.shard is None:
            self.gathered_alias.copy_(src)
        else:
            self.announce("all_gather", self.plan.padded_numel)
            self._gather_work = collectives.all_gather_into(self.gathered_alias, src, self.pgs.shard, async_op=True)
            self._gather_src = src
        self.state = GatherState.GATHERING
        if self.keep_gathered:
            self.refresh_due = self.written = False
            self._gathered_version = self.shard_version()

    def refill(self) -> None:
        """Gather the shards again into the gathered buffer, which stays allocated and bound: they were written
        while it was gathered (``Unit.refill_after_write``). Nothing to do where the buffer is the shard."""
        if self.aliases_shard:
            return
        self.wait_unshard()
        self.state = GatherState.SHARDED
        self.begin_unshard()
        self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state is GatherState.GATHERING:
            work = self._gather_work
            self._gather_work = self._gather_src = None
            try:
                collectives.wait(work, what=self._what("all_gather"), group=self.pgs.shard)
            except BaseException:
                # A stalled or mismatched all-gather may still write into the buffer: never free it, and
                # never wait on it a second time (a failed forward's always-called exit reshards).
                self.state = GatherState.GATHERED if work is None or work.is_completed() else GatherState.FAILED
                raise
            self.state = GatherState.GATHERED

    def reshard(self) -> None:
        if self.aliases_shard or self.state in (GatherState.SHARDED, GatherState.FAILED):
            return
        self.wait_unshard()  # never free memory a collective is still writing into
        if self.keep_gathered:
            return  # ZeRO-1/2: kept until the next step's first unshard refills it
        resize_storage(self.gathered, 0)
        self.state = GatherState.SHARDED

    # ---- gradients --------------------------------------------------------------------------------
    def reduce_grads(self, grads: Sequence[Optional[torch.Tensor]], sync: bool) -> Optional[reduction.Reduction]:
        """Pack this group's unsharded gradients and start their reduction (reduction.py), or keep them
        unreduced under no_sync."""
        if not self._warned_frozen and not all(self.factory.requires_grad(p) for p in self.shard_params):
            self._warned_frozen = True
            frozen = [s.fqn for s, p in zip(self.plan.params, self.shard_params) if not self.factory.requires_grad(p)]
            warnings.warn(
                f"shardwise: {len(frozen)} parameter(s) of unit {self.plan.unit_fqn or '<root>'!r} (first "
                f"{frozen[0]!r}) were frozen after shard() while others in their flat group still train: they "
                f"stay frozen and training is exact, but their zero gradients still travel in the unit's "
                f"reduce-scatter; set requires_grad before shardwise.shard() to save that traffic", stacklevel=2)
        flat = torch.empty(self.plan.padded_numel, dtype=self.reduce_dtype, device=self.device)
        used = [g is not None for g in grads]  # (None: no gradient reached that output: grad_usage.py)
        for spec, g in zip(self.plan.params, grads):
            dst = flat.narrow(0, spec.offset, spec.numel)
            if g is None:
                dst.zero_()  # parameter unused in this forward: it contributes zero
            elif g.layout != torch.strided:
                dst.copy_(g.to_dense().reshape(-1))  # nn.Embedding(sparse=True): reduced (and handed out) dense
            else:
                dst.copy_(g.reshape(-1))
        flat.narrow(0, self.plan.numel, self.plan.padded_numel - self.plan.numel).zero_()
        if self.has_unsynced_grad():
            flat.add_(self._unsynced_grad)
            used = grad_usage.either(used, self._unsynced_used)
            self._unsynced_grad = self._unsynced_used = None
        if not sync:
            self.sink.begin_unsynced(self)
            self._unsynced_grad, self._unsynced_used = flat, used
            self.sink.mark_unsynced(self, used)
            return None
        return reduction.start(self, flat, used)

    # [Note: the no_sync accumulator follows p.grad] Under no_sync the gradient accumulates unsharded,
    # here, not in ``p.grad``. Its lifetime follows the handles the user holds: each trainable shard
    # parameter gets a ``p.grad`` (zeros until the synced backward adds the reduced gradient to it) and the
    # accumulator lives only while every one of those is still the same tensor, unwritten. So
    # ``optimizer.zero_grad()`` (to None, or zeroed in place), ``p.grad = None`` or any write to the
    # gradients drops the accumulated micro-batches, as in plain torch and DDP. The sink hands the
    # ``p.grad`` out and knows whether they are still held (``GradSink.mark_unsynced`` / ``unsynced_held``).
    def has_unsynced_grad(self) -> bool:
        if self._unsynced_grad is not None and not self.sink.unsynced_held(self):
            self._unsynced_grad = self._unsynced_used = None  # the user dropped or rewrote the gradients it belonged to
        return self._unsynced_grad is not None


# ZeRO-1/2 groups alive in this process: an optimizer step makes their gathered buffers stale.
_KEPT_GATHERED: "weakref.WeakSet[FlatGroup]" = weakref.WeakSet()


def mark_kept_copies_stale() -> None:
    """Any ``torch.optim.Optimizer`` step (the process-wide step post-hook, installed with the pre-hook in
    surface/optimizer_guard.py) signals every kept gathered buffer as written. Only a signal: it may come from
    the offload worker thread in the middle of a backward, so whether a buffer is refilled is decided by the
    ranks together at the next top-level entry (ModelRuntime.agree_kept_copies), never here."""
    for g in list(_KEPT_GATHERED):
        g.written = True


def gathered_aliases_shard(shard_size: int, master_dtype: torch.dtype, compute_dtype: torch.dtype,
                           offloaded: bool) -> bool:
    """Whether a flat group's gathered buffer *is* its shard (no second copy, nothing gathered or freed):
    one rank per shard group, no cast to a compute dtype, and the shard on the compute device. The memory
    planner asks the same question."""
    return shard_size == 1 and compute_dtype == master_dtype and not offloaded
