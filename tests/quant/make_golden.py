"""Writes golden_nf4.safetensors: fixed inputs and what bitsandbytes (the pinned version) makes of them.
Run by hand when the pinned version changes: ``python tests/quant/make_golden.py``."""

from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from bnb_oracle import PINNED_BNB, bnb_quantize  # noqa: E402


def golden_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(20)
    w = torch.randn(1, 64 * 260 + 7, generator=g).to(torch.bfloat16)  # partial blocks, odd numel, 2 nested blocks
    w.view(-1)[128:192] = 0  # an all-zero block
    return {"bf16_nf4_dq": w, "bf16_nf4_plain": w.clone(), "bf16_fp4_dq": w[:1, :900].clone()}


def main() -> None:
    import bitsandbytes

    assert bitsandbytes.__version__ == PINNED_BNB, bitsandbytes.__version__
    out = {}
    for prefix, w in golden_inputs().items():
        quant_type, dq = prefix.split("_")[1], prefix.endswith("dq")
        out[f"{prefix}/input"] = w
        for key, t in bnb_quantize(w, quant_type, dq).items():
            out[f"{prefix}/{key}"] = t.reshape(1) if key == "offset" else t.contiguous()
    save_file(out, os.path.join(os.path.dirname(__file__), "golden_nf4.safetensors"),
              metadata={"bitsandbytes": PINNED_BNB})


if __name__ == "__main__":
    main()
