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


def lm_loss(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def moe_config(**overrides):
    """hf_dirs' tiny Qwen3-MoE (2 layers, 4 experts, top 2)."""
    return tiny_config("qwen3_moe", VOCAB, **overrides)


def quantised_lora_model(family: str = "llama", seed: int = 0, targets=TARGETS, quant_type: str = "nf4",
                         double_quant: bool = True, **config):
    """fp32 tiny ``family`` model, quantised, with r=4 adapters (B drawn non-zero so A's gradient is too)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import AutoModelForCausalLM

    from shardwise.quant.experts import quantize_experts
    from shardwise.quant.linear import QuantLinear, quantize_linears

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, VOCAB, **config), attn_implementation="sdpa")
    model.config.use_cache = False
    quantize_experts(model, quant_type=quant_type, double_quant=double_quant)
    quantize_linears(model, quant_type=quant_type, double_quant=double_quant)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    lora._register_custom_module({QuantLinear: LoraLinear})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: "Unsupported layer type ... proceed at your own risk"
        return get_peft_model(model, lora)
