"""Hugging Face causal LMs from a ``config.json`` alone: random init, no weights downloaded, ever.

Small models are built eagerly (``AutoModelForCausalLM.from_config``). Large ones are built on the meta
device and materialised shard by shard inside ``shardwise.shard`` through ``param_init_fn``, so no rank ever
holds the whole model.

Initialising them on meta the way ``from_config`` would: ``shardwise.engine.hf_init`` ([Note: HF init on meta]).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.nn as nn


class HFConfigError(ValueError):
    """A config.json that cannot be built as a causal LM."""


def load_hf_config(path: str):
    """An ``AutoConfig`` from a local config.json (or a directory holding one); never touches the network."""
    try:
        import transformers  # noqa: F401  (only to say what is missing, before reading anything)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise HFConfigError("--model PATH/config.json needs the transformers package: pip install transformers") from e
    cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise HFConfigError(f"cannot read Hugging Face config {cfg_file!r}: {e}") from None
    return hf_config_from_dict(raw, repr(cfg_file))


def hf_config_from_dict(raw: dict, where: str):
    """An ``AutoConfig`` from the contents of a config.json (``where`` names its source in errors)."""
    from transformers import AutoConfig

    raw = dict(raw)
    model_type = raw.pop("model_type", None)
    if not model_type:
        raise HFConfigError(f"{where} has no 'model_type' (llama, qwen2, mistral, gpt2, ...)")
    try:
        config = AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as e:
        raise HFConfigError(f"{where}: transformers {transformers_version()} does not know model_type "
                            f"{model_type!r} ({type(e).__name__})") from None
    check_causal_lm(config, where)
    return config


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def check_causal_lm(config, cfg_file: str) -> None:
    """shardwise train builds ``AutoModelForCausalLM``: refuse encoders, encoder-decoders and vision models
    (ViT, T5, BERT ...) here, with the reason, rather than with transformers' traceback in every worker."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFConfigError(f"{cfg_file}: model_type {config.model_type!r} is not a causal language model "
                            f"(AutoModelForCausalLM cannot build it); shardwise train needs one, e.g. llama, "
                            f"qwen2, mistral, gpt2")


def build_hf_model(config, device: torch.device | str = "cpu") -> nn.Module:
    """A randomly initialised causal LM for ``config``, on ``device`` ('meta' allocates nothing)."""
    from transformers import AutoModelForCausalLM

    # SDPA attention: memory-efficient on CPU and GPU, and the attention shardwise's planner models.
    # fp32 masters whatever dtype config.json names (transformers 5 would build a bf16 config in bf16):
    # the optimizer updates them; --mixed-precision bf16 computes in bf16.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False  # training: no KV cache kept alive between micro-batches
    return model


def _text_config_int(config, names: tuple[str, ...]) -> int:
    """The first of ``names`` set on the (text part of the) config: architectures spell sizes differently."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for k in names:
        if getattr(text, k, None):
            return int(getattr(text, k))
    return 0


def hf_num_layers(config) -> int:
    return _text_config_int(config, ("num_hidden_layers", "n_layer", "num_layers"))


def hf_hidden_size(config) -> int:
    return _text_config_int(config, ("hidden_size", "n_embd", "d_model"))


def hf_max_positions(config) -> Optional[int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for k in ("max_position_embeddings", "n_positions", "n_ctx"):
        if getattr(text, k, None):
            return int(getattr(text, k))
    return None
