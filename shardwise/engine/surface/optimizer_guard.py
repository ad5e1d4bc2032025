"""What happens around every ``torch.optim.Optimizer`` step: the process-wide step hooks, both here.

Before a step, the checks below, then the swap to plain local parameters (optimizer_swap.py: the step pays no
Python dispatch); after it, the swap back, and every gathered copy of a shard kept across steps (ZeRO-1/2) is
refilled at its next unshard (``flat_group.mark_kept_copies_stale``).

An optimizer steps this rank's elements of each parameter (its local parameter). That is exactly the step of
the whole only if it updates each element from that element's own values and the optimizer's scalars: the
*elementwise* family. Three things are checked, each once per optimizer (again when its parameter count
changes, or its state is replaced by ``load_state_dict``), so a step costs a dict lookup:

- **parameters from before ``shard()``** (retired: their memory is gone): refused.
- **the optimizer class**: over pieces (a shard group of more than one rank), only the elementwise torch
  optimizers below, their subclasses that keep their ``step``, and shardwise's own are accepted. LBFGS
  (line search over the whole vector), Adafactor (row/column factors of a matrix), torch's Muon
  (orthogonalises a matrix), SparseAdam and any unknown class are refused by name, unless the user
  declares the class with ``shardwise.allow_optimizer`` (an explicit opt-in: "this class updates each
  element from that element alone", or "I accept the per-piece result").
- **whose state it holds**: an optimizer steps each piece's local parameter, so during the step
  ``optimizer.state`` holds plain tensors of this rank's elements; between steps it shows them as pieces of
  their parameters (optimizer_swap.py). ``optimizer.state_dict()`` returns them as pieces of their
  parameters (``Piece``: the whole tensor to user code, no copy), so, as under DDP, the dict holds the
  whole state: ``torch.save`` of it on every rank writes whole tensors (one agreed all-gather each; on one
  rank alone it is refused by name, as for the model's), and ``load_state_dict`` of a whole state,
  saved at any world size or plan, or of the pieces themselves, steps exactly: at the first step after the
  state was replaced, every entry is made this rank's elements again (a whole tensor cut by the piece's
  layout) and checked against the piece it now sits on, and the ranks agree on the verdict (one
  all-reduce), so a state that is not the parameter's raises ``ShardwiseError`` on every rank instead of
  stepping with the wrong moments. A state of this rank's elements (shardwise's own checkpoints, which
  reshard; a state kept on the host by an offloading optimizer) is accepted when its tensors have the
  pieces' shapes and, where it was saved with a stamp (``STAMP_KEY``: name, element range, size), the
  stamp is this piece's.
"""

from __future__ import annotations

import gc
import inspect
import sys
import weakref
import zlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.base import collectives
from shardwise.engine.base.torch_internals import optimizer_ever_built
from shardwise.engine.core.flat_group import mark_kept_copies_stale
from shardwise.engine.core.unit import refill_units_stepped
from shardwise.engine.surface import optimizer_swap
from shardwise.engine.surface.pieces import Piece
from shardwise.engine.surface.shard_param import where_of
from shardwise.errors import ShardwiseError

STAMP_KEY = "shardwise_piece"
# optimizer -> its _Guard; beside the optimizer, not in it: a guard holds flat groups (and through them
# process groups), which copy.deepcopy(optimizer) or pickling it must not meet.
_GUARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# Verified elementwise per element (torch 2.13 sources): every per-parameter tensor of state has the
# parameter's shape and is updated from the same element of param/grad/state; the rest are scalars that
# depend only on the step count and hyperparameters (NAdam's mu_product, ASGD's eta/mu, RAdam's rho).
_ELEMENTWISE = {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
                torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Adadelta,
                torch.optim.Rprop}
_allowed: set = set()  # shardwise.allow_optimizer and shardwise's own optimizers


