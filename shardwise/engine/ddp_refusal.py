"""Refuse ``DistributedDataParallel`` around a sharded model before it touches a parameter.

DDP's constructor broadcasts rank 0's parameters to every rank and then all-reduces gradients by position.
After ``shard()`` every rank's parameters are its own pieces of the whole: the broadcast would overwrite
each rank's pieces with rank 0's (silently when the pieces have the same sizes, with torch's size error
otherwise), and shardwise already averages the gradients. The DDP habit reaches us through user code,
Accelerate's ``prepare(model)`` (MULTI_CPU / MULTI_GPU) and Hugging Face ``Trainer``, which calls it.

The catch is DDP's own list of parameters to ignore, ``module._ddp_params_and_buffers_to_ignore`` (what
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` sets; torch 2.1 to 2.13 read it
with ``set(...)`` in ``__init__`` before any collective): we put there an object whose iteration raises,
so every rank raises when it constructs the wrapper, before the broadcast. Nothing else reads that name.
"""

from __future__ import annotations

import torch.nn as nn

from shardwise.errors import ShardwiseError

ATTR = "_ddp_params_and_buffers_to_ignore"


class _RefuseDDP:
    """Stands where DDP looks for its ignore list; iterating it (DDP's constructor does) raises."""

    def __init__(self, module_name: str):
        self.module_name = module_name

    def __iter__(self):
        raise ShardwiseError(
            f"DistributedDataParallel around this {self.module_name}, which shardwise.shard() already "
            f"shards (DDP would overwrite every rank's parameter pieces with rank 0's and all-reduce them again): "
            f"use the sharded model as it is (it averages gradients itself); with Accelerate, pass only the "
            f"optimizer and data loaders to accelerator.prepare(), not the model. Hugging Face Trainer wraps "
            f"the model this way and is not supported on a sharded model")

    def __reduce__(self):  # a pickled model (torch.save(model)) keeps the refusal
        return (_RefuseDDP, (self.module_name,))


def refuse_ddp(model: nn.Module) -> None:
    """Make ``DistributedDataParallel(m)`` raise for ``model`` and each of its submodules."""
    for m in model.modules():
        m.__dict__[ATTR] = _RefuseDDP(type(m).__name__)
