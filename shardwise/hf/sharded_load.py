"""A Hugging Face model directory loaded straight into a sharded model, without any rank ever holding the
whole model: the README's "in your own loop" recipe as one call, for the framework integrations
(``shardwise.integrations``) and for users.

Built on the meta device (nothing allocated), quantised to 4 bits where asked (``QuantLinear``), wrapped by
peft where a LoRA config is given, sharded (``shard(param_init_fn=skip_weight_init(...))``: no random init
of weights about to be read), then each rank reads only the bytes of its own pieces from the safetensors
files (``load_pretrained``; a 4-bit base by byte-range copy or quantised on load). Peak memory per rank is
its 1/N of the model plus one module's temporaries, where ``from_pretrained`` on every rank holds a full
copy per rank.

What comes out equals ``AutoModelForCausalLM.from_pretrained(directory)`` (then ``get_peft_model``): the
same dtype rule (``dtype="auto"``: the dtype config.json names), the same names, tied weights and buffers,
and LoRA adapters initialised as peft initialises them, drawing from the random generator in the order
``get_peft_model`` draws (the same seed gives the same adapters).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from shardwise.errors import ShardwiseError
from shardwise.hf.quantization import QuantSettings, quantize_model

PathLike = Union[str, os.PathLike]


def load_sharded(directory: PathLike, *, peft_config: Any = None, quantization_config: Any = None,
                 dtype: Union[str, torch.dtype, None] = "auto", auto_class: Any = None,
                 attn_implementation: Optional[str] = None, **shard_options: Any) -> nn.Module:
    """The model of Hugging Face directory ``directory``, sharded by ``shardwise.shard(**shard_options)``
    (units, strategy, mixed_precision, offload, activation_checkpointing, device, ...; ``units`` may also be
    a list of class names). Collective.

    ``peft_config``: a peft ``LoraConfig`` (the model comes back a peft model, adapters trainable, base
    frozen). ``quantization_config``: ``transformers.BitsAndBytesConfig(load_in_4bit=True, ...)``, its dict,
    or a ``shardwise.QuantSettings``: the base's Linears become shardwise's 4-bit ``QuantLinear`` (bytes
    equal to bitsandbytes'; bitsandbytes itself is not needed); a pre-quantised directory ("bnb-4bit") is
    read as it is quantised. ``dtype``: the dtype of the (non-4-bit) weights, ``"auto"`` as
    ``from_pretrained``. ``auto_class``: default ``transformers.AutoModelForCausalLM``;
    ``attn_implementation``: as ``from_pretrained`` takes it."""
    from shardwise.engine.api import shard
    from shardwise.hf.lora import apply_peft_config, lora_param_init_fn
    from shardwise.hf.pretrained import load_pretrained, skip_weight_init

    config = _config(directory)
    quant = quant_settings_of(directory, quantization_config)
    with torch.device("meta"):
        model = _auto_class(auto_class).from_config(config, dtype=_dtype(config, dtype),
                                                    **({} if attn_implementation is None else
                                                       {"attn_implementation": attn_implementation}))
    if quant is not None:
        quantize_model(model, quant)
    init = skip_weight_init(model)
    if peft_config is not None:
        model = apply_peft_config(model, peft_config)
        init = lora_param_init_fn(model, init)
    shard(model, param_init_fn=init, **{**shard_options, "units": units_of(model, shard_options.get("units", "auto"))})
    load_pretrained(model, directory, quantization=quant)
    return model


def units_of(model: nn.Module, units: Any) -> Any:
    """``shard()``'s ``units``, where a list of class names (Accelerate's ``transformer_layer_cls_to_wrap``)
    becomes those classes of ``model`` (a name it does not hold is refused, listing those it does)."""
    from shardwise.hf.model_spec import ModelError, classes_named

    if isinstance(units, (list, tuple)) and units and all(isinstance(u, str) for u in units):
        try:
            return classes_named(model, units, "units")
        except ModelError as e:
            raise ShardwiseError(str(e)) from None
    return units


def quant_settings_of(directory: PathLike, quantization_config: Any) -> Optional[QuantSettings]:
    """The 4-bit settings ``load_sharded`` uses: ``quantization_config`` translated, else those of a
    pre-quantised directory, else None. A directory quantised otherwise than asked is refused."""
    saved = QuantSettings.from_pretrained(directory)
    if quantization_config is None:
        return saved
    if isinstance(quantization_config, QuantSettings):
        asked = quantization_config
    else:
        raw = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
        asked = QuantSettings.from_hf(raw)
    if saved is not None and saved != asked:
        raise ShardwiseError(f"quantization_config asks for {asked.to_dict()}, but {directory} holds weights "
                             f"quantised as {saved.to_dict()} (config.json's quantization_config): drop "
                             f"quantization_config, or load the high-precision weights")
    return asked


def base_record_of(directory: PathLike, quantization: Optional[QuantSettings] = None,
                   recorded: Optional[dict] = None) -> dict:
    """The ``frozen_base`` record (checkpoint/frozen_base.py) of the weights in ``directory`` as they are held
    (``quantization``): what an adapter-only checkpoint records, and what a resume compares with it.
    ``recorded``: the record of the checkpoint about to be loaded (its identity may follow the older,
    file-layout rule: ``weight_files.identity_for``)."""
    from shardwise.checkpoint.frozen_base import base_record
    from shardwise.hf.weight_files import identity_for

    identity = identity_for(directory, recorded["weights_sha256"] if recorded else None)
    return base_record(os.path.abspath(directory), identity, None if quantization is None else quantization.to_dict())


def _config(directory: PathLike):
    from transformers import AutoConfig

    if not os.path.isdir(directory):
        raise ShardwiseError(f"{directory}: not a model directory (shardwise downloads nothing: give a local "
                             f"directory with config.json and safetensors weights)")
    return AutoConfig.from_pretrained(str(directory))


def _auto_class(auto_class: Any):
    if auto_class is not None:
        return auto_class
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def _dtype(config, dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    """``from_pretrained``'s rule: ``"auto"`` takes the dtype config.json names (fp32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in ("auto", None):
        named = getattr(torch, str(dtype), None)
        if not isinstance(named, torch.dtype):
            raise ShardwiseError(f"dtype={dtype!r}: not a torch dtype (e.g. torch.bfloat16, 'bfloat16', 'auto')")
        return named
    named = getattr(config, "dtype", None) if dtype == "auto" else None
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else torch.float32
