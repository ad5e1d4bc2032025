"""The plan arithmetic (``planner.memory``): shards shrink exactly as the sharding plan says, each strategy
keeps what the engine keeps, the buffers are sized by the engine's own rules, LoRA keeps gradients and AdamW
state for the adapters only, and the fewest ranks that fit are found by the same plan."""

import json
from dataclasses import replace

import pytest

from shardwise.engine.core.runtime import ModelRuntime
from shardwise.engine.base.strategy import Strategy
from shardwise.planner.memory import PlanInputs, fewest_ranks_that_fit, plan_memory

LLAMA_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
# Parameter counts published with the models (model cards / safetensors metadata).
KNOWN_PARAMS = {"llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248, "mistral-7b": 7_241_732_096,
                "qwen2.5-7b": 7_615_616_512}


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


def test_70b_on_512_ranks_from_our_own_plan(tmp_path):
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_70B))
    plan = plan_memory(PlanInputs(str(cfg), 512, dtype="bf16", mixed_precision="bf16", batch_size=1, seq_len=4096))
    assert 69e9 < plan.num_params < 72e9
    assert plan.param_bytes == pytest.approx(141e9, rel=0.02)  # ~140 GB of bf16 parameters
    assert plan.param_shard_bytes == pytest.approx(275.6e6, rel=0.02)  # ~275 MB of them per rank
    assert plan.num_units == 83  # 80 decoder layers, the embedding, the head, the root
    assert plan.activation_bytes > 0


# ---- the engine's rules, consumed rather than restated -------------------------------------------------


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard", "hybrid_shard", "shard_optim"])
def test_shard_group_size_is_the_engine_strategys(strategy):
    for world, per_node in ((1, 8), (4, 8), (16, 8), (12, 4)):
        plan = plan_memory(PlanInputs("gpt-tiny", world, sharding_strategy=strategy, ranks_per_node=per_node))
        assert plan.shard_size == Strategy.parse(strategy).shard_group_size(world, per_node)
    assert Strategy.HYBRID_SHARD.shard_group_size(16, 8) == 8 and Strategy.NO_SHARD.shard_group_size(16, 8) == 1


def test_gathered_buffer_is_the_shard_exactly_when_the_engine_says_so():
    """One rank, no cast, no offload: the engine's gathered buffer *is* the shard, so nothing is gathered.
    A cast (bf16 compute) or CPU offload needs a buffer of its own; so does a second rank."""
    cache: dict = {}
    alone = plan_memory(PlanInputs("gpt-small", 1), _cache=cache)
    assert alone.gathered_bytes == alone.root_unit_bytes == alone.gathered_unit_bytes == 0
    for changed in (dict(mixed_precision="bf16"), dict(cpu_offload=True), dict(world_size=2)):
        assert plan_memory(PlanInputs("gpt-small", **{"world_size": 1, **changed}), _cache=cache).gathered_bytes > 0


def test_gradient_reduction_counts_the_engines_gradient_flats_alive_at_once():
    """A unit's unsharded gradients (bf16 compute) plus MAX_GRAD_FLATS_ALIVE flat buffers (fp32 reduce): the
    one being packed and those the runtime leaves in flight, the oldest finished before the next is allocated;
    the root reduces last, behind the blocks'."""
    alive = ModelRuntime.MAX_GRAD_FLATS_ALIVE
    assert alive == ModelRuntime.MAX_PENDING_REDUCES
    plan = plan_memory(PlanInputs("gpt-34m", 4, mixed_precision="bf16"))
    block, root = plan.gathered_unit_bytes // 2, plan.root_unit_bytes // 2  # padded numels (gathered in bf16)
    assert plan.grad_reduce_bytes == max(2 * block + alive * 4 * block, 2 * root + 4 * root + (alive - 1) * 4 * block)
    # with one rank the flat buffer is the gradient shard itself, counted with the shards
    one = plan_memory(PlanInputs("gpt-34m", 1, mixed_precision="bf16"))
    assert one.grad_reduce_bytes == max(one.gathered_unit_bytes, one.root_unit_bytes)  # bf16 gradients only


def test_end_of_backward_holds_the_last_blocks_or_the_roots_reduction_not_the_root_gathered():
    """At the end of backward every gradient shard exists; what is gathered then is the last blocks (one in
    backward, one prefetched) with a block's reduction, or nothing beside the root's reduction: the root was
    released after its head's backward (engine/core/unit.py). With almost no activations that is the peak."""
    plan = plan_memory(PlanInputs("gpt-170m", 2, batch_size=1, seq_len=1))  # fp32, cuda: no gloo scratch
    block, root = plan.gathered_unit_bytes, plan.root_unit_bytes  # fp32: gradients and flat are as large
    shards = plan.param_shard_bytes + plan.grad_shard_bytes + plan.optim_shard_bytes
    assert plan.prefetched_unit_bytes == block
    assert plan.backward_peak_bytes == shards + max(2 * block + 2 * block, 2 * root)


