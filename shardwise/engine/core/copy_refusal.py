"""``torch.save(model)``, ``pickle`` and ``copy.deepcopy`` of a sharded model, refused by name.

The objects a sharded module reaches first (its units, through their hooks, and its runtime, through every
submodule's attribute) carry these as ``__reduce_ex__`` and ``__deepcopy__``, so the copy fails with a
``ShardwiseError`` instead of on a ProcessGroup pickle.
"""

from __future__ import annotations

from shardwise.errors import ShardwiseError


def refuse_pickle(self, protocol):
    """``__reduce_ex__`` of the objects a sharded module reaches first (its units through their hooks, its
    runtime): ``torch.save(model)`` / ``pickle.dumps(model)`` are refused by name instead of failing on a
    ProcessGroup."""
    raise ShardwiseError(
        "torch.save(model) / pickle of a sharded model: its runtime holds process groups and its units' "
        "gathered buffers. Save its weights instead: torch.save(model.state_dict(), path) on every rank (the "
        "whole model, as under DDP), shardwise.save_whole_model(model, dir) (streamed safetensors) or "
        "shardwise.save_checkpoint (every rank's pieces and the optimizer state, to resume)")


def refuse_deepcopy(self, memo):
    """``__deepcopy__`` of the same objects: the copy would share hooks, buffers and process groups."""
    raise ShardwiseError(
        "copy.deepcopy() of a sharded model: its parameters are this rank's shards and its runtime holds "
        "process groups and gathered buffers. Copy the model before shardwise.shard() (and shard the copy "
        "too), or keep copies of the shards: [p.detach().clone() for p in model.parameters()] (an EMA "
        "updates them in place)")
