"""``ShardParam``: a sharded parameter knows that it is one rank's piece of a whole, and that its gradient
comes from the engine.

After ``shard()`` each parameter is an ``nn.Parameter`` view of this rank's piece of its unit's flat shard.
Two kinds of torch code would take the piece for the whole:

- **Reductions over the parameters themselves**: weight-norm logging (``get_total_norm(model.parameters())``,
  ``parameters_to_vector(model.parameters()).norm()``, ``p.norm()``, ``p.abs().max()``), an L2 penalty
  written by hand (``loss + wd * sum(p.pow(2).sum() for p in model.parameters())``). A ``ShardParam`` is a
  ``pieces.ShardPiece``: the one table there decides, for parameters as for gradients, what is exact
  (one all-reduce per call), what follows the piece and what is refused. Exact sums and finite-order norms
  are differentiable: each rank's piece gets its single-process gradient, which autograd accumulates into
  ``p.grad`` before the engine adds the reduced gradient of the rest of the loss
  (``grad_sink.PieceGradSink.accumulate``).
- **Autograd calls that name parameters as inputs**: a shard's gradient arrives through its unit's
  reduce-scatter (``UnshardParams``' backward, whose autograd input is the group's ``grad_anchor``), not
  through an autograd edge, so torch would find no path to it. ``torch.autograd.backward(..., inputs=)``
  and ``loss.backward(inputs=)`` (torch consults ``__torch_function__`` of the inputs there; torch 2.13,
  since pytorch/pytorch#171473) are exact when the inputs hold every trainable parameter of each flat
  group they touch: the groups' anchors join the inputs, so their reductions run as in ``loss.backward()``.
  A subset of a group is refused by name, before any collective: the group's gradient is reduced and handed
  out as one. ``torch.autograd.grad(..., inputs=params)`` is refused by name on every rank: it returns
  gradients without accumulating them, and the engine's only product is the accumulated ``p.grad`` (with
  its post-accumulate hooks and ``no_sync`` accumulation); call ``loss.backward()`` and read ``p.grad``.

Under ``no_shard`` (a shard group of one rank) the parameter is whole: its reductions are the plain local
ones (no collective), but it is a ``ShardParam`` still, because its gradient too comes from the engine.
The engine reads its own parameters inside ``local_only()``: no Python dispatch on its paths.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn as nn

from shardwise.engine.base.torch_internals import version_counter
from shardwise.engine.core.seams import ParamFactory
from shardwise.engine.surface.pieces import (_EXACT, _FOLLOWS_PIECE, _FOREACH_TYPES, ShardPiece, as_piece, local_only,
                                             register_foreach_types, register_group, strip)
from shardwise.errors import ShardwiseError


class PieceInfo:
    """What a shard parameter knows about itself (its one back-pointer, ``p._shardwise_piece``): its
    ``FlatGroup`` and its index in the group's plan (None for a copy, which belongs to no group), and the
    ``piece_key`` under which its reductions find their shard group (pieces.py; 0: a group of one rank)."""

    __slots__ = ("group", "index", "key")

    def __init__(self, group, index: Optional[int], key: int):
        self.group, self.index, self.key = group, index, key


_INFO_ATTR = "_shardwise_piece"


def where_of(p: torch.Tensor):
    """``(FlatGroup, index)`` of a shard parameter, or None for any other tensor (a copy of one included)."""
    info = getattr(p, _INFO_ATTR, None)
    return None if info is None or info.group is None else (info.group, info.index)


class ShardParam(ShardPiece, nn.Parameter):
    """A sharded parameter: this rank's 1-D piece (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.data:
            _written_through_data(args[0])
        handler = _AUTOGRAD_CALLS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func in _DIFFERENTIABLE and torch.is_grad_enabled():
            args, kwargs = _route(args), dict(zip(kwargs, _route(kwargs.values())))
        return super().__torch_function__(func, types, args, kwargs)

    def __repr__(self):
        with local_only():
            return (f"ShardParam (this rank's piece of a sharded parameter) containing:\n"
                    f"{self.detach()!r}, requires_grad={self.requires_grad}")

    def __reduce_ex__(self, proto):
        # Pickled as a plain nn.Parameter holding the local piece (its process group does not travel).
        return nn.Parameter(strip(self), requires_grad=self.requires_grad).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        # A copy (an EMA of the parameters) is a piece of the same whole: its norms stay exact. It belongs to no
        # flat group: autograd reaches it as any leaf.
        if id(self) not in memo:
            with local_only():
                data = self.detach().clone()
            memo[id(self)] = make_shard_param(data, PieceInfo(None, None, self._shard_key), self.requires_grad)
        return memo[id(self)]

    @property
    def _shard_key(self) -> int:  # (pieces.py reads every piece's key here)
        info = getattr(self, _INFO_ATTR, None)
        return 0 if info is None else info.key  # 0: a ShardParam made by other code (type(p)(data)) is whole


