"""CPU offload: keep parameter shards, gradient shards and so the optimizer step on the CPU, and move each
unit's shard to the compute device only for its all-gather.

On a CPU-only machine the compute device is the CPU, and offload changes nothing but where the docs say
memory goes; on CUDA the shard travels host-to-device (from pinned memory, asynchronously) right before
the all-gather and the reduced gradient shard travels back right after the reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CPUOffload:
    pin_memory: bool = True
    """Pin the host shards so the copies to and from the GPU can overlap compute."""

    def storage_device(self) -> torch.device:
        return torch.device("cpu")

    def allocate(self, numel: int, dtype: torch.dtype, compute_device: torch.device) -> torch.Tensor:
        pin = self.pin_memory and compute_device.type == "cuda"
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)
