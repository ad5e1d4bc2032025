"""Refused by name at ``shard()``: modules and methods that rewrite parameters behind the engine's back.

- ``nn.Embedding(max_norm=...)`` (and ``EmbeddingBag``) renormalises the rows it looks up in place, inside its
  forward: on a sharded model that write would land in the gathered copy (autograd refuses it there, a view
  written in place) and never reach the shards. Refused at ``shard()``, before anything is allocated.
- ``resize_token_embeddings`` and ``resize_position_embeddings`` (Hugging Face) build new embedding modules
  from the old weights and swap them in: after ``shard()`` they would read pieces as whole matrices. Each module
  that has them gets an instance attribute that raises, naming the method and what to do instead (resize
  before ``shard()``).
- ``add_adapter``, ``load_adapter`` and ``add_weighted_adapter`` (peft's ``PeftModel`` and tuners, transformers'
  adapter mixin) create new adapter parameters inside modules that are already sharded: they would belong to
  no flat group, so each rank would train its own copy on its own data (DDP does not sync them either). Refused
  the same way; ``set_adapter`` between adapters added before ``shard()`` is exact.
"""

from __future__ import annotations

import torch.nn as nn

from shardwise.errors import ShardwiseError

# method -> (what it does, what to do instead)
REBUILDING_METHODS = {
    "resize_token_embeddings": ("rebuilds embedding parameters from the old weights, which are this rank's "
                                "pieces now", "call resize_token_embeddings() before shard()"),
    "resize_position_embeddings": ("rebuilds embedding parameters from the old weights, which are this rank's "
                                   "pieces now", "call resize_position_embeddings() before shard()"),
}
_ADDED_PARAMETERS = ("creates adapter parameters that no flat group holds: each rank would train its own copy on "
                     "its own data", "add every adapter before shard() (switch between them with set_adapter)")
REBUILDING_METHODS.update({m: _ADDED_PARAMETERS for m in ("add_adapter", "load_adapter", "add_weighted_adapter")})


def refuse_rewriting_modules(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise ShardwiseError(
                f"module {name or '<root>'!r} is {type(m).__name__}(max_norm={m.max_norm}), which renormalises the "
                f"rows it looks up in place during forward: on a sharded model that write would reach only a "
                f"gathered copy of the weight, not the parameter. Build it without max_norm (renormalise "
                f"explicitly between steps under shardwise.summon_full_params(model, writeback=True) if needed)")


def refuse_rebuilding_methods(model: nn.Module) -> None:
    """After ``shard()``: each module's parameter-rebuilding methods raise by name."""
    for m in model.modules():
        for method, (does, instead) in REBUILDING_METHODS.items():
            if callable(getattr(type(m), method, None)):
                m.__dict__[method] = _Refusal(type(m).__name__, method, does, instead)


class _Refusal:
    def __init__(self, owner: str, method: str, does: str, instead: str):
        self.owner, self.method, self.does, self.instead = owner, method, does, instead

    def __call__(self, *args, **kwargs):
        raise ShardwiseError(f"{self.owner}.{self.method}() after shardwise.shard(): it {self.does}; {self.instead}")
