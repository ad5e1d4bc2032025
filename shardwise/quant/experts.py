"""``QuantExperts``: the fused MoE experts of transformers 5 (``experts.gate_up_proj`` ``[E, 2I, H]``,
``experts.down_proj`` ``[E, H, I]``) stored in bitsandbytes' 4-bit format, each expert's gate, up and down
matrix quantised on its own, dequantised one matrix at a time for the experts the router picked.

Why one quantised matrix per expert and projection: transformers 5.24 + bitsandbytes leave fused experts in
high precision (``BitsAndBytesConfig(load_in_4bit=True)`` swaps only ``nn.Linear``; the 3-D parameters load
and save unquantised, under the per-expert names ``experts.{e}.gate_proj.weight`` that the checkpoints on the
Hub use). Before transformers 5 these experts *were* ``nn.Linear`` modules (``Linear4bit`` under
bitsandbytes), so a "bnb-4bit" MoE checkpoint saved then holds one bitsandbytes 4-bit weight per expert and
projection, with its own scales and double quantisation offset (tests/hf/test_quantized_load.py writes one
with bitsandbytes' own ``QuantState.as_dict``; no Hub file was read). Storing the same bytes lets such a checkpoint load by copy and a high-precision one be
quantised per file tensor; and dequantising expert ``e`` reads row ``e`` of each stored tensor, nothing else.

The forward is the one the supported families share (their eager experts loop, identical source in
Qwen2-MoE, Qwen3-MoE, OLMoE and Mixtral under transformers 5.24): the same routing mask, the same token
gather, ``act(gate) * up``, the routing weight, ``index_add_``. Only the matmuls differ: gate and up are two
4-bit matmuls instead of one on the fused ``[2I, H]`` weight (the same values), each through
``Dequant4bitLinear`` (no gradient to the base; the input gradient uses the recompute's weight or
dequantises again). The family's ``experts_implementation`` setting (grouped_mm, batched_mm) is ignored:
those need every expert's weight at once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.quant.format import BLOCKSIZE, Layout4bit, quantize_4bit
from shardwise.quant.linear import STORED, Dequant4bitLinear, DequantTally, QuantLinear

# Experts classes whose eager forward is the loop below (checked: transformers 5.24), and the names their
# checkpoints give expert e's (gate, up, down) weights: ``<experts>.{e}.<name>.weight``.
FILE_NAMES = {
    "Qwen3MoeExperts": ("gate_proj", "up_proj", "down_proj"),
    "Qwen2MoeExperts": ("gate_proj", "up_proj", "down_proj"),
    "OlmoeExperts": ("gate_proj", "up_proj", "down_proj"),
    "MixtralExperts": ("w1", "w3", "w2"),  # files: ``block_sparse_moe.experts.{e}.w1.weight``
}
# What transformers' ``use_experts_implementation`` records about the fused layout; ours is only this one.
LAYOUT_FLAGS = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
                "has_post_expert_norm": False}


class QuantExpertMatrices(nn.Module):
    """``num_experts`` frozen matrices of one shape ``[out, in]``, each quantised on its own. Parameters
    (uint8, ``requires_grad=False``): ``weight``, ``absmax``, ``nested_absmax``, ``offset``, each
    ``[num_experts, bytes of one matrix]`` (see ``Layout4bit``). ``file_name``: the name of one expert's
    matrix in a checkpoint (``gate_proj`` in ``experts.{e}.gate_proj.weight``)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, file_name: str, *,
                 quant_type: str = "nf4", double_quant: bool = True, dtype: torch.dtype = torch.bfloat16,
                 device: Optional[torch.device] = None):
        super().__init__()
        self.num_experts, self.file_name = num_experts, file_name
        self.layout = Layout4bit((out_features, in_features), dtype, quant_type, double_quant, BLOCKSIZE)
        for name, nbytes in self.layout.nbytes().items():
            self.register_parameter(name, nn.Parameter(
                torch.zeros(num_experts, nbytes, dtype=torch.uint8, device=device), requires_grad=False))
        self.dequant_tallies = [DequantTally() for _ in range(num_experts)]

    def stored(self, expert: int) -> list[torch.Tensor]:
        """Expert ``expert``'s stored bytes (views of row ``expert``), in ``STORED`` order."""
        return [getattr(self, name)[expert] for name in STORED]

    @torch.no_grad()
    def load_quantized(self, expert: int, quantized) -> None:
        for name, data in self.layout.to_bytes(quantized).items():
            getattr(self, name)[expert].copy_(data)

    def quantize_from(self, weights: torch.Tensor, name: str) -> None:
        """Quantise ``weights`` ``[num_experts, out, in]`` (on CPU), one expert's matrix at a time."""
        for e in range(self.num_experts):
            self.load_quantized(e, quantize_4bit(weights[e].detach(), self.layout.quant_type,
                                                 self.layout.double_quant, name=f"{name}.{e}.{self.file_name}"))

    def dequantized(self, expert: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return self.layout.dequantize(dict(zip(STORED, self.stored(expert))), dtype or self.layout.dtype)

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """``x @ W_expert^T``, W dequantised inside the matmul (forward, and backward for dX only)."""
        return Dequant4bitLinear.apply(x, self.layout, None, self.dequant_tallies[expert], *self.stored(expert))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, shape={list(self.layout.shape)}, {self.layout.quant_type}, "
                f"double_quant={self.layout.double_quant}, file_name={self.file_name!r}")


