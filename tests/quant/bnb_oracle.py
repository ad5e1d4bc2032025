"""bitsandbytes as the byte-level oracle of shardwise's 4-bit format: its pinned version, and its outputs
in the shape of ``shardwise.quant.format.Quantized4bit``. Tests that need it skip when it is absent; the
golden fixture (golden_nf4.safetensors, written by ``make_golden`` with the pinned version) keeps the format
checked without it."""

from __future__ import annotations

import pytest
import torch

PINNED_BNB = "0.50.2"


def require_bnb():
    """The bitsandbytes module at the pinned version, or skip: other versions quantise corner cases
    differently (0.46-0.49 encode all-zero blocks as code 0; CUDA kernels use approximate reciprocals)."""
    bnb = pytest.importorskip("bitsandbytes")
    if bnb.__version__ != PINNED_BNB:
        pytest.skip(f"byte-level oracle pinned to bitsandbytes {PINNED_BNB}, found {bnb.__version__}")
    import torch._dynamo

    torch._dynamo.config.disable = True  # its default dequant op is torch.compile'd: seconds per shape
    return bnb


def bnb_quantize(w: torch.Tensor, quant_type: str, double_quant: bool) -> dict[str, torch.Tensor]:
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type=quant_type)
    out = {"packed": packed.view(-1), "absmax": state.absmax, "quant_map": state.code,
           "dequantized": F.dequantize_4bit(packed, state)}
    if double_quant:
        out.update(nested_absmax=state.state2.absmax, nested_quant_map=state.state2.code, offset=state.offset)
    return out
