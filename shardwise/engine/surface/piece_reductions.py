"""Reductions of pieces: this rank's partial result, then one collective over the shard group (``combine``).

Without a dimension (``p.sum()``, ``p.norm()``, ``p.grad.abs().max()``, ``torch.dot``, ``torch.equal``,
``clip_grad_norm_``'s ``_foreach_norm``, ``GradScaler``'s inf check) the partials are scalars. With one
(``p.sum(0)``, ``p.norm(dim=1)``, ``p.amax(-1)``, ``F.normalize``, ``F.cosine_similarity``) the output is a
whole, replicated tensor: each rank reduces its elements into the output positions they belong to (index
arithmetic from its runs), and one all-reduce combines them, exact for sums, maxima, minima, products and
any/all along any dimensions. ``mean``, ``var``/``std`` (two passes) and every vector norm follow from
those. Results are plain tensors, the same on every rank. Autograd differentiates them with torch's own
formulas, which come back to the table as pointwise operations between the piece and the (whole) result:
so a norm's gradient at zero is torch's subgradient 0, as in one process. Reductions that return
positions (``argmax``, ``max(dim)``, ``sort``, ``topk``, ``median``, ``cumsum``...) have no rule: refused.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from shardwise.engine.surface.layout import Layout
from shardwise.engine.surface.piece_comm import combine
from shardwise.engine.surface.piece_ops import _called, refusal
from shardwise.engine.surface.pieces import Piece

aten = torch.ops.aten


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    if t.dtype == torch.float64:
        return torch.float64
    return torch.float32 if t.is_floating_point() else torch.int64


def _identity(how: str, dtype: torch.dtype):
    if how == "sum":
        return 0
    if how == "prod":
        return 1
    big = math.inf if dtype.is_floating_point else torch.iinfo(dtype).max
    return -big if how == "max" else big


def _dims(shape: torch.Size, dim) -> Optional[tuple[int, ...]]:
    """The reduced dimensions, normalised; None: all of them."""
    if dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return None  # (torch: dim=[] reduces every dimension)
    n = max(len(shape), 1)
    return tuple(sorted({d % n for d in dims}))


def reduce(values: torch.Tensor, layout: Layout, how: str, dims: Optional[tuple[int, ...]], keepdim: bool,
           what: str) -> torch.Tensor:
    """``values`` (this rank's elements, in local order) reduced over ``dims`` of the whole (None: all) by
    ``how`` (sum, max, min, prod), combined over the shard group. Float results in float32 (float64 stays),
    integer ones in int64; the caller casts."""
    acc = _acc_dtype(values)
    shape = layout.shape
    if dims is None or len(shape) == 0:
        v = values.to(acc)
        if how == "sum":
            part = v.sum()
        elif how == "prod":
            part = v.prod()
        elif v.numel():
            part = v.amax() if how == "max" else v.amin()
        else:
            part = torch.tensor(_identity(how, acc), dtype=acc, device=v.device)
        total = combine(part.reshape(1), layout.key, how, what)[0]
        return total.reshape([1] * len(shape)) if keepdim else total
    kept = [1 if d in dims else s for d, s in enumerate(shape)]
    index = torch.zeros(values.numel(), dtype=torch.int64, device=values.device)
    pos = layout.positions(values.device)
    stride_in = stride_out = 1
    strides = []
    for d in reversed(range(len(shape))):
        strides.append((d, stride_in, stride_out))
        stride_in *= shape[d]
        stride_out *= kept[d]
    for d, s_in, s_out in strides:
        if d not in dims and shape[d] > 1:
            index += (pos // s_in) % shape[d] * s_out
    out = torch.full((math.prod(kept),), _identity(how, acc), dtype=acc, device=values.device)
    if how == "sum":
        out.index_add_(0, index, values.to(acc))
    else:
        out.scatter_reduce_(0, index, values.to(acc), reduce={"max": "amax", "min": "amin", "prod": "prod"}[how])
    out = combine(out, layout.key, how, what).view(kept)
    if not keepdim:
        out = out.reshape([s for d, s in enumerate(shape) if d not in dims])
    return out


def _what(func, x) -> str:
    name = getattr(x, "_fqn", None)
    return f"{_called(func)} of {f'sharded parameter {name!r}' if name else 'a sharded tensor'}"


def _out_dtype(func, args, kwargs) -> torch.dtype:
    """The dtype torch gives the result (computed on meta tensors of the whole shapes)."""
    meta = func(*[torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a
                  for a in args], **kwargs)
    return (meta[0] if isinstance(meta, (tuple, list)) else meta).dtype


# ---- sums, extremes, products, any/all ---------------------------------------------------------------------
def _bind(func, args, kwargs) -> dict:
    """``func``'s arguments by name, defaults filled in from its schema."""
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _simple(how: str, prepare=None, mean: bool = False):
    """sum / amax / amin / max / min / prod / any / all / count_nonzero, with or without dimensions."""

    def rule(func, args, kwargs):
        bound = _bind(func, args, kwargs)
        x, dim, keepdim, dtype = args[0], bound.get("dim"), bool(bound.get("keepdim")), bound.get("dtype")
        out_dtype = _out_dtype(func, args, kwargs)
        values = x._local
        if dtype is not None:
            values = values.to(dtype)
        if prepare is not None:
            values = prepare(values)
        dims = _dims(x.shape, dim)
        out = reduce(values, x._layout, how, dims, keepdim, _what(func, x))
        if mean:
            count = x._layout.numel if dims is None else math.prod(x.shape[d] for d in dims)
            out = out / count
        return out.to(out_dtype)

    return rule


def _nonzero(v: torch.Tensor) -> torch.Tensor:
    return (v != 0).to(torch.int64)


def _without_nan(v: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(v), torch.zeros((), dtype=v.dtype, device=v.device), v) if v.is_floating_point() else v


# ---- norms ---------------------------------------------------------------------------------------------------
def _norm_partial(values: torch.Tensor, ord: float) -> tuple[torch.Tensor, str]:
    """Per element, what an ``ord``-norm sums (or takes the extreme of), and how."""
    a = values.abs()
    if math.isinf(ord):
        return a, "max" if ord > 0 else "min"
    if ord == 0:
        return (a != 0).to(_acc_dtype(a) if a.is_floating_point() else torch.float32), "sum"
    return a.to(_acc_dtype(a)).pow(ord), "sum"


def _finish_norm(total: torch.Tensor, ord: float) -> torch.Tensor:
    return total if math.isinf(ord) or ord == 0 else total.pow(1.0 / ord)


def _vector_norm(func, args, kwargs):
    bound = _bind(func, args, kwargs)
    x, ord, dim, keepdim, dtype = args[0], float(bound["ord"]), bound["dim"], bool(bound["keepdim"]), bound["dtype"]
    if x.is_complex():
        raise refusal(func, args, kwargs, "complex pieces have no exact rule")
    values = x._local.to(dtype) if dtype is not None else x._local
    part, how = _norm_partial(values, ord)
    total = reduce(part, x._layout, how, _dims(x.shape, dim), keepdim, _what(func, x))
    return _finish_norm(total, ord).to(dtype or x.dtype)


def _foreach_norm(func, args, kwargs):
    """``torch._foreach_norm`` (``clip_grad_norm_``, ``get_total_norm``): one collective per shard group
    among the tensors, whole tensors (plain, or a group of one rank) as they are."""
    bound = _bind(func, args, kwargs)
    tensors, ord, dtype = list(args[0]), float(bound["ord"]), bound["dtype"]
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    by_key: dict[int, list[int]] = {}
    partials: dict[int, torch.Tensor] = {}
    how = "sum"
    for i, t in enumerate(tensors):
        if isinstance(t, Piece) and not t._layout.is_whole:
            part, how = _norm_partial(t._local, ord)
            if how == "sum":
                partials[i] = part.sum()
            elif part.numel():
                partials[i] = part.amax() if how == "max" else part.amin()
            else:
                partials[i] = torch.tensor(_identity(how, part.dtype), dtype=part.dtype, device=part.device)
            by_key.setdefault(t._layout.key, []).append(i)
        else:
            whole = t._local.view(t._layout.shape) if isinstance(t, Piece) else t
            out[i] = torch.linalg.vector_norm(whole, ord, dtype=dtype)
    for key, idx in by_key.items():
        acc = torch.float64 if any(partials[i].dtype == torch.float64 for i in idx) else torch.float32
        totals = combine(torch.stack([partials[i].to(acc) for i in idx]), key, how, _what(func, tensors[idx[0]]))
        for j, i in enumerate(idx):
            out[i] = _finish_norm(totals[j], ord).to(dtype or tensors[i].dtype)
    return tuple(out)


# ---- products of two pieces, comparisons ---------------------------------------------------------------------
def _operands(func, args, kwargs, a, b) -> tuple[torch.Tensor, torch.Tensor, Layout]:
    """This rank's elements of two operands of one whole shape: pieces of one layout or a plain whole."""
    layout = (a if isinstance(a, Piece) else b)._layout
    for t in (a, b):
        if isinstance(t, Piece) and t._layout != layout:
            from shardwise.engine.surface.piece_ops import _why_layouts_differ

            raise refusal(func, args, kwargs, _why_layouts_differ(layout, t._layout))
    return tuple(t._local if isinstance(t, Piece) else layout.cut(t) for t in (a, b)) + (layout,)  # type: ignore


def _dot(func, args, kwargs):
    a, b = args[0], args[1]
    if a.shape != b.shape:
        raise refusal(func, args, kwargs, f"its operands' shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    la, lb, layout = _operands(func, args, kwargs, a, b)
    part = func(la, lb)
    return combine(part.reshape(1), layout.key, "sum", _what(func, a if isinstance(a, Piece) else b))[0].to(part.dtype)


def _agree_all(func, args, kwargs, local_verdict: bool, x) -> bool:
    flag = torch.tensor([int(local_verdict)], dtype=torch.int64)
    return bool(combine(flag, x._layout.key, "min", _what(func, x))[0])


def _equal(func, args, kwargs):
    a, b = args[0], args[1]
    if a.shape != b.shape:
        return False
    la, lb, layout = _operands(func, args, kwargs, a, b)
    return _agree_all(func, args, kwargs, torch.equal(la, lb), a if isinstance(a, Piece) else b)


def _allclose(func, args, kwargs):
    a, b = args[0], args[1]
    la, lb, layout = _operands(func, args, kwargs, a, b)
    return _agree_all(func, args, kwargs, func(la, lb, *args[2:], **kwargs), a if isinstance(a, Piece) else b)


# ---- variance ------------------------------------------------------------------------------------------------
def _moments(func, args, kwargs):
    """var / std / var_mean / std_mean with a correction: the mean first, then the squared deviations."""
    bound = _bind(func, args, kwargs)
    x, dim, correction, keepdim = args[0], bound["dim"], bound["correction"], bool(bound["keepdim"])
    correction = 1 if correction is None else correction
    if x.is_complex() or not x.is_floating_point():
        raise refusal(func, args, kwargs, "only real floating pieces have an exact rule")
    dims = _dims(x.shape, dim)
    count = x._layout.numel if dims is None else math.prod(x.shape[d] for d in dims)
    what = _what(func, x)
    mean = reduce(x._local, x._layout, "sum", dims, True, what) / count
    centered = x._local.to(mean.dtype) - x._layout.cut(mean.reshape([1] * len(x.shape)) if dims is None else mean)
    var = reduce(centered * centered, x._layout, "sum", dims, keepdim, what) / max(0, count - correction)
    name = func.overloadpacket.__name__
    first = (var.sqrt() if name.startswith("std") else var).to(x.dtype)
    if name.endswith("_mean"):
        return first, (mean if keepdim else mean.reshape(first.shape)).to(x.dtype)
    return first


# ---- GradScaler ----------------------------------------------------------------------------------------------
def _non_finite_check(func, args, kwargs):
    """``torch.amp.GradScaler.unscale_``'s kernel: unscale every rank's elements, then agree on found_inf."""
    grads, found_inf, inv_scale = args[0], args[1], args[2]
    func([g._local if isinstance(g, Piece) else g for g in grads], found_inf, inv_scale)
    for key in sorted({g._layout.key for g in grads if isinstance(g, Piece) and not g._layout.is_whole}):
        found_inf.copy_(combine(found_inf.reshape(1), key, "max", "GradScaler's inf check")[0])


RULES: dict = {
    aten.sum.default: _simple("sum"), aten.sum.dim_IntList: _simple("sum"),
    aten.nansum.default: _simple("sum", _without_nan),
    aten.mean.default: _simple("sum", mean=True), aten.mean.dim: _simple("sum", mean=True),
    aten.amax.default: _simple("max"), aten.amin.default: _simple("min"),
    aten.max.default: _simple("max"), aten.min.default: _simple("min"),
    aten.prod.default: _simple("prod"), aten.prod.dim_int: _simple("prod"),
    aten.any.default: _simple("max", _nonzero), aten.any.dim: _simple("max", _nonzero),
    aten.any.dims: _simple("max", _nonzero),
    aten.all.default: _simple("min", _nonzero), aten.all.dim: _simple("min", _nonzero),
    aten.all.dims: _simple("min", _nonzero),
    aten.count_nonzero.default: _simple("sum", _nonzero), aten.count_nonzero.dim_IntList: _simple("sum", _nonzero),
    aten.linalg_vector_norm.default: _vector_norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.dot.default: _dot, aten.vdot.default: _dot,
    aten.var.correction: _moments, aten.std.correction: _moments,
    aten.var_mean.correction: _moments, aten.std_mean.correction: _moments,
    aten.equal.default: _equal, aten.allclose.default: _allclose,
    aten._amp_foreach_non_finite_check_and_unscale_.default: _non_finite_check,
}
