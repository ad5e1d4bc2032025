"""``model.state_dict()`` / ``model.load_state_dict()`` on a sharded model: whole tensors, or refused by name.

``state_dict()`` holds each parameter as a ``Piece`` (``p.detach()``: no copy, no collective), which reads as
the whole tensor and pickles as it (pieces.py ``__reduce_ex__``: one agreed all-gather per tensor). So
``torch.save(model.state_dict(), path)``, or a checkpoint dict holding it, called on every rank writes the
whole model (in one file per call: every rank holds and writes it), loadable by one process; called on one
rank only it is a collective on one rank, which the agreement names as an error on every rank. torch.save
keeps every storage it pickles until it ends, so the whole model is in memory while it writes:
``shardwise.full_state_dict`` (rank 0 only) and the streamed whole-model writer are the ways for large
models. ``safetensors.torch.save_file`` reads ``data_ptr()``, which a piece refuses by name.
``torch.distributed.checkpoint`` is refused by name (``Piece.__create_write_items__``).

``load_state_dict`` copies each entry into the parameter (``param.copy_(value)``): a whole tensor (a file
written as above, a single-process checkpoint) gives each rank its own elements; a piece of the same layout
(the model's own ``state_dict()``) its elements; anything else is refused by name by the table
(piece_ops.py). Buffers are whole on every rank and load as usual.
"""

from __future__ import annotations

import torch.nn as nn


def install(model: nn.Module, runtime) -> None:
    """After ``model.load_state_dict()``: the shards were written (ZeRO-1/2 refill their kept copies)."""
    model.register_load_state_dict_post_hook(lambda module, incompatible_keys: runtime.shards_written())
