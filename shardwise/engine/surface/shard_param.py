"""The sharded parameter: a ``Piece`` that is an ``nn.Parameter``, its factory, and what it owns of torch.

``ShardParamFactory`` makes each user-facing parameter (core/seams.py: the interface): a ``Piece`` over a
persistent *local parameter*, a plain ``nn.Parameter`` over this rank's piece of the flat shard (the core's
alias). The local parameter is what the optimizer steps (optimizer_swap.py) and what the factory reads to
answer the core (no Python dispatch on the engine's paths). ``_is_param`` makes ``isinstance(p,
nn.Parameter)`` true, as ``nn.Parameter(piece)`` would.

What the parameter owns, beyond the table of pieces (piece_ops.py):

- ``p.grad = t`` (``set_grad``): a piece of the parameter's layout is kept; a plain tensor of the whole
  shape (hand-written accumulation: ``p.grad = acc / k``) becomes a piece (this rank's elements, copied);
  anything else is refused by name, so ``p.grad`` is always the parameter's piece and torch's
  ``clip_grad_norm_`` stays global.
- ``p.data = t`` (``set_data``): values of the same dtype and device (a plain whole tensor, or a piece of the
  same layout: ``vector_to_parameters``) are copied into the parameter's elements; a piece of another dtype
  (``model.half()`` converting every parameter) is the conversion the core follows (seams.py ``converted``);
  anything else is refused by name.
- the autograd calls that name parameters (``backward(inputs=)``, ``autograd.grad``), and the routing of
  maths on a parameter under grad mode through its group's anchor ([Note: gradients that reach a parameter
  directly]).

Under ``no_shard`` (a shard group of one rank) the layout is whole: every operation runs on the whole tensor
(piece_ops.py, rule 5), but it is a ``Piece`` still, because its gradient too comes from the engine.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Optional

import torch
import torch.nn as nn

from shardwise.engine.base.torch_internals import version_counter
from shardwise.engine.core.seams import ParamFactory, storage_home
from shardwise.engine.surface import pieces
from shardwise.engine.surface.layout import Layout, register_group
from shardwise.engine.surface.pieces import Piece, local_of, local_only
from shardwise.errors import ShardwiseError


class PieceInfo:
    """What a shard parameter knows about itself (its one back-pointer, ``p._shardwise_piece``, also on its
    local parameter): its ``FlatGroup`` and its index in the group's plan."""

    __slots__ = ("group", "index")

    def __init__(self, group, index: int):
        self.group, self.index = group, index


_INFO_ATTR = "_shardwise_piece"


def where_of(p: torch.Tensor):
    """``(FlatGroup, index)`` of a shard parameter or of its local parameter, or None for any other tensor."""
    info = getattr(p, _INFO_ATTR, None)
    return None if info is None else (info.group, info.index)


def local_param(p: torch.Tensor) -> Optional[nn.Parameter]:
    """The plain local parameter of a shard parameter (what optimizers step), or None."""
    return p._local if isinstance(p, Piece) and where_of(p) is not None else None


def param_layout(group, index: int, key: int) -> Layout:
    """Where parameter ``index`` of ``group`` lies across the shard group's ranks (plan.py's ranges)."""
    plan, spec = group.plan, group.plan.params[index]
    size = group.pgs.shard_size
    runs = []
    for r in range(size):
        lo, hi = spec.local_range(*plan.shard_range(r))
        runs.append(((lo, hi - lo),) if hi > lo else ())
    if size == 1:
        return Layout.whole(spec.shape)
    return Layout(torch.Size(spec.shape), tuple(runs), group.pgs.shard_rank, key)


