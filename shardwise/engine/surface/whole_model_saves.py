"""``model.save_pretrained(dir)`` on a sharded model writes the whole model through the one streamed writer.

Hugging Face's ``save_pretrained`` (and peft's ``PeftModel.save_pretrained``) would write ``state_dict()``
through safetensors, which cannot read a piece's memory (pieces.py refuses ``data_ptr``). A model that has a
``save_pretrained`` gets an instance attribute of that name at ``shard()`` that calls the registered writer
(``shardwise.save_whole_model``, hf/whole_model.py, registered from above: the engine imports no
integration). Every rank must call it, as transformers' examples do (``is_main_process=rank == 0`` only
chooses who writes, and rank 0 always does); a call on one rank only is a collective on one rank, which the
writer's agreement names on every rank. ``state_dict=`` the model's own (``model.state_dict()``, or
``accelerator.get_state_dict(model)``, as FSDP scripts pass it) is what the writer writes anyway; any other
state dict, and arguments the streamed writer cannot honour (``push_to_hub``, ``safe_serialization=False``,
``variant``), are refused by name. ``save_function`` changes nothing a safetensors save writes (transformers 4
called it only with ``safe_serialization=False``; transformers 5 has no such parameter), so it is ignored, as
transformers ignores it (``save_function=accelerator.save``: Hugging Face's no-trainer scripts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Optional

import torch
import torch.nn as nn

from shardwise.engine.surface.pieces import Piece
from shardwise.errors import ShardwiseError

_writer: Optional[Callable] = None


def register_writer(writer: Callable) -> None:
    """``writer(model, directory, *, max_shard_size=...)``: the whole-model save (shardwise.save_whole_model)."""
    global _writer
    _writer = writer


# save_pretrained's arguments (transformers' and peft's) the streamed writer cannot honour, with the value that
# asks for nothing it would not do anyway.
_REFUSED = {"push_to_hub": False, "safe_serialization": True, "variant": None}
# peft's save_pretrained arguments that choose what is written: passed on to the writer when given
_PASSED = ("max_shard_size", "selected_adapters", "save_embedding_layers")


def install(model: nn.Module) -> None:
    """Route ``model.save_pretrained`` to the writer, where the model has one."""
    if not callable(getattr(type(model), "save_pretrained", None)):
        return

    def save_pretrained(save_directory, is_main_process: bool = True, **kwargs):
        # is_main_process only says who writes in a DDP script: here rank 0 writes, every rank takes part.
        kwargs.pop("save_function", None)
        state_dict = kwargs.pop("state_dict", None)
        if state_dict is not None and not _is_own_state_dict(model, state_dict):
            raise ShardwiseError(
                f"{type(model).__name__}.save_pretrained(..., state_dict={_described(state_dict)}) on a sharded model: "
                f"it writes the model's own weights through shardwise.save_whole_model, one flat group at a time, and "
                f"this state dict is not the model's own (model.state_dict(), accelerator.get_state_dict(model)); "
                f"load it into the model first, or call model.save_pretrained(directory) on every rank")
        for name, harmless in _REFUSED.items():
            value = kwargs.pop(name, harmless)
            if value is not harmless:
                raise ShardwiseError(
                    f"{type(model).__name__}.save_pretrained(..., {name}={_described(value)}) on a sharded model: it "
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


def _is_own_state_dict(model: nn.Module, given: object) -> bool:
    """Whether ``given`` holds the model's own state under its own names: each tensor the same elements of
    the same tensor as ``model.state_dict()``'s (a piece: this rank's, of the same layout), so writing the
    model writes it."""
    own = model.state_dict()
    return isinstance(given, Mapping) and given.keys() == own.keys() and all(
        _same_tensor(given[name], tensor) for name, tensor in own.items())


def _same_tensor(given: object, own: torch.Tensor) -> bool:
    if not isinstance(given, torch.Tensor) or given.dtype != own.dtype or given.shape != own.shape:
        return False
    if isinstance(own, Piece):
        return (isinstance(given, Piece) and given._layout == own._layout
                and given._local.data_ptr() == own._local.data_ptr())
    return not isinstance(given, Piece) and given.data_ptr() == own.data_ptr()


def _described(value: object) -> str:
    """A refused argument, named short: a state dict is not printed tensor by tensor."""
    if isinstance(value, Mapping) and value:
        return f"<{type(value).__name__} of {len(value)} entries>"
    text = repr(value)
    return text if len(text) <= 80 else f"<{type(value).__name__}>"
