"""The closed table: every aten operation that reaches a ``Piece`` is computed exactly or refused by name.

A piece of a shard group of one rank (no_shard, hybrid_shard over groups of one) is whole: every operation runs
on the whole tensor as torch's (``on_whole``); its results are plain tensors (``p.detach()``, ``p.data`` and
``model.state_dict()`` entries are the whole tensor itself), except a dtype conversion, which stays a piece
(``nn.Module._apply``'s ``p.data = p.half()``). Among pieces of more ranks, a whole piece is a plain tensor.
Otherwise ``dispatch`` decides, in this order (at the aten level, where ``CompositeImplicitAutograd`` functions such as
``F.l1_loss``, ``torch.inner``, ``matmul``, ``reshape`` already arrived as their primitives, and autograd's
backward formulas arrive as aten calls too, so gradients through pieces follow the same table):

1. **random** (``rand_like``, ``normal_``, ``uniform_``, ``bernoulli``...: torch's ``nondeterministic_seeded``
   tag): refused. A piece drawn on its own is not one process's draw of its positions.
2. **an explicit rule** (``_RULES`` here, and the reductions of piece_reductions.py).
3. **pointwise** (torch's ``pointwise`` tag, ``copy_``/``fill_``/``zero_``, the ``_foreach_*`` and ``_fused_*``
   optimizer kernels as lists): the operands are pieces of one layout, Python scalars, 0-dim tensors, or
   plain tensors broadcastable to the whole shape (replicated values: each rank takes its elements, the
   ``cut``). The result is a piece of that layout. In place (or ``out=``) into a piece: its local elements
   are written. In place into a plain tensor (``whole.copy_(p)``, an EMA kept as a plain model): the pieces
   are gathered first (one agreed collective each), since the result is the whole.
4. **views** (any aten view): computed on a meta tensor of the whole shape; a view that is a contiguous run
   of the flattened whole (``view``/``reshape``/``flatten``/``unflatten``, ``squeeze``/``unsqueeze``,
   ``detach``, ``p[0]``, ``p[2:5]``, ``narrow``/``split``/``unbind`` along the first dimension) is a piece
   of that run, aliasing the same local memory, so writes through it are exact; any other (``t``,
   ``transpose``, ``permute``, ``expand``, ``p[:, 0]``, ``diagonal``, ``as_strided``) is refused by name:
   it reorders or selects positions this rank cannot tell apart.
5. **a decomposition** in torch's table (``mse_loss``, ``smooth_l1_loss``, ``dist``, ``var``, ``std``,
   ``logsumexp``, ``_softmax``...): run; it calls aten operations that come back here, so it is exact
   or refused piece by piece. Decompositions divide by the whole ``numel``, since that is what a piece
   reports.
6. **everything else** (``mm``, ``bmm``, ``embedding``, ``index``, ``sort``, ``cumsum``, ``argmax``...):
   ``ShardwiseError`` naming the aten operation, the user's call and the parameter.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.engine.surface.layout import Layout, concatenated, same_group
from shardwise.engine.surface.pieces import Piece, local_of, user_call, whole_of
from shardwise.errors import ShardwiseError

aten = torch.ops.aten


def dispatch(func, args: tuple, kwargs: dict):
    pieces = _pieces(args, kwargs)
    if all(p._layout.is_whole for p in pieces):
        if func is aten._to_copy.default:  # (a conversion stays a piece: nn.Module._apply sets it as p.data)
            return _like(func, args, kwargs)
        return on_whole(func, args, kwargs)
    if any(p._layout.is_whole for p in pieces):  # a whole piece among pieces is a plain tensor to them
        args, kwargs = tree_map(_whole_as_plain, (args, kwargs))
    return _decide(func, args, kwargs)


def _whole_as_plain(t):
    return t._local.view(t._layout.shape) if isinstance(t, Piece) and t._layout.is_whole else t


def _decide(func, args: tuple, kwargs: dict):
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise ShardwiseError(
            f"{_called(func)} on {_subject(args, kwargs)}: a random fill draws this rank's elements on their "
            f"own, so the values are not one process's draw of those positions; initialise before shard(), or "
            f"pass shard(param_init_fn=...) on a meta-device model, or draw inside shardwise.summon_full_params")
    rule = _RULES.get(func)
    if rule is not None:
        return rule(func, args, kwargs)
    reduction = piece_reductions.RULES.get(func)
    if reduction is not None:
        return reduction(func, args, kwargs)
    if _is_pointwise(func):
        return pointwise(func, args, kwargs)
    if _is_view(func):
        return view(func, args, kwargs)
    decomposition = decomposition_of(func)
    if decomposition is not None:
        try:
            return decomposition(*args, **kwargs)
        except ShardwiseError:
            raise
        except Exception as e:  # (a decomposition that cannot run on pieces: say which, not how it failed)
            raise refusal(func, args, kwargs, f"its decomposition does not run on pieces ({type(e).__name__})") from e
    raise refusal(func, args, kwargs)


# ---- naming ----------------------------------------------------------------------------------------------
def _pieces(args, kwargs) -> list[Piece]:
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Piece)]


def _subject(args, kwargs) -> str:
    names = [getattr(p, "_fqn", None) for p in _pieces(args, kwargs)]
    named = [n for n in names if n]
    if named:
        return f"sharded parameter {named[0]!r}" + (" (or its gradient)" if len(set(named)) == 1 else " and others")
    return "a piece of a sharded parameter or gradient"


def _called(func) -> str:
    call = user_call()
    return f"{call} ({func})" if call and call != str(func) else str(func)


# Operations whose answer is, or depends on, positions inside the whole tensor.
_POSITIONAL = {"sort", "argsort", "msort", "topk", "kthvalue", "argmax", "argmin", "max", "min", "median",
               "nanmedian", "mode", "quantile", "nanquantile", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
               "unique", "_unique2", "unique_consecutive", "unique_dim", "nonzero", "nonzero_static", "argwhere",
               "searchsorted", "bucketize", "histc", "histogram", "bincount", "flip", "roll", "rot90", "tril", "triu",
               "diag", "diagonal", "trace", "index", "index_select", "gather", "scatter", "index_put",
               "masked_select", "take", "embedding", "embedding_dense_backward"}


def refusal(func, args, kwargs, why: str = "") -> ShardwiseError:
    pieces = _pieces(args, kwargs)
    if not why and func.overloadpacket.__name__.rstrip("_") in _POSITIONAL:
        why = "its answer depends on positions in the whole tensor, which no rank holds"
    shape = tuple(pieces[0].shape) if pieces else ()
    return ShardwiseError(
        f"{_called(func)} on {_subject(args, kwargs)} (whole shape {shape}): "
        f"{why or 'shardwise has no exact rule for it on a tensor sharded across ranks'}. Each rank holds only "
        f"its piece; compute it inside shardwise.summon_full_params(model) (whole parameters), in a tensor hook "
        f"(p.register_hook sees the whole gradient), inside the model's forward (a method registered with "
        f"shardwise.register_forward_method), or before shard()")


# ---- a whole piece runs as the tensor it is -----------------------------------------------------------------
def on_whole(func, args, kwargs):
    """Every piece is the whole (a group of one rank): run on whole-shape views of the local elements;
    the result is what torch returns (an in-place op returns its piece)."""
    views = {}

    def unwrap(t):
        if isinstance(t, Piece):
            v = t._local.view(t._layout.shape)
            views[id(v)] = t
            return v
        return t

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    return tree_map(lambda t: views.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)


# ---- 3: pointwise ----------------------------------------------------------------------------------------
_ALSO_POINTWISE = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
                   aten.masked_fill_.Scalar, aten.masked_fill_.Tensor, aten.where.ScalarOther, aten.where.ScalarSelf,
                   aten.where.Scalar}
_NOT_POINTWISE = {aten.equal.default}  # (tagged pointwise, but a comparison of whole tensors: piece_reductions)


@functools.lru_cache(maxsize=None)
def _is_pointwise(func) -> bool:
    if func in _NOT_POINTWISE:
        return False
    name = func.overloadpacket.__name__
    return (torch.Tag.pointwise in func.tags or func in _ALSO_POINTWISE or name.startswith("_foreach_")
            or name.startswith("_fused_"))


@functools.lru_cache(maxsize=None)
def _written(func) -> tuple[str, ...]:
    """The names of the arguments ``func`` writes into (in place, ``out=``)."""
    return tuple(a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write)


def _arg(func, args, kwargs, name: str):
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name)
    return None


def pointwise(func, args, kwargs):
    if func.overloadpacket.__name__.startswith(("_foreach_", "_fused_")):
        return _foreach(func, args, kwargs)
    written = [_arg(func, args, kwargs, n) for n in _written(func)]
    written = [w for w in written if isinstance(w, torch.Tensor)]
    if any(not isinstance(w, Piece) for w in written):
        return _into_plain(func, args, kwargs)
    layout = _common_layout(func, args, kwargs)
    shapes = [t.shape for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if torch.broadcast_shapes(*shapes) != layout.shape:
        raise refusal(func, args, kwargs, f"it broadcasts the piece to the larger shape "
                                          f"{tuple(torch.broadcast_shapes(*shapes))}")
    local_args, local_kwargs = tree_map(functools.partial(_local_operand, layout), (args, kwargs))
    out = func(*local_args, **local_kwargs)
    if written:
        return written[0] if not isinstance(out, (tuple, list)) else type(out)(written)
    return tree_map(lambda t: Piece(t, layout) if isinstance(t, torch.Tensor) else t, out)


def _common_layout(func, args, kwargs) -> Layout:
    pieces = _pieces(args, kwargs)
    layout = pieces[0]._layout
    for p in pieces[1:]:
        if p._layout != layout:
            raise refusal(func, args, kwargs, _why_layouts_differ(layout, p._layout))
    return layout


def _why_layouts_differ(a: Layout, b: Layout) -> str:
    if a.shape != b.shape:
        return f"its operands are pieces of wholes of different shapes {tuple(a.shape)} and {tuple(b.shape)}"
    return ("its operands are pieces laid out differently across the ranks (two parameters of one shape: each "
            "rank holds other positions of each), so no rank holds matching elements")


def _local_operand(layout: Layout, t):
    """An operand of a pointwise op on pieces of ``layout``, as this rank computes it."""
    if isinstance(t, Piece):
        return t._local
    if not isinstance(t, torch.Tensor):
        return t
    if t.dim() == 0:
        # A 0-dim operand stays 0-dim (type promotion treats it as a scalar), unless the whole is 0-dim too:
        # then every operand of the whole op is 0-dim, and the local ones (1-D) must be dimensioned alike.
        return t.reshape(1) if len(layout.shape) == 0 else t
    if t.numel() == 1:
        return t.reshape(1)
    return layout.cut(t)


def _into_plain(func, args, kwargs):
    """An op that writes a plain tensor from pieces (``whole.copy_(p)``, ``ema.lerp_(p, w)``): the pieces are
    gathered into whole tensors first (one agreed all-gather each), then it runs as torch would."""
    what = f"{_called(func)}, which writes a plain tensor from a piece of a sharded tensor"
    return func(*tree_map(lambda t: whole_of(t, what) if isinstance(t, Piece) else t, args),
                **tree_map(lambda t: whole_of(t, what) if isinstance(t, Piece) else t, kwargs))


def _foreach(func, args, kwargs):
    """``torch._foreach_*`` / ``_fused_*``: index i of every list is one pointwise op on the layout of the
    pieces at index i (plain tensors at an index without pieces pass as they are)."""
    lists = [a for a in list(args) + list(kwargs.values()) if isinstance(a, (list, tuple)) and a]
    n = len(lists[0]) if lists else 0
    layouts: list[Optional[Layout]] = [None] * n
    for lst in lists:
        for i, t in enumerate(lst):
            if isinstance(t, Piece):
                if layouts[i] is None:
                    layouts[i] = t._layout
                elif t._layout != layouts[i]:
                    raise refusal(func, args, kwargs, _why_layouts_differ(layouts[i], t._layout))
    gathered = set()  # indices whose written tensor is plain: their pieces are gathered, as in _into_plain
    for i, lay in enumerate(layouts):
        if lay is not None:
            written = [lst[i] for name in _written(func) for lst in [_arg(func, args, kwargs, name)]
                       if isinstance(lst, (list, tuple)) and not isinstance(lst[i], Piece)]
            if written:
                gathered.add(i)
                layouts[i] = None
    if gathered:  # (an EMA of the parameters kept in plain tensors: AveragedModel's _foreach_lerp_)
        what = f"{_called(func)}, which writes plain tensors from pieces of sharded tensors"

        def whole_at(a):
            if isinstance(a, (list, tuple)) and len(a) == n:
                return [whole_of(t, what) if i in gathered and isinstance(t, Piece) else t for i, t in enumerate(a)]
            return a
        args = tuple(whole_at(a) for a in args)
        kwargs = {k: whole_at(v) for k, v in kwargs.items()}

    def localise(a):
        if isinstance(a, (list, tuple)) and a and len(a) == n:
            return [(_local_operand(layouts[i], t) if layouts[i] is not None else t) for i, t in enumerate(a)]
        return local_of(a)

    out = func(*[localise(a) for a in args], **{k: localise(v) for k, v in kwargs.items()})
    if isinstance(out, (list, tuple)) and len(out) == n:
        return [Piece(t, layouts[i]) if layouts[i] is not None and isinstance(t, torch.Tensor) else t
                for i, t in enumerate(out)]
    return out


# ---- 4: views --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def view(func, args, kwargs):
    x = args[0]
    if not isinstance(x, Piece) or _pieces(args[1:], kwargs):
        raise refusal(func, args, kwargs)
    meta = func(torch.empty(x.shape, dtype=x.dtype, device="meta"), *args[1:], **kwargs)
    single = isinstance(meta, torch.Tensor)
    out = [_view_of(func, args, kwargs, x, m) for m in ([meta] if single else meta)]
    return out[0] if single else type(meta)(out) if isinstance(meta, tuple) else out


def _view_of(func, args, kwargs, x: Piece, m: torch.Tensor) -> Piece:
    lay = x._layout
    if m.dtype != x.dtype or not m.is_contiguous():
        raise refusal(func, args, kwargs, "it reorders or selects positions of the whole tensor (only views that are "
                                          "one contiguous run of it, such as view, reshape, flatten, p[i] and "
                                          "p[i:j] along the first dimension, are pieces again)")
    if m.numel() == lay.numel:
        return Piece(x._local.view(-1), lay.reshaped(m.shape))
    sub, at, n = lay.select(m.storage_offset(), m.numel(), m.shape)
    return Piece(x._local.narrow(0, at, n), sub)


# ---- 2: explicit rules -----------------------------------------------------------------------------------
def _like(func, args, kwargs):
    """``zeros_like(p)``, ``clone(p)``, ``p.to(dtype)``...: a piece of the same layout."""
    x = args[0]
    out = func(x._local, *args[1:], **kwargs)
    return Piece(out, x._layout)


def _new(func, args, kwargs):
    """``p.new_zeros(size)``: a plain tensor of the given size, as torch makes it."""
    x = args[0]
    return func(torch.empty(0, dtype=x.dtype, device=x.device), *args[1:], **kwargs)


def _cat(func, args, kwargs):
    """``torch.cat`` along dimension 0 (``parameters_to_vector``) is the flat concatenation of the wholes: a
    piece whose runs are each operand's, shifted. A plain tensor among them (replicated) is held by the
    group's first rank. Another dimension interleaves the operands: refused."""
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    wholes = [t for t in tensors if t.numel() or t.dim() > 1]  # (torch skips 1-D empty operands)
    ndim = max(t.dim() for t in wholes) if wholes else 1
    if dim not in (0, -ndim):
        raise refusal(func, args, kwargs, "it interleaves its operands along a dimension other than the first")
    meta = func([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors], *args[1:], **kwargs)
    pieces = [t for t in tensors if isinstance(t, Piece)]
    key = pieces[0]._layout.key
    if any(not same_group(p._layout.key, key) for p in pieces):
        raise refusal(func, args, kwargs, "its operands are pieces of different shard groups")
    ref = pieces[0]._layout
    world, rank = len(ref.runs), ref.rank
    layouts, locals_ = [], []
    for t in wholes:
        if isinstance(t, Piece):
            layouts.append(t._layout)
            locals_.append(t._local.to(meta.dtype))
        else:  # a replicated whole: the group's first rank holds it
            runs = tuple((((0, t.numel()),) if r == 0 and t.numel() else ()) for r in range(world))
            layouts.append(Layout(t.shape, runs, rank, key))
            locals_.append(t.reshape(-1).to(meta.dtype) if rank == 0 else t.new_empty(0, dtype=meta.dtype))
    layout = concatenated(layouts, key, rank, world).reshaped(meta.shape)
    local = torch.cat(locals_) if locals_ else torch.empty(0, dtype=meta.dtype, device=meta.device)
    return Piece(local, layout)


