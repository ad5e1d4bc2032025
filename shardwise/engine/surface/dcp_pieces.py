"""``torch.distributed.checkpoint`` (DCP) of ``model.state_dict()``: refused by name at ``dcp.save``.

After ``shard()`` a parameter's entry is this rank's 1-D piece. DCP takes a plain tensor for a replicated
whole: it would keep one rank's piece and load it on every rank (silently, where the pieces have the same
sizes). DCP cannot be told the truth instead: it places chunks by ``__create_write_items__`` (the
``_Checkpointable`` protocol DTensor implements, ``torch/distributed/_checkpointable.py``), but at load it
requires ``value.size()`` to be the whole tensor's, which a piece's is not. So ``state_dict()`` returns each
piece that is not the whole parameter as a ``StateDictPiece``: the same memory and a plain tensor to every
operation (torch functions return plain tensors, ``torch.save`` writes a plain tensor), whose
``__create_write_items__`` raises. DCP collects that error from every rank and raises its
``CheckpointException`` (naming ours) on all of them. Whole parameters (``no_shard``) stay plain tensors,
which DCP saves and loads exactly. Checked on torch 2.11 and 2.13.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.engine.surface import pieces
from shardwise.engine.logical_shapes import param_info
from shardwise.errors import ShardwiseError


class StateDictPiece(torch.Tensor):
    """A piece of a parameter in a ``state_dict()``: a plain tensor, except to DCP."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # every op sees (and returns) plain tensors

    def __create_write_items__(self, fqn: str, obj) -> list:
        raise ShardwiseError(
            f"torch.distributed.checkpoint of {fqn!r}: model.state_dict() of a sharded model holds this rank's "
            f"1-D piece of each parameter, which DCP would take for the whole tensor (it keeps one rank's). "
            f"Use shardwise.save_checkpoint / load_checkpoint (any world size), or torch.save(model.state_dict()) "
            f"per rank at the same world size and plan")

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def mark_pieces(model: nn.Module, state_dict: dict, prefix: str) -> None:
    """Turn the entries of ``state_dict`` (a ``state_dict()`` result) that are pieces into StateDictPieces."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            key = f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}"
            value = state_dict.get(key)
            if value is None or value is p:  # keep_vars=True: the parameter
                continue
            if isinstance(value, pieces.ShardPiece):  # p.detach() of a ShardParam: the same memory, plain here
                value = state_dict[key] = pieces.strip(value)
            elif type(value) is not torch.Tensor:
                continue
            try:
                info = param_info(p)
            except ShardwiseError:  # not a shard parameter (state_dict() called inside a unit's forward)
                continue
            if info.local_numel != info.numel:
                state_dict[key] = value.as_subclass(StateDictPiece)
