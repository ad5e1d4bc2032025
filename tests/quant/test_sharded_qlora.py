"""QLoRA on a sharded 4-bit base: the quantised bytes (packed nibbles and scales) live as uint8 in the
engine's flat buffers, each rank holding ~1/N of them; every byte pattern comes back unchanged from the
all-gather (bf16 NaN payloads included: the bitsandbytes#1945 failure) under bf16 mixed precision; the base
gets no gradient and no optimizer state; and training the adapters at world sizes 1-4 equals one process
running the same quantised model through the same dequantisation code (fp32 compute, 1e-6): SGD with
momentum and AdamW, activation checkpointing with no_sync accumulation, shard_grad_op, a tied-head model
(Qwen2: lm_head tied to the embedding stays in high precision), and a MoE model (Qwen3-MoE, 4 experts, top
2) whose fused experts are 4-bit QuantExperts: uint8 bytes split across the ranks, every expert byte held
by exactly one rank, frozen, with LoRA on the attention projections."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from harness import run_distributed
from parity_utils import (assert_parity, is_sharded, make_batches, make_optimizer, run_scenarios, scenario,
                          simple_step, spawn_once, train_pair)
from qlora_models import MOE_TARGETS, VOCAB, lm_loss, quantised_lora_model

STEPS = 3


def _parity(rank, ws, optimizer="sgd", loss_step=None, model_fn=quantised_lora_model, **shard_kwargs):
    import shardwise

    initial = model_fn()
    ref = copy.deepcopy(initial)
    model = shardwise.shard(copy.deepcopy(initial), units="auto", **shard_kwargs)
    return train_pair(model, ref, loss_step or simple_step(lm_loss), make_batches(STEPS, VOCAB), rank, ws,
                      optimizer=optimizer)


def _accumulating_step(model, batch, _step, take):
    """The sharded model accumulates two micro-batches (no_sync, then a synced backward); the reference
    takes the whole batch at once: the same mean gradient."""
    import shardwise

    x, y = take(batch[0]), take(batch[1])
    if not is_sharded(model):
        loss = lm_loss(model, x, y)
        loss.backward()
        return loss.detach()
    n = x.shape[0]
    half = n // 2  # micro-batches weighted by their rows, so uneven halves (3 rows at ws 4) still give the mean
    with shardwise.no_sync(model):
        first = lm_loss(model, x[:half], y[:half]) * (half / n)
        first.backward()
    second = lm_loss(model, x[half:], y[half:]) * ((n - half) / n)
    second.backward()
    return (first + second).detach()


def every_bit_pattern(nbytes: int) -> torch.Tensor:
    """Every byte value, then every bf16 NaN (both signs, all 127 payloads) as little-endian byte pairs,
    then fp32 NaNs with payload bits in both halves, repeated to ``nbytes``."""
    nan_bf16 = [(sign | 0x7F80 | m) for sign in (0, 0x8000) for m in range(1, 128)]
    nan_bf16 = torch.tensor(nan_bf16, dtype=torch.int32).to(torch.int16).view(torch.uint8)
    nan_fp32 = torch.tensor([0x7FC00001, 0x7F800001, -0x00000001, 0x7FFFFFFF, -0x7FFFFF], dtype=torch.int32)
    pattern = torch.cat([torch.arange(256, dtype=torch.uint8), nan_bf16, nan_fp32.view(torch.uint8)])
    return pattern.repeat(-(-nbytes // pattern.numel()))[:nbytes]


def _bytes_and_frozen(rank, ws):
    """Under bf16 mixed precision: the bytes a QuantLinear sees in forward are the bytes it was given; the
    uint8 groups hold ~1/N of the quantised bytes per rank; after a step they have no gradient and no
    optimizer state."""
    import shardwise
    from shardwise.engine.runtime import runtime_of
    from shardwise.quant.linear import QuantLinear

    model = quantised_lora_model()
    quantised = [m for m in model.modules() if isinstance(m, QuantLinear)]
    patterned = quantised[0]
    with torch.no_grad():
        for name in ("weight", "absmax"):
            p = getattr(patterned, name)
            p.copy_(every_bit_pattern(p.numel()))
    original = {n: getattr(patterned, n).detach().clone() for n in ("weight", "absmax", "nested_absmax", "offset")}
    total_bytes = sum(p.numel() for m in quantised for p in m.parameters() if p.dtype == torch.uint8)
    model = shardwise.shard(model, units="auto", mixed_precision=shardwise.MixedPrecision(param_dtype=torch.bfloat16))
    seen = {}
    patterned.register_forward_pre_hook(
        lambda m, _a: seen.update({n: getattr(m, n).detach().clone() for n in original}))
    x, y = make_batches(1, VOCAB)[0]
    opt = make_optimizer("sgd", model.parameters())
    lm_loss(model, x[:2], y[:2]).backward()
    opt.step()
    groups = [g for u in runtime_of(model).units for g in u.flat_groups if g.plan.dtype == torch.uint8]
    sd = shardwise.full_state_dict(model)
    prefix = next(n for n, m in model.named_modules() if m is patterned)
    out = {
        "forward_bytes_equal": {n: torch.equal(seen[n], original[n]) for n in original},
        "local_bytes": sum(g.shard.numel() for g in groups),
        "total_bytes": total_bytes,
        "frozen": all(not g.plan.requires_grad for g in groups),
        "no_grad": all(p.grad is None for g in groups for p in g.shard_params),
        "no_state": all(p.dtype != torch.uint8 for p in opt.state),
    }
    if rank == 0:
        out["state_dict_bytes_equal"] = {n: torch.equal(sd[f"{prefix}.{n}"], original[n]) for n in original}
    return out


def moe_model():
    return quantised_lora_model("qwen3_moe", targets=MOE_TARGETS)


def _moe_expert_bytes(rank, ws):
    """Per rank, after a step of the sharded MoE model: its share of the experts' bytes and of all uint8
    bytes, and that the experts are uint8, frozen and gradient-free, and only the adapters train."""
    import shardwise
    from shardwise.engine.runtime import runtime_of
    from shardwise.quant.experts import QuantExperts

    model = moe_model()
    modules = [m for m in model.modules() if isinstance(m, QuantExperts)]
    total_expert_bytes = sum(p.numel() for m in modules for p in m.parameters())
    total_bytes = sum(p.numel() for p in model.parameters() if p.dtype == torch.uint8)
    model = shardwise.shard(model, units="auto")
    x, y = make_batches(1, VOCAB)[0]
    opt = make_optimizer("adamw", model.parameters())
    lm_loss(model, x[:2], y[:2]).backward()
    opt.step()
    experts = [p for m in modules for p in m.parameters()]  # the shard parameters now
    groups = [g for u in runtime_of(model).units for g in u.flat_groups if g.plan.dtype == torch.uint8]
    return {
        "expert_dtypes": sorted({str(p.dtype) for p in experts}),
        "local_expert_bytes": sum(shardwise.param_info(p).local_numel for p in experts),
        "total_expert_bytes": total_expert_bytes,
        "local_bytes": sum(g.shard.numel() for g in groups),
        "total_bytes": total_bytes,
        "frozen": all(not p.requires_grad and p.grad is None for p in experts),
        "only_adapters_train": all("lora_" in n for n, p in model.named_parameters() if p.requires_grad),
        "no_state": all(p.dtype != torch.uint8 for p in opt.state),
    }


def _worker(rank, ws):
    return run_scenarios({
        "sgd": lambda r, w: _parity(r, w, "sgd"),
        "adamw_ckpt_nosync": lambda r, w: _parity(r, w, "adamw", _accumulating_step, activation_checkpointing=True),
        "shard_grad_op": lambda r, w: _parity(r, w, "sgd", strategy="shard_grad_op"),
        "tied_head_qwen2": lambda r, w: _parity(r, w, "adamw", model_fn=lambda: quantised_lora_model("qwen2")),
        "bytes": _bytes_and_frozen,
        "moe_qwen3_sgd": lambda r, w: _parity(r, w, "sgd", model_fn=moe_model),
        "moe_qwen3_adamw_ckpt": lambda r, w: _parity(r, w, "adamw", model_fn=moe_model, activation_checkpointing=True),
        "moe_bytes": _moe_expert_bytes,
    }, rank, ws)


@spawn_once
def _report(ws: int) -> dict:
    return run_distributed(_worker, ws, timeout_s=240)


WORLD_SIZES = [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3,
               pytest.param(4, marks=pytest.mark.slow)]  # ws 3 (uneven shards) in the default run


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("case", ["sgd", "adamw_ckpt_nosync", "shard_grad_op", "tied_head_qwen2", "moe_qwen3_sgd",
                                  "moe_qwen3_adamw_ckpt"])
def test_qlora_training_equals_single_process_on_the_same_quantised_model(ws, case):
    assert_parity(scenario(_report(ws)[0], case), rtol=1e-6, label=f"ws {ws} {case}")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_every_bit_pattern_survives_storage_and_all_gather(ws):
    for rank, r in enumerate(_report(ws)):
        r = scenario({"bytes": r["bytes"]}, "bytes")
        assert all(r["forward_bytes_equal"].values()), f"rank {rank}: gathered bytes changed: {r['forward_bytes_equal']}"
        if rank == 0:
            assert all(r["state_dict_bytes_equal"].values()), r["state_dict_bytes_equal"]


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_each_rank_holds_its_share_of_the_quantised_bytes_frozen(ws):
    for rank, r in enumerate(_report(ws)):
        r = scenario({"bytes": r["bytes"]}, "bytes")
        # one uint8 group per unit, each padded to a multiple of ws: at most ws - 1 bytes of padding per unit
        assert r["local_bytes"] <= r["total_bytes"] / ws + 4 * ws, (rank, r["local_bytes"], r["total_bytes"])
        assert r["frozen"] and r["no_grad"] and r["no_state"], r


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_moe_experts_are_4bit_bytes_split_across_ranks_and_frozen(ws):
    reports = [scenario({"moe_bytes": r["moe_bytes"]}, "moe_bytes") for r in _report(ws)]
    first = reports[0]
    assert first["expert_dtypes"] == ["torch.uint8"], first
    assert first["total_expert_bytes"] > first["total_bytes"] / 2, "the experts should be most of the 4-bit bytes"
    assert sum(r["local_expert_bytes"] for r in reports) == first["total_expert_bytes"], reports  # each byte once
    for rank, r in enumerate(reports):
        assert r["local_bytes"] <= r["total_bytes"] / ws + 4 * ws, (rank, r["local_bytes"], r["total_bytes"])
        assert r["frozen"] and r["only_adapters_train"] and r["no_state"], (rank, r)
