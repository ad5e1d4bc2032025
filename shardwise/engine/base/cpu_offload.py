"""CPU offload: keep parameter shards, gradient shards and so the optimizer step on the CPU, and move each
unit's shard to the compute device only for its all-gather.

On a CPU-only machine the compute device is the CPU, and offload changes nothing but where the docs say
memory goes; on CUDA the copies each way run on side streams from pinned memory and overlap compute
(``offload_transfers.py``), and ``shardwise.offload_optimizer`` steps each unit on the CPU as soon as its
gradients have landed (``optim/offload_optimizer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class CPUOffload:
    pin_memory: bool = True
    """Pin the host shards and gradient buffers so the copies to and from the GPU can overlap compute."""
    h2d_ahead: int = 2
    """How many shards are copied to the device ahead of their all-gather (each costs its size there)."""
    worker_thread: Optional[bool] = None
    """Run the host side of the pipeline (gradient hand-out, ``offload_optimizer``'s per-unit steps) on one
    worker thread; default: on CUDA, where it overlaps the GPU's backward."""

    def allocate(self, numel: int, dtype: torch.dtype, compute_device: torch.device) -> torch.Tensor:
        pin = self.pin_memory and compute_device.type == "cuda"
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)
