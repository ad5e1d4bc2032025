"""What DDP users ask of the wrapper, answered by the sharded model itself (``shard()`` works in place).

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
from shardwise.errors import ShardwiseError


class NoModuleError(ShardwiseError, AttributeError):
    """``model.module`` of a sharded model: there is no wrapper (an AttributeError, for ``hasattr``)."""


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


def _getattr_naming_module(original):
    """The class's own ``__getattr__`` (nn.Module's: submodules, parameters, buffers), then, for a missing
    ``module``, the named error. (``__getattr__``, not a property: Python answers a property's AttributeError
    with ``__getattr__``'s own.)"""

    def __getattr__(self, name: str):
        try:
            return original(self, name)
        except AttributeError:
            if name != "module":
                raise
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
        if "module" not in own:
            members["__getattr__"] = _getattr_naming_module(cls.__getattr__)
        # torch.save(model) / copy.deepcopy(model) meet the class first now (pickle would not find this one
        # under the class's name): refused by name, as at the runtime they reach otherwise.
        members.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__,
                       __reduce_ex__=refuse_pickle, __deepcopy__=refuse_deepcopy)
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), members)
    model.__class__ = _SUBCLASSES[cls]
