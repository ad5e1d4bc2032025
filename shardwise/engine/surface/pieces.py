"""``Piece``: what a sharded parameter and its gradient are to user code, the whole tensor, held in pieces.

After ``shard()`` each parameter (and its ``.grad``) is a ``Piece``: a tensor subclass made with
``torch.Tensor._make_wrapper_subclass`` whose metadata is the WHOLE tensor's (``shape``, ``size()``,
``dim()``/``ndim``, ``numel()``, ``len()``, ``dtype``, ``device``, ``requires_grad``), as FSDP2's DTensor
parameters are, and which holds no storage of its own: this rank's elements live in ``_local`` (a plain 1-D
tensor, a view of the flat shard or of the reduced gradient), placed by ``_layout`` (layout.py). Every
operation on it reaches ``__torch_dispatch__``, where one closed table (piece_ops.py, piece_reductions.py)
computes it exactly across ranks or raises ``ShardwiseError`` naming it; nothing runs on the local
elements as if they were the whole.

Why a wrapper and not a 1-D tensor that reports whole metadata: code below Python reads ``prod(shape)``
elements from ``data_ptr()`` (``safetensors.torch.save_file``, numpy, ctypes); with whole metadata over a
piece's memory those would be reads past its end. A wrapper has no data pointer to read
(``_refuse_memory_access``), and a piece pickles as the whole tensor (``__reduce_ex__``: one agreed
all-gather), so ``torch.save(model.state_dict())`` writes whole tensors. docs/ARCHITECTURE.md ("What a
parameter is") has the table.

``__torch_function__`` does three things before dispatch: it names the user's call for errors raised
below it, it hands the torch calls that are about a tensor object rather than its values to their owners
(``p.grad = ...``, ``p.data = ...`` and the autograd calls: shard_param.py; memory access: refused), and it
routes a trainable parameter through its group's anchor under grad mode (shard_param.py, [Note: gradients
that reach a parameter directly]). Inside shardwise, code that must see the local elements reads
``local_of(t)``; ``local_only()`` turns ``__torch_function__`` off (attribute reads of the engine's own
parameters, no Python cost).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from shardwise.engine.checks.fingerprint import PICKLE_PIECES
from shardwise.engine.surface.layout import Layout
from shardwise.errors import ShardwiseError


def local_only():
    """Within this block ``__torch_function__`` of pieces is off: shardwise's own reads of its parameters'
    attributes (``requires_grad``, ``_version``, ``grad``) pay no Python dispatch. It does not make a piece
    its local tensor: operations still reach the table; read ``local_of(t)`` for that.
    ``torch._C.DisableTorchFunctionSubclass`` is the documented way for a subclass to step aside (torch
    2.11, 2.13)."""
    return torch._C.DisableTorchFunctionSubclass()


class Piece(torch.Tensor):
    """The whole tensor to user code, this rank's elements inside (see the module docstring)."""

    _local: torch.Tensor
    _layout: Layout

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, requires_grad: bool = False):
        r = torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=local.dtype, device=local.device,
                                                requires_grad=requires_grad)
        r._local = local
        r._layout = layout
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return piece_ops.dispatch(func, args, kwargs or {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _BY_OBJECT.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func in _COLLECTIVES:
            _refuse_collective(func, args, kwargs)
        if _routes is not None and torch.is_grad_enabled() and not _about_the_object(func):
            args, kwargs = _routes(args, kwargs)
        outer = _CALL.name is None
        if outer:
            _CALL.name = func
        try:
            with local_only():
                return func(*args, **kwargs)
        except RuntimeError as e:
            if _NO_STORAGE in str(e):  # C++ code that reads a tensor's memory directly: a piece has none
                raise _memory_refusal(user_call() or getattr(func, "__name__", str(func)), args) from None
            raise
        finally:
            if outer:
                _CALL.name = None

    def __repr__(self) -> str:
        lay = self._layout
        what = f"parameter {self._fqn!r}" if getattr(self, "_fqn", None) else "tensor"
        held = "all" if lay.is_whole else f"{lay.local_numel}"
        grad = f", grad_fn=<{type(self.grad_fn).__name__}>" if self.grad_fn is not None else ""
        return (f"shardwise.Piece(whole shape={tuple(lay.shape)}, dtype={self.dtype}, device={self.device}, "
                f"this rank's piece of a sharded {what}: {held} of {lay.numel} elements"
                f"{', requires_grad=True' if self.requires_grad and not grad else ''}{grad})")

    def __hash__(self) -> int:
        return id(self)  # (Tensor.__hash__ would go through __torch_function__: optimizer dicts key on pieces)

    def __reduce_ex__(self, protocol):
        # Pickled (torch.save, a checkpoint dict, copy.deepcopy of a dict holding it is __deepcopy__) as the
        # whole plain tensor, gathered now: every rank must pickle it, as with any collective.
        whole = whole_of(self, "pickling (torch.save) a piece of a sharded tensor", PICKLE_PIECES)
        if _is_param(self):
            whole = torch.nn.Parameter(whole, requires_grad=self.requires_grad)
        return whole.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        # A copy (an EMA of the parameters) is a piece of the same whole: its maths stays exact. It belongs to
        # no flat group: autograd reaches it as any leaf.
        if id(self) not in memo:
            copy = Piece(local_of(self).detach().clone(), self._layout, requires_grad=self.requires_grad)
            if _is_param(self):
                copy._is_param = True
            memo[id(self)] = copy
        return memo[id(self)]

    def __create_write_items__(self, fqn: str, obj):
        # torch.distributed.checkpoint (DCP) takes a plain tensor for a replicated whole and places chunks by
        # this protocol; it has no way to hold our pieces. Refused (DCP raises it on every rank).
        raise ShardwiseError(
            f"torch.distributed.checkpoint of {fqn!r}: a sharded model's parameters are shardwise pieces, which "
            f"DCP cannot save. Use shardwise.save_checkpoint / load_checkpoint (any world size), or "
            f"torch.save(model.state_dict()) on every rank (whole tensors)")


def _is_param(t) -> bool:
    return bool(getattr(t, "_is_param", False))


def local_of(t):
    """This rank's elements of a piece (a plain 1-D tensor), or ``t`` itself for any other value."""
    return t._local if isinstance(t, Piece) else t


def is_piece(t) -> bool:
    return isinstance(t, Piece)


def whole_of(t: torch.Tensor, what: str, op: str = "piece_gather") -> torch.Tensor:
    """The whole tensor a piece stands for (one agreed all-gather over its shard group; every rank must ask)."""
    from shardwise.engine.surface.piece_comm import gather

    return gather(local_of(t), t._layout, what, op)


# ---- what __torch_function__ hands elsewhere ---------------------------------------------------------------
class _Call(threading.local):
    name: Optional[object] = None  # the user's outermost torch call in progress, named in refusals


_CALL = _Call()


def user_call() -> str:
    """The torch function user code called (``torch.einsum``, ``torch.Tensor.__matmul__``), for an error
    text; empty for an attribute access."""
    func = _CALL.name
    if func is None or getattr(func, "__name__", None) in ("__get__", "__set__"):
        return ""
    from torch.overrides import resolve_name

    own = getattr(func, "__name__", None)
    if own and getattr(torch, own, None) is func:  # (resolve_name may give an alias: torch.spmm for torch.mm)
        return f"torch.{own}"
    name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
    return name.replace("torch.functional.", "torch.").replace("torch.nn.functional.", "F.")


_NO_STORAGE = "data is not allocated yet"  # (torch's error reading the memory of a wrapper, 2.11 and 2.13)


def _memory_refusal(name: str, args) -> ShardwiseError:
    t = next((a for a in args if isinstance(a, Piece)), None)
    shape = tuple(t.shape) if t is not None else ()
    held = f"holds {t._layout.local_numel} of its {t._layout.numel} elements" if t is not None else "holds a piece"
    return ShardwiseError(
        f"{name}() on a piece of a sharded parameter or gradient (whole shape {shape}): this rank {held} and no "
        f"memory of the whole to read. Save with torch.save(model.state_dict()) on every rank (whole tensors), "
        f"model.save_pretrained(dir) or shardwise.save_whole_model(model, dir) on every rank (safetensors, "
        f"streamed), or shardwise.full_state_dict(model); read values inside shardwise.summon_full_params(model), or take "
        f"t.detach().clone() of the whole under it")


def _refuse_memory_access(name: str):
    def handler(t, *args, **kwargs):
        if isinstance(t, Piece) and t._layout.is_whole:  # no_shard: the whole is here
            view = local_of(t).view(t._layout.shape)
            return getattr(torch.Tensor, name)(view, *args, **kwargs)
        raise _memory_refusal(f"Tensor.{name}", (t,))
    return handler


_BY_OBJECT: dict = {getattr(torch.Tensor, n): _refuse_memory_access(n) for n in (
    "data_ptr", "const_data_ptr", "mutable_data_ptr", "untyped_storage", "storage", "_typed_storage", "numpy",
    "tolist", "__array__", "__dlpack__") if hasattr(torch.Tensor, n)}


def _detach(t, *args, **kwargs):
    """``Tensor.detach``: as every call (a view of a piece is a piece; of a whole piece, the plain whole), except
    for ``nn.Parameter(p)`` of a whole piece (no_shard), which torch builds from ``p.detach()`` and requires
    to keep the subclass: there it is a whole piece over the same memory, as ``nn.Parameter`` of a piece of
    more ranks is. So ``nn.Parameter(p)`` and the parametrizations that call it after ``shard()``
    (``parametrizations.weight_norm``) reach shardwise's own refusal of a replaced parameter under every
    strategy, not torch's error about ``detach()`` semantics."""
    if isinstance(t, Piece) and t._layout.is_whole and _called_by_parameter_new():
        return Piece(local_of(t).detach(), t._layout)
    with local_only():
        return torch.Tensor.detach(t, *args, **kwargs)


def _called_by_parameter_new() -> bool:
    """Whether ``detach()`` was called by ``nn.Parameter.__new__`` (its custom-tensor path:
    ``data.detach().requires_grad_(...)``, then ``type(t) is type(data)`` or a RuntimeError): the frame
    above ``Piece.__torch_function__``, which called ``_detach``, which called this. ``sys._getframe`` is
    CPython's; checked on torch 2.13."""
    import sys

    try:
        caller = sys._getframe(3)
    except ValueError:  # (no Python frame that deep: detach called from C++ alone)
        return False
    return caller.f_code is torch.nn.Parameter.__new__.__code__


_BY_OBJECT[torch.Tensor.detach] = _detach

# Calls about the tensor object, not its values: never routed through a group's anchor.
_ABOUT_THE_OBJECT = {getattr(torch.Tensor, n) for n in (
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "retain_grad", "detach", "detach_",
    "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "element_size",
    "is_floating_point", "is_complex", "__len__", "storage_offset", "get_device", "__reduce_ex__", "__deepcopy__",
    "__setstate__", "__format__", "__repr__", "share_memory_", "is_shared", "is_pinned", "_is_view", "backward",
    "__hash__", "__dir__", "__iter__") if hasattr(torch.Tensor, n)}




# torch.distributed's collectives on a piece (they call __torch_function__ since torch 2.4): a piece's elements
# differ in number by rank, and user traffic on shardwise's tensors is unagreed (fingerprint.py). Refused on
# every rank alike, before any traffic.
_COLLECTIVES = {getattr(dist, n) for n in (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv") if hasattr(dist, n)}


def _refuse_collective(func, args, kwargs) -> None:
    """A collective on a piece of a sharded tensor is refused by name (a whole one, under no_shard, runs)."""
    found = []
    for a in list(args) + list(kwargs.values()):
        found += [t for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, Piece)]
    if any(not t._layout.is_whole for t in found):
        name = getattr(func, "__name__", str(func))
        raise ShardwiseError(
            f"torch.distributed.{name} on a sharded parameter or its gradient: each rank holds its own elements of "
            f"the whole, a different number on another rank, and a gradient is already averaged over the ranks by "
            f"shardwise (p.grad needs no all_reduce); reduce it with torch's own functions (p.grad.norm(), .sum(): "
            f"exact over the ranks) or read whole values with shardwise.summon_full_params / full_state_dict")


def _about_the_object(func) -> bool:
    return func in _ABOUT_THE_OBJECT or getattr(func, "__name__", None) in ("__get__", "__set__", "__delete__")


_routes: Optional[Callable] = None  # shard_param.route: installs itself (it sits above this module)


def register(by_object: dict, routes: Callable) -> None:
    """shard_param.py's handlers: the calls it owns (``p.grad = ...``, autograd calls) and the routing."""
    global _routes
    _BY_OBJECT.update(by_object)
    _routes = routes


def register_foreach_types() -> None:
    """Let torch's ``clip_grad_norm_`` and optimizers keep their foreach paths for pieces (one exact
    collective per dtype group instead of one per tensor). Private list
    ``torch.utils._foreach_utils._foreach_supported_types``, appended to exactly as torch does for
    ``DTensor`` (checked on torch 2.11 and 2.13)."""
    from torch.utils import _foreach_utils

    types = getattr(_foreach_utils, "_foreach_supported_types", None)
    if isinstance(types, list) and Piece not in types:
        types.append(Piece)


from shardwise.engine.surface import piece_ops  # noqa: E402  (the table dispatches on Piece, defined above)
