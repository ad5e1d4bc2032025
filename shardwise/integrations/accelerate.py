"""shardwise in your own Accelerate loop.

Accelerate's ``prepare(model)`` wraps the model in DDP under MULTI_CPU / MULTI_GPU, which a sharded model
refuses; its ``DistributedType`` is a closed list with no place for another sharding. What it does offer in
public is ``prepare_model(model, device_placement=False, evaluation_mode=True)``: the model gets
Accelerate's autocast (``mixed_precision="bf16"``) and ``torch.compile`` if configured, is marked prepared,
and is not wrapped. A later ``accelerator.prepare(model, optimizer, loader)`` then hands the model back as
it is. ``accelerator.accumulate(model)`` / ``no_sync(model)`` call ``model.no_sync()`` where a model has
one (DDP's interface): the model gets shardwise's, so accumulation keeps gradients local until the last
micro-batch. ``accelerator.backward`` and ``accelerator.clip_grad_norm_`` need nothing: torch's
``clip_grad_norm_`` is exact on shard parameters.

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
    model = shard_and_prepare(accelerator, model, units="auto")      # instead of prepare(model)
    optimizer, loader = accelerator.prepare(torch.optim.AdamW(model.parameters()), loader)
    ...
    save_model(accelerator, model, "out/")                         # instead of accelerator.save_model
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

import shardwise
from shardwise.errors import ShardwiseError

PathLike = Union[str, os.PathLike]


def shard_and_prepare(accelerator, model: nn.Module, **shard_options: Any) -> nn.Module:
    """``shardwise.shard(model, **shard_options)`` (on ``accelerator.device`` unless ``device=`` is given;
    skipped for a model that is already sharded, which then takes no options), then ``prepare_model``.
    Every rank calls it. Returns what ``prepare_model`` returns: the model itself, unless Accelerate
    compiles it."""
    if not is_sharded(model):
        shard_options.setdefault("device", accelerator.device)
        shardwise.shard(model, **shard_options)
    elif shard_options:
        raise ShardwiseError(f"shard_and_prepare: {type(model).__name__} is already sharded; pass it without "
                             f"shard options ({', '.join(sorted(shard_options))}), or pass the model unsharded")
    return prepare_model(accelerator, model)


def prepare_model(accelerator, model: nn.Module) -> nn.Module:
    """Hand an already sharded ``model`` to ``accelerator`` without a DDP wrapper: Accelerate's autocast
    and compile kept (its public ``prepare_model(..., device_placement=False, evaluation_mode=True)``), and
    ``model.no_sync`` for gradient accumulation. Returns the model."""
    _refuse_sharding_plugins(accelerator)
    if not is_sharded(model):
        raise ShardwiseError(f"prepare_model: {type(model).__name__} is not sharded; call shardwise.shard(model) "
                             f"first, or use shard_and_prepare(accelerator, model, ...)")
    # DDP's accumulation interface, which Accelerate (and the Trainer through it) looks up on the model.
    model.no_sync = functools.partial(shardwise.no_sync, model)
    prepared = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    if prepared is not model:  # torch.compile returns a wrapper around the same sharded modules
        prepared.no_sync = model.no_sync
    return prepared


def save_model(accelerator, model: nn.Module, save_directory: PathLike, *, max_shard_size: Union[int, str] = "10GB",
               dtype: Optional[torch.dtype] = None, processing_class: Any = None) -> Optional[list[Path]]:
    """What ``accelerator.save_model(model, save_directory)`` writes for an unsharded model (the whole
    model as safetensors; a peft model's adapter), from a sharded one, with a transformers model's config
    beside it so that ``from_pretrained(save_directory)`` loads it: ``shardwise.save_whole_model``. Every
    rank calls it; rank 0 writes. Returns the files written on rank 0, None elsewhere."""
    return shardwise.save_whole_model(accelerator.unwrap_model(model), save_directory, dtype=dtype,
                                      max_shard_size=max_shard_size, processing_class=processing_class)


def _refuse_sharding_plugins(accelerator) -> None:
    """An Accelerator configured for FSDP or DeepSpeed would shard (or wrap) the model itself."""
    kind = str(getattr(accelerator, "distributed_type", "")).split(".")[-1].upper()
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        raise ShardwiseError(f"this Accelerator is configured for {kind} (accelerate config or ACCELERATE_USE_"
                             f"{'FSDP' if kind == 'FSDP' else kind} in the environment), which would shard the "
                             f"model again: run with a plain multi-process configuration; shardwise shards")


def is_sharded(model: nn.Module) -> bool:
    """Whether ``shardwise.shard`` was called on ``model``."""
    from shardwise.engine.core.runtime import STATE_ATTR

    return getattr(model, STATE_ATTR, None) is not None