def test_an_untied_embedding_and_head_are_gathered_beside_a_block_never_together(tmp_path):
    """The trainer's units ("auto+head") make a Hugging Face model's untied embedding and head units of their
    own (engine/base/plan.py): the engine gathers each beside the block next to it in forward order (the head prefetched by
    the last block, the first block by the embedding), never the two together, and the root keeps only the
    final norm. The plan counts the pair the engine holds, not the two largest units."""
    pytest.importorskip("transformers")
    from shardwise.engine.base.plan import build_plan
    from shardwise.planner.memory import build_meta_model

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(LLAMA_70B, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=32000)))
    inputs = PlanInputs(str(cfg), 2, dtype="bf16", mixed_precision="bf16", batch_size=1, seq_len=8)
    plan = plan_memory(inputs)
    _, model, units = build_meta_model(inputs)
    bytes_of = {u.label: sum(g.padded_numel for g in u.groups) * 2 for u in build_plan(model, units, 2).units}
    head, block = bytes_of["lm_head"], bytes_of["model.layers.3"]
    assert bytes_of["model.embed_tokens"] == head > 2 * block  # the two largest units by far
    assert (plan.gathered_unit_bytes, plan.prefetched_unit_bytes) == (head, block)
    assert plan.root_unit_bytes == bytes_of["<root>"] == 256 * 2  # model.norm
    assert plan.gathered_bytes == plan.root_unit_bytes + head + block


# ---- fine-tuning: presets and LoRA ---------------------------------------------------------------------


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "llama-2-7b" else pytest.mark.slow)
                                  for n in sorted(KNOWN_PARAMS)])
def test_preset_shapes_give_the_published_parameter_count(name):
    plan = plan_memory(PlanInputs(name, 1, batch_size=1, seq_len=8))
    assert plan.num_params == plan.trainable_params == KNOWN_PARAMS[name]


def test_lora_keeps_gradients_and_adam_state_for_adapters_only():
    pytest.importorskip("peft")
    cache: dict = {}
    lora_inputs = PlanInputs("llama-3.2-1b", 1, batch_size=1, seq_len=8, lora_r=8,
                             lora_target_modules=("q_proj", "v_proj"))
    full = plan_memory(replace(lora_inputs, lora_r=0, lora_target_modules=()), _cache=cache)
    lora = plan_memory(lora_inputs, _cache=cache)
    hidden, kv_width, layers, r = 2048, 8 * 64, 16, 8  # 8 key/value heads of 64
    adapters = layers * ((r * hidden + hidden * r) + (r * hidden + kv_width * r))  # q and v: A and B each
    assert lora.trainable_params == adapters
    assert lora.num_params == full.num_params + adapters
    # one rank, fp32: no padding, so the shrink factor is exactly trainable / all parameters
    assert full.optim_shard_bytes == 2 * 4 * full.num_params and lora.optim_shard_bytes == 2 * 4 * adapters
    assert lora.grad_shard_bytes == 4 * adapters
    assert lora.optim_shard_bytes / full.optim_shard_bytes == pytest.approx(adapters / full.num_params)
    # a bf16 base halves the frozen weights and leaves the fp32 adapters alone
    bf16 = plan_memory(replace(lora_inputs, lora_base_dtype="bf16"), _cache=cache)
    assert bf16.param_shard_bytes == 2 * full.num_params + 4 * adapters
    assert bf16.optim_shard_bytes == lora.optim_shard_bytes
    # under bf16 compute on one rank the bf16 base needs no cast: its gathered buffer is its shard
    # (the engine's rule), so only the fp32 adapters are gathered
    bf16_compute = plan_memory(replace(lora_inputs, lora_base_dtype="bf16", mixed_precision="bf16"), _cache=cache)
    assert 0 < bf16_compute.gathered_bytes < 2 * adapters


def test_no_rank_count_fits_when_activations_alone_exceed_the_device():
    inputs = PlanInputs("qwen2.5-0.5b", 1, batch_size=4, seq_len=2048, dtype="bf16", mixed_precision="bf16")
    cache: dict = {}
    assert plan_memory(inputs, _cache=cache).activation_bytes > 4e9  # fp32 logits over 152k tokens alone: 5 GB
    assert fewest_ranks_that_fit(inputs, int(4e9), cache) is None


def test_cpu_offload_states_the_host_memory_it_needs():
    plain = plan_memory(PlanInputs("gpt-34m", 4))
    offload = plan_memory(PlanInputs("gpt-34m", 4, cpu_offload=True))
    host = plain.param_shard_bytes + plain.grad_shard_bytes + plain.optim_shard_bytes
    assert offload.offload_host_bytes == offload.device_bytes_offloaded == host > 0
    assert offload.offload_device_bytes == offload.total_bytes < plain.total_bytes
    assert plain.offload_host_bytes is None  # no offload, and no budget asked about
