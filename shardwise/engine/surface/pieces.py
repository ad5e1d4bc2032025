"""Pieces: the parameters and gradients of a sharded model know that they are one rank's piece of a whole.

After ``shard()`` each parameter is a 1-D piece of the whole (a ``shard_param.ShardParam``) and so is its
``p.grad`` (a ``ShardGrad``). Element-wise code (optimizers, ``clip_grad_value_``, scaling) is exact on
pieces, but a reduction is not: ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` (the DDP
habit, and what Hugging Face Trainer, Accelerate and Lightning call), ``get_total_norm`` of the gradients or
of the parameters, ``p.grad.norm()``, ``p.norm()``, an L2 penalty written by hand or ``GradScaler``'s inf
check would each see the rank's piece and differ from rank to rank. So both are ``ShardPiece`` subclasses
(plain tensor subclasses over the same memory) whose one ``__torch_function__`` here decides per torch
function, for parameters and gradients alike:

- **exact**: norms (``torch._foreach_norm``, ``linalg.vector_norm``, ``linalg.norm`` and ``Tensor.norm`` of
  a vector, any order), full reductions (``sum``, ``mean``, ``max``/``min``/``amax``/``amin`` without a
  dimension, ``any``, ``all``, ``count_nonzero``), ``dot``, and the inf/nan check of ``torch.amp.GradScaler``:
  the local result is reduced over the shard group in ``_combine`` (one collective per call; one per dtype
  group for ``clip_grad_norm_``, which takes the foreach path because the piece classes are registered as
  foreach types the way torch registers ``DTensor``). Every rank must make the call, as with any collective;
  the ranks first agree on it through the model's fingerprint exchange (``_combine``), so a call made on one
  rank only (``if rank == 0: print(p.grad.norm())``) is a ``ShardwiseError`` on every rank, not a hang or
  a sum paired with another rank's next collective. Sums, means, dots and finite-order norms are
  differentiable (``_through_local``: each piece gets its single-process gradient); a backward through a
  maximum, minimum or count refuses by name.
- **follows the piece**: ``detach``, ``.data``, dtype/device casts, ``clone``, element-wise maths (``abs``,
  ``pow``, ``mul``...), ``view(-1)``/``flatten`` and ``cat`` return a piece again (a ``ShardGrad`` where a
  gradient is among the inputs, else a plain ``ShardPiece``), so ``p.grad.data.float().pow(2).sum()`` and
  ``parameters_to_vector(model.parameters()).norm()`` are exact too.
- **refused** (``ShardwiseError``): functions whose answer depends on positions inside the whole tensor
  (``sort``, ``topk``, ``argmax``, ``median``, ``quantile``, ``std``, ``cumsum``...).
- everything else runs on the local piece and returns a plain tensor (indexing, in-place updates).

Under ``no_shard`` and for a shard group of one rank a piece is whole (key 0): a gradient stays a plain
tensor, a parameter is a ``ShardParam`` whose reductions are the plain local ones (shard_param.py says why it
is one at all). Inside shardwise (our own ``clip_grad_norm_``, which sums norms itself, and the engine's reads
of its parameters) ``local_only()`` turns this off.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from shardwise.engine.base import collectives
from shardwise.errors import ShardwiseError

# key -> (shard process group, device its collectives run on); a key, not the group, rides on each tensor:
# tensors get deep-copied and pickled, process groups cannot be.
_GROUPS: dict[int, tuple] = {}
# key -> weak reference to the fingerprint.CollectiveChecker of the model whose gradients carry the key.
_CHECKERS: dict[int, weakref.ref] = {}


def register_group(group: dist.ProcessGroup, device: torch.device, checker=None) -> int:
    """The key under which gradient pieces of ``group`` find it (one key per process group, device and
    model checker: ``checker`` fingerprints the reductions, see ``_combine``)."""
    for key, (g, d) in _GROUPS.items():
        if g is group and d == device and _checker(key) is checker:
            return key
    key = len(_GROUPS) + 1
    _GROUPS[key] = (group, device)
    if checker is not None:
        _CHECKERS[key] = weakref.ref(checker)
    register_foreach_types()
    return key


def _checker(key: int):
    ref = _CHECKERS.get(key)
    return ref() if ref is not None else None


def as_piece(t: torch.Tensor, key: int, kind: type) -> torch.Tensor:
    """``t`` (a rank's piece of a whole) as a ``kind`` (a ``ShardPiece`` class) over the same memory; it stays
    attached to the autograd graph, so a penalty computed from a parameter's piece differentiates."""
    out = t.as_subclass(kind)
    out._shard_key = key
    return out


def as_shard_grad(piece: torch.Tensor, key: int) -> torch.Tensor:
    """``piece`` (a rank's piece of a gradient) as a ``ShardGrad`` over the same memory."""
    return as_piece(piece, key, ShardGrad)


def local_only():
    """Within this block a piece (``ShardGrad``, ``ShardParam``) behaves as the plain local tensor: shardwise's
    own code (norms, the engine's reads of its parameters) pays no Python dispatch and no collective.
    ``torch._C.DisableTorchFunctionSubclass`` is the documented way for a subclass to step aside (torch
    2.11, 2.13)."""
    return torch._C.DisableTorchFunctionSubclass()


class ShardPiece(torch.Tensor):
    """One rank's 1-D piece of a whole tensor sharded over a shard group: the rules of the module docstring.
    ``ShardGrad`` (a sharded parameter's ``.grad``) and ``shard_param.ShardParam`` (the parameter itself)
    are pieces; what element-wise maths makes of either is a plain ``ShardPiece``."""

    _shard_key: int = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key, kind = _key_of(args, kwargs)
        if not key:  # pieces of a group of one rank (a ShardParam under no_shard) are whole tensors
            with local_only():
                return func(*args, **kwargs)
        handler = _EXACT.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func in _REFUSED:
            raise ShardwiseError(
                f"{_name(func)} on a sharded parameter or its gradient: it is this rank's 1-D piece of the "
                f"whole, and the answer depends on positions in the whole tensor; compute it in a tensor hook "
                f"(p.register_hook, which sees the full gradient) or inside shardwise.summon_full_params")
        if func in _COLLECTIVES:
            raise ShardwiseError(
                f"torch.distributed.{_name(func)} on a sharded parameter or its gradient: it is this rank's 1-D "
                f"piece of the whole, of another size on another rank, and a gradient is already averaged over "
                f"the ranks by shardwise (p.grad needs no all_reduce); reduce it with torch's own functions "
                f"(p.grad.norm(), .sum(): exact over the ranks) or read whole values with "
                f"shardwise.summon_full_params / full_state_dict")
        if func in _RANDOM_FILLS:
            raise ShardwiseError(
                f"{_name(func)} on a sharded parameter: a random fill draws this rank's 1-D piece on its own, so "
                f"the values are not one process's (and pieces of equal size repeat across ranks seeded alike); "
                f"initialise before shard(), or pass shard(param_init_fn=...) on a meta-device model")
        if func in _CONCATENATIONS:
            _refuse_mixed(args[0] if args else kwargs.get("tensors", ()))
        with local_only():
            out = func(*args, **kwargs)
        if func in _FOLLOWS_PIECE:
            if isinstance(out, torch.Tensor) and out.dim() == 1:  # (a view to another shape is no piece)
                return as_piece(out, key, kind)
        return out

    def __reduce_ex__(self, proto):
        # Saved (torch.save, pickle, a copy to another process) as the plain local piece: a file must load
        # with torch.load(weights_only=True), and the process group a key names does not travel.
        return strip(self).__reduce_ex__(proto)


class ShardGrad(ShardPiece):
    """One rank's 1-D piece of a sharded parameter's gradient (see the module docstring)."""


def _refuse_mixed(tensors) -> None:
    """A concatenation of pieces is a piece of the concatenated whole; with a whole tensor among them
    (a gradient of a parameter outside the sharded model) it is neither, and its norm would count the
    whole tensor once per rank."""
    if any(not _is_piece(t) and t.numel() for t in tensors):
        raise ShardwiseError(
            "torch.cat of pieces of sharded parameters or gradients (this rank's pieces) with whole tensors: the result is neither a "
            "piece nor a whole, so its norm or sum would be wrong; reduce the two kinds separately")


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def _is_piece(t) -> bool:
    """A piece of a tensor sharded over more than one rank (a ShardParam under no_shard is whole)."""
    return isinstance(t, ShardPiece) and bool(t._shard_key)


def _key_of(args, kwargs) -> tuple[int, type]:
    """The shard key of the first piece among the arguments, and the class a result that follows the piece
    takes: a ``ShardGrad`` where a gradient is among them, else a plain ``ShardPiece`` (never a parameter)."""
    key, kind = 0, ShardPiece
    for a in list(args) + list(kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, ShardPiece):
                key = key or t._shard_key
                if isinstance(t, ShardGrad):
                    return key, ShardGrad
    return key, kind


def _group(key: int) -> tuple:
    return _GROUPS[key]


# ---- exact reductions ------------------------------------------------------------------------------------
_HOW = ("sum", "max", "min")  # the reduce op, in the fingerprint's group field


def _combine(values: torch.Tensor, key: int, how: str, what: str) -> torch.Tensor:
    """Reduce per-piece partial results (a 1-D float tensor) over the key's shard group: every exact
    reduction goes through here. The call is user code's, outside the unit schedule, so the ranks agree on
    it first (``check_now``, on the side group whatever each rank does next): a rank calling alone meets
    the others' next compare, or the stall watchdog's probe, and every rank raises the disagreement."""
    group, device = _group(key)
    checker = _checker(key)
    if checker is not None:
        checker.check_now("grad_reduction", values.numel(), group=_HOW.index(how))
    buf = values.to(device=device, dtype=torch.float64 if values.dtype == torch.float64 else torch.float32)
    op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[how]
    collectives.run_and_wait(dist.all_reduce, buf, op=op, group=group, what=what)
    return buf.to(values.device)


def _through_local(part: torch.Tensor, total: torch.Tensor, what: str, additive: bool) -> torch.Tensor:
    """``total`` (the reduction over every rank, computed outside autograd), differentiable where ``part``
    (this rank's contribution) is. A sum over the ranks has derivative one in each rank's part, and every
    rank holds the same total in its loss, so each piece gets exactly its single-process gradient (an L2
    penalty added to the loss, a weight-norm regulariser). Maxima, minima and counts get no such
    gradient: their backward refuses by name (the value stays exact for logging)."""
    if not part.requires_grad:
        return total
    if additive:
        return part + (total - part).detach()
    return _Undifferentiable.apply(part, total, what)


class _Undifferentiable(torch.autograd.Function):
    """The exact ``total`` in the forward; a backward through it raises (the same call on every rank)."""

    @staticmethod
    def forward(ctx, part, total, what):
        ctx.what = what
        return total.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ShardwiseError(
            f"backward through {ctx.what} of a sharded parameter: the maximum, minimum or count of a tensor "
            f"sharded across ranks is computed exactly but not differentiated; use a sum or a finite-order norm, "
            f"or compute it inside shardwise.summon_full_params")


def _is_whole_vector(dim) -> bool:
    return dim is None or dim in (0, -1) or (isinstance(dim, (tuple, list)) and list(dim) in ([0], [-1]))


def _wide(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _local_norms(pieces: list[torch.Tensor], ord: float) -> torch.Tensor:
    """Per piece: its ``ord``-partial (sum of |x|^ord, or max/min |x|, or nonzero count), float32/64,
    differentiable where a piece requires a gradient."""
    out = []
    for t in pieces:
        a = t.abs().to(_wide(t))
        if math.isinf(ord):
            out.append((a.max() if ord > 0 else a.min()) if a.numel() else a.new_full((), 0.0 if ord > 0 else math.inf))
        elif ord == 0:
            out.append((a != 0).sum().to(a.dtype))
        else:
            out.append(a.pow(ord).sum())
    return torch.stack(out) if out else torch.zeros(0)


def _finish_norms(partials: torch.Tensor, ord: float) -> torch.Tensor:
    if math.isinf(ord) or ord == 0:
        return partials
    return partials.pow(1.0 / ord)


def _norms(pieces: list[torch.Tensor], ord, what: str) -> list[torch.Tensor]:
    """Exact whole-tensor ``ord``-norms of ``pieces`` (pieces and whole tensors mixed), one collective
    per shard group among them."""
    ord = 2.0 if ord is None or ord == "fro" else float(ord)
    if ord < 0 and not math.isinf(ord):
        raise ShardwiseError(f"{what} of order {ord} over sharded parameters or gradients is not supported")
    with local_only():
        partials = _local_norms(pieces, ord)
        totals = partials.detach().clone()
        keys = sorted({t._shard_key for t in pieces if _is_piece(t)})
        for key in keys:
            idx = [i for i, t in enumerate(pieces) if _is_piece(t) and t._shard_key == key]
            how = "sum" if not math.isinf(ord) else ("max" if ord > 0 else "min")
            totals[idx] = _combine(totals[idx], key, how, what)
        results = _through_local(partials, totals, what, additive=not math.isinf(ord) and ord != 0)
        return list(_finish_norms(results, ord).unbind(0)) if pieces else []


def _out_dtype(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    return dtype or (t.dtype if t.is_floating_point() or t.is_complex() else torch.float32)


def _foreach_norm(tensors, ord=2, dtype=None):
    norms = _norms(list(tensors), ord, "torch._foreach_norm")
    return tuple(n.to(_out_dtype(t, dtype)) for n, t in zip(norms, tensors))


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    if not _is_whole_vector(dim) or out is not None:
        return _refuse_partial("torch.linalg.vector_norm", "dim/out")
    (n,) = _norms([x], ord, "torch.linalg.vector_norm")
    n = n.to(_out_dtype(x, dtype))
    return n.reshape(1) if keepdim else n


def _tensor_norm(x, p="fro", dim=None, keepdim=False, dtype=None, out=None):
    if p == "nuc" or not _is_whole_vector(dim) or out is not None:
        return _refuse_partial("norm", f"p={p!r}/dim/out")
    return _vector_norm(x, p, dim, keepdim, dtype=dtype)


def _linalg_norm(x, ord=None, dim=None, keepdim=False, *, dtype=None, out=None):
    if ord in ("fro", "nuc") or not _is_whole_vector(dim) or out is not None:
        return _refuse_partial("torch.linalg.norm", f"ord={ord!r}/dim/out")
    return _vector_norm(x, 2 if ord is None else ord, dim, keepdim, dtype=dtype)


def _refuse_partial(what: str, how: str):
    raise ShardwiseError(f"{what} with {how} on a sharded parameter or its gradient: it is this rank's 1-D "
                         f"piece; only whole-tensor norms and reductions are computed exactly across ranks")


def _full_reduction(name: str, how: str, finish=None):
    local = getattr(torch.Tensor, name)

    def handler(x, *rest, **kwargs):
        if rest and isinstance(rest[0], torch.Tensor):  # torch.max(a, b): element-wise, stays a piece
            with local_only():
                return as_piece(local(x, *rest, **kwargs), *_key_of((x,) + rest, kwargs))
        dim = rest[0] if rest else kwargs.pop("dim", None)
        if not _is_whole_vector(dim) or (dim is not None and name in ("max", "min")):
            return _refuse_partial(f"Tensor.{name}", "a dimension")  # (max/min with a dim return positions)
        keepdim = kwargs.pop("keepdim", False)
        what = f"Tensor.{name}"
        with local_only():
            if x.numel() == 0 and name in ("max", "min", "amax", "amin"):
                part = torch.tensor(-math.inf if how == "max" else math.inf, dtype=x.dtype, device=x.device)
            else:
                part = local(x, **kwargs)
            wide = part.reshape(1).to(_wide(part))
            value = _combine(wide.detach(), x._shard_key, how, f"{what} of a sharded parameter or gradient")
            value = _through_local(wide, value, what, additive=how == "sum")[0]
            if finish is not None:
                value = finish(x, value)
            value = value.to(part.dtype)
            return value.reshape(1) if keepdim else value
    return handler


def _mean_finish(x, total):
    count = _combine(torch.tensor([float(x.numel())]), x._shard_key, "sum", "Tensor.mean of a sharded parameter or gradient")
    return total / count[0].to(total.device)


def _dot(a, b, *, out=None):
    key, _ = _key_of((a, b), {})
    with local_only():
        part = torch.dot(a, b).reshape(1)
        total = _combine(part.detach().float(), key, "sum", "torch.dot of sharded parameters or gradients")
        return _through_local(part.float(), total, "torch.dot", additive=True)[0].to(part.dtype)


def _non_finite_check(grads, found_inf, inv_scale):
    """``torch.amp.GradScaler.unscale_``'s kernel: unscale locally, then agree on found_inf."""
    with local_only():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        for key in sorted({g._shard_key for g in grads if _is_piece(g)}):
            found_inf.copy_(_combine(found_inf.reshape(1).float(), key, "max", "GradScaler's inf check")[0])


def _bool_reduction(name: str, how: str):
    def handler(x, *rest, **kwargs):
        if rest or kwargs.get("dim") is not None:
            return _refuse_partial(f"Tensor.{name}", "a dimension")
        with local_only():
            part = getattr(torch.Tensor, name)(x).float().reshape(1)
            return _combine(part, x._shard_key, how, f"Tensor.{name} of a sharded parameter or gradient")[0].bool()
    return handler


def _count_nonzero(x, dim=None):
    if dim is not None:
        return _refuse_partial("torch.count_nonzero", "a dimension")
    with local_only():
        part = torch.count_nonzero(x).double().reshape(1)
        return _combine(part, x._shard_key, "sum", "count_nonzero of a sharded parameter or gradient")[0].long()


_EXACT = {
    torch._foreach_norm: _foreach_norm,
    torch.linalg.vector_norm: _vector_norm,
    torch.linalg.norm: _linalg_norm,
    torch.norm: _tensor_norm,
    torch.Tensor.norm: _tensor_norm,
    torch.dot: _dot,
    torch.Tensor.dot: _dot,
    torch._amp_foreach_non_finite_check_and_unscale_: _non_finite_check,
    torch.count_nonzero: _count_nonzero,
    torch.Tensor.count_nonzero: _count_nonzero,
}
for _fn, _how in (("sum", "sum"), ("max", "max"), ("min", "min"), ("amax", "max"), ("amin", "min")):
    _EXACT[getattr(torch.Tensor, _fn)] = _EXACT[getattr(torch, _fn)] = _full_reduction(_fn, _how)
_EXACT[torch.Tensor.mean] = _EXACT[torch.mean] = _full_reduction("sum", "sum", _mean_finish)
for _fn, _how in (("any", "max"), ("all", "min")):
    _EXACT[getattr(torch.Tensor, _fn)] = _EXACT[getattr(torch, _fn)] = _bool_reduction(_fn, _how)

# torch.distributed's collectives on a piece (they call __torch_function__ since torch 2.4): a piece's size
# differs by rank, so the ranks would pair different sizes at the wire. Refused on every rank alike, no traffic.
_COLLECTIVES = {getattr(dist, n) for n in (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv") if hasattr(dist, n)}

_REFUSED = {getattr(mod, n) for mod in (torch, torch.Tensor) for n in (
    "sort", "argsort", "msort", "topk", "kthvalue", "argmax", "argmin", "median", "nanmedian", "mode", "quantile",
    "nanquantile", "std", "var", "std_mean", "var_mean", "cumsum", "cumprod", "cummax", "cummin", "logsumexp",
    "histc", "prod", "nansum", "nanmean") if hasattr(mod, n)}

# In-place random fills (``model.apply(init)`` after ``shard()``; nn.init's trunc_normal_ and xavier_*_ reach
# Tensor.uniform_/normal_): a piece drawn on its own is not the single-process draw of its positions.
_RANDOM_FILLS = {getattr(torch.Tensor, n) for n in (
    "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_", "cauchy_")}
_RANDOM_FILLS |= {getattr(torch.nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_")}

_CONCATENATIONS = {torch.cat, torch.concat}
_FOLLOWS_PIECE = {torch.Tensor.data.__get__} | _CONCATENATIONS
_FOLLOWS_PIECE |= {getattr(torch.Tensor, n) for n in (
    "detach", "clone", "to", "float", "double", "half", "bfloat16", "cpu", "cuda", "contiguous", "abs", "neg",
    "pow", "square", "sqrt", "mul", "div", "add", "sub", "__mul__", "__rmul__", "__truediv__", "__add__",
    "__radd__", "__sub__", "__rsub__", "__neg__", "__abs__", "__pow__", "clamp", "clip", "sign", "isfinite",
    "isnan", "isinf", "logical_not", "__invert__", "flatten", "ravel", "view", "reshape", "type_as", "conj",
    "nan_to_num", "exp", "log", "float_power", "__and__", "__or__", "ne", "eq", "gt", "lt", "ge", "le",
    "__ne__", "__eq__", "__gt__", "__lt__", "__ge__", "__le__", "where", "masked_fill")
    if hasattr(torch.Tensor, n)}
_FOLLOWS_PIECE |= {getattr(torch, n) for n in (
    "abs", "pow", "square", "sqrt", "mul", "div", "add", "sub", "clamp", "clip", "sign", "isfinite", "isnan",
    "isinf", "flatten", "ravel", "reshape", "nan_to_num", "where", "exp", "log") if hasattr(torch, n)}


_FOREACH_TYPES: list[type] = [ShardPiece, ShardGrad]  # (shard_param.py adds ShardParam)
_foreach_registered = False


def register_foreach_types() -> None:
    """Let torch's optimizers and ``clip_grad_norm_`` keep their foreach (and fused) paths for parameters and
    gradients that are pieces (one exact collective per dtype group instead of one per tensor). Private list
    ``torch.utils._foreach_utils._foreach_supported_types``, appended to exactly as torch does for
    ``DTensor`` (checked on torch 2.11 and 2.13)."""
    global _foreach_registered
    if _foreach_registered:
        return
    from torch.utils import _foreach_utils

    types = getattr(_foreach_utils, "_foreach_supported_types", None)
    if isinstance(types, list):
        types.extend(t for t in _FOREACH_TYPES if t not in types)
    _foreach_registered = True


def strip(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A plain tensor over the same memory (for code that must not see a piece)."""
    if isinstance(t, ShardPiece):
        with local_only():
            return t.as_subclass(torch.Tensor)
    return t