def allow_optimizer(optimizer_cls: type) -> type:
    """Accept ``optimizer_cls`` over sharded parameters although shardwise cannot tell it is elementwise.

    After ``shard()`` an optimizer steps this rank's elements of every parameter (a plain 1-D tensor); a class
    that updates each element from that element's own values (and scalars) steps them exactly as it would
    the whole.
    Declare such a class here (a custom Adam variant, bitsandbytes' 8-bit Adam if its block-wise
    quantisation per piece is acceptable to you). Anything that looks across a parameter (norms, matrix
    factors, orthogonalisation, line search) will silently compute per piece. Returns the class, so it
    can decorate one."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise ShardwiseError(f"shardwise.allow_optimizer takes a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
    _allowed.add(optimizer_cls)
    return optimizer_cls


_delegating: set = set()  # optimizers whose step only steps inner optimizers (offload_optimizer): not swapped


def delegates_step(optimizer_cls: type) -> type:
    """``optimizer_cls.step`` steps other optimizers over the same parameters, never the parameters itself:
    those are swapped to local parameters, not it (shardwise's offload optimizer)."""
    _delegating.add(optimizer_cls)
    return optimizer_cls


def _step_function(cls: type):
    # torch wraps ``step`` of every class it instantiates (profiling, hooks): compare the functions inside.
    return inspect.unwrap(getattr(cls, "step", None))


def is_elementwise(cls: type) -> bool:
    """Whether ``cls`` is (or subclasses, keeping the ``step`` of) an accepted optimizer class."""
    if cls in _allowed or cls in _ELEMENTWISE:
        return True
    step = _step_function(cls)
    return any(issubclass(cls, base) and _step_function(base) is step for base in _ELEMENTWISE | _allowed)


class _Guard:
    """What is known about one optimizer (kept in ``_GUARDS``)."""

    __slots__ = ("numel", "pieces", "state", "swap", "retirements", "_groups")

    def __init__(self, numel: int, pieces: list, swap: Optional[optimizer_swap.Swap]):
        self.numel = numel
        self.retirements = _retirements  # shard() calls seen when it was made (``install``)
        self.pieces = pieces  # [(index in param order, param, FlatGroup, index in group)] of pieces
        self.state = None  # the state dict object last verified: load_state_dict replaces it
        self.swap = swap  # None: the optimizer does not step its parameters itself (a wrapper, a delegator)
        self._groups = None

    def groups(self) -> list:
        """The flat groups of the pieces it steps, each once."""
        if self._groups is None:
            self._groups = list({id(g): g for _i, _p, g, _gi in self.pieces}.values())
        return self._groups


def _params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def adopt_in_live_optimizers(retired: list) -> None:
    """At the end of ``shard()``: every optimizer alive in this process that holds parameters ``retired`` by
    this call, and no state for them, takes their shard parameters now rather than at its first step, so code
    between ``shard()`` and that step reads the model's parameters from ``optimizer.param_groups`` as under DDP
    (clipping over the groups' params before the first step would otherwise see ``None`` gradients and clip
    nothing: another model). An optimizer holding state for them is left to its first step, whose adoption
    agrees the state across ranks (a collective, and the optimizers found here may differ by rank: uncollected
    garbage). Other optimizers, and parameters retired by an earlier ``shard()``, are not touched. Found by a
    walk of the garbage collector's objects: an optimizer is not reachable from the model."""
    ids = {id(p) for p in retired}
    # The walk costs ~0.2 s at half a million objects: only where something can hold a retired parameter.
    if not ids or not _held_elsewhere(retired) or not optimizer_ever_built():
        return
    for obj in gc.get_objects():
        # (type(), not isinstance: isinstance reads __class__, which some module proxies answer with a warning)
        if not issubclass(type(obj), torch.optim.Optimizer):
            continue
        groups = [g["params"] for g in getattr(obj, "param_groups", None) or ()
                  if isinstance(g, dict) and isinstance(g.get("params"), list)]
        if not any(id(p) in ids for params in groups for p in params):
            continue
        state = getattr(obj, "state", None) or {}
        if any(id(p) in ids and state.get(p) for p in state):
            continue
        for params in groups:
            for i, p in enumerate(params):
                if id(p) in ids:
                    params[i] = p._shardwise_successor()


def _held_elsewhere(retired: list) -> bool:
    """Whether anything but ``retired`` references one of its parameters (an optimizer's group, a state dict,
    a user's list): Python reference counts, against a parameter held only by a list, read the same way.
    Exact where it matters: a list that holds a parameter adds one reference; other holders only cost a walk."""
    probe = [nn.Parameter(torch.empty(0))]
    alone = _references(probe, 0)
    return any(_references(retired, i) > alone for i in range(len(retired)))


def _references(items: list, i: int) -> int:
    return sys.getrefcount(items[i])


def adopt_successors(optimizer) -> None:
    """An optimizer built before ``shard()`` (nanoGPT's order: ``configure_optimizers``, and on resume its
    ``load_state_dict``, then the DDP wrapper) holds the original parameters, which shard() retired. Each is
    replaced, in place, by its shard parameter, so its groups (weight decay by ``p.dim()``, learning rates)
    stay as the user built them, as with DDP, whose parameters are the originals. A state it holds for them
    (loaded, or stepped, before shard()) is whole tensors of the originals: the ranks agree that it is the
    same state (a checksum, one agreed all-reduce), and each keeps its elements of it, as from a whole
    state loaded after shard(). Called on every rank alike (a step, a checkpoint save)."""
    adopted = []
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            fqn = getattr(p, "_shardwise_retired", None)
            if fqn is None:
                continue
            successor = p._shardwise_successor()
            if successor is None:
                raise ShardwiseError(
                    f"{type(optimizer).__name__} holds parameter {fqn!r} from before shardwise.shard(), of a "
                    f"sharded model that no longer exists; build the optimizer from the model's parameters")
            params[i] = successor
            state = optimizer.state.pop(p, None)
            if state:
                optimizer.state[successor] = state
                adopted.append((fqn, successor, state))
    if adopted:
        _agree_adopted(optimizer, adopted)


def _agree_adopted(optimizer, adopted: list) -> None:
    """The whole state an optimizer held for the parameters before shard() is the same on every rank (else
    each rank's elements would come from another state: refused by name); then this rank's elements."""
    digest = 0
    for fqn, _p, state in adopted:
        for name in sorted(state):
            value = state[name]
            if isinstance(value, torch.Tensor):
                raw = value.detach().reshape(-1).cpu().contiguous().view(torch.uint8)
                digest = zlib.crc32(raw.numpy().tobytes(), zlib.crc32(f"{fqn}|{name}".encode(), digest))
    spread = torch.tensor([digest, -digest], dtype=torch.int64)
    for pg, device, checker in _groups_of([where_of(p)[0] for _f, p, _s in adopted]):
        flag = spread.to(device)
        collectives.run_agreed(checker, "optimizer_state_check", dist.all_reduce, flag, op=dist.ReduceOp.MAX,
                               group=pg, what="the agreement on an optimizer state held from before shard()")
        spread = flag.cpu()
    if int(spread[0]) != -int(spread[1]):
        raise ShardwiseError(
            f"{type(optimizer).__name__} holds optimizer state for {len(adopted)} parameter(s) from before "
            f"shardwise.shard() (first {adopted[0][0]!r}) that differs across ranks; load or step the same state "
            f"on every rank before shard(), or load it after shard() (optimizer.load_state_dict)")
    for _fqn, p, state in adopted:
        _as_local_entry(p, state)


def _examine(optimizer) -> _Guard:
    adopt_successors(optimizer)
    params = _params(optimizer)
    pieces = []
    for i, p in enumerate(params):
        where = where_of(p)
        if where is not None and isinstance(p, Piece):  # a shard parameter
            pieces.append((i, p) + tuple(where))
    cls = type(optimizer)
    wrapper = _is_wrapper(optimizer)
    if pieces and not wrapper and not is_elementwise(cls):
        name = f"{cls.__module__}.{cls.__qualname__}"
        raise ShardwiseError(
            f"{name} is not a known elementwise optimizer, and after shardwise.shard() it would step each rank's "
            f"elements of parameter {pieces[0][2].plan.params[pieces[0][3]].fqn!r} (and every other) as if they "
            f"were the whole parameter: norms, matrix factors or line searches would be per piece. Use an "
            f"elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, ASGD, Adadelta, "
            f"Rprop), shardwise.optim.Muon, or, if {cls.__name__} does update each element from that element "
            f"alone, call shardwise.allow_optimizer({cls.__name__}) first")
    steps_itself = pieces and not wrapper and not isinstance(optimizer, tuple(_delegating))
    return _Guard(len(params), pieces, optimizer_swap.Swap(optimizer) if steps_itself else None)


def _is_wrapper(optimizer) -> bool:
    """An optimizer that only forwards to an inner one over the same param groups (accelerate's
    AcceleratedOptimizer): the inner optimizer's own step is checked."""
    inner = getattr(optimizer, "optimizer", None)
    return isinstance(inner, torch.optim.Optimizer) and inner.param_groups is optimizer.param_groups


def stamp_of(p: torch.Tensor) -> Optional[int]:
    """The identity of this rank's piece of shard parameter ``p``: name, element range, full size."""
    where = where_of(p)
    if where is None:
        return None
    group, i = where
    spec = group.plan.params[i]
    lo, hi, _ = group.local_slices[i]
    return zlib.crc32(f"{spec.fqn}|{lo}|{hi}|{spec.numel}".encode())


def _problem(p: torch.Tensor, state: dict) -> Optional[str]:
    """Make a just-loaded entry this rank's elements (see the module docstring); what is wrong with it, or None."""
    saved = state.pop(STAMP_KEY, None)
    if saved is not None and saved != stamp_of(p):
        return ("was saved per rank for a different piece of it (another rank, world size or plan): state "
                "stamped with its piece loads only where it was saved")
    _as_local_entry(p, state)
    local = p._local
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != local.shape:
            return (f"holds {name!r} of shape {tuple(value.shape)}, but the parameter's shape is {tuple(p.shape)} "
                    f"(this rank's piece: {tuple(local.shape)})")
    return None


def _as_local_entry(p: torch.Tensor, state: dict) -> None:
    """Each of ``state``'s tensors that stands for the whole parameter made this rank's elements, in place."""
    local = p._local
    for name, value in state.items():
        if isinstance(value, Piece) and value._layout == p._layout:
            # optimizer.state_dict()'s own pieces, or state made from the piece outside a step (Adagrad's
            # constructor: full_like(p)): the optimizer steps the local parameter, so its state is this
            # rank's elements.
            state[name] = value._local
        elif (isinstance(value, torch.Tensor) and not isinstance(value, Piece) and value.shape == p.shape
              and value.shape != local.shape):
            # A whole state (torch.save of state_dict() and back, at any world size or plan): this rank's
            # elements, copied so the whole is not kept alive.
            state[name] = p._layout.cut(value.to(local.device)).clone(memory_format=torch.contiguous_format)


def verify_state(optimizer, guard: _Guard) -> None:
    """Every piece's state belongs to that piece, agreed over the shard groups (see the module docstring)."""
    first_bad, why = 0, None
    for i, p, group, gi in guard.pieces:
        state = optimizer.state.get(p)
        problem = _problem(p, state) if state else None
        if problem is not None and not first_bad:
            first_bad, why = i + 1, problem  # (the loop goes on: every entry's stamp is removed)
    verdict = torch.tensor([first_bad], dtype=torch.int64)
    for pg, device, checker in _shard_groups(guard):
        flag = verdict.to(device)  # agreed first: a rank stepping alone is named, not paired with another's collective
        collectives.run_agreed(checker, "optimizer_state_check", dist.all_reduce, flag, op=dist.ReduceOp.MAX,
                               group=pg, what="the optimizer-state ownership check")
        verdict = flag.cpu()
    bad = int(verdict[0])
    if bad:
        params = _params(optimizer)
        where = where_of(params[bad - 1])
        fqn = where[0].plan.params[where[1]].fqn
        detail = why if bad == first_bad else "on another rank of its shard group (see that rank's error)"
        raise ShardwiseError(
            f"{type(optimizer).__name__}'s state for parameter {fqn!r} {detail}: load a state that "
            f"optimizer.state_dict() returned for this model (whole tensors, saved with torch.save on every rank), "
            f"or use shardwise.save_checkpoint / load_checkpoint")


def _shard_groups(guard: _Guard) -> list:
    """The process groups over which the verdict is agreed (``_groups_of`` the pieces' flat groups)."""
    return _groups_of([group for _i, _p, group, _gi in guard.pieces])


def _groups_of(flat_groups: list) -> list:
    """The shard and replicate groups of the parameters' models (every rank that steps them; MAX over one,
    then the other, is MAX over all), each with the device and the fingerprint checker of its model."""
    seen, out = set(), []
    for group in flat_groups:
        for pg in (group.pgs.shard, group.pgs.replicate):
            if pg is not None and id(pg) not in seen:
                seen.add(id(pg))
                out.append((pg, group.device, group.checker))
    return out


def _whole_state_dict(optimizer, state_dict: dict) -> dict:
    """``register_state_dict_post_hook``: each piece's entry of the returned dict (a copy: the entries are
    ``optimizer.state``'s own dicts) holds its tensors of this rank's elements as pieces of the parameter,
    the whole state to user code and to torch.save, as DDP's is. An entry with such a tensor elsewhere (an
    offloading optimizer's host copy) stays this rank's elements, stamped with its piece."""
    guard = _GUARDS.get(optimizer)
    if guard is None:
        return state_dict
    index = {id(p): i for i, p in enumerate(_params(optimizer))}  # state_dict() numbers params in this order
    packed = state_dict["state"]
    for _i, p, _g, _gi in guard.pieces:
        k = index.get(id(p))
        if k not in packed:
            continue
        local, entry, stamped = p._local, dict(packed[k]), False
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, Piece) and value.dim() > 0 \
                    and value.shape == local.shape:
                if value.device == local.device:
                    entry[name] = Piece(value, p._layout)
                else:
                    stamped = True
        if stamped:
            entry[STAMP_KEY] = stamp_of(p)
        packed[k] = entry
    return state_dict


