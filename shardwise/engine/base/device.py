"""The one place that decides where shardwise computes, where each collective's tensors live and which
process group carries it.

[Note: data groups and the control group] shardwise's collectives are of two kinds, and each kind has its
own groups, made once by ``shard()`` (``own_groups``, ``control_group``):

* **data** (all-gathers, reduce-scatters, gradient all-reduces, the buffer broadcast, exact reductions of
  pieces, Muon's exchange, rank 0's values): tensors on the compute device, on *data groups*: shardwise's own
  copy of each group the model shards and replicates over (same ranks, same backend). A user's own
  ``torch.distributed`` call on the default group can therefore never be paired with one of ours at the
  wire (gloo aborts the process on a size mismatch; NCCL mixes the data): it can only wait, and waits are
  what the stall watchdog names. On NCCL a data group moves device tensors only.
* **control** (fingerprint exchanges, the plan check, verdicts, key checks, stale flags, metric
  reductions): small tensors on the *host*, on the *control group*, a gloo group of all ranks. Verdicts are
  read with no host-device sync, and the NCCL groups never see a host tensor.

Host data that must travel as data (an offloaded shard in ``gather_full``, Muon's pieces under offload) is
copied to the compute device first. Backend names are compared here only: ``init_process_group()`` without
a backend (the torchrun idiom) gives a group whose ``get_backend()`` is ``'undefined'`` on torch 2.13 while it
carries CPU tensors over gloo and CUDA tensors over NCCL; its configuration string says which is which
(``dist.get_backend_config``: ``"cpu:gloo,cuda:nccl"``, or a plain ``"gloo"`` / ``"nccl"``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

_DEVICE_TYPES = ("cpu", "cuda")
HOST = torch.device("cpu")  # where control tensors, offloaded shards and pinned buffers live


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on the host: compared with the host device itself, not by its type, so that a
    compute device of type cpu other than the host (the NCCL-rules test mode's stand-in) does not count."""
    return t.device == HOST


# Backends that move accelerator tensors only, and the accelerator a model on them computes on. The
# NCCL-rules test mode (tests/nccl_rules.py) adds its CPU stand-in for NCCL here.
DEVICE_ONLY_BACKENDS: dict[str, Callable[[], torch.device]] = {
    "nccl": lambda: torch.device("cuda", torch.cuda.current_device())}
# The control group's backend: gloo moves host tensors. (The test mode names one that refuses device tensors.)
CONTROL_BACKEND = "gloo"


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


def device_only_accelerator(group=None) -> Optional[torch.device]:
    """The accelerator of a group whose backend moves device tensors only (NCCL, or the test mode's
    stand-in), where that accelerator exists; else None."""
    for dev, name in backends(group).items():
        if name in DEVICE_ONLY_BACKENDS and (name != "nccl" or moves_cuda_over_nccl(group)):
            return DEVICE_ONLY_BACKENDS[name]()
    return None


def compute_device(param_devices: Iterable[torch.device], group=None,
                   explicit: Optional[torch.device | str] = None) -> torch.device:
    """Where a sharded model computes: the explicit choice; else the device its parameters are on when that
    is an accelerator; else the accelerator of a group that moves device tensors only (NCCL: parameters
    built on the CPU or the meta device on a GPU machine); else the CPU."""
    if explicit is not None:
        return torch.device(explicit)
    for d in param_devices:
        if d.type not in ("cpu", "meta"):
            return d if d.index is not None or d.type != "cuda" else torch.device("cuda", torch.cuda.current_device())
    return device_only_accelerator(group) or torch.device("cpu")


# ---- shardwise's own groups (see [Note: data groups and the control group]) ------------------------------
_control: dict = {}  # id(the default group) -> the control group
_own: dict = {}  # id(a data group) -> shardwise's copy of it


def control_group():
    """The gloo group of all ranks that carries shardwise's control traffic (host tensors), or None in a world
    of one. Made at its first use by every rank at the same point (``new_group`` is collective over the
    world): ``shard()``, or a checkpoint call, which every rank makes."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    key = id(dist.group.WORLD)
    if key not in _control:
        _control[key] = dist.new_group(backend=CONTROL_BACKEND, timeout=_world_timeout())
    return _control[key]


def own_groups(groups: list) -> list:
    """shardwise's own data group for each of ``groups`` (None stays None): same ranks, same backend, made once
    per group and shared by every model over it. Collective: every rank calls it with its own groups of the
    same kinds in the same order (``shard()``); the ranks first learn every rank's groups over the control
    group, then every rank creates every group of each kind, in the same order, as ``new_group`` requires."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(groups)
    first = {id(g): i for i, g in reversed(list(enumerate(groups))) if g is not None}  # the same group twice: once
    missing = [i for i, g in enumerate(groups) if g is not None and id(g) not in _own and first[id(g)] == i]
    flags = torch.tensor([len(missing)], dtype=torch.int64)
    _host_all_reduce_max(flags)  # the same on every rank: whether anyone still has groups to make
    if int(flags.item()) == 0:
        return [None if g is None else _own[id(g)] for g in groups]
    world = dist.get_world_size()
    mine = torch.full((len(groups), world), -1, dtype=torch.int64)
    for i, g in enumerate(groups):
        if g is not None and i in missing:
            ranks = dist.get_process_group_ranks(g)
            mine[i, : len(ranks)] = torch.tensor(ranks)
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(everyone, mine.view(-1),
                                                                              group=control_group())
    rows = everyone.view(world, len(groups), world)
    made: dict[tuple, object] = {}
    for i, g in enumerate(groups):
        sets = sorted({tuple(r for r in row if r >= 0) for row in rows[:, i].tolist() if row[0] >= 0})
        config = str(dist.get_backend_config(g)) if g is not None and hasattr(dist, "get_backend_config") else None
        for ranks in sets:
            made[(i, ranks)] = dist.new_group(ranks=list(ranks), backend=config, timeout=_world_timeout())
        if i in missing:
            _own[id(g)] = made[(i, tuple(dist.get_process_group_ranks(g)))]
    return [None if g is None else _own[id(g)] for g in groups]


def _host_all_reduce_max(t: torch.Tensor) -> None:
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())


def _world_timeout():
    """The timeout the user gave ``init_process_group``: ``new_group`` would otherwise default to gloo's 30
    minutes, and a stuck exchange would outlive every data collective. Private attributes, isolated here
    (checked on torch 2.13; None, the torch default, where they are missing)."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def copy_streams(device: torch.device):
    """Streams and events for host <-> ``device`` copies (streams.py): CUDA's own on a CUDA device, so
    offload copies overlap compute; synchronous host stand-ins anywhere else."""
    from shardwise.engine.base import streams
    device = torch.device(device)
    if device.type == "cuda":
        return streams.CudaCopyStreams(device)
    return streams.HostCopyStreams()
