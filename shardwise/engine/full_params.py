"""Full parameters for code that runs outside a sharded model's forward.

``summon_full_params(module)`` gathers, in the master dtype, every unit that holds a parameter of
``module`` (the sharded model or any submodule of it) and binds full-shape parameters to the modules for
the duration of the block: reading weights, editing them (written back to the shards on exit), saving them
with ``module.state_dict()``. ``register_forward_method(model, "generate")`` makes another method of the
model or of a unit gather its unit's parameters the way ``forward`` does, for methods that use weights
directly instead of calling submodules (a call to any module that holds parameters already gathers them,
see runtime.py, [Note: entries]).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn as nn

from shardwise.errors import ShardwiseError
from shardwise.engine.unit import Frame, FrameKind, Phase, autograd_engine_running


def _runtime(module: nn.Module):
    from shardwise.engine.runtime import runtime_of

    return runtime_of(module)


@contextlib.contextmanager
def summon_full_params(module: nn.Module, writeback: bool = True) -> Iterator[None]:
    """Bind full parameters (master dtype, ``nn.Parameter`` views of freshly gathered buffers) to every
    module below ``module`` for the duration of the block; every rank must enter it (it communicates).

    ``writeback=True`` copies the values back into each rank's shard on exit, so in-place edits (made the
    same way on every rank) persist; with ``False`` they are dropped. Not inside forward or backward.
    Peak extra memory: the full parameters of the units involved."""
    rt = _runtime(module)
    if autograd_engine_running() or rt.phase is Phase.FORWARD:
        raise ShardwiseError("summon_full_params() was called inside a forward or backward of the sharded "
                             "model; call it between steps")
    rt.settle()
    inside = {id(m) for m in module.modules()}
    units = [u for u in rt.units if any(ref.module is not None and id(ref.module) in inside
                                        for spec in u.plan.params() for ref in spec.refs)]
    if rt.checker is not None:
        rt.checker.check_now("summon_full_params", len(units))
    fulls, frames = [], []
    try:
        for u in units:
            frame = Frame(FrameKind.SUMMON, None)
            frame.views = []
            for g in u.flat_groups:
                full = g.gather_full()
                fulls.append((g, full))
                frame.views.append([nn.Parameter(full.narrow(0, s.offset, s.numel).view(s.shape),
                                                 requires_grad=p.requires_grad)
                                    for s, p in zip(g.plan.params, g.shard_params)])
            u.frames.append(frame)
            frames.append((u, frame))
            u.rebind()
        yield
    finally:
        for u, frame in reversed(frames):
            if frame in u.frames:
                u.frames.remove(frame)
            u.rebind()
        if writeback:
            with torch.no_grad():
                for g, full in fulls:
                    g.shard.copy_(full.narrow(0, g.shard_start, g.plan.shard_numel))
                    g.refresh_due = True  # ZeRO-1/2: the kept gathered copy is refilled at the next unshard


def register_forward_method(module: nn.Module, name: str) -> None:
    """Make ``module.<name>(...)`` gather its unit's parameters like ``forward`` does (torch FSDP2's
    ``register_fsdp_forward_method``). ``module`` is the sharded model or one of its units' modules."""
    rt = _runtime(module)
    unit = next((u for u in rt.units if u.plan.module is module), None)
    if unit is None:
        raise ShardwiseError(f"register_forward_method: {type(module).__name__} is neither the sharded model nor "
                             f"one of its units (units: {', '.join(u.label for u in rt.units)})")
    method = getattr(module, name, None)
    if not callable(method):
        raise ShardwiseError(f"register_forward_method: {type(module).__name__} has no method {name!r}")

    @functools.wraps(method)
    def entered(*args, **kwargs):
        try:
            changed = unit.enter(args, kwargs, submodule=False)
            if changed is not None:
                args, kwargs = changed
            out = method(*args, **kwargs)
        except BaseException:
            unit.post_forward(module, args, kwargs, None)  # sys.exc_info() says it failed
            raise
        unit.post_forward(module, args, kwargs, out)
        return out

    setattr(module, name, entered)