def examine(optimizer) -> _Guard:
    """The optimizer's guard, (re)built when its parameters changed: raises for retired parameters and
    optimizer classes that are not elementwise over pieces."""
    guard = _GUARDS.get(optimizer)
    numel = sum(len(g["params"]) for g in optimizer.param_groups)
    if guard is not None and guard.swap is not None and not guard.swap.current(optimizer):
        guard = None  # (param groups replaced: prepare again)
    if guard is None or guard.numel != numel or guard.retirements != _retirements:
        if optimizer not in _GUARDS and hasattr(optimizer, "register_state_dict_post_hook"):  # public since 2.3
            optimizer.register_state_dict_pre_hook(restore_swap)
            optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: restore_swap(opt))
            optimizer.register_state_dict_post_hook(_whole_state_dict)
        guard = _examine(optimizer)
        _GUARDS[optimizer] = guard
    return guard


def show_state_as_pieces(optimizer) -> None:
    """After ``shardwise.load_checkpoint`` put this rank's elements in ``optimizer.state``: each shown as a piece
    of its parameter, as after a step (optimizer_swap.state_as_pieces), so reads before the first step see the
    whole state too."""
    guard = examine(optimizer)
    if guard.swap is None or not optimizer_swap.shows_state_as_pieces(optimizer):
        return
    for _i, p, _g, _gi in guard.pieces:
        entry = optimizer.state.get(p)
        if entry:
            optimizer_swap.state_as_pieces(entry, p, guard.swap.state_pieces)


