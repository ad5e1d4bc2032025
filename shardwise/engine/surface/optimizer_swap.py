"""An optimizer steps plain local tensors, not pieces: the step pays no Python dispatch.

Every operation on a ``Piece`` goes through ``__torch_dispatch__`` (pieces.py); an optimizer step is ~10 of
them per parameter (single-tensor AdamW on CPU), which is what made FSDP2's DTensor steps dear
(pytorch/pytorch#134191). For the duration of ``step()`` (the process-wide step hooks, optimizer_guard.py)
every shard parameter in ``optimizer.param_groups`` is swapped for its *local parameter* (a plain
``nn.Parameter`` over the same memory as the piece's elements, made once by the factory), whose ``.grad`` is
the plain local gradient, and ``optimizer.state`` is re-keyed from the piece to the local parameter; after
the step both are swapped back and the local gradients dropped. So torch's own kernels (single-tensor,
foreach or fused, as torch picks them) run on plain tensors of this rank's elements of ``exp_avg``...;
between steps each such state tensor is shown in ``optimizer.state`` as a piece of its parameter (the whole
tensor to user code, as the parameter is; one wrapper per state tensor, made at the first step).

A step that raised leaves the swap in place. Every later way in repairs it first (``restore``): the next step,
``state_dict()`` / ``load_state_dict()`` (per-optimizer hooks) and the model's next forward (``restore_all``).
The repair reads what happened meanwhile: a local gradient set to None (``zero_grad()``) drops the piece's.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from shardwise.engine.surface.pieces import Piece, local_only
from shardwise.engine.surface.shard_param import local_param, piece_of_local

_SWAPPED: "weakref.WeakSet" = weakref.WeakSet()  # optimizers whose step is running (or raised)


class Swap:
    """One optimizer's swap, prepared once per parameter layout of its param groups (optimizer_guard's
    guard holds it): per group, its list of parameters and the same list with local parameters."""

    __slots__ = ("lists", "pairs", "state_pieces")

    def __init__(self, optimizer):
        self.lists = []
        self.pairs = []  # (piece, local) of every shard parameter, in param-group order
        # id(state tensor) -> the piece shown in optimizer.state for it, made once: torch's optimizers update
        # their state tensors in place, so a step after the first makes no new wrappers
        self.state_pieces: dict = {}
        for group in optimizer.param_groups:
            params = group["params"]
            swapped = [_local_or_self(p) for p in params]
            self.lists.append((params, swapped))
            self.pairs += [(p, q) for p, q in zip(params, swapped) if q is not p]

    def current(self, optimizer) -> bool:
        """Whether the param groups still hold the lists this swap was prepared for."""
        groups = optimizer.param_groups
        return len(groups) == len(self.lists) and all(
            g["params"] is a or g["params"] is b for g, (a, b) in zip(groups, self.lists))


def _local_or_self(p):
    local = local_param(p)
    return p if local is None else local


def swap_in(optimizer, swap: Swap) -> None:
    """Before ``step()``: local parameters with local gradients in the param groups, state re-keyed."""
    for group, (_params, swapped) in zip(optimizer.param_groups, swap.lists):
        group["params"] = swapped
    state = optimizer.state
    with local_only():
        for p, local in swap.pairs:
            entry = _move_state(state, p, local)
            if entry is not None:
                _state_as_locals(entry, p)
            grad = p.grad
            local.grad = grad._local if isinstance(grad, Piece) else None
    _SWAPPED.add(optimizer)


def swap_out(optimizer, swap: Swap) -> None:
    """After ``step()``: the pieces back, state re-keyed back, the local gradients dropped (a local gradient
    the step or the user set to None drops the piece's: ``zero_grad()`` on a swapped optimizer)."""
    for group, (params, _swapped) in zip(optimizer.param_groups, swap.lists):
        group["params"] = params
    state = optimizer.state
    with local_only():
        for p, local in swap.pairs:
            entry = _move_state(state, local, p)
            if entry is not None and shows_state_as_pieces(optimizer):
                state_as_pieces(entry, p, swap.state_pieces)
            if local.grad is None and p.grad is not None:
                p.grad = None
            local.grad = None
    _SWAPPED.discard(optimizer)


def _move_state(state: dict, source, target) -> Optional[dict]:
    """Re-key ``source``'s optimizer state (if any) to ``target``; the entry moved."""
    entry = state.pop(source, None)
    if entry is not None:
        state[target] = entry
    return entry


def shows_state_as_pieces(optimizer) -> bool:
    """Whether ``optimizer.state`` shows pieces between steps: not an offload optimizer's per-group inner
    optimizers, whose shared state is the host copy the offload worker steps (it stays this rank's elements,
    as ``optimizer.state_dict()`` stamps it)."""
    return not optimizer.__dict__.get("_shardwise_inner")


def state_as_pieces(entry: dict, p: Piece, made: dict) -> None:
    """Between steps, ``optimizer.state[p]``'s tensors of this rank's elements (``exp_avg``, a momentum buffer)
    are pieces of ``p``'s layout: the whole tensor to user code, as ``p`` is and as ``optimizer.state_dict()``
    returns them, so ``opt.state[p]["exp_avg"].norm()`` or ``.shape`` is one process's value on every rank,
    not this rank's 1-D elements. A tensor elsewhere stays as it is. ``made``: the wrapper of each state
    tensor (by its id): torch's optimizers update their state in place, so a step after the first finds them
    all there and checks nothing else."""
    for name, value in entry.items():
        if type(value) is not torch.Tensor:
            continue  # (a number, or already a piece)
        piece = made.get(id(value))
        if piece is None or piece._local is not value:
            local = p._local
            if value.dim() == 0 or value.shape != local.shape or value.device != local.device:
                continue  # (a scalar such as Adam's step; a copy elsewhere)
            piece = made[id(value)] = Piece(value, p._layout)
        entry[name] = piece


def _state_as_locals(entry: dict, p: Piece) -> None:
    """For the step: each state piece of ``p``'s layout is its local elements again (what the step updates)."""
    layout = p._layout
    for name, value in entry.items():
        if isinstance(value, Piece) and (value._layout is layout or value._layout == layout):
            entry[name] = value._local


def restore(optimizer, swap: Swap) -> None:
    """Undo a swap a raised step left behind (nothing to do otherwise)."""
    if optimizer in _SWAPPED:
        swap_out(optimizer, swap)


def restore_all() -> None:
    """The model's next forward: undo every swap a raised step left behind."""
    if _SWAPPED:
        from shardwise.engine.surface.optimizer_guard import restore_swap

        for optimizer in list(_SWAPPED):
            restore_swap(optimizer)


def is_local_param(t) -> bool:
    return piece_of_local(t) is not None
