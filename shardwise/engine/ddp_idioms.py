"""What DDP and FSDP users ask of the wrapper, answered by the sharded model itself (``shard()`` works in place).

- ``model.no_sync()``: the context manager, as ``DistributedDataParallel.no_sync`` (and ``shardwise.no_sync
  (model)``): backwards inside it accumulate without communicating, the first one outside reduces all.
- ``model.require_backward_grad_sync``: read and written as on DDP (nanoGPT sets it before each micro-batch,
  Accelerate around its accumulation). It *is* the engine's switch (``ModelRuntime.require_grad_sync``), so
  ``no_sync`` and the attribute are one flag. One difference from DDP, which reads it at the forward:
  shardwise reads it when the backward reduces, so it must hold during the backward (it does in both of those
  loops, and in ``with model.no_sync(): loss = model(x); loss.backward()``).
- ``model.module``: there is no wrapper, so there is no ``.module``. Reading it raises ``NoModuleError``, a
  ``ShardwiseError`` that is also an ``AttributeError``: ``hasattr(model, "module")`` is False, so unwrapping
  helpers (Accelerate's, transformers', timm's, ``getattr(model, "module", model)``) return the model itself,
  and a script's ``raw_model = model.module`` gets the error naming what to write instead. (The model as its
  own ``.module`` would send ``while hasattr(m, "module"): m = m.module`` into an endless loop.)
- FSDP2's gradient-sync controls, as accumulation loops call them on the root (often behind
  ``hasattr(model, "set_requires_gradient_sync")``): ``set_requires_gradient_sync(flag)`` is the same switch as
  ``no_sync``; ``set_is_last_backward`` and HSDP's ``set_requires_all_reduce`` only let FSDP2 skip waits and
  the cross-replica all-reduce of micro-batches whose sum it all-reduces later: the gradients are the same
  without them, so here they change nothing. FSDP1's ``model.clip_grad_norm_(max_norm)`` is
  ``shardwise.clip_grad_norm_(model, max_norm)``.
- FSDP2's other ``FSDPModule`` methods (``unshard``, ``reshard``, ``set_reshard_after_backward``, prefetch
  and divide-factor settings) are ``NoModuleError``-like named errors that ``hasattr`` reads as absent, each
  saying what shardwise offers instead (``_FSDP_ONLY``).

How: the model's class becomes a subclass made once per class, as FSDP2's ``fully_shard`` does, with the same
name (so ``save_pretrained`` writes the same architecture) and only the members the class does not define
itself (a model with its own ``no_sync``, ``module`` or ``require_backward_grad_sync`` keeps them).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from shardwise.engine.core.copy_refusal import refuse_deepcopy, refuse_pickle
from shardwise.engine.core.runtime import runtime_of
from shardwise.engine.grad_norm import clip_grad_norm_
from shardwise.errors import ShardwiseError


class NoModuleError(ShardwiseError, AttributeError):
    """``model.module`` of a sharded model: there is no wrapper (an AttributeError, for ``hasattr``)."""


class NoFSDPMethodError(ShardwiseError, AttributeError):
    """An ``FSDPModule`` method shardwise does not offer on the sharded model (an AttributeError, for
    ``hasattr``)."""


_AVERAGED = "shardwise averages gradients over the data-parallel ranks, as DDP does; scale the loss to change that"

# FSDP2's FSDPModule members a sharded model does not have, and what to use instead.
_FSDP_ONLY = {
    "unshard": "shardwise gathers each unit at its forward and prefetches the next; for whole weights outside "
               "forward use `with shardwise.summon_full_params(model):`",
    "reshard": "shardwise frees each unit's gathered weights itself after its forward and backward",
    "set_reshard_after_forward": "choose it at shard(): strategy='shard_grad_op' keeps gathered weights from "
                                 "forward to backward, strategy='full_shard' frees them",
    "set_reshard_after_backward": "shardwise frees gathered weights after each backward; for fewer gathers "
                                  "choose strategy='shard_grad_op' or 'shard_optim_grad' at shard()",
    "set_modules_to_forward_prefetch": "shardwise prefetches the next unit in forward order itself "
                                       "(shard(prefetch=False) turns it off)",
    "set_modules_to_backward_prefetch": "shardwise prefetches the next unit in backward order itself "
                                        "(shard(prefetch=False) turns it off)",
    "set_unshard_in_backward": "shardwise re-gathers a unit for its backward whenever the unit has parameters "
                               "that need a gradient",
    "set_post_optim_event": "shardwise orders its gathers after the optimizer step itself",
    "set_reduce_scatter_divide_factor": _AVERAGED,
    "set_gradient_divide_factor": _AVERAGED,
    "set_force_sum_reduction_for_comms": _AVERAGED,
    "set_all_reduce_hook": "register a hook on the parameters (p.register_hook, "
                           "p.register_post_accumulate_grad_hook): it sees the reduced gradient",
    "set_custom_all_gather": "shardwise's gathers are its own",
    "set_custom_reduce_scatter": "shardwise's reductions are its own",
}


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (unsharded, in the reduce dtype) without communicating them; the first
    backward outside the context reduces everything accumulated so far."""
    rt = runtime_of(model)
    previous = rt.require_grad_sync
    rt.require_grad_sync = False
    try:
        yield
    finally:
        rt.require_grad_sync = previous


