"""The one place that decides where shardwise computes and which backend carries a collective.

Everything else asks here instead of comparing backend names: ``init_process_group()`` without a backend
(the torchrun idiom) gives a group whose ``get_backend()`` is ``'undefined'`` on torch 2.13 while it carries
CPU tensors over gloo and CUDA tensors over NCCL; its configuration string says which is which
(``dist.get_backend_config``: ``"cpu:gloo,cuda:nccl"``, or a plain ``"gloo"`` / ``"nccl"``).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

_DEVICE_TYPES = ("cpu", "cuda")


def backends(group=None) -> dict[str, str]:
    """Device type -> backend name for ``group``: ``{"cpu": "gloo", "cuda": "nccl"}`` for the default
    mixed group, ``{"cpu": "gloo", "cuda": "gloo"}`` for gloo (it moves CUDA tensors too), ``{"cuda": "nccl"}``."""
    config = str(dist.get_backend_config(group)) if hasattr(dist, "get_backend_config") else str(dist.get_backend(group))
    out: dict[str, str] = {}
    for part in config.split(","):
        part = part.strip().lower()
        if ":" in part:
            dev, name = part.split(":", 1)
            out[dev.strip()] = name.strip()
        elif part == "nccl":
            out["cuda"] = part
        elif part:
            out.update({d: part for d in _DEVICE_TYPES})
    return out


def nccl_usable() -> bool:
    """Whether this machine can run NCCL: a CUDA GPU and a torch built with NCCL."""
    return torch.cuda.is_available() and dist.is_nccl_available()


def pick_backend(requested: str = "auto") -> str:
    """The backend a launched job initialises: an explicit choice wins; "auto" is nccl where it is usable,
    else gloo."""
    if requested != "auto":
        return requested
    return "nccl" if nccl_usable() else "gloo"


def backend_for(group, device: torch.device) -> str:
    """The backend that moves ``device``'s tensors on ``group`` ('' if none does)."""
    return backends(group).get(torch.device(device).type, "")


def moves_cuda_over_nccl(group=None) -> bool:
    """Whether ``group`` moves CUDA tensors over NCCL on a machine that has CUDA: then the model computes on
    the GPU by default, and a wait on a collective only orders the current CUDA stream."""
    return backend_for(group, torch.device("cuda")) == "nccl" and torch.cuda.is_available()


def compute_device(param_devices: Iterable[torch.device], group=None,
                   explicit: Optional[torch.device | str] = None) -> torch.device:
    """Where a sharded model computes: the explicit choice; else the device its parameters are on when that
    is an accelerator; else the current CUDA device when the group moves CUDA tensors over NCCL (parameters
    built on the CPU or the meta device on a GPU machine); else the CPU."""
    if explicit is not None:
        return torch.device(explicit)
    for d in param_devices:
        if d.type not in ("cpu", "meta"):
            return d if d.index is not None or d.type != "cuda" else torch.device("cuda", torch.cuda.current_device())
    if moves_cuda_over_nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def communication_device(group=None) -> torch.device:
    """Where the small tensors of shardwise's own collectives (flags, norms, text) live: the CPU if the
    group moves CPU tensors, else the current CUDA device (NCCL moves only CUDA tensors)."""
    if backend_for(group, torch.device("cpu")):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def copy_streams(device: torch.device):
    """Streams and events for host <-> ``device`` copies (streams.py): CUDA's own on a CUDA device, so
    offload copies overlap compute; synchronous host stand-ins anywhere else."""
    from shardwise.engine.base import streams
    device = torch.device(device)
    if device.type == "cuda":
        return streams.CudaCopyStreams(device)
    return streams.HostCopyStreams()