_FOREACH_TYPES.append(ShardParam)


def _written_through_data(p: torch.Tensor) -> None:
    """``p.data`` was read: an in-place write through it (an EMA swap, pruning) moves no version counter, so
    the group is signalled as written (core/flat_group.py: ZeRO-1/2 refill their kept copy at the next
    top-level entry; a read alone costs one all-gather there)."""
    where = where_of(p)
    if where is not None:
        where[0].written = True


def make_shard_param(data: torch.Tensor, info: PieceInfo, requires_grad: bool) -> ShardParam:
    """A ``ShardParam`` over ``data``, placed by ``info``."""
    register_foreach_types()
    p = ShardParam(data, requires_grad=requires_grad)
    setattr(p, _INFO_ATTR, info)
    return p


class ShardParamFactory(ParamFactory):
    """The parameters of a sharded model are ``ShardParam`` objects (core/seams.py: the interface). Reads of their
    own state go around the piece's rules (``local_only``): no Python dispatch, no collective."""

    def __init__(self, shard_group, device: torch.device, checker=None):
        # Reductions of the pieces (p.grad.norm(), p.norm()) run over the shard group, checked by the model's
        # checker; key 0 (no shard group): the pieces are whole tensors.
        self.piece_key = register_group(shard_group, device, checker) if shard_group is not None else 0

    def make(self, group, index: int, alias: torch.Tensor, requires_grad: bool) -> ShardParam:
        p = make_shard_param(torch.empty(0, dtype=alias.dtype), PieceInfo(group, index, self.piece_key), requires_grad)
        self.rehome(p, alias)  # (its own version counter: see ParamFactory.make)
        return p

    def rehome(self, p: torch.Tensor, alias: torch.Tensor) -> None:
        with local_only():
            p.data = alias

    def requires_grad(self, p: torch.Tensor) -> bool:
        with local_only():
            return p.requires_grad

    def version(self, p: torch.Tensor) -> int:
        with local_only():
            return version_counter(p)

    def is_intact(self, p: torch.Tensor, alias: torch.Tensor) -> bool:
        with local_only():
            return super().is_intact(p, alias)

    def converted(self, p: torch.Tensor, alias: torch.Tensor) -> Optional[torch.Tensor]:
        with local_only():
            return super().converted(p, alias)


# [Note: gradients that reach a parameter directly] Maths on a shard parameter under grad mode (a penalty
# added to the loss) would give autograd an edge to the parameter's AccumulateGrad node: torch would write
# ``p.grad`` in the middle of backward, run the parameter's tensor hooks on a piece and its post-accumulate
# hooks before the reduced gradient arrives, and bump the version of a ``no_sync`` accumulation's gradients.
# So the parameter enters the graph as ``_DirectGrad`` of its group's anchor instead: the same memory, and a
# backward that hands the gradient to the group, which adds it to ``p.grad`` at the end of backward
# (``direct_grads.DirectGrads.hand_out``), the one writer of shard gradients. Functions outside the table
# (indexing, matmul) still reach the parameter's own AccumulateGrad: that gradient is this rank's too, and
# the hand-out makes ``p.grad`` a piece again.
_DIFFERENTIABLE = (set(_EXACT) | _FOLLOWS_PIECE) - {torch.Tensor.detach, torch.Tensor.data.__get__}


def _route(args):
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            a = type(a)(_route(a)) if any(isinstance(t, ShardParam) for t in a) else a
        elif isinstance(a, ShardParam) and where_of(a) is not None:
            with local_only():
                if a.requires_grad:
                    group, index = where_of(a)
                    a = as_piece(_DirectGrad.apply(group.grad_anchor, a.detach(), group, index), a._shard_key, ShardPiece)
        out.append(a)
    return out