class _DDPIdioms:
    """The members a sharded model's class gains (see the module docstring)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """``DistributedDataParallel.no_sync``: accumulate without communicating inside the block."""
        return no_sync(self)

    @property
    def require_backward_grad_sync(self) -> bool:
        return runtime_of(self).require_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        runtime_of(self).require_grad_sync = bool(value)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: False accumulates without communicating until a backward with it True (the same
        switch as ``no_sync``). The whole model has one switch, so ``recurse=False`` is refused."""
        if not recurse:
            raise ShardwiseError(
                f"{type(self).__name__}.set_requires_gradient_sync(..., recurse=False): a sharded model has one "
                f"gradient-sync switch for all its units; call it with recurse=True (the default)")
        runtime_of(self).require_grad_sync = bool(requires_gradient_sync)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's: lets it skip the end-of-backward wait; here every backward ends the same way."""
        del is_last_backward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP's: FSDP2 skips the cross-replica all-reduce of micro-batches whose sum it all-reduces later,
        which gives the gradients shardwise gives by reducing every synced backward."""
        del requires_all_reduce, recurse

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0):
        """FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``: ``shardwise.clip_grad_norm_(model, ...)``, the
        global norm before clipping, the same on every rank."""
        return clip_grad_norm_(self, max_norm, norm_type)


def _getattr_naming(original, named: frozenset):
    """The class's own ``__getattr__`` (nn.Module's: submodules, parameters, buffers), then, for a missing
    name in ``named`` (``module``, FSDP-only methods the class does not define), the named error.
    (``__getattr__``, not a property: Python answers a property's AttributeError with ``__getattr__``'s own.)"""

    def __getattr__(self, name: str):
        try:
            return original(self, name)
        except AttributeError:
            if name not in named:
                raise
        if name in _FSDP_ONLY:
            raise NoFSDPMethodError(
                f"{type(self).__name__}.{name}: FSDP2's FSDPModule.{name} has no counterpart on a model sharded "
                f"by shardwise.shard(): {_FSDP_ONLY[name]}")
        raise NoModuleError(
            f"{type(self).__name__}.module: shardwise.shard() shards the model in place and returns it, so there "
            f"is no wrapper and no .module (DistributedDataParallel's); use the model itself (raw_model = model, "
            f"model.state_dict())")

    return __getattr__


_SUBCLASSES: dict[type, type] = {}


def install(model: nn.Module) -> None:
    """Give ``model`` (the sharded root) DDP's idioms: its class becomes the idioms' subclass of it."""
    cls = type(model)
    if cls not in _SUBCLASSES:
        own = {name for klass in cls.__mro__ if klass is not object for name in vars(klass)}
        members = {name: value for name, value in vars(_DDPIdioms).items()
                   if not name.startswith("__") and name not in own}
        named = frozenset(n for n in ("module", *_FSDP_ONLY) if n not in own)
        if named:
            members["__getattr__"] = _getattr_naming(cls.__getattr__, named)
        # torch.save(model) / copy.deepcopy(model) meet the class first now (pickle would not find this one
        # under the class's name): refused by name, as at the runtime they reach otherwise.
        members.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__,
                       __reduce_ex__=refuse_pickle, __deepcopy__=refuse_deepcopy)
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), members)
    model.__class__ = _SUBCLASSES[cls]
