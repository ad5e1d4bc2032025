"""``QuantLinear``: a frozen ``nn.Linear`` whose weight is stored in bitsandbytes' 4-bit format as uint8
parameters, so a sharded engine splits its bytes (scales included) like any frozen parameter, and the
weight is dequantised one matrix at a time inside the matmul.

The weight is never kept dequantised past its backward: ``Dequant4bitLinear`` dequantises it in forward,
multiplies and drops it, and dequantises it again in backward for the input gradient only (the base gets no
gradient). Autograd saves the stored bytes, which the engine re-gathers into the same storage before
backward. Under activation checkpointing the recompute (a forward inside backward) dequantises, and its
backward, which follows at once, uses that same weight: twice per weight per step either way, the
recompute's weights alive for one unit's backward, as a bf16 base's gathered unit is. Each module's
``DequantTally`` counts its dequantisations (``dequantization_counts``).

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

from shardwise.autograd_state import autograd_engine_running
from shardwise.quant.format import BLOCKSIZE, Layout4bit, quantize_4bit

STORED = ("weight", "absmax", "nested_absmax", "offset")


class DequantTally:
    """How many times one 4-bit matrix has been dequantised for a matmul (forward, recompute, backward)."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0


def _dequantize(layout: Layout4bit, stored, dtype: torch.dtype, tally: DequantTally) -> torch.Tensor:
    tally.count += 1
    return layout.dequantize(dict(zip(STORED, stored)), dtype)


def _stand_in(w: torch.Tensor) -> torch.Tensor:
    """What an ordinary forward saves in place of its weight: a one-element tensor expanded to the weight's
    shape (every stride 0, so ``backward`` tells it from a real weight), with its dtype and device, since
    non-reentrant checkpointing compares what the forward and the recompute save."""
    return w.new_empty(()).expand(w.shape)


class Dequant4bitLinear(torch.autograd.Function):
    """y = x W^T + b with W dequantised from its bytes in forward; dX only in backward, with the recompute's
    W (activation checkpointing) or W dequantised again."""

    @staticmethod
    def forward(ctx, x, layout: Layout4bit, bias, tally: DequantTally, *stored):
        w = _dequantize(layout, stored, x.dtype, tally)
        y = F.linear(x, w, None if bias is None else bias.to(x.dtype))
        ctx.layout, ctx.tally = layout, tally
        # A forward inside backward is a recompute, whose backward comes right after it: keep W for it. An
        # ordinary forward keeps only the bytes (W for every layer until backward would be a bf16 base's
        # memory). Non-reentrant checkpointing hands backward what the recompute saved, not the forward's
        # ctx attributes, so the choice travels in the saved tensor itself.
        recompute = ctx.needs_input_grad[0] and autograd_engine_running()
        ctx.save_for_backward(*stored, w if recompute else _stand_in(w))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        grad_x = None
        if ctx.needs_input_grad[0]:
            *stored, w = ctx.saved_tensors
            if not any(w.stride()):
                w = _dequantize(ctx.layout, stored, grad_y.dtype, ctx.tally)
            grad_x = grad_y @ w
        return (grad_x, None, None, None) + (None,) * len(STORED)


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
        self.dequant_tallies = [DequantTally()]  # one per matrix, as QuantExpertMatrices has

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
        return Dequant4bitLinear.apply(x, self.layout, self.bias, self.dequant_tallies[0],
                                       *(getattr(self, n) for n in STORED))

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