def restore_swap(optimizer) -> None:
    """Undo the swap of a step that raised (optimizer_swap.py), before anything else reads the optimizer."""
    guard = _GUARDS.get(optimizer)
    if guard is not None and guard.swap is not None:
        optimizer_swap.restore(optimizer, guard.swap)


def verify_loaded(optimizer) -> None:
    """Check a just-loaded state now (every rank loads together): for optimizers that step in backward."""
    guard = examine(optimizer)
    if guard.pieces:
        verify_state(optimizer, guard)
        guard.state = optimizer.state


def before_step(optimizer, args, kwargs):
    restore_swap(optimizer)
    guard = examine(optimizer)
    if guard.pieces and optimizer.state is not guard.state and not optimizer.__dict__.get("_shardwise_inner"):
        verify_state(optimizer, guard)
        guard.state = optimizer.state
    if guard.swap is not None:
        optimizer_swap.swap_in(optimizer, guard.swap)
        return _closure_outside_the_swap(optimizer, guard.swap, args, kwargs)
    return None


def _closure_outside_the_swap(optimizer, swap, args, kwargs):
    """``step(closure)`` (Lightning's automatic optimisation, ``closure`` in any loop) computes the gradients
    inside the step: the closure runs with the pieces back in the param groups (its ``zero_grad`` and
    backward reach the pieces' gradients), and the swap is redone after it, with the fresh gradients. torch
    lets a step pre-hook return new (args, kwargs)."""
    # (``args`` starts with the optimizer itself: torch's wrapper hands the hooks step's own arguments)
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None

    def run():
        optimizer_swap.swap_out(optimizer, swap)
        try:
            return closure()
        finally:
            optimizer_swap.swap_in(optimizer, swap)

    if "closure" in kwargs:
        return args, {**kwargs, "closure": run}
    return (args[0], run) + tuple(args[2:]), kwargs


def after_step(optimizer, args, kwargs) -> None:
    restore_swap(optimizer)
    mark_kept_copies_stale()
    guard = _GUARDS.get(optimizer)
    if guard is not None and guard.pieces:  # a step inside a method that binds its unit's gathered parameters
        refill_units_stepped(guard.groups())


_installed = False
_retirements = 0  # how many times shard() has retired original parameters in this process


def install() -> None:
    """Register the process-wide step hooks once (``shard()`` calls this, after retiring the original
    parameters: every guard made before is examined again, for parameters it holds that were retired)."""
    global _installed, _retirements
    _retirements += 1
    if _installed:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)
    _installed = True
