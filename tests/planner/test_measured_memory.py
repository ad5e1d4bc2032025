"""The plan against a real run: peak memory measured over a few training steps on CPU ranks is within 15% of
the plan, activation checkpointing cuts it as planned, and the buffers the plan counts are the ones the
engine allocates (the same shards, the same gathered units, the same number of gradient flats alive)."""

import functools
import json
import os

import pytest

from harness import run_distributed
from shardwise.engine.core.runtime import ModelRuntime
from shardwise.planner.memory import PlanInputs, plan_memory


# ---- validation against measured memory ----------------------------------------------------------------


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024


def _measure_worker(rank, world, model_path, warm_path, batch, seq, ac, steps, extra=None):
    """Peak RSS above the baseline taken right before the model is built, over a few training steps; and the
    engine's own buffers: per unit its gathered bytes (0 where the gathered buffer is the shard) and shard
    bytes, and the most unsharded gradient flats alive at once.

    glibc's malloc moves its mmap threshold up as large blocks are freed and then keeps freed memory in
    its heap, so plain RSS carries a few tens of MB of allocator retention that varies run to run. Pinning
    the threshold (mallopt M_MMAP_THRESHOLD) returns every large block to the OS when freed: RSS then
    tracks the live bytes the plan predicts, and repeated measurements agree to within 1 MB."""
    import ctypes
    import gc

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD = 128 KiB, fixed

    import torch

    import shardwise
    from shardwise.engine.core.runtime import ModelRuntime, runtime_of
    from shardwise.trainer.config import TrainConfig
    from shardwise.trainer.loop import build_optimizer, build_sharded_model
    from shardwise.hf.model_spec import lm_loss, resolve_model

    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))
    flats_alive = [0]
    add_pending = ModelRuntime.add_pending

    def counting_add_pending(self, pending):  # the new flat is packed; the pending ones are still alive
        flats_alive[0] = max(flats_alive[0], len(self._pending) + 1)
        add_pending(self, pending)

    ModelRuntime.add_pending = counting_add_pending

    def run(path, steps):
        cfg = TrainConfig(model=path, batch_size=batch, seq_len=seq, activation_checkpointing=ac, **(extra or {}))
        spec = resolve_model(path)
        model = build_sharded_model(cfg, spec, torch.device("cpu"))
        opt = build_optimizer(model, cfg)
        for _ in range(steps):
            lm_loss(spec, model, x, y).backward()
            shardwise.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [(u.plan.is_root,
                 sum(0 if g.aliases_shard else g.gathered.numel() * g.gathered.element_size() for g in u.flat_groups),
                 sum(g.shard.numel() * g.shard.element_size() for g in u.flat_groups))
                for u in runtime_of(model).units]

    # The first run of each op maps libtorch code and allocator arenas: runtime memory, not the model's.
    # A throwaway tiny model of the same kind takes that hit before the baseline.
    run(warm_path, 1)
    gc.collect()
    flats_alive[0] = 0
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    base = _rss_kib("VmRSS")
    units = run(model_path, steps)
    return dict(peak=_rss_kib("VmHWM") - base, units=units, flats_alive=flats_alive[0])


def _gpt(tmp_path, name, **kw):
    path = tmp_path / name
    path.write_text(json.dumps(dict(model_type="shardwise-gpt", n_head=4, block_size=128, vocab_size=256, **kw)))
    return str(path)


BATCH, SEQ = 4, 128
needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset peak RSS")


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory):
    """world size -> (model path, per-rank results of two training steps): one run per world size, read by
    every test of this module. ~7M parameters (28 MB fp32; 112 MB of parameter + gradient + AdamW state on
    one rank) and ~60 MB of activations: large enough that allocator noise is small against it."""
    tmp = tmp_path_factory.mktemp("measured")
    model = _gpt(tmp, "gpt.json", n_layer=4, n_embd=384)
    warm = _gpt(tmp, "warm.json", n_layer=1, n_embd=32)

    @functools.lru_cache(maxsize=None)
    def run(world):
        return model, run_distributed(_measure_worker, world, model, warm, BATCH, SEQ, False, 2, timeout_s=120)

    return run


