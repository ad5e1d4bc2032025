"""Which Linears of a model become 4-bit, spelled as Hugging Face spells it (``BitsAndBytesConfig`` /
``quantization_config`` in config.json), and the peft hookup that puts LoRA adapters around them.

The recipe (README, "QLoRA"): build on meta, ``quantize_model`` (Linears -> ``QuantLinear``, lm_head kept;
transformers 5's fused MoE experts -> ``QuantExperts``),
``apply_lora``, ``shard``, then ``load_pretrained(..., quantization=settings)``, which reads a pre-quantised
directory by copy or quantises a bf16/fp32 one on load.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.quant.codebooks import check_quant_type
from shardwise.quant.experts import QUANT_MODULE_TYPES, quantize_experts
from shardwise.quant.linear import QuantLinear, quantize_linears


@dataclass(frozen=True)
class QuantSettings:
    """A 4-bit base: ``quant_type`` nf4|fp4, ``double_quant`` (bitsandbytes' ``bnb_4bit_use_double_quant``),
    and the Linears and MoE experts modules left in high precision (by the last part of their name:
    ``"experts"`` keeps a MoE model's fused experts unquantised, as transformers' own 4-bit load does)."""

    quant_type: str = "nf4"
    double_quant: bool = True
    skip_modules: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        check_quant_type(self.quant_type, "quantization")

    def to_dict(self) -> dict:
        """What a checkpoint records (and ``from_dict`` reads back)."""
        return {"quant_type": self.quant_type, "double_quant": self.double_quant,
                "skip_modules": list(self.skip_modules)}

    @classmethod
    def from_dict(cls, d: dict) -> "QuantSettings":
        return cls(d["quant_type"], bool(d["double_quant"]), tuple(d.get("skip_modules", ("lm_head",))))

    @classmethod
    def from_hf(cls, config: dict, where: str = "quantization_config") -> "QuantSettings":
        """From a ``BitsAndBytesConfig.to_dict()`` (config.json's ``quantization_config``)."""
        if config.get("quant_method") != "bitsandbytes" or not config.get("load_in_4bit", config.get("_load_in_4bit")):
            raise ShardwiseError(f"{where}: only bitsandbytes 4-bit checkpoints load as a 4-bit base (quant_method "
                                 f"{config.get('quant_method')!r}, load_in_4bit {config.get('load_in_4bit')!r})")
        skip = tuple(config.get("llm_int8_skip_modules") or ("lm_head",))
        return cls(config.get("bnb_4bit_quant_type", "fp4"), bool(config.get("bnb_4bit_use_double_quant", False)), skip)

    @classmethod
    def from_pretrained(cls, directory: os.PathLike | str) -> "QuantSettings | None":
        """The settings of a pre-quantised Hugging Face directory; None when its weights are not quantised."""
        path = Path(directory) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ShardwiseError(f"{path}: cannot read ({type(e).__name__})") from None
        q = config.get("quantization_config") if isinstance(config, dict) else None
        return None if q is None else cls.from_hf(q, f"{path}: quantization_config")


def quantize_model(model: nn.Module, settings: QuantSettings) -> list[str]:
    """Replace the model's ``nn.Linear`` modules by ``QuantLinear`` and its fused MoE experts modules by
    ``QuantExperts`` (``settings.skip_modules`` excepted). On a meta-built model nothing is quantised yet
    (``load_pretrained`` fills them); on a real one the weights are quantised now. Returns the names replaced."""
    args = (settings.skip_modules, settings.quant_type, settings.double_quant)
    replaced = quantize_experts(model, *args) + quantize_linears(model, *args)
    if not replaced:
        raise ShardwiseError(f"quantization: {type(model).__name__} has no nn.Linear to quantise")
    return replaced


def check_quantised_model(model: nn.Module, settings: QuantSettings) -> None:
    """A model given to ``load_pretrained(..., quantization=settings)`` must have been quantised with them."""
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, QUANT_MODULE_TYPES)]
    if not modules:
        raise ShardwiseError(f"load_pretrained(quantization=...): {type(model).__name__} has no 4-bit modules; "
                             f"call shardwise.quantize_model(model, settings) before shard()")
    for name, m in modules:
        if (m.layout.quant_type, m.layout.double_quant) != (settings.quant_type, settings.double_quant):
            raise ShardwiseError(f"load_pretrained: {name} is {m.layout.quant_type} double_quant="
                                 f"{m.layout.double_quant}, quantization asks for {settings.quant_type} "
                                 f"double_quant={settings.double_quant}")


def register_with_peft(lora_config) -> None:
    """Let peft put its LoRA Linear around ``QuantLinear`` (peft's custom-module hook; peft reads
    ``in_features`` / ``out_features`` from it and keeps the adapters in their own dtype)."""
    from peft.tuners.lora import Linear as LoraLinear

    lora_config._register_custom_module({QuantLinear: LoraLinear})


KERNEL_HINT_LOGGER = "bitsandbytes.backends.cpu.ops"


class _DropKernelHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


def quiet_bitsandbytes_kernel_hint() -> None:
    """Drop the one line bitsandbytes (0.49+) logs when it is imported on a CPU with AVX512-BF16 and the
    ``kernels`` package is missing ("Failed to load CPU gemm_4bit_forward ... pip install kernels").
    transformers and peft import bitsandbytes whenever it is installed, so every rank printed it first
    thing, although shardwise's 4-bit base never runs a bitsandbytes kernel. Only that message, only from
    that logger (``bitsandbytes.backends.cpu.ops``, checked on bitsandbytes 0.50.2)."""
    logger = logging.getLogger(KERNEL_HINT_LOGGER)
    if not any(isinstance(f, _DropKernelHint) for f in logger.filters):
        logger.addFilter(_DropKernelHint())


def num_weights(model: nn.Module) -> int:
    """The parameter count of the model as its unquantised self has it: a 4-bit module's packed bytes and
    scales count as the weights they encode (each matrix's elements), every other parameter as
    ``shardwise.num_parameters`` counts it (tied ones once; whole, not this rank's piece, once sharded)."""
    from shardwise.engine.logical_shapes import param_info
    from shardwise.engine.core.runtime import STATE_ATTR

    sharded = getattr(model, STATE_ATTR, None) is not None
    quantised = [m for m in model.modules() if isinstance(m, QUANT_MODULE_TYPES)]
    packed = {id(m._parameters[n]) for m in quantised for n in m.layout.nbytes()}
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in packed:
            seen.add(id(p))
            total += param_info(p).numel if sharded else p.numel()
    return total + sum(m.layout.numel * getattr(m, "num_experts", 1) for m in quantised)


def has_quantised(model: nn.Module) -> bool:
    return any(isinstance(m, QUANT_MODULE_TYPES) for m in model.modules())

