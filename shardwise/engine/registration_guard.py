"""A module attached to a sharded model after ``shard()`` with parameters that no flat group holds is refused by
name: ``peft.get_peft_model`` (or ``inject_adapter_in_model``) on a model already sharded, a head swapped for a
new ``nn.Linear``. Those parameters would belong to no flat group, so nothing gathers, reduces or shards them:
each rank would train its own copy on its own data, silently (DDP built before them does not sync them either).

torch's global module-registration hook (``torch.nn.modules.module.register_module_module_registration_hook``,
public since torch 2.0; checked on torch 2.11 and 2.13) sees every ``setattr(parent, name, module)`` and
``add_module``. It is installed once, at the first ``shard()``; the check runs only where the parent belongs to
a sharded model (it carries the runtime), so other modules pay one dictionary read. A child that carries only
parameters the model already holds (the module it replaces wrapped, as an activation-checkpoint wrapper does)
passes. Adapters added before ``shard()`` are sharded like any parameter; rewrite_refusal.py refuses peft's
``add_adapter`` after it.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn
from torch.nn.modules.module import register_module_module_registration_hook

from shardwise.engine.core.runtime import STATE_ATTR
from shardwise.errors import ShardwiseError

_installed = False


def install() -> None:
    global _installed
    if not _installed:
        register_module_module_registration_hook(_check)
        _installed = True


def _check(parent: nn.Module, name: str, child: Optional[nn.Module]) -> None:
    runtime = parent.__dict__.get(STATE_ATTR)
    if runtime is None or child is None:
        return None
    known = {id(p) for g in runtime.flat_groups() for p in g.shard_params}
    replaced = parent._modules.get(name)
    if replaced is not None:  # mid-forward its parameters may be the gathered ones
        known.update(id(p) for p in replaced.parameters())
    unknown = [n for n, p in child.named_parameters() if id(p) not in known]
    if unknown:
        raise ShardwiseError(
            f"module {type(child).__name__} attached as {name!r} to {type(parent).__name__} after shardwise.shard() "
            f"holds parameters no flat group holds ({', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}): "
            f"each rank would train its own copy on its own data. Build the model whole first (peft's "
            f"get_peft_model, a new head, ...), then call shardwise.shard()")
    return None
