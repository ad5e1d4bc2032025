"""How one optimizer step's loss is normalised over micro-batches and ranks.

The step's loss is the mean over *every target of the global batch that is in the loss* (all ranks, all
micro-batches). Gradients are averaged over ranks by the reduce-scatter and summed over micro-batches by
accumulation, so each micro-batch contributes ``sum of its token losses * world_size / N``, where ``N`` is
the count of loss targets in the global batch (one all-reduce per step). Then the accumulated, rank-averaged
gradient is exactly the gradient of ``sum over the global batch / N``, the loss a single process would take
on the whole batch; with a loss mask, ranks and micro-batches hold different numbers of loss tokens, and a
mean of per-rank means would weight them wrongly.

Without a mask every micro-batch holds ``batch_size * seq_len`` targets, so ``N`` is known and the same
formula is each micro-batch's mean divided by the accumulation steps: that is what is computed then (no
collective, the arithmetic of the trainer before masks existed).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from shardwise.engine.checks import agree
from shardwise.hf.model_spec import ModelSpec, lm_loss
from shardwise.trainer.data import IGNORE_INDEX


def loss_targets(targets: Sequence[torch.Tensor]) -> int:
    """Targets in the loss (not IGNORE_INDEX) over these micro-batches of this rank."""
    return sum(int((t != IGNORE_INDEX).sum()) for t in targets)


def global_loss_targets(targets: Sequence[torch.Tensor], device: torch.device) -> int:
    """``loss_targets`` summed over every rank (collective when distributed)."""
    (count,) = agree.all_reduce_host([loss_targets(targets)], what="the count of loss targets over ranks")
    return int(count)


def micro_batch_loss(spec: ModelSpec, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                     accumulation_steps: int, global_targets: Optional[int], world_size: int) -> torch.Tensor:
    """The loss to call ``backward`` on for one micro-batch (see the module docstring). ``global_targets``:
    ``global_loss_targets`` of the step's micro-batches, or None for data without a loss mask."""
    if global_targets is None:
        return lm_loss(spec, model, inputs, targets) / accumulation_steps
    return lm_loss(spec, model, inputs, targets, reduction="sum") * (world_size / max(global_targets, 1))
