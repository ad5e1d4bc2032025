"""Activation checkpointing of whole units (non-reentrant ``torch.utils.checkpoint``).

The unit's forward runs once without keeping activations; backward re-runs it to rebuild them. The
recompute does not go through ``module.__call__`` (checkpoint calls the function it was given), so our
forward hooks do not fire for it: the wrapped function binds the gathered parameters itself. By then the
unit's pre-backward hook has already re-gathered them, so the recompute costs no communication.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from shardwise.runtime import Phase, Unit


def checkpoint_unit(unit: Unit) -> None:
    module = unit.plan.module
    inner = module.forward

    def run(*args, **kwargs):
        if unit.model.phase is not Phase.BACKWARD:
            return inner(*args, **kwargs)  # first pass: pre-forward hook bound the parameters
        unit.unshard(wait=True)
        unit.bind_full()
        try:
            return inner(*args, **kwargs)
        finally:
            unit.bind_sharded()

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    module.forward = forward
