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


# save_pretrained's arguments (transformers' and peft's) the streamed writer cannot honour, with the value that
# asks for nothing it would not do anyway.
_REFUSED = {"state_dict": None, "push_to_hub": False, "safe_serialization": True, "variant": None,
            "save_function": None}
# peft's save_pretrained arguments that choose what is written: passed on to the writer when given
_PASSED = ("max_shard_size", "selected_adapters", "save_embedding_layers")


def install(model: nn.Module) -> None:
    """Route ``model.save_pretrained`` to the writer, where the model has one."""
    if not callable(getattr(type(model), "save_pretrained", None)):
        return

    def save_pretrained(save_directory, is_main_process: bool = True, **kwargs):
        # is_main_process only says who writes in a DDP script: here rank 0 writes, every rank takes part.
        for name, harmless in _REFUSED.items():
            value = kwargs.pop(name, harmless)
            if value is not harmless and not (name == "save_function" and value is _torch_save()):
                raise ShardwiseError(
                    f"{type(model).__name__}.save_pretrained(..., {name}={value!r}) on a sharded model: it "
                    f"writes the whole model through shardwise.save_whole_model, one flat group at a time, which "
                    f"takes no {name}=; call model.save_pretrained(directory) on every rank")
        options = {name: kwargs.pop(name) for name in _PASSED if name in kwargs}
        if _writer is None:
            raise ShardwiseError("save_pretrained on a sharded model needs shardwise's whole-model writer: "
                                 "import shardwise (its package registers it)")
        # (other keywords, such as token=, change nothing of what is written)
        return _writer(model, save_directory, **options)

    save_pretrained.__doc__ = __doc__
    model.__dict__["save_pretrained"] = save_pretrained


def _torch_save():
    import torch

    return torch.save
