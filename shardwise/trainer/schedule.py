"""The learning-rate schedule as a pure function of the step: nothing to save, nothing to drift on resume."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (1-based): linear warmup to ``lr``, then cosine (or, for
    ``schedule='linear'``, linear) decay to ``lr * min_lr_ratio`` at ``total_steps`` (or flat for
    ``schedule='constant'``)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    floor = lr * min_lr_ratio
    if schedule == "linear":
        return lr - (lr - floor) * progress
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
