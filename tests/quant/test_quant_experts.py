"""QuantExperts, transformers 5's fused MoE experts in 4 bits: each expert's gate, up and down matrix is
bitsandbytes' 4-bit encoding of that matrix alone (what a per-expert "bnb-4bit" checkpoint holds); the sparse
MoE block with it computes what the family's own block computes with the dequantised weights (routing and
combination are the family's); only the experts the router picked are dequantised, one matrix at a time,
again in backward for the input gradient, and the base gets no gradient; ``quantize_model`` quantises the
experts unless ``skip_modules`` names them, and refuses an experts class it does not know."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from qlora_models import VOCAB, moe_config

SMALL = {"vocab_size": VOCAB, "hidden_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 32}
FAMILIES = {
    "qwen3_moe": lambda: moe_config(num_hidden_layers=1),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, moe_intermediate_size=40, num_experts=4,
                                                     num_experts_per_tok=2, shared_expert_intermediate_size=24),
    "olmoe": lambda: transformers.OlmoeConfig(**SMALL, intermediate_size=40, num_experts=4, num_experts_per_tok=2),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, intermediate_size=40, num_local_experts=4,
                                                  num_experts_per_tok=2),
}


def moe_block(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
    return next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))


def quantised_pair(family: str) -> tuple[nn.Module, nn.Module]:
    """(the family's block with its experts replaced by the dequantised 4-bit weights, the same block with
    QuantExperts)."""
    from shardwise.quant.experts import QuantExperts

    block = moe_block(family)
    quantised = copy.deepcopy(block)
    quantised.experts = QuantExperts.from_experts(block.experts)
    gate_up, down = quantised.experts.dequantized_fused()
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    return block, quantised


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert want.abs().max() > 0
    return float((got - want).abs().max().detach() / want.abs().max().detach())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_the_block_with_4bit_experts_computes_the_familys_own_forward(family, implementation):
    block, quantised = quantised_pair(family)
    block.experts.config._experts_implementation = implementation
    x = torch.randn(3, 7, 48, requires_grad=True)
    want, got = block(x), quantised(x)
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)  # Qwen2-MoE/OLMoE also return logits
    # the same values; only the summation order may differ (gate and up are two matmuls here, one fused there)
    assert relative_error(got, want) <= 1e-6
    grad_want, = torch.autograd.grad(want.square().sum(), x)
    grad_got, = torch.autograd.grad(got.square().sum(), x)
    assert relative_error(grad_got, grad_want) <= 1e-6
    assert all(p.grad is None and not p.requires_grad for p in quantised.experts.parameters())
    assert {p.dtype for p in quantised.experts.parameters()} == {torch.uint8}


def test_each_expert_matrix_is_the_4bit_encoding_of_that_matrix_alone():
    from shardwise.quant.experts import QuantExperts
    from shardwise.quant.format import quantize_4bit

    experts = moe_block("qwen3_moe").experts
    q = QuantExperts.from_experts(experts)
    inter = experts.intermediate_dim
    for e in range(experts.num_experts):
        for module, w in ((q.gate_4bit, experts.gate_up_proj[e, :inter]), (q.up_4bit, experts.gate_up_proj[e, inter:]),
                          (q.down_4bit, experts.down_proj[e])):
            want = module.layout.to_bytes(quantize_4bit(w.detach()))
            for name, data in want.items():
                assert torch.equal(getattr(module, name)[e], data), (e, module.file_name, name)


def test_matches_bitsandbytes_per_expert_weights():
    """The bytes transformers 4 + bitsandbytes stored for expert e's ``gate_proj`` Linear4bit."""
    from bnb_oracle import bnb_quantize, require_bnb

    require_bnb()
    from shardwise.quant.experts import QuantExperts

    experts = moe_block("qwen3_moe").experts
    q = QuantExperts.from_experts(experts)
    for e in range(experts.num_experts):
        ref = bnb_quantize(experts.down_proj[e].detach().contiguous(), "nf4", True)
        assert torch.equal(q.down_4bit.weight[e], ref["packed"]) and torch.equal(q.down_4bit.absmax[e], ref["absmax"])
        assert torch.equal(q.down_4bit.dequantized(e), ref["dequantized"])


def test_only_the_routed_experts_are_dequantised_one_matrix_at_a_time(monkeypatch):
    from shardwise.quant.experts import QuantExperts
    from shardwise.quant.format import Layout4bit

    q = QuantExperts.from_experts(moe_block("qwen3_moe").experts)
    rows = {m.weight.data_ptr(): (name, m.weight.stride(0)) for name, m in
            (("gate", q.gate_4bit), ("up", q.up_4bit), ("down", q.down_4bit))}
    seen = []
    dequantize = Layout4bit.dequantize

    def counting(self, stored, dtype, **kw):
        ptr = stored["weight"].data_ptr()
        base = max(p for p in rows if p <= ptr)
        seen.append((rows[base][0], (ptr - base) // rows[base][1], tuple(self.shape)))
        return dequantize(self, stored, dtype, **kw)

    monkeypatch.setattr(Layout4bit, "dequantize", counting)
    x = torch.randn(5, 48, requires_grad=True)
    top_k = torch.tensor([[0, 2]] * 4 + [[2, 0]])  # experts 1 and 3 get no token
    out = q(x, top_k, torch.rand(5, 2))
    forward = list(seen)
    out.sum().backward()
    per_matrix = [(m, e) for e in (0, 2) for m in ("gate", "up", "down")]
    assert sorted((m, e) for m, e, _ in forward) == sorted(per_matrix)  # each once, in forward
    assert sorted((m, e) for m, e, _ in seen) == sorted(per_matrix * 2)  # and once more for dX in backward
    assert {s for _, _, s in seen} == {(40, 48), (48, 40)}  # one expert matrix each time
    assert x.grad is not None


def test_quantize_model_quantises_the_experts_unless_skipped():
    import shardwise
    from shardwise.quant.experts import QuantExperts
    from shardwise.quant.linear import QuantLinear

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(moe_config())
    replaced = shardwise.quantize_model(model, shardwise.QuantSettings())
    assert "model.layers.1.mlp.experts" in replaced and "model.layers.1.self_attn.o_proj" in replaced
    assert all(isinstance(layer.mlp.experts, QuantExperts) for layer in model.model.layers)
    assert all(p.is_meta for p in model.parameters())  # nothing to quantise yet: load_pretrained fills them
    assert not isinstance(model.lm_head, QuantLinear) and not isinstance(model.model.layers[0].mlp.gate, QuantExperts)

    with torch.device("meta"):
        kept = transformers.AutoModelForCausalLM.from_config(moe_config())
    shardwise.quantize_model(kept, shardwise.QuantSettings(skip_modules=("lm_head", "experts")))
    assert type(kept.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert isinstance(kept.model.layers[0].self_attn.q_proj, QuantLinear)


def test_an_unknown_experts_class_is_refused_naming_it():
    import shardwise
    from shardwise.errors import ShardwiseError

    class OtherExperts(nn.Module):  # a fused layout whose forward we do not know
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 8))
            self.down_proj = nn.Parameter(torch.zeros(4, 8, 4))

    model = nn.Sequential(nn.Linear(8, 8))
    model.add_module("experts", OtherExperts())
    with pytest.raises(ShardwiseError, match=r"^experts: OtherExperts experts are not supported in 4 bits .*put "
                                             r"'experts' in skip_modules"):
        shardwise.quantize_model(model, shardwise.QuantSettings())