class ShardParamFactory(ParamFactory):
    """The parameters of a sharded model are pieces (see the module docstring). The core's questions are
    answered from the local parameter and the piece's own attributes, without Python dispatch."""

    def __init__(self, shard_group, device: torch.device, checker=None):
        # Pieces' reductions run over the shard group, agreed by the model's checker; key 0: no shard group.
        self.piece_key = register_group(shard_group, device, checker) if shard_group is not None else 0
        pieces.register_foreach_types()

    def make(self, group, index: int, alias: torch.Tensor, requires_grad: bool) -> Piece:
        local = nn.Parameter(torch.empty(0, dtype=alias.dtype, device=alias.device), requires_grad=False)
        local.data = alias  # (its own version counter: see ParamFactory.make)
        info = PieceInfo(group, index)
        setattr(local, _INFO_ATTR, info)
        p = Piece(local, param_layout(group, index, self.piece_key), requires_grad=requires_grad)
        p._is_param = True
        p._fqn = group.plan.params[index].fqn
        setattr(p, _INFO_ATTR, info)
        local._shardwise_whole = weakref.ref(p)
        return p

    def rehome(self, p: torch.Tensor, alias: torch.Tensor) -> None:
        p._local.data = alias

    def requires_grad(self, p: torch.Tensor) -> bool:
        with local_only():
            return p.requires_grad

    def version(self, p: torch.Tensor) -> int:
        with local_only():  # in-place writes through the piece (the table) and through the local (the optimizer)
            return version_counter(p) + version_counter(p._local)

    def is_intact(self, p: torch.Tensor, alias: torch.Tensor) -> bool:
        with local_only():
            return p.dtype == alias.dtype and p.device == alias.device and storage_home(p._local) == storage_home(alias)

    def converted(self, p: torch.Tensor, alias: torch.Tensor) -> Optional[torch.Tensor]:
        with local_only():
            local = p._local
            if p.device != alias.device or local.dtype != p.dtype or p.dtype == alias.dtype:
                return None
            return local.detach() if local.shape == alias.shape else None

    def describe(self, p: torch.Tensor) -> str:
        with local_only():
            return f"now {p.dtype}, shape {tuple(p.shape)} on {p.device}"


def piece_of_local(local: torch.Tensor) -> Optional[Piece]:
    """The shard parameter whose local parameter is ``local`` (None for any other tensor)."""
    back = getattr(local, "_shardwise_whole", None)
    return back() if back is not None else None


# ---- p.grad = ..., p.data = ... --------------------------------------------------------------------------
def as_grad_of(p: Piece, value, what: str):
    """``value`` as a gradient of ``p``: None, a piece of ``p``'s layout, or a plain tensor of the whole shape
    (this rank's elements copied into a new piece)."""
    if value is None:
        return None
    if isinstance(value, Piece):
        if value._layout == p._layout or (value._layout.is_whole and p._layout.is_whole
                                          and value.shape == p.shape):
            return value
        raise ShardwiseError(
            f"{what} for parameter {p._fqn!r}: the tensor is a piece of another sharded tensor (whole shape "
            f"{tuple(value.shape)}, laid out differently across the ranks); assign a tensor computed from "
            f"{p._fqn!r}'s own gradient, or a plain tensor of shape {tuple(p.shape)}")
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(p.shape):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        hint = (" (this rank's piece of it? a gradient is assigned whole on every rank)"
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == p._layout.local_numel
                else "")
        raise ShardwiseError(f"{what} for parameter {p._fqn!r} of shape {tuple(p.shape)}: got shape {shape}{hint}")
    local = p._layout.cut(value.detach()).to(device=p.device, dtype=p.dtype).clone(
        memory_format=torch.contiguous_format)
    return Piece(local, p._layout)


def set_grad(p, value) -> None:
    """``p.grad = value`` on a piece (see the module docstring)."""
    if isinstance(p, Piece) and getattr(p, "_fqn", None) is not None:
        value = as_grad_of(p, value, "p.grad = tensor")
    with local_only():
        p.grad = value


def get_data(p) -> torch.Tensor:
    """``p.data`` read: an in-place write through it (an EMA swap, pruning) moves no version counter the core
    reads, so the group is signalled as written (core/flat_group.py: ZeRO-1/2 refill their kept copy at the
    next top-level entry; a read alone costs one all-gather there)."""
    where = where_of(p)
    if where is not None and where[0] is not None:
        where[0].written = True
    with local_only():
        return p.data


def set_data(p, value) -> None:
    """``p.data = value`` on a piece (see the module docstring)."""
    with local_only():
        if isinstance(value, Piece) and value._layout == p._layout and value.dtype != p.dtype \
                and value.device == p.device:
            # A dtype conversion (nn.Module._apply: model.half()): the piece's metadata takes the new dtype and
            # its local elements the converted values (the core follows it: seams.py ``converted``).
            p.data = value
            local = p._local
            if isinstance(local, nn.Parameter) and where_of(local) is not None:
                local.data = value._local
            else:
                p._local = value._local
            return
        if isinstance(value, torch.Tensor) and value.dtype == p.dtype and value.device == p.device \
                and tuple(value.shape) == tuple(p.shape):
            if isinstance(value, Piece) and value._layout != p._layout:
                pass  # refused below
            else:
                local_of(p).copy_(local_of(value) if isinstance(value, Piece) else p._layout.cut(value))
                return
    name = getattr(p, "_fqn", None) or "of a sharded model"
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise ShardwiseError(
        f"p.data = tensor for sharded parameter {name!r} ({p.dtype}, shape {tuple(p.shape)} on {p.device}): got "
        f"{getattr(value, 'dtype', '')} {shape} on {getattr(value, 'device', '')}. After shard() p.data = x copies "
        f"x's values in (same dtype, device and whole shape); converting one parameter, moving it or reshaping it "
        f"is not supported: do it before shard(), or convert the whole model (model.half())")