class QuantExperts(nn.Module):
    """A 4-bit stand-in for a transformers 5 fused experts module (``FILE_NAMES``): ``gate_4bit``,
    ``up_4bit`` ``[E x (I, H)]`` and ``down_4bit`` ``[E x (H, I)]``. The submodules are not called
    ``gate_proj``/``down_proj`` so that LoRA's target names (which match module names) never pick them."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module,
                 file_names: tuple[str, str, str] = FILE_NAMES["Qwen3MoeExperts"], *, quant_type: str = "nf4",
                 double_quant: bool = True, dtype: torch.dtype = torch.bfloat16,
                 device: Optional[torch.device] = None):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        kw = {"quant_type": quant_type, "double_quant": double_quant, "dtype": dtype, "device": device}
        gate, up, down = file_names
        self.gate_4bit = QuantExpertMatrices(num_experts, intermediate_dim, hidden_dim, gate, **kw)
        self.up_4bit = QuantExpertMatrices(num_experts, intermediate_dim, hidden_dim, up, **kw)
        self.down_4bit = QuantExpertMatrices(num_experts, hidden_dim, intermediate_dim, down, **kw)
        self.act_fn = act_fn

    @classmethod
    def from_experts(cls, experts: nn.Module, quant_type: str = "nf4", double_quant: bool = True,
                     name: str = "experts") -> "QuantExperts":
        """Quantise a supported fused experts module (on CPU); a meta one gives a meta QuantExperts."""
        check_supported(experts, name)
        gate_up, down = experts.gate_up_proj, experts.down_proj
        q = cls(experts.num_experts, experts.hidden_dim, experts.intermediate_dim, experts.act_fn,
                FILE_NAMES[type(experts).__name__], quant_type=quant_type, double_quant=double_quant,
                dtype=gate_up.dtype, device=gate_up.device)
        if not gate_up.is_meta:
            inter = experts.intermediate_dim
            q.gate_4bit.quantize_from(gate_up[:, :inter], name)
            q.up_4bit.quantize_from(gate_up[:, inter:], name)
            q.down_4bit.quantize_from(down, name)
        return q

    def matrices(self) -> tuple[QuantExpertMatrices, QuantExpertMatrices, QuantExpertMatrices]:
        return self.gate_4bit, self.up_4bit, self.down_4bit

    def dequantized_fused(self, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) as the family's module holds them:
        for tests and exports only (every expert at once)."""
        gate_up = torch.stack([torch.cat([self.gate_4bit.dequantized(e, dtype), self.up_4bit.dequantized(e, dtype)])
                               for e in range(self.num_experts)])
        return gate_up, torch.stack([self.down_4bit.dequantized(e, dtype) for e in range(self.num_experts)])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():  # the families' routing mask; index num_experts is "no expert" (expert parallel)
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit.view(-1).tolist():
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate = self.gate_4bit.linear(current_state, expert_idx)
            up = self.up_4bit.linear(current_state, expert_idx)
            current_hidden_states = self.down_4bit.linear(self.act_fn(gate) * up, expert_idx)
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}"


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers 5 fused experts module (3-D ``gate_up_proj``), supported or not."""
    p = getattr(module, "gate_up_proj", None)
    return isinstance(p, torch.Tensor) and p.dim() == 3


def check_supported(experts: nn.Module, name: str) -> None:
    cls = type(experts).__name__
    if cls not in FILE_NAMES:
        raise ShardwiseError(f"{name}: {cls} experts are not supported in 4 bits (supported: "
                             f"{', '.join(FILE_NAMES)}); put {name.rsplit('.', 1)[-1]!r} in skip_modules to keep "
                             f"them in high precision")
    flags = {k: getattr(experts, k, v) for k, v in LAYOUT_FLAGS.items()}
    if flags != LAYOUT_FLAGS or experts.gate_up_proj.shape[1] != 2 * experts.intermediate_dim:
        raise ShardwiseError(f"{name}: {cls} has an expert layout {flags} other than {LAYOUT_FLAGS}; "
                             f"not supported in 4 bits")


def quantize_experts(model: nn.Module, skip: tuple[str, ...] = (), quant_type: str = "nf4",
                     double_quant: bool = True) -> list[str]:
    """Replace every fused experts module of ``model`` whose name's last part is not in ``skip`` with its
    ``QuantExperts`` (an unsupported family raises, naming the module). Returns the replaced names."""
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if is_fused_experts(child) and child_name not in skip:
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, QuantExperts.from_experts(child, quant_type, double_quant, full))
                replaced.append(full)
    return replaced


# The modules whose parameters (``bias`` excepted) are 4-bit stored bytes, each with a ``layout`` and one
# ``DequantTally`` per matrix in ``dequant_tallies``.
QUANT_MODULE_TYPES = (QuantLinear, QuantExpertMatrices)


def dequantization_counts(model: nn.Module) -> dict[str, int]:
    """How many times each 4-bit matrix of ``model`` was dequantised for a matmul since it was built or
    ``reset_dequantization_counts``: by module name, ``name[e]`` for expert ``e``'s matrix."""
    counts = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantExpertMatrices):
            counts.update({f"{name}[{e}]": t.count for e, t in enumerate(m.dequant_tallies)})
        elif isinstance(m, QuantLinear):
            counts[name] = m.dequant_tallies[0].count
    return counts


def reset_dequantization_counts(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, QUANT_MODULE_TYPES):
            for t in m.dequant_tallies:
                t.count = 0