def _local_scalar(func, args, kwargs):
    """``.item()``, ``float(t)``, ``bool(t)`` of a one-element whole: the rank holding it says what it is."""
    x = args[0]
    if x._layout.numel != 1:
        raise RuntimeError(f"a Tensor with {x._layout.numel} elements cannot be converted to Scalar")
    return whole_of(x, f"{_called(func)} of a one-element sharded tensor").item()


def _set_metadata(func, args, kwargs):
    raise refusal(func, args, kwargs, "it changes the tensor's storage or shape in place (torch.nn.utils.parametrize, "
                                      "weight_norm and prune do: apply them before shard())")


_RULES: dict = {
    aten.empty_like.default: _like, aten.zeros_like.default: _like, aten.ones_like.default: _like,
    aten.full_like.default: _like, aten.clone.default: _like, aten._to_copy.default: _like,
    aten.new_empty.default: _new, aten.new_zeros.default: _new, aten.new_ones.default: _new,
    aten.new_full.default: _new, aten.new_empty_strided.default: _new,
    aten.cat.default: _cat,
    aten._local_scalar_dense.default: _local_scalar,
    aten.set_.source_Tensor: _set_metadata, aten.set_.source_Storage: _set_metadata,
    aten.set_.source_Storage_storage_offset: _set_metadata, aten.resize_.default: _set_metadata,
    aten.resize_as_.default: _set_metadata,
}


# ---- 6: decompositions -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def decomposition_of(func):
    """torch's decomposition of ``func`` into other aten operations, or None. Private registry
    ``torch._decomp.decomposition_table`` (checked on torch 2.11 and 2.13); the one place it is read."""
    from torch._decomp import decomposition_table

    return decomposition_table.get(func)


from shardwise.engine.surface import piece_reductions  # noqa: E402  (it uses the naming above)