# [Note: gradients that reach a parameter directly] Maths on a shard parameter under grad mode (a penalty
# added to the loss) would give autograd an edge to the parameter's AccumulateGrad node: torch would write
# ``p.grad`` in the middle of backward, run the parameter's tensor hooks on it and its post-accumulate hooks
# before the reduced gradient arrives, and bump the version of a ``no_sync`` accumulation's gradients.
# So the parameter enters the graph as ``_DirectGrad`` of its group's anchor instead: the same piece, and a
# backward that hands the gradient (a piece, or a plain whole-shape tensor cut to this rank's elements) to
# the group, which adds it to ``p.grad`` at the end of backward (``direct_grads.DirectGrads.hand_out``), the
# one writer of shard gradients. The table (piece_ops.py) decides what is computable; autograd's backward
# formulas are aten calls that go through it too.
def route(args, kwargs):
    """Every trainable engine parameter among ``args``/``kwargs`` replaced by its routed piece."""
    return _route_all(args), {k: _route_one(v) for k, v in kwargs.items()}


def _route_all(args):
    return type(args)(_route_one(a) for a in args) if isinstance(args, (list, tuple)) else args


def _route_one(a):
    if isinstance(a, (list, tuple)):
        return type(a)(_route_one(t) for t in a) if any(isinstance(t, Piece) for t in a) else a
    if isinstance(a, Piece):
        where = where_of(a)
        if where is not None and getattr(a, "_is_param", False):
            with local_only():
                if not a.requires_grad:
                    return a
                group, index = where
                detached = a.detach()  # (a piece; for a whole piece the plain tensor itself)
            routed = _DirectGrad.apply(group.grad_anchor, detached, group, index, a._layout)
            routed._fqn = getattr(a, "_fqn", None)  # a refusal further down names the parameter, not "a piece"
            return routed
    return a


class _DirectGrad(torch.autograd.Function):
    """Identity from a group's anchor to a parameter's piece; its gradient goes to the group (see the Note)."""

    @staticmethod
    def forward(ctx, anchor, piece, group, index, layout):
        ctx.group, ctx.index, ctx.layout = group, index, layout
        return piece.view_as(piece)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            local = grad._local if isinstance(grad, Piece) else ctx.layout.cut(grad)
            ctx.group.sink.direct.add(ctx.index, local)
        return None, None, None, None, None


def _engine_params(tensors) -> list:
    return [t for t in tensors if isinstance(t, Piece) and where_of(t) is not None]


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
        with local_only():
            left_out = [s.fqn for s, p in zip(g.plan.params, g.shard_params) if p.requires_grad and id(p) not in chosen]
        if left_out:
            raise ShardwiseError(
                f"backward(inputs=...) names some parameters of a sharded flat group but not {left_out[0]!r} "
                f"(unit {g.plan.unit_fqn or '<root>'!r}): a group's gradient is reduced and handed out as one; "
                f"name every trainable parameter of the model (or call loss.backward()), or freeze the others")
    with local_only():
        frozen = [where_of(p) for p in params if not p.requires_grad]
    if frozen:
        g, i = frozen[0]
        raise ShardwiseError(f"backward(inputs=...) names parameter {g.plan.params[i].fqn!r}, which does not require grad")
    with local_only():
        # Each parameter as the gradient edge of its AccumulateGrad node (a penalty that reaches it directly),
        # plus each group's anchor: the unit's reduction runs, as in loss.backward().
        edges = [torch.autograd.graph.get_gradient_edge(t) if isinstance(t, Piece) else t for t in inputs]
        edges += [g.grad_anchor for g in groups]
        return torch.autograd.backward(tensors, grad_tensors, retain_graph, create_graph, inputs=edges, **kwargs)


pieces.register({torch.autograd.grad: _autograd_grad, torch.autograd.backward: _autograd_backward,
                 torch.Tensor.grad.__set__: set_grad, torch.Tensor.data.__get__: get_data,
                 torch.Tensor.data.__set__: set_data}, route)


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
