"""``model.save_pretrained(dir)`` on a sharded model writes the whole model through the one streamed writer.

Hugging Face's ``save_pretrained`` (and peft's ``PeftModel.save_pretrained``) would write ``state_dict()``
through safetensors, which cannot read a piece's memory (pieces.py refuses ``data_ptr``). A model that has a
``save_pretrained`` gets an instance attribute of that name at ``shard()`` that calls the registered writer
(``shardwise.save_whole_model``, hf/whole_model.py, registered from above: the engine imports no
integration). Every rank must call it, as transformers' examples do (``is_main_process=rank == 0`` only
chooses who writes, and rank 0 always does); a call on one rank only is a collective on one rank, which the
writer's agreement names on every rank. Arguments the streamed writer cannot honour (``state_dict=``,
``push_to_hub``, ``safe_serialization=False``, ``variant``) are refused by name.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.nn as nn

from shardwise.errors import ShardwiseError

_writer: Optional[Callable] = None


def register_writer(writer: Callable) -> None:
    """``writer(model, directory, *, max_shard_size=...)``: the whole-model save (shardwise.save_whole_model)."""
    global _writer
    _writer = writer


_REFUSED = {"state_dict": None, "push_to_hub": False, "safe_serialization": True, "variant": None}


def install(model: nn.Module) -> None:
    """Route ``model.save_pretrained`` to the writer, where the model has one."""
    if not callable(getattr(type(model), "save_pretrained", None)):
        return

    def save_pretrained(save_directory, is_main_process: bool = True, *args, max_shard_size="5GB", **kwargs):
        for name, harmless in _REFUSED.items():
            if name in kwargs and kwargs[name] is not harmless:
                raise ShardwiseError(
                    f"{type(model).__name__}.save_pretrained(..., {name}={kwargs[name]!r}) on a sharded model: it "
                    f"writes the whole model through shardwise.save_whole_model, one flat group at a time, which "
                    f"takes no {name}=; call model.save_pretrained(directory) on every rank")
        if _writer is None:
            raise ShardwiseError("save_pretrained on a sharded model needs shardwise's whole-model writer: "
                                 "import shardwise (its package registers it)")
        return _writer(model, save_directory, max_shard_size=max_shard_size)

    save_pretrained.__doc__ = __doc__
    model.__dict__["save_pretrained"] = save_pretrained
