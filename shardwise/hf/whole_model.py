"""``shardwise.save_whole_model``: the one path that writes a sharded model out whole, as the unsharded model's
``save_pretrained`` would. The tensors are streamed by checkpoint/whole_model.py; this module adds what a
Hugging Face model directory holds besides them (config, generation config, tokenizer) and, for a peft
model, writes the adapter as ``PeftModel.save_pretrained`` does. The framework integrations
(``shardwise.integrations``) save through it.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from shardwise.checkpoint.whole_model import CALL, HF_MAX_SHARD_BYTES, rank0_writes, write_whole_model
from shardwise.engine.surface import whole_model_saves
from shardwise.errors import ShardwiseError
from shardwise.hf.lora import ADAPTER_NAME, ADAPTER_WEIGHTS, adapter_state_dict, is_peft_model, write_adapter_files
from shardwise.hf.quantization import has_quantised
from shardwise.usage import SizeError, parse_size

PathLike = Union[str, os.PathLike]


def save_whole_model(model: nn.Module, directory: PathLike, *, dtype: Optional[torch.dtype] = None,
                     max_shard_size: Union[int, str] = HF_MAX_SHARD_BYTES,
                     processing_class: Any = None, selected_adapters: Optional[list[str]] = None,
                     save_embedding_layers: Union[bool, str] = "auto") -> Optional[list[Path]]:
    """Write sharded ``model`` whole into ``directory``, loadable in one process by ``from_pretrained``.

    The contract (what ``model.save_pretrained`` / ``torch.save`` of a sharded model build on):

    - **Collective.** Every rank of the model calls it, with the same arguments, between steps. A call on
      some ranks only is a ShardwiseError on every rank naming ``save_whole_model`` (the model's collective
      check, on by default; with ``SHARDWISE_CHECK_COLLECTIVES=0`` the others' next collective decides).
    - **What is written.** A transformers ``PreTrainedModel``: ``config.json`` (its ``dtype`` the dtype
      written, ``architectures`` the model's class), ``generation_config.json`` for models that generate,
      and the weights as ``save_pretrained`` lays them out (``model.safetensors``, or
      ``model-0000k-of-0000n.safetensors`` of at most ``max_shard_size`` each plus
      ``model.safetensors.index.json``), under the names of the unsharded model's ``state_dict()``, a tied
      parameter once under its first name, persistent buffers included (no conversion back to another
      checkpoint format: transformers' ``save_original_format=False``). Floating-point tensors in ``dtype``,
      default the master dtype the shards hold (fp32 masters under mixed precision). ``processing_class``
      (a tokenizer or processor): its files too. A peft model: ``adapter_config.json`` and
      ``adapter_model.safetensors`` of each adapter (``selected_adapters``, default all; ``"default"`` in
      ``directory``, any other in ``directory/<name>``), holding what ``PeftModel.save_pretrained`` writes
      (``get_peft_model_state_dict``: ``modules_to_save``, trainable tokens, embeddings as
      ``save_embedding_layers`` says, a prompt-learning adapter's prompt; the frozen base is not written;
      ``shardwise.hf.lora.save_merged`` writes base and adapters merged), and ``processing_class``'s files
      beside them, as a Trainer's ``save_model`` writes them. Any other module: the weights only.
    - **Memory.** Rank 0 writes each tensor as its flat group arrives: no rank holds more than one flat group
      (one unit's parameters of one dtype) whole, plus the tensor being cast; a peft adapter is gathered
      whole on rank 0 (adapters are small).
    - **Atomic.** A new ``directory`` appears complete or not at all; into an existing one (a Trainer's
      output directory) each file is renamed into place and the weight files of an earlier save that this
      one lacks are removed. A failure (a full disk) raises on every rank, naming the file, and leaves
      ``directory`` as it was.
    - **Refused**, on every rank before anything is written: a 4-bit base outside a peft model (its packed
      bytes are shardwise's, not bitsandbytes' serialisation: save the adapter), a parameter a state-dict
      hook renames.

    Rank 0 returns the weight files written; the other ranks None.
    """
    max_shard_bytes = _shard_bytes(max_shard_size)
    if is_peft_model(model):
        return _save_adapter(model, Path(directory), selected_adapters, save_embedding_layers, processing_class)
    if selected_adapters is not None:
        raise ShardwiseError(f"{CALL}: selected_adapters= names adapters of a peft model; "
                             f"{type(model).__name__} is not one")
    if has_quantised(model):
        raise ShardwiseError(f"{CALL}: {type(model).__name__} holds a 4-bit base (QuantLinear), whose packed bytes "
                             f"are shardwise's layout, not a checkpoint format: save the LoRA adapters around it "
                             f"(a peft model saves its adapter), or export the adapters merged into the "
                             f"high-precision base (shardwise export --merge)")
    return write_whole_model(model, directory, dtype=dtype, max_shard_bytes=max_shard_bytes,
                             add_files=lambda tmp, written: _model_files(model, tmp, written, processing_class))


def _shard_bytes(max_shard_size: Union[int, str]) -> int:
    if isinstance(max_shard_size, str):
        try:
            return parse_size(max_shard_size)
        except SizeError as e:
            raise ShardwiseError(f"{CALL}: max_shard_size: {e}") from None
    return max_shard_size


def _save_adapter(model: nn.Module, out: Path, selected_adapters: Optional[list[str]],
                  save_embedding_layers: Union[bool, str], processing_class: Any) -> Optional[list[Path]]:
    """The peft adapters, as ``PeftModel.save_pretrained`` writes them: each selected adapter (default: all)
    under ``out`` for ``"default"``, under ``out/<name>`` for any other name, its config's
    ``base_model_name_or_path`` kept; and the tokenizer beside them, as a Trainer's ``save_model`` writes it."""
    from shardwise.engine.core.runtime import runtime_of

    rt = runtime_of(model)
    if rt.checker is not None:
        rt.checker.check_now(CALL, len(rt.units))  # named as the whole-model save it is, on every rank
    names = list(model.peft_config) if selected_adapters is None else list(selected_adapters)
    unknown = [n for n in names if n not in model.peft_config]
    if unknown:
        raise ShardwiseError(f"{CALL}: selected_adapters {unknown} are not adapters of the peft model "
                             f"(it has {sorted(model.peft_config)})")
    # collective, one adapter at a time; whole on rank 0
    adapters = {n: adapter_state_dict(model, n, save_embedding_layers) for n in names}

    def fill(tmp: Path) -> list[Path]:
        written = []
        for name, tensors in adapters.items():
            where = tmp if name == ADAPTER_NAME else tmp / name
            where.mkdir(parents=True, exist_ok=True)
            config = model.peft_config[name]
            write_adapter_files(where, tensors, config, config.base_model_name_or_path)
            written.append(out / where.relative_to(tmp) / ADAPTER_WEIGHTS)
        if processing_class is not None:
            processing_class.save_pretrained(str(tmp))
        return written

    return rank0_writes(out, fill)


def _model_files(model: nn.Module, tmp: Path, written: Optional[torch.dtype], processing_class: Any) -> None:
    """config.json, generation_config.json and the tokenizer, as ``save_pretrained`` writes them beside the
    weights; nothing for a module that is not a transformers model."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)
    if written is not None:  # what from_pretrained's dtype="auto" then loads: exactly what was written
        config.dtype = str(written).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(tmp))
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(tmp))
    if processing_class is not None:
        processing_class.save_pretrained(str(tmp))


# model.save_pretrained(dir) of a sharded model comes here (engine/surface/whole_model_saves.py).
whole_model_saves.register_writer(save_whole_model)
