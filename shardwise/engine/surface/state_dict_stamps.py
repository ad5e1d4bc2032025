"""``model.state_dict()`` / ``model.load_state_dict()`` on a sharded model: exact, or refused by name.

After ``shard()`` a parameter's ``state_dict()`` entry is this rank's 1-D piece. The DDP habit (rank 0
saves with ``torch.save``, every rank loads) would give every rank rank 0's pieces: silently, where the
pieces have the same sizes. So ``state_dict()`` stamps its metadata (``state_dict._metadata``, which
``torch.save``/``torch.load`` keep and ``load_state_dict`` hands back) with which pieces it holds, and
``load_state_dict`` on the sharded model takes, per parameter:

- a tensor of the parameter's whole shape (a single-process or ``full_state_dict`` checkpoint, present on
  every rank): this rank cuts its own piece out of it, so ``model.load_state_dict(torch.load(...))``
  of an unsharded checkpoint is exact;
- pieces from a dict stamped with exactly this rank's pieces (the same plan and position): as they are;
- anything else (another rank's or plan's pieces, or pieces whose stamp was lost in a dict copy): refused.

The verdict is agreed by all ranks (``agree.raise_if_any``), so a rank-0-only save loaded everywhere fails
on every rank, rank 0 included. Buffers are whole on every rank and load as usual.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from shardwise.engine.checks import agree
from shardwise.engine.surface.dcp_pieces import mark_pieces
from shardwise.engine.state_dict import _entries

STAMP = "shardwise_pieces"  # the key in the root's state-dict metadata


def install(model: nn.Module, runtime) -> None:
    """Stamp ``model.state_dict()`` with this rank's pieces and check ``model.load_state_dict()``."""
    stamp = _pieces_digest(runtime)

    def add_stamp(module, state_dict, prefix, local_metadata):
        local_metadata[STAMP] = stamp
        mark_pieces(model, state_dict, prefix)  # torch.distributed.checkpoint refuses the pieces (dcp_pieces.py)

    def check_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        problem = _take_pieces(model, runtime, state_dict, prefix, local_metadata.get(STAMP), stamp)
        agree.raise_if_any(problem)
        runtime.shards_written()

    model.register_state_dict_post_hook(add_stamp)
    model.register_load_state_dict_pre_hook(check_load)


def _pieces_digest(runtime) -> str:
    """Which piece of which parameter this rank holds: equal on two ranks exactly when their pieces are."""
    h = hashlib.sha1()
    for g in runtime.flat_groups():
        for spec, (lo, hi, _) in zip(g.plan.params, g.local_slices):
            h.update(f"{spec.fqn} {tuple(spec.shape)} {lo} {hi}\n".encode())
    return h.hexdigest()


def _take_pieces(model, runtime, state_dict, prefix: str, stamp, mine: str):
    """Replace each whole-shape tensor in ``state_dict`` (load_state_dict's own copy) by this rank's piece;
    return the problem text, or None."""
    entries = _entries(runtime, model)
    pieces = []
    for key, e in entries.items():
        if not isinstance(e, tuple) or prefix + key not in state_dict:
            continue
        g, i = e
        spec, (lo, hi, _) = g.plan.params[i], g.local_slices[i]
        value = state_dict[prefix + key]
        if not isinstance(value, torch.Tensor):
            continue  # torch's own error names it
        if tuple(value.shape) == tuple(spec.shape) and stamp is None:
            state_dict[prefix + key] = value.reshape(-1)[lo:hi]
        elif tuple(value.shape) != tuple(spec.shape) or stamp is not None:
            pieces.append(prefix + key)
    if not pieces or stamp == mine:
        return None
    whose = ("without shardwise's stamp (a copy of the dict, or a file format that drops torch's metadata)"
             if stamp is None else "that belong to another rank, plan or world size")
    return (f"load_state_dict: {pieces[0]!r} (and {len(pieces) - 1} more) are 1-D pieces of a sharded model "
            f"{whose}; model.state_dict() holds this rank's pieces only. Save and load it per rank "
            f"(torch.save(model.state_dict(), f'model-rank{{rank}}.pt')) at the same world size and plan, or "
            f"load a whole-model state dict (shardwise.full_state_dict(model) on rank 0, or a single-process "
            f"checkpoint) on every rank with model.load_state_dict, or use shardwise.save_checkpoint")
