"""Activation checkpointing of whole units (non-reentrant ``torch.utils.checkpoint``).

The unit's forward runs once without keeping activations; backward re-runs it to rebuild them. The
recompute calls ``forward`` directly, not ``module.__call__``, so no forward hook fires for it: it finds
the unit's parameters bound already, because the unit's pre-backward hook gathered them and bound its
backward views (runtime.py, [Note: entries]), so the recompute costs no communication. Any other
recompute (``torch.utils.checkpoint`` in either mode, Hugging Face's gradient checkpointing) works the
same way.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from shardwise.engine.core.unit import Unit


def checkpoint_unit(unit: Unit) -> None:
    module = unit.plan.module
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
