"""The sink a sharded model's flat groups hand their gradients to (core/seams.py: the interface).

On top of the core's ``.grad`` views it makes each gradient a ``Piece`` of its parameter's layout (the whole
gradient to user code, this rank's elements a view of the reduced shard inside), runs tensor hooks on the
full gradient (param_hooks.py) and post-accumulate-grad hooks as autograd would have, refuses tensor hooks
under ``no_sync``, and adds the gradients that reached a parameter directly (direct_grads.py) at the end of
backward. Reads of the shard parameters' attributes go around ``__torch_function__`` (``local_only``); the
gradients' elements are read through ``local_of``: no Python dispatch, no collective.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from shardwise.engine.core.seams import GradSink, like_shard
from shardwise.engine.surface.direct_grads import DirectGrads
from shardwise.engine.surface.param_hooks import (full_grad, has_tensor_hooks, hooked_piece, post_accumulate_grad_hooks,
                                                  refuse_under_no_sync, run_post_accumulate_grad_hooks, tensor_hooks)
from shardwise.engine.surface.pieces import Piece, local_only
from shardwise.engine.surface.shard_param import as_grad_of


class PieceGradSink(GradSink):
    """One flat group's gradients as pieces. ``on_direct_grad``: the runtime's ``begin_backward``."""

    def __init__(self, transfers=None, on_direct_grad: Optional[Callable[[], None]] = None):
        super().__init__(transfers)
        self.direct = DirectGrads(on_direct_grad)  # gradients that reach the parameters directly (a penalty)
        self._full: Optional[torch.Tensor] = None  # the whole gradient for tensor hooks, gathered by deliver

    def deliver(self, group, grad_shard: torch.Tensor, final: bool, used=None) -> None:
        # The tensor hooks' gradient gather is a collective: issued here, on the training thread, never on the
        # offload worker thread that may run ``accumulate`` (collectives.py: one issuing thread).
        with local_only():
            hooked = has_tensor_hooks(group)
        self._full = full_grad(group, grad_shard.to(group.plan.dtype)) if hooked else None
        super().deliver(group, grad_shard, final, used)

    def set_grad(self, p: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        """``grad``: this rank's elements (a plain 1-D tensor, kept as the piece's memory), a piece, or None."""
        if grad is not None and not isinstance(grad, Piece):
            grad = Piece(grad, p._layout)
        with local_only():
            p.grad = grad

    def add_grad(self, p: torch.Tensor, piece: torch.Tensor) -> None:
        """``p.grad += piece`` (this rank's elements); the first gradient is ``piece`` itself (a view)."""
        with local_only():
            grad = p.grad
        if grad is None:
            self.set_grad(p, piece)
            return
        if not isinstance(grad, Piece):  # a whole gradient autograd wrote past the routing: this rank's elements
            grad = as_grad_of(p, grad, "a gradient autograd accumulated")
            self.set_grad(p, grad)
        grad._local.add_(piece)

    def wants_usage_at_hand_out(self, group) -> bool:
        """Post-accumulate-grad hooks run at the hand-out, and an offload optimizer may step there."""
        consumer = group.transfers.consumer if group.transfers is not None else None
        with local_only():
            return (any(post_accumulate_grad_hooks(p) for p in group.shard_params)
                    or bool(consumer is not None and consumer.steps_in_backward))

    def accumulate(self, group, grad_shard: torch.Tensor, used=None) -> None:
        """Give each trainable shard parameter its piece of ``grad_shard`` (a view, so grads stay one flat
        buffer), then run its post-accumulate-grad hooks as autograd would have; with ``used``, only the
        parameters some rank used get either. No collective here: under CPU offload this runs on the offload
        worker thread (``deliver`` gathered the tensor hooks' gradient and ``reduction.finish`` agreed
        ``used`` on the training thread)."""
        with local_only():
            self.begin_hand_outs(group)
        grad_shard = like_shard(group, grad_shard)
        full, self._full = self._full, None  # (deliver gathered it)
        for i, (p, (lo, hi, at), spec) in enumerate(zip(group.shard_params, group.local_slices, group.plan.params)):
            with local_only():
                trainable, hooked = p.requires_grad, full is not None and bool(tensor_hooks(p))
            if not trainable or (used is not None and not used[i]):
                continue  # frozen after shard(), or no rank used it: autograd would give it no gradient either
            if hooked:  # (user code: runs with pieces' rules on)
                piece = hooked_piece(p, spec, full, lo, hi).to(grad_shard.device)
            else:
                piece = grad_shard.narrow(0, at, hi - lo)
            self.add_grad(p, piece)
            run_post_accumulate_grad_hooks(p)

    def has_grad(self, group) -> bool:
        with local_only():
            return super().has_grad(group)

    def begin_unsynced(self, group) -> None:
        with local_only():
            refuse_under_no_sync(group)  # tensor hooks would see the sum of the micro-batches

    def mark_unsynced(self, group, used=None) -> None:
        with local_only():
            super().mark_unsynced(group, used)

    def unsynced_held(self, group) -> bool:
        with local_only():
            return super().unsynced_held(group)

    def end_backward(self, group, used) -> None:
        with local_only():
            super().end_backward(group, used)  # parameters no rank used: no gradient
        self.keep_grads(self.direct.hand_out(group, self))

    def recover(self, group) -> None:
        super().recover(group)
        self.direct.drop()
