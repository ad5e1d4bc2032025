"""The two seams between the step and what user code sees: where parameters come from, where gradients go.

The core computes only on its own plain tensors: the flat ``shard``, the ``gathered`` buffer, and one plain
1-D *alias* per parameter (``FlatGroup.aliases[i]``, a view of the shard: this rank's piece). The objects
user code holds (``model.parameters()``, the optimizer's params, ``p.grad``) are made and read above it,
through two objects ``shard()`` hands every ``FlatGroup``:

``ParamFactory`` (one per model): makes each user-facing parameter and answers the core's questions
about it. The core binds the object into modules and compares it by identity, and asks nothing else:

    make(group, index, alias, requires_grad)   the user-facing parameter of piece ``alias``
    rehome(p, alias)                           ``p`` now holds ``alias`` (the group moved to a new shard
                                               after a dtype conversion was followed)
    requires_grad(p)                           whether autograd should give ``p`` a gradient now
    version(p)                                 a number that changes with every in-place write through ``p``
    is_intact(p, alias)                        whether ``p`` still holds ``alias`` (not ``p.data = ...``,
                                               ``.to(device)``, a conversion)
    converted(p, alias)                        ``p``'s values as a plain tensor where ``p`` is ``alias``
                                               converted to another dtype in place (``model.half()``,
                                               same device and element count), else None
    describe(p)                                what ``p`` is now, for an error message

``GradSink`` (one per flat group): owns the ``.grad`` of the group's parameters. The core hands it the
reduced gradient shard and never touches ``.grad`` itself:

    deliver(group, grad_shard, final, used)    a reduced gradient shard: give each trainable parameter its
                                               piece (through the host first, under CPU offload); ``used``:
                                               None, or (where ``wants_usage_at_hand_out``) which parameters
                                               any rank gave a gradient in this reduction: only those get it
    accumulate(group, grad_shard, used)        the hand-out itself (``OffloadTransfers`` calls it on landing)
    wants_usage_at_hand_out(group)             whether the hand-out acts at once (a post-accumulate-grad hook,
                                               an optimizer stepping in backward): then ``used`` is agreed
                                               for each reduction before it (core/grad_usage.py)
    has_grad(group)                            whether any parameter of the group holds a gradient
    begin_unsynced(group) / mark_unsynced(group, used) / unsynced_held(group)
                                               ``no_sync``: before keeping a gradient unreduced; give the
                                               parameters this rank ``used`` so far their ``.grad`` handles
                                               and remember them; whether the user still holds them (see
                                               [Note: the no_sync accumulator follows p.grad] in flat_group.py)
    convert(group, dtype)                      the gradients follow a dtype conversion of the group
    end_backward(group, used) / recover(group) at the end of a backward (``used``: after a synced backward
                                               that reduced the group, which parameters any rank gave a
                                               gradient, core/grad_usage.py; else None); after a failed one

Every assignment of a shard gradient goes through ``GradSink.set_grad`` and every addition to one through
``GradSink.add_grad``: the one writer of shard gradients. No gradient means ``p.grad is None``, as in one
process: a reduction hands every trainable parameter its piece (zeros where no rank used it), and
``end_backward`` drops again the gradients the hand-outs started (since the last synced backward) for
parameters no rank used; one that held a gradient before keeps it unchanged (zeros were added).

The defaults here are what a model with no
surface gets: plain ``nn.Parameter`` objects over the aliases and ``.grad`` views of the reduced shard. The
surface's (``engine/surface/shard_param.py``, ``surface/grad_sink.py``) make parameters and gradients
pieces that know the whole, run tensor hooks and post-accumulate-grad hooks, and take gradients that reach
a parameter directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn as nn

from shardwise.engine.base.torch_internals import version_counter

if TYPE_CHECKING:
    from shardwise.engine.core.flat_group import FlatGroup


def storage_home(t: torch.Tensor) -> tuple:
    """Where ``t``'s data lives. The storage, not the data pointer: a rank's empty piece has data_ptr 0
    whatever it points into, and a verdict read from this must be the same on every rank."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t.device


def like_shard(group: "FlatGroup", grad_shard: torch.Tensor) -> torch.Tensor:
    """``grad_shard`` in the group's master dtype, on its shard's device (the dtype and device of ``.grad``)."""
    if grad_shard.dtype != group.plan.dtype or grad_shard.device != group.shard.device:
        grad_shard = grad_shard.to(device=group.shard.device, dtype=group.plan.dtype)
    return grad_shard