class _DirectGrad(torch.autograd.Function):
    """Identity from a group's anchor to a parameter's piece; its gradient goes to the group (see the Note)."""

    @staticmethod
    def forward(ctx, anchor, piece, group, index):
        ctx.group, ctx.index = group, index
        return piece.view_as(piece)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            ctx.group.sink.direct.add(ctx.index, grad)
        return None, None, None, None


def _engine_params(tensors) -> list:
    return [t for t in tensors if isinstance(t, ShardParam) and where_of(t) is not None]


def _listed(inputs) -> list:
    if inputs is None:
        return []
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def _autograd_grad(outputs, inputs, *args, **kwargs):
    if _engine_params(_listed(inputs)):
        raise ShardwiseError(
            "torch.autograd.grad(..., inputs=<parameters of a sharded model>): a sharded parameter's gradient is "
            "produced by its unit's reduce-scatter into p.grad, never returned by autograd; call "
            "loss.backward() (or loss.backward(inputs=...) naming every trainable parameter) and read p.grad")
    with local_only():
        return torch.autograd.grad(outputs, inputs, *args, **kwargs)


def _autograd_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None, **kwargs):
    inputs = _listed(inputs)
    params = _engine_params(inputs)
    groups = list({id(g): g for g, _ in map(where_of, params)}.values())
    chosen = {id(p) for p in params}
    for g in groups:
        left_out = [s.fqn for s, p in zip(g.plan.params, g.shard_params) if p.requires_grad and id(p) not in chosen]
        if left_out:
            raise ShardwiseError(
                f"backward(inputs=...) names some parameters of a sharded flat group but not {left_out[0]!r} "
                f"(unit {g.plan.unit_fqn or '<root>'!r}): a group's gradient is reduced and handed out as one; "
                f"name every trainable parameter of the model (or call loss.backward()), or freeze the others")
    frozen = [where_of(p) for p in params if not p.requires_grad]
    if frozen:
        g, i = frozen[0]
        raise ShardwiseError(f"backward(inputs=...) names parameter {g.plan.params[i].fqn!r}, which does not require grad")
    with local_only():
        # Each parameter as the gradient edge of its AccumulateGrad node (a penalty that reaches it directly),
        # plus each group's anchor: the unit's reduction runs, as in loss.backward().
        edges = [torch.autograd.graph.get_gradient_edge(t) if isinstance(t, ShardPiece) else t for t in inputs]
    edges += [g.grad_anchor for g in groups]
    return torch.autograd.backward(tensors, grad_tensors, retain_graph, create_graph, inputs=edges, **kwargs)


_AUTOGRAD_CALLS = {torch.autograd.grad: _autograd_grad, torch.autograd.backward: _autograd_backward}


@functools.lru_cache(maxsize=None)
def backward_consults_inputs() -> bool:
    """Whether this torch hands ``torch.autograd.backward``'s ``inputs`` to ``__torch_function__``
    (pytorch/pytorch#171473: torch 2.13 does; a release without it runs ``loss.backward(inputs=params)``
    past us, and the sharded parameters get no gradient). Probed once, on a throwaway subclass."""
    seen = []

    class _Probe(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.autograd.backward:
                seen.append(func)
                return None
            with local_only():
                return func(*args, **(kwargs or {}))

    x = torch.zeros(1, requires_grad=True)
    probe = torch.zeros(1).as_subclass(_Probe).requires_grad_()
    try:
        torch.autograd.backward((x * 2).sum(), inputs=[probe])
    except RuntimeError:  # a torch that ran it and found the probe outside the graph
        pass
    return bool(seen)


def warn_if_backward_inputs_unseen() -> None:
    """At ``shard()``: say once per process, where this torch cannot let us see ``backward(inputs=...)``,
    that naming sharded parameters there would leave them without gradients (otherwise exact or refused)."""
    global _warned
    if _warned or backward_consults_inputs():
        return
    _warned = True
    warnings.warn(
        f"shardwise: torch {torch.__version__} does not pass backward(inputs=...)'s inputs to __torch_function__ "
        f"(pytorch/pytorch#171473), so loss.backward(inputs=<sharded parameters>) would leave them without "
        f"gradients: call loss.backward()", RuntimeWarning, stacklevel=3)


_warned = False