@needs_proc
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)])
def test_plan_matches_measured_peak_memory_within_15_percent(measured_run, world):
    model, results = measured_run(world)
    planned = plan_memory(PlanInputs(model, world, batch_size=BATCH, seq_len=SEQ, device="cpu")).total_bytes
    measured = max(r["peak"] for r in results)
    print(f"world size {world}: planned {planned / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert abs(planned - measured) <= 0.15 * measured, (world, planned / 2**20, measured / 2**20)


@needs_proc
def test_planned_buffers_are_the_ones_the_engine_allocates(measured_run):
    """At 2 ranks: every rank's shards, the largest gathered block and the root are the plan's figures,
    and backward keeps at most MAX_GRAD_FLATS_ALIVE gradient flats alive -- and does reach that many."""
    model, results = measured_run(2)
    plan = plan_memory(PlanInputs(model, 2, batch_size=BATCH, seq_len=SEQ, device="cpu"))
    for r in results:
        assert sum(shard for _, _, shard in r["units"]) == plan.param_shard_bytes
        assert max(gathered for is_root, gathered, _ in r["units"] if not is_root) == plan.gathered_unit_bytes
        assert next(gathered for is_root, gathered, _ in r["units"] if is_root) == plan.root_unit_bytes
        assert r["flats_alive"] == ModelRuntime.MAX_GRAD_FLATS_ALIVE


@needs_proc
def test_activation_checkpointing_cuts_measured_memory(tmp_path):
    model = _gpt(tmp_path, "gpt.json", n_layer=6, n_embd=128)  # activation-heavy: small weights, long batch
    warm = _gpt(tmp_path, "warm.json", n_layer=1, n_embd=32)
    plain = run_distributed(_measure_worker, 1, model, warm, 16, 128, False, 1)[0]["peak"]
    ckpt = run_distributed(_measure_worker, 1, model, warm, 16, 128, True, 1)[0]["peak"]
    assert ckpt < 0.7 * plain, (plain / 2**20, ckpt / 2**20)
    planned = plan_memory(PlanInputs(model, 1, batch_size=16, seq_len=128, activation_checkpointing=True,
                                     device="cpu")).total_bytes
    # The plan counts a whole unit's recomputed activations at once; the real recompute frees them as the
    # unit's backward proceeds, so on this activation-dominated model the plan errs high: by ~14% on torch
    # 2.13, by 39% on torch 2.11 (37.4 planned vs 26.9 MiB measured), whose CPU kernels keep less.
    assert ckpt <= planned <= 1.5 * ckpt, (planned / 2**20, ckpt / 2**20)


def _llama_dir(path, hidden, intermediate, layers, vocab=256):
    """A random bf16 Llama saved as Hugging Face saves it (the 4-bit base is quantised from it on load)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


QLORA = dict(lora_r=16, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
             lora_base_dtype="bf16", mixed_precision="bf16")


@needs_proc
@pytest.mark.slow
@pytest.mark.parametrize("load_in_4bit", [True, False], ids=["qlora", "lora-bf16"])
def test_lora_plan_matches_measured_peak_memory_within_10_percent(tmp_path, load_in_4bit):
    """A LoRA step at 2 ranks on a 4-bit base and on a bf16 base (~60 MB of bf16 weights, activation
    checkpointing): the planned per-rank peak is the measured live peak within 10%; the 4-bit base's
    shards are the plan's."""
    pytest.importorskip("peft")
    extra = dict(QLORA, load_in_4bit=load_in_4bit)
    model = _llama_dir(tmp_path / "llama", 768, 2048, 4, vocab=8192)
    # The warm-up model has the same widths (one layer): oneDNN builds and caches its bf16 kernels per matmul
    # shape, ~20 MiB per process for these shapes on an AMX machine, runtime memory rather than the model's.
    warm = _llama_dir(tmp_path / "warm", 768, 2048, 1, vocab=8192)
    results = run_distributed(_measure_worker, 2, model, warm, 1, 64, True, 2, extra, timeout_s=300)
    planned = plan_memory(PlanInputs(model, 2, batch_size=1, seq_len=64, activation_checkpointing=True, device="cpu",
                                     dtype="fp32", lora_r=16, lora_target_modules=tuple(QLORA["lora_target_modules"]),
                                     lora_base_dtype="bf16", mixed_precision="bf16", load_in_4bit=load_in_4bit))
    measured = max(r["peak"] for r in results)
    print(f"planned {planned.total_bytes / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    for r in results:
        assert sum(shard for _, _, shard in r["units"]) == planned.param_shard_bytes
    assert abs(planned.total_bytes - measured) <= 0.10 * measured, (planned.total_bytes / 2**20, measured / 2**20)
