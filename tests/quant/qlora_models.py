"""Tiny quantised models for the QLoRA tests: a Hugging Face causal LM built from config, its Linears
(lm_head excepted) replaced by QuantLinear and its fused MoE experts (if any) by QuantExperts, LoRA adapters
around the Linears through peft's custom-module hook."""

from __future__ import annotations

import warnings

import torch

from hf_dirs import tiny_config

VOCAB = 97
TARGETS = ("q_proj", "v_proj", "down_proj")
MOE_TARGETS = ("q_proj", "v_proj")  # attention: a MoE model's experts are not Linears


def moe_config(**overrides):
    """A tiny Qwen3-MoE: 2 layers, 4 experts (top 2), every layer sparse."""
    from transformers import Qwen3MoeConfig

    kw = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 72, "moe_intermediate_size": 40,
          "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 12, "max_position_embeddings": 64, "tie_word_embeddings": False}
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def lm_loss(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def quantised_lora_model(family: str = "llama", seed: int = 0, targets=TARGETS, quant_type: str = "nf4",
                         double_quant: bool = True, **config):
    """fp32 tiny ``family`` model, quantised, with r=4 adapters (B drawn non-zero so A's gradient is too)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import AutoModelForCausalLM

    from shardwise.quant.experts import quantize_experts
    from shardwise.quant.linear import QuantLinear, quantize_linears

    torch.manual_seed(seed)
    config = moe_config(**config) if family == "qwen3_moe" else tiny_config(family, VOCAB, **config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    quantize_experts(model, quant_type=quant_type, double_quant=double_quant)
    quantize_linears(model, quant_type=quant_type, double_quant=double_quant)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    lora._register_custom_module({QuantLinear: LoraLinear})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: "Unsupported layer type ... proceed at your own risk"
        return get_peft_model(model, lora)
