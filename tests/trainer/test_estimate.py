"""`shardwise estimate-memory`: the plan comes from shardwise's own sharding plan on meta tensors, scales to
70B on 512 ranks in seconds, suggests what would fit, and matches measured peak memory within 15%."""

import json
import os

import pytest

from harness import run_distributed
from shardwise.planner.memory import PlanInputs, main, plan_memory
from shardwise.trainer.config import TrainConfig
from shardwise.usage import parse_size

LLAMA_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)


def estimate(argv):
    """`shardwise estimate-memory ARGV` as the CLI runs it (the trainer's defaults passed in)."""
    return main(argv, TrainConfig())


def test_json_has_the_plan_fields(capsys):
    assert estimate(["--model", "gpt-small", "--world-size", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("param_shard_bytes", "grad_shard_bytes", "optim_shard_bytes", "gathered_unit_bytes",
                "activation_bytes", "total_bytes"):
        assert isinstance(plan[key], int) and plan[key] > 0, key
    assert plan["optim_shard_bytes"] == 2 * plan["grad_shard_bytes"]  # AdamW: two fp32 states per element
    assert plan["total_bytes"] == max(plan["backward_peak_bytes"], plan["optimizer_step_peak_bytes"])
    assert plan["optimizer_step_peak_bytes"] >= plan["param_shard_bytes"] + plan["grad_shard_bytes"] + plan["optim_shard_bytes"]
    assert plan["backward_peak_bytes"] >= plan["param_shard_bytes"] + plan["optim_shard_bytes"] + plan["activation_bytes"]


def test_human_readable_output(capsys):
    assert estimate(["--model", "gpt-34m", "--world-size", "4", "--mixed-precision", "bf16"]) == 0
    text = capsys.readouterr().out
    for row in ("parameter shards", "gradient shards", "optimizer shards", "largest unit, gathered",
                "prefetched unit, gathered", "activations", "total per rank"):
        assert row in text


def test_shards_shrink_with_world_size_exactly_like_the_plan():
    one = plan_memory(PlanInputs("gpt-34m", 1))
    eight = plan_memory(PlanInputs("gpt-34m", 8))
    assert one.param_shard_bytes == one.param_bytes  # one rank holds everything
    assert one.param_bytes / 8 <= eight.param_shard_bytes <= one.param_bytes / 8 + 8 * 4 * eight.num_units  # + padding
    assert eight.activation_bytes == one.activation_bytes  # per-rank batch unchanged


def test_zero1_and_zero2_plans_keep_full_parameters_and_zero1_full_gradients():
    """ZeRO-2 (shard_optim_grad) keeps every unit gathered through the optimizer step, with 1/N gradients and
    optimizer state; ZeRO-1 (shard_optim) also keeps the whole reduced gradient."""
    zero3 = plan_memory(PlanInputs("gpt-34m", 4, sharding_strategy="full_shard"))
    zero2 = plan_memory(PlanInputs("gpt-34m", 4, sharding_strategy="zero2"))
    zero1 = plan_memory(PlanInputs("gpt-34m", 4, sharding_strategy="shard_optim"))
    assert zero2.sharding_strategy == "shard_optim_grad"
    assert zero2.param_shard_bytes == zero3.param_shard_bytes and zero2.optim_shard_bytes == zero3.optim_shard_bytes
    assert zero2.grad_shard_bytes == zero3.grad_shard_bytes
    assert zero2.gathered_bytes >= zero3.param_bytes > zero3.gathered_bytes  # every unit, all the time
    assert zero2.optimizer_step_peak_bytes >= zero3.optimizer_step_peak_bytes + zero3.param_bytes
    assert zero1.grad_shard_bytes >= zero3.param_bytes  # whole fp32 gradients (padding included)
    assert zero1.optim_shard_bytes == zero3.optim_shard_bytes  # optimizer state stays 1/N


def test_70b_on_512_ranks_from_our_own_plan(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_70B))
    assert estimate(["--model", str(cfg), "--world-size", "512", "--dtype", "bf16", "--mixed-precision", "bf16",
                 "--batch-size", "1", "--seq-len", "4096", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert 69e9 < plan["num_params"] < 72e9
    assert plan["param_bytes"] == pytest.approx(141e9, rel=0.02)  # ~140 GB of bf16 parameters
    assert plan["param_shard_bytes"] == pytest.approx(275.6e6, rel=0.02)  # ~275 MB of them per rank
    assert plan["num_units"] == 81  # 80 decoder layers + the root
    assert plan["activation_bytes"] > 0


def test_activation_checkpointing_cuts_planned_activations():
    plain = plan_memory(PlanInputs("gpt-34m", 2, batch_size=8, seq_len=256))
    ckpt = plan_memory(PlanInputs("gpt-34m", 2, batch_size=8, seq_len=256, activation_checkpointing=True))
    assert ckpt.activation_bytes < 0.6 * plain.activation_bytes


def test_fit_verdict_and_suggestions(capsys):
    assert estimate(["--model", "gpt-1b", "--world-size", "1", "--device-memory", "8GB"]) == 0
    text = capsys.readouterr().out
    assert "does NOT fit" in text and "what would fit:" in text and "--world-size" in text
    assert estimate(["--model", "gpt-1b", "--world-size", "64", "--device-memory", "80GB"]) == 0
    assert "fits in --device-memory" in capsys.readouterr().out
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("80GB") == 80 * 10**9
    assert estimate(["--model", "nope", "--world-size", "2"]) == 2


# ---- validation against measured memory ----------------------------------------------------------------


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024


def _measure_worker(rank, world, model_path, warm_path, batch, seq, ac, steps):
    """Peak RSS above the baseline taken right before the model is built, over a few training steps.

    glibc's malloc moves its mmap threshold up as large blocks are freed and then keeps freed memory in
    its heap, so plain RSS carries a few tens of MB of allocator retention that varies run to run. Pinning
    the threshold (mallopt M_MMAP_THRESHOLD) returns every large block to the OS when freed: RSS then
    tracks the live bytes the plan predicts, and repeated measurements agree to within 1 MB."""
    import ctypes
    import gc

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD = 128 KiB, fixed

    import torch

    import shardwise
    from shardwise.trainer.config import TrainConfig
    from shardwise.trainer.loop import build_optimizer, build_sharded_model
    from shardwise.hf.model_spec import lm_loss, resolve_model

    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))

    def run(path, steps):
        cfg = TrainConfig(model=path, batch_size=batch, seq_len=seq, activation_checkpointing=ac)
        spec = resolve_model(path)
        model = build_sharded_model(cfg, spec, torch.device("cpu"))
        opt = build_optimizer(model, cfg)
        for _ in range(steps):
            lm_loss(spec, model, x, y).backward()
            shardwise.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    # The first run of each op maps libtorch code and allocator arenas: runtime memory, not the model's.
    # A throwaway tiny model of the same kind takes that hit before the baseline.
    run(warm_path, 1)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    base = _rss_kib("VmRSS")
    run(model_path, steps)
    return _rss_kib("VmHWM") - base


def _gpt(tmp_path, name, **kw):
    path = tmp_path / name
    path.write_text(json.dumps(dict(model_type="shardwise-gpt", n_head=4, block_size=128, vocab_size=256, **kw)))
    return str(path)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset peak RSS")
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)])
def test_plan_matches_measured_peak_memory_within_15_percent(tmp_path, world):
    # ~7M parameters (28 MB fp32; 112 MB of parameter + gradient + AdamW state on one rank) and ~60 MB of
    # activations: large enough that allocator noise is small against it.
    model = _gpt(tmp_path, "gpt.json", n_layer=4, n_embd=384)
    warm = _gpt(tmp_path, "warm.json", n_layer=1, n_embd=32)
    batch, seq = 4, 128
    planned = plan_memory(PlanInputs(model, world, batch_size=batch, seq_len=seq, device="cpu")).total_bytes
    measured = max(run_distributed(_measure_worker, world, model, warm, batch, seq, False, 2, timeout_s=120))
    print(f"world size {world}: planned {planned / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert abs(planned - measured) <= 0.15 * measured, (world, planned / 2**20, measured / 2**20)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset peak RSS")
def test_activation_checkpointing_cuts_measured_memory(tmp_path):
    model = _gpt(tmp_path, "gpt.json", n_layer=6, n_embd=128)  # activation-heavy: small weights, long batch
    warm = _gpt(tmp_path, "warm.json", n_layer=1, n_embd=32)
    plain, = run_distributed(_measure_worker, 1, model, warm, 16, 128, False, 1)
    ckpt, = run_distributed(_measure_worker, 1, model, warm, 16, 128, True, 1)
    assert ckpt < 0.7 * plain, (plain / 2**20, ckpt / 2**20)
    planned = plan_memory(PlanInputs(model, 1, batch_size=16, seq_len=128, activation_checkpointing=True,
                                     device="cpu")).total_bytes
    # The plan counts a whole unit's recomputed activations at once; the real recompute frees them as the
    # unit's backward proceeds, so on this activation-dominated model the plan errs high: by ~14% on torch
    # 2.13, by 39% on torch 2.11 (37.4 planned vs 26.9 MiB measured), whose CPU kernels keep less.
    assert ckpt <= planned <= 1.5 * ckpt, (planned / 2**20, ckpt / 2**20)
