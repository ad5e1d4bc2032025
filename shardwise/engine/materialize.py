"""Filling the shards at ``shard()`` time, without any rank ever holding the whole model.

Three sources:
- an eagerly built model: each rank copies its slice of each parameter, then the full tensor is freed;
- a model on the meta device: module by module, in module order, the module's own parameters are
  allocated full-size, initialised by ``param_init_fn(module)`` or ``module.reset_parameters()``, sliced
  into the shard and dropped. Peak extra memory is one module's parameters. Consuming the RNG in module
  order is what makes the result equal to eager construction with the same seed;
- ``sync_module_states``: rank 0's values, broadcast one flat group at a time.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.base import collectives
from shardwise.errors import ShardwiseError
from shardwise.engine.base.torch_internals import resize_storage, version_counter
from shardwise.engine.core.flat_group import FlatGroup
from shardwise.engine.hf_init import hf_param_init_fn, is_hf_model
from shardwise.engine.base.plan import ParamSpec


def _specs_by_param(groups: list[FlatGroup]) -> dict[int, tuple[FlatGroup, int]]:
    out = {}
    for g in groups:
        for i, spec in enumerate(g.plan.params):
            out[id(spec.refs[0].module._parameters[spec.refs[0].name])] = (g, i)
    return out


def copy_slice_into_shard(group: FlatGroup, index: int, full: torch.Tensor) -> None:
    lo, hi, at = group.local_slices[index]
    if hi > lo:
        group.shard.narrow(0, at, hi - lo).copy_(full.detach().reshape(-1)[lo:hi])


def fill_from_full_params(groups: list[FlatGroup]) -> None:
    for g in groups:
        for i, spec in enumerate(g.plan.params):
            ref = spec.refs[0]
            copy_slice_into_shard(g, i, ref.module._parameters[ref.name])


def fill_from_meta(
    model: nn.Module,
    groups: list[FlatGroup],
    device: torch.device,
    param_init_fn: Optional[Callable[[nn.Module], None]],
    seen: Optional[Callable[[FlatGroup, int, torch.Tensor], None]] = None,
) -> None:
    """Default init: ``module.reset_parameters()``, or for a Hugging Face model the model's own
    ``_init_weights`` (hf_init.py), so that a meta build comes out as ``from_config`` would. ``seen(group,
    index, value)`` is shown every parameter's whole initial value before it is sliced (initial_weights.py
    compares them across ranks), except where the init leaves parameters to ``load_pretrained``."""
    if param_init_fn is None and is_hf_model(model):
        param_init_fn = hf_param_init_fn(model, device)
    where = _specs_by_param(groups)
    # skip_weight_init leaves parameters to load_pretrained, which writes every one of them.
    check_params = not getattr(param_init_fn, "leaves_parameters_unwritten", False)
    done: set[int] = set()
    uninitialised: list[str] = []
    for mod_name, module in model.named_modules():
        direct = [(n, p) for n, p in module._parameters.items() if p is not None]
        # A buffer on meta is allocated here and must be written by the init below (reset_parameters,
        # param_init_fn, HF's _init_weights); one nobody writes would hold garbage, different on every rank.
        placeholders = {}
        for n, b in module._buffers.items():
            if b is not None and b.is_meta:
                t = torch.empty_like(b, device=device)
                module._buffers[n] = t
                placeholders[n] = (t, version_counter(t))
        if not direct:
            if placeholders:
                if param_init_fn is not None:
                    param_init_fn(module)
                elif hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            uninitialised += _still_unwritten(module, mod_name, placeholders)
            continue
        originals = dict(direct)
        # Fresh full tensors for *every* direct parameter, tied ones included: eager construction
        # consumed RNG for them too, so skipping them would shift every later module's values.
        # Filled with NaN first: a parameter no init writes (wholly or in part) is found below by its NaNs,
        # which survive any write path (``p.data`` too), instead of training from uninitialised memory.
        temps = {n: nn.Parameter(_unwritten_like(p, device, check_params), requires_grad=p.requires_grad)
                 for n, p in direct}
        for n, t in temps.items():
            module._parameters[n] = t
        try:
            if param_init_fn is not None:
                param_init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                raise ShardwiseError(
                    f"module {mod_name or '<root>'} ({type(module).__name__}) has parameters on the meta device "
                    f"but no reset_parameters(); pass param_init_fn= to shardwise.shard()"
                )
            for n, p in originals.items():
                if id(p) in where and id(p) not in done:
                    g, i = where[id(p)]
                    value = module._parameters[n]
                    if check_params and value.is_floating_point() and bool(torch.isnan(value).any()):
                        uninitialised.append(f"parameter {mod_name + '.' if mod_name else ''}{n} "
                                             f"({type(module).__name__})")
                    if seen is not None and check_params:
                        seen(g, i, value)
                    copy_slice_into_shard(g, i, value)
                    done.add(id(p))
        finally:
            for n, p in originals.items():
                module._parameters[n] = p
        uninitialised += _still_unwritten(module, mod_name, placeholders)
    if uninitialised:
        raise ShardwiseError(
            f"{', '.join(uninitialised[:8])}{' ...' if len(uninitialised) > 8 else ''}: built on the meta device "
            f"and nothing initialised them (no reset_parameters(), and param_init_fn did not write them, or not "
            f"all of them): they would hold uninitialised memory, different on every rank. Pass "
            f"shard(param_init_fn=...) that fills them, or build the model with real buffers (only parameters "
            f"need the meta device), or sync_module_states=True with rank 0 built for real")


def _unwritten_like(p: torch.Tensor, device: torch.device, mark: bool) -> torch.Tensor:
    """A full tensor for ``p`` to be initialised: NaN where that can mark what no init writes."""
    if mark and p.is_floating_point():
        return torch.full_like(p, float("nan"), device=device)
    return torch.empty_like(p, device=device)


def _still_unwritten(module: nn.Module, mod_name: str, placeholders: dict) -> list[str]:
    """Names of the buffers allocated for ``module`` that no init wrote (same tensor, same version)."""
    prefix = f"{mod_name}." if mod_name else ""
    return [f"buffer {prefix}{n} ({type(module).__name__})" for n, (t, version) in placeholders.items()
            if module._buffers.get(n) is t and version_counter(t) == version]


def fill_group_from_rank0(
    group: FlatGroup, device: torch.device, value_of: Callable[[ParamSpec], torch.Tensor]
) -> None:
    """Rank 0 packs ``value_of(spec)`` for every parameter of the group into one zero-padded flat buffer on
    the compute device, broadcasts it over the model's world data group, and every rank keeps its slice. One
    group's full size is the peak extra memory. ``value_of`` is only called on rank 0."""
    full = torch.empty(group.plan.padded_numel, dtype=group.plan.dtype, device=device)
    if dist.get_rank() == 0:
        full.zero_()  # the padding is broadcast into the last rank's shard, which keeps it zero
        for spec in group.plan.params:
            full.narrow(0, spec.offset, spec.numel).copy_(value_of(spec).detach().reshape(-1))
    collectives.run_and_wait(dist.broadcast, full, src=0, group=group.pgs.world,
                             what=f"rank 0's values of unit {group.plan.unit_fqn or '<root>'!r}")
    with torch.no_grad():
        group.shard.copy_(full.narrow(0, group.shard_start, group.plan.shard_numel))
    resize_storage(full, 0)  # freed now, though collectives keep the finished work a while


def fill_from_rank0(model: nn.Module, groups: list[FlatGroup], device: torch.device, world) -> None:
    """Broadcast rank 0's parameters and buffers over ``world`` (the model's world data group); other ranks may
    hold anything of the right shapes (or meta)."""
    for g in groups:
        fill_group_from_rank0(g, device, lambda spec: spec.refs[0].module._parameters[spec.refs[0].name])
    for module in model.modules():
        for n, b in list(module._buffers.items()):
            if b is None:
                continue
            if b.is_meta or b.device != device:
                b = torch.empty_like(b, device=device) if b.is_meta else b.to(device)
                module._buffers[n] = b
            collectives.run_and_wait(dist.broadcast, b, src=0, group=world, what=f"rank 0's buffer {n!r}")

