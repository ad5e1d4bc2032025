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
