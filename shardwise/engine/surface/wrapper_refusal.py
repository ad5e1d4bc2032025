"""Refuse torch's data-parallel wrappers around a sharded model before they touch a parameter.

DDP's constructor broadcasts rank 0's parameters to every rank and then all-reduces gradients by position.
After ``shard()`` every rank's parameters are its own pieces of the whole: the broadcast would overwrite
each rank's pieces with rank 0's (silently when the pieces have the same sizes, with torch's size error
otherwise), and shardwise already averages the gradients. The DDP habit reaches us through user code,
Accelerate's ``prepare(model)`` (MULTI_CPU / MULTI_GPU) and Hugging Face ``Trainer``, which calls it.

The catch is DDP's own list of parameters to ignore, ``module._ddp_params_and_buffers_to_ignore`` (what
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` sets; torch 2.1 to 2.13 read it
with ``set(...)`` in ``__init__`` before any collective): we put there an object whose iteration raises,
so every rank raises when it constructs the wrapper, before the broadcast. Nothing else reads that name.

FSDP2's ``fully_shard`` and the composable ``replicate`` would shard or broadcast the pieces again (ranks
whose pieces differ in size abort in gloo); FSDP's and ``torch.distributed.checkpoint.state_dict``'s
helpers walk the same registry and would treat the pieces as whole tensors. They all ask the module's
composable-API registry first (``_composable/contract.py``), so there we put a registry whose membership
test for those two APIs raises (see ``_composable_registry_key``); composable ``checkpoint`` still applies.
"""

from __future__ import annotations

import torch.nn as nn

from shardwise.errors import ShardwiseError

ATTR = "_ddp_params_and_buffers_to_ignore"
SHARDING_APIS = ("fully_shard", "replicate")  # the composable APIs that would shard or replicate the pieces


class _RefuseDDP:
    """Stands where DDP looks for its ignore list; iterating it (DDP's constructor does) raises."""

    def __init__(self, module_name: str):
        self.module_name = module_name

    def __iter__(self):
        raise ShardwiseError(
            f"DistributedDataParallel around this {self.module_name}, which shardwise.shard() already "
            f"shards (DDP would overwrite every rank's parameter pieces with rank 0's and all-reduce them again): "
            f"use the sharded model as it is (it averages gradients itself); with Accelerate, hand it over with "
            f"shardwise.integrations.accelerate.prepare_model(accelerator, model); with Hugging Face Trainer or "
            f"TRL, use shardwise.integrations.transformers (ShardwiseTrainer, or its mixin)")

    def __reduce__(self):  # a pickled model (torch.save(model)) keeps the refusal
        return (_RefuseDDP, (self.module_name,))


class _RefuseComposable(dict):
    """A composable-API registry (a dict, as torch checks) that raises when asked what it holds."""

    def __init__(self, module_name: str):
        super().__init__()
        self.module_name = module_name

    def __contains__(self, key):
        if key not in SHARDING_APIS:  # composable checkpoint() and others compose with a sharded model
            return super().__contains__(key)
        raise ShardwiseError(
            f"torch.distributed's fully_shard and replicate, FSDP1 (FullyShardedDataParallel and its static "
            f"helpers) and torch.distributed.checkpoint.state_dict's get_/set_ helpers (torch asked for {key!r}) "
            f"cannot be used on this {self.module_name}, which shardwise.shard() already shards: they would "
            f"shard its parameters again or read each rank's elements as whole tensors. shardwise's own: "
            f"FSDP.summon_full_params -> shardwise.summon_full_params(model); FSDP.state_dict_type / "
            f"get_model_state_dict / set_model_state_dict -> model.state_dict() and model.load_state_dict() as "
            f"they are (torch.save on every rank writes whole tensors), or shardwise.full_state_dict(model) / "
            f"shardwise.load_full_state_dict; FSDP.optim_state_dict / get_optimizer_state_dict -> "
            f"optimizer.state_dict() and optimizer.load_state_dict() as they are (the whole state); "
            f"torch.distributed.checkpoint saves -> shardwise.save_checkpoint / load_checkpoint; "
            f"FSDP.clip_grad_norm_ -> shardwise.clip_grad_norm_(model, max_norm)")

    def __reduce__(self):
        return (_RefuseComposable, (self.module_name,))


def _composable_registry_key():
    """Where ``torch.distributed._composable.contract`` keeps a module's registry of composable APIs in
    ``module.__dict__`` (private; checked on torch 2.11 and 2.13: ``contract`` and ``_get_registry`` test
    membership with ``in``). None where that module is missing."""
    try:
        from torch.distributed._composable.contract import REGISTRY_KEY
    except ImportError:
        return None
    return REGISTRY_KEY


def refuse_wrappers(model: nn.Module) -> None:
    """Make DDP, ``fully_shard``, ``replicate`` and FSDP's state-dict helpers raise for ``model`` and each of
    its submodules."""
    registry_key = _composable_registry_key()
    for m in model.modules():
        m.__dict__[ATTR] = _RefuseDDP(type(m).__name__)
        if registry_key is not None:
            m.__dict__[registry_key] = _RefuseComposable(type(m).__name__)
