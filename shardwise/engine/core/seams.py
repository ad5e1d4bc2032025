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

    deliver(group, grad_shard, final)          a reduced gradient shard: give each trainable parameter its
                                               piece (through the host first, under CPU offload)
    accumulate(group, grad_shard)              the hand-out itself (``OffloadTransfers`` calls it on landing)
    has_grad(group)                            whether any parameter of the group holds a gradient
    begin_unsynced(group) / mark_unsynced(group) / unsynced_held(group)
                                               ``no_sync``: before keeping a gradient unreduced; give the
                                               parameters their ``.grad`` handles and remember them; whether
                                               the user still holds them (see [Note: the no_sync
                                               accumulator follows p.grad] in flat_group.py)
    convert(group, dtype)                      the gradients follow a dtype conversion of the group
    end_backward(group) / recover(group)       at the end of a backward; after a failed one

Every assignment of a shard gradient goes through ``GradSink.set_grad`` and every addition to one through
``GradSink.add_grad``: the one writer of shard gradients. The defaults here are what a model with no
surface gets: plain ``nn.Parameter`` objects over the aliases and ``.grad`` views of the reduced shard. The
surface's (``engine/surface/shard_param.py``, ``surface/grad_sink.py``) make parameters and gradients
pieces that know the whole, run tensor hooks and post-accumulate-grad hooks, and take gradients that reach
a parameter directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

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
    def deliver(self, group: "FlatGroup", grad_shard: torch.Tensor, final: bool) -> None:
        """A reduced gradient shard of ``group``. ``final``: the group gets no other in this backward."""
        if self.transfers is not None:
            self.transfers.grad_to_host(group, grad_shard, final)  # lands in accumulate, from the host
        else:
            self.accumulate(group, grad_shard)

    def accumulate(self, group: "FlatGroup", grad_shard: torch.Tensor) -> None:
        grad_shard = like_shard(group, grad_shard)
        for p, alias, (lo, hi, at) in zip(group.shard_params, group.aliases, group.local_slices):
            if group.factory.requires_grad(p):  # frozen after shard(): autograd would give it none either
                self.add_grad(p, grad_shard.narrow(0, at, hi - lo))

    def has_grad(self, group: "FlatGroup") -> bool:
        return any(p.grad is not None for p in group.shard_params)

    # ---- no_sync ----------------------------------------------------------------------------------
    def begin_unsynced(self, group: "FlatGroup") -> None:
        """Before a gradient is kept unreduced (``no_sync``)."""

    def mark_unsynced(self, group: "FlatGroup") -> None:
        marks = []
        for p, alias in zip(group.shard_params, group.aliases):
            if group.factory.requires_grad(p):
                if p.grad is None:
                    self.set_grad(p, torch.zeros_like(alias))
                marks.append((p, p.grad, version_counter(p.grad)))
        self._unsynced_marks = marks

    def unsynced_held(self, group: "FlatGroup") -> bool:
        return all(p.grad is grad and version_counter(grad) == v for p, grad, v in self._unsynced_marks)

    # ---- around a backward ------------------------------------------------------------------------
    def convert(self, group: "FlatGroup", dtype: torch.dtype) -> None:
        for p in group.shard_params:
            if p.grad is not None:
                self.set_grad(p, p.grad.to(dtype))

    def end_backward(self, group: "FlatGroup") -> None:
        """Every reduced gradient of this backward was handed out."""

    def recover(self, group: "FlatGroup") -> None:
        """The backward raised: drop what it left."""