class ParamFactory:
    """Plain ``nn.Parameter`` objects over the aliases (see the module docstring for the interface)."""

    def make(self, group: "FlatGroup", index: int, alias: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        # Made over an empty tensor and then pointed at the alias: the parameter keeps its own version counter
        # (a view would share the shard's), so an optimizer step on it does not touch the gathered views
        # autograd saved.
        p = nn.Parameter(torch.empty(0, dtype=alias.dtype), requires_grad=requires_grad)
        p.data = alias
        return p

    def rehome(self, p: torch.Tensor, alias: torch.Tensor) -> None:
        p.data = alias

    def requires_grad(self, p: torch.Tensor) -> bool:
        return p.requires_grad

    def version(self, p: torch.Tensor) -> int:
        return version_counter(p)

    def is_intact(self, p: torch.Tensor, alias: torch.Tensor) -> bool:
        return storage_home(p) == storage_home(alias)

    def converted(self, p: torch.Tensor, alias: torch.Tensor) -> Optional[torch.Tensor]:
        if p.device != alias.device or tuple(p.shape) != tuple(alias.shape) or p.dtype == alias.dtype:
            return None
        return p.detach()

    def describe(self, p: torch.Tensor) -> str:
        return f"now {p.dtype}, shape {tuple(p.shape)} on {p.device}"


class GradSink:
    """``.grad`` views of the reduced shard on plain parameters (see the module docstring)."""

    def __init__(self, transfers=None):
        self.transfers = transfers  # offload_transfers.OffloadTransfers under CPU offload
        self._unsynced_marks: list = []  # (param, its grad, grad's version) handed out under no_sync
        # Per parameter: whether it held no gradient when this sink's hand-outs began (the first since the last
        # synced backward ended); ``end_backward`` drops what they started where no rank used the parameter.
        self._held_none: Optional[list[bool]] = None

    # ---- the one writer ---------------------------------------------------------------------------
    def set_grad(self, p: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        p.grad = grad

    def add_grad(self, p: torch.Tensor, piece: torch.Tensor) -> None:
        """``p.grad += piece``; the first gradient is ``piece`` itself (a view: gradients stay one buffer)."""
        if p.grad is None:
            self.set_grad(p, piece)
        else:
            p.grad.add_(piece)

    # ---- delivery ---------------------------------------------------------------------------------
    def deliver(self, group: "FlatGroup", grad_shard: torch.Tensor, final: bool,
                used: Optional[Sequence[bool]] = None) -> None:
        """A reduced gradient shard of ``group``. ``final``: the group gets no other in this backward."""
        if self.transfers is not None:
            self.transfers.grad_to_host(group, grad_shard, final, used)  # lands in accumulate, from the host
        else:
            self.accumulate(group, grad_shard, used)

    def accumulate(self, group: "FlatGroup", grad_shard: torch.Tensor, used: Optional[Sequence[bool]] = None) -> None:
        self.begin_hand_outs(group)
        grad_shard = like_shard(group, grad_shard)
        for i, (p, (lo, hi, at)) in enumerate(zip(group.shard_params, group.local_slices)):
            # Frozen after shard(), or no rank used it: autograd would give it no gradient either.
            if group.factory.requires_grad(p) and (used is None or used[i]):
                self.add_grad(p, grad_shard.narrow(0, at, hi - lo))

    def wants_usage_at_hand_out(self, group: "FlatGroup") -> bool:
        return False

    def has_grad(self, group: "FlatGroup") -> bool:
        return any(p.grad is not None for p in group.shard_params)

    def begin_hand_outs(self, group: "FlatGroup") -> None:
        """Before a hand-out (or ``no_sync`` handles): note which parameters hold no gradient, once until the
        window ends (a synced ``end_backward``, the user dropping the ``no_sync`` handles, a recovery)."""
        if self._held_none is None:
            self._held_none = [p.grad is None for p in group.shard_params]

    def keep_grads(self, indices) -> None:
        """These parameters got a gradient by another path (directly: a penalty): never dropped."""
        if self._held_none is not None:
            for i in indices:
                self._held_none[i] = False

    # ---- no_sync ----------------------------------------------------------------------------------
    def begin_unsynced(self, group: "FlatGroup") -> None:
        """Before a gradient is kept unreduced (``no_sync``)."""

    def mark_unsynced(self, group: "FlatGroup", used: Optional[Sequence[bool]] = None) -> None:
        """Give ``.grad`` handles (zeros) to the trainable parameters this rank ``used`` so far and remember
        every handle held (None: remember those held now, e.g. after direct gradients were added)."""
        self.begin_hand_outs(group)
        marks = []
        for i, (p, alias) in enumerate(zip(group.shard_params, group.aliases)):
            if group.factory.requires_grad(p):
                if p.grad is None and used is not None and used[i]:
                    self.set_grad(p, torch.zeros_like(alias))
                if p.grad is not None:
                    marks.append((p, p.grad, version_counter(p.grad)))
        self._unsynced_marks = marks

    def unsynced_held(self, group: "FlatGroup") -> bool:
        held = all(p.grad is grad and version_counter(grad) == v for p, grad, v in self._unsynced_marks)
        if not held:
            self._held_none = None  # the user dropped the handles: the accumulation starts again
        return held

    # ---- around a backward ------------------------------------------------------------------------
    def convert(self, group: "FlatGroup", dtype: torch.dtype) -> None:
        for p in group.shard_params:
            if p.grad is not None:
                self.set_grad(p, p.grad.to(dtype))

    def end_backward(self, group: "FlatGroup", used: Optional[Sequence[bool]]) -> None:
        """Every reduced gradient of this backward was handed out. ``used``: see the module docstring."""
        if used is None:
            return
        held_none, self._held_none = self._held_none, None
        for p, any_rank, none_before in zip(group.shard_params, used, held_none or ()):
            if none_before and not any_rank and p.grad is not None:
                self.set_grad(p, None)  # no rank used it: no gradient, as in one process

    def recover(self, group: "FlatGroup") -> None:
        """The backward raised: drop what it left."""
        self._held_none = None
