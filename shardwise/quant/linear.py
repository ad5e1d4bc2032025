"""``QuantLinear``: a frozen ``nn.Linear`` whose weight is stored in bitsandbytes' 4-bit format as uint8
parameters, so a sharded engine splits its bytes (scales included) like any frozen parameter, and the
weight is dequantised one matrix at a time inside the matmul.

The weight is never kept dequantised: ``Dequant4bitLinear`` dequantises it in forward, multiplies and drops
it, and dequantises it again in backward for the input gradient only (the base gets no gradient). Autograd
saves the stored bytes, which the engine re-gathers into the same storage before backward; under activation
checkpointing the recompute dequantises once more.

``in_features`` / ``out_features`` mirror nn.Linear's, which is what peft needs to put LoRA adapters around
it (register ``{QuantLinear: peft.tuners.lora.Linear}`` as a custom module). The adapters then keep their
own dtype: the stored parameters are uint8, and nothing here is called ``compute_dtype`` (peft would cast
the adapters to it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.quant.format import BLOCKSIZE, Layout4bit, quantize_4bit

STORED = ("weight", "absmax", "nested_absmax", "offset")


class Dequant4bitLinear(torch.autograd.Function):
    """y = x W^T + b with W dequantised from its bytes in forward and again in backward (dX only)."""

    @staticmethod
    def forward(ctx, x, layout: Layout4bit, bias, *stored):
        w = layout.dequantize(dict(zip(STORED, stored)), x.dtype)
        y = F.linear(x, w, None if bias is None else bias.to(x.dtype))
        ctx.layout = layout
        ctx.save_for_backward(*stored)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = ctx.layout.dequantize(dict(zip(STORED, ctx.saved_tensors)), grad_y.dtype)
            grad_x = grad_y @ w
        return (grad_x, None, None) + (None,) * len(STORED)


class QuantLinear(nn.Module):
    """A frozen 4-bit Linear. Parameters (all uint8, ``requires_grad=False``): ``weight`` (packed nibbles),
    ``absmax``, ``nested_absmax``, ``offset`` (see ``Layout4bit``); ``bias`` keeps the original's dtype,
    frozen too. Computes in the input's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, quant_type: str = "nf4",
                 double_quant: bool = True, dtype: torch.dtype = torch.bfloat16,
                 device: Optional[torch.device] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.layout = Layout4bit((out_features, in_features), dtype, quant_type, double_quant, BLOCKSIZE)
        for name, nbytes in self.layout.nbytes().items():
            self.register_parameter(name, nn.Parameter(torch.zeros(nbytes, dtype=torch.uint8, device=device),
                                                       requires_grad=False))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, quant_type: str = "nf4", double_quant: bool = True,
                    name: str = "linear") -> "QuantLinear":
        """Quantise ``linear.weight`` (on CPU); the bias is kept as is. A meta Linear gives a meta QuantLinear
        (nothing to quantise yet: loading fills it)."""
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, quant_type=quant_type,
                double_quant=double_quant, dtype=linear.weight.dtype, device=linear.weight.device)
        if linear.weight.is_meta:
            return q
        q.load_quantized(quantize_4bit(linear.weight.detach(), quant_type, double_quant, name=f"{name}.weight"))
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach())
        return q

    @torch.no_grad()
    def load_quantized(self, quantized) -> None:
        for name, data in self.layout.to_bytes(quantized).items():
            getattr(self, name).copy_(data)

    def stored(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in STORED}

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return self.layout.dequantize(self.stored(), dtype or self.layout.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Dequant4bitLinear.apply(x, self.layout, self.bias, *(getattr(self, n) for n in STORED))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.layout.quant_type}, double_quant={self.layout.double_quant}")


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",), quant_type: str = "nf4",
                     double_quant: bool = True) -> list[str]:
    """Replace every ``nn.Linear`` in ``model`` whose name's last part is not in ``skip`` with its
    ``QuantLinear`` (weights quantised on CPU; a meta model stays on meta). Returns the replaced names."""
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child_name not in skip:
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, QuantLinear.from_linear(child, quant_type, double_quant, full))
                replaced.append(full)
    return replaced
