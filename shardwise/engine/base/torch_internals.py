"""The torch internals the step relies on, each in one function whose comment names the torch versions
checked (torch 2.13 on the CPU machines, 2.11 on the GPU image). Nothing else in the engine calls them.
``autograd_engine_running`` lives in ``shardwise.autograd_state`` (quant/ asks it too) and is re-exported here."""

from __future__ import annotations

from typing import Callable

import torch

# Whether this thread runs a backward: a leaf below the engine, because quant/ asks it too.
from shardwise.autograd_state import autograd_engine_running  # noqa: F401  (re-exported for the engine)


def version_counter(t: torch.Tensor) -> int:
    """Autograd's in-place version counter of ``t`` (bumped by every in-place op on it or a view of it).
    Private attribute ``Tensor._version`` (checked on torch 2.11 and 2.13)."""
    return t._version


def resize_storage(t: torch.Tensor, nbytes: int) -> None:
    """Give ``t``'s storage ``nbytes`` bytes in place (0 frees its memory), keeping the storage object, so
    every tensor that views it (autograd's saved views of a gathered buffer) sees the memory come back when it
    is resized up again. ``UntypedStorage.resize_`` on a storage shared by views (checked on torch 2.11 and
    2.13; FSDP2 frees its unsharded parameters the same way)."""
    t.untyped_storage().resize_(nbytes)


def call_after_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` once, after the last node of the backward pass this thread is executing, inside the
    autograd engine (dropped if the backward raises). Private API ``Variable._execution_engine.queue_callback``
    (checked on torch 2.11 and 2.13; DDP and FSDP2 end their backward the same way)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def storage_held_only_by(buffer: torch.Tensor, views: list[torch.Tensor]) -> bool:
    """Whether ``buffer``'s storage is held by no tensor but ``buffer``, one other tensor on it (a gathered
    buffer's collective alias) and ``views``, none of which is held by anything but its Python object: then no
    autograd node, saved tensor or other tensor can read that memory. Private ``torch._C._storage_Use_Count``
    (a storage's reference count: one per tensor on it, one per Python storage object) and
    ``Tensor._use_count`` (a tensor's: one per Python object, saved variable or view that holds it), checked
    on torch 2.13 (torch's cudagraph trees and ``torch.utils.swap_tensors`` read them). The counts a storage
    and a tensor held by nothing else have are measured once on a probe, not assumed; where either API is
    missing, False: the memory is then kept, never freed on a guess."""
    baseline = _unshared_counts()
    if baseline is None:
        return False
    storage_base, tensor_base = baseline
    if _storage_count(buffer) != storage_base + len(views):
        return False
    return all(v._use_count() == tensor_base for v in views)


def _storage_count(t: torch.Tensor) -> int:
    storage = t.untyped_storage()  # (this Python object is counted too, on the probe as here)
    return torch._C._storage_Use_Count(storage._cdata)


_UNSHARED: list = []


def _unshared_counts():
    """(storage count of a buffer and its alias held by nothing else, count of a tensor held only by its Python
    object), measured once; None where torch lacks the APIs."""
    if not _UNSHARED:
        if not hasattr(torch._C, "_storage_Use_Count") or not hasattr(torch.Tensor, "_use_count"):
            _UNSHARED.append(None)
        else:
            probe = torch.empty(2)
            alias = torch.empty(0).set_(probe.untyped_storage(), 0, (2,), (1,))
            _UNSHARED.append((_storage_count(probe), probe.narrow(0, 0, 1)._use_count()))
            del alias
    return _UNSHARED[0]


def optimizer_ever_built() -> bool:
    """Whether any ``torch.optim.Optimizer`` has been constructed in this process: ``Optimizer.__init__``
    wraps its class's ``step`` once, marking it ``hooked`` (``Optimizer._patch_step_function``; checked on
    torch 2.11 and 2.13). Where the mark is absent from every class, True: the caller then looks anyway."""
    seen, stack = set(), [torch.optim.Optimizer]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if getattr(cls.__dict__.get("step"), "hooked", False):
            return True
        stack.extend(cls.__subclasses__())
    return not hasattr(torch.optim.Optimizer, "_patch_step_function")
