"""``shardwise estimate-memory``: the per-rank memory plan of a training configuration, from the real
sharding plan, with no processes and no memory.

The model is built on the meta device (shapes only) and handed to ``shardwise.engine.plan.build_plan`` with the
shard size the strategy would use on N ranks: the flat-group sizes, padding included, are exactly those
``shardwise.shard`` would allocate. Activations come from running the model's real forward on meta
tensors under ``saved_tensors_hooks``, counting every distinct storage autograd keeps for backward, so
any architecture (GPT presets, Llama, Qwen2, GPT-2 ...) is measured rather than guessed at.

What is counted, per rank (see flat_group.py for the buffer lifetimes)::

    param shards      sum(shard_numel) x master dtype
    grad shards       trainable shard_numel x master dtype (shard_optim / ZeRO-1: the whole reduced
                      gradient, trainable padded_numel x reduce dtype)
    optimizer shards  AdamW: 2 x trainable shard_numel x master dtype
    gathered          root unit (stays gathered for forward + backward) + the largest unit + the next one
                      (prefetched); shard_grad_op / no_shard keep every unit gathered from forward to backward;
                      shard_optim / shard_optim_grad (ZeRO-1/2) keep every unit gathered all the time, through
                      the optimizer step too
    grad reduction    one unit's unsharded gradients (compute dtype) + its flat reduce-scatter buffer
    scratch           gloo's temporary copy of the buffer a collective works on (CPU only)
    activations       what autograd saves in forward + the backward working set (two of the largest)

With ``lora_r`` the meta model is wrapped by peft exactly as the trainer wraps it (``shardwise.hf.lora``): the
frozen base gets its own flat groups (no gradient or optimizer shards), the adapters theirs. ``answer``
turns a plan and a device budget into the verdict: fits or not, the fewest ranks that fit, and what CPU
offload leaves on the device and needs in host memory.

The total is the largest of three peaks: early in backward, at its end, and at the optimizer step ([Note: three peaks]
in ``plan_memory``). "Memory" is live bytes: what a caching allocator or malloc keeps beyond that (freed
blocks not yet returned) is not predicted. With ``cpu_offload`` the shards live in CPU memory and are not
counted against the device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.errors import ShardwiseError
from shardwise.usage import parse_size
from shardwise.engine.plan import ShardingPlan, build_plan
from shardwise.engine.mixed_precision import NAMED_DTYPES
from shardwise.engine.strategy import ALIASES as STRATEGY_ALIASES, STRATEGY_NAMES, Strategy

_MASTER = {"fp32": torch.float32, "bf16": torch.bfloat16}
ADAM_STATES = 2  # exp_avg and exp_avg_sq, each the size and dtype of the shard


@dataclass(frozen=True)
class PlanInputs:
    """One configuration to plan for."""

    model: str
    world_size: int
    sharding_strategy: str = "full_shard"
    mixed_precision: str = "no"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    batch_size: int = 16
    seq_len: int = 128
    dtype: str = "fp32"  # master weights
    ranks_per_node: int = 8  # the shard group size of the hybrid strategies
    device: str = "cuda"  # cuda (NCCL) or cpu (gloo, whose collectives allocate a full-size scratch buffer)
    auto_wrap: str = "transformer_based_wrap"
    transformer_layer_cls_to_wrap: tuple[str, ...] = ()
    lora_r: int = 0  # > 0: peft LoRA adapters of this rank, the base frozen (no gradients, no optimizer state)
    lora_target_modules: tuple[str, ...] = ()  # () -> peft's default for the architecture
    lora_base_dtype: str = ""  # the frozen base's dtype (fp32/bf16); "" -> the master dtype


@dataclass
class MemoryPlan:
    model: str
    num_params: int
    trainable_params: int  # all of them, or only the LoRA adapters
    world_size: int
    shard_size: int
    sharding_strategy: str
    mixed_precision: str
    cpu_offload: bool
    activation_checkpointing: bool
    batch_size: int
    seq_len: int
    num_units: int
    param_bytes: int  # the whole model in master dtype (for reference)
    param_shard_bytes: int
    grad_shard_bytes: int
    optim_shard_bytes: int
    gathered_unit_bytes: int  # the largest non-root unit, gathered in compute dtype
    prefetched_unit_bytes: int  # the unit gathered ahead of it
    root_unit_bytes: int
    gathered_bytes: int  # everything gathered at the peak (units above, or all of them without resharding)
    grad_reduce_bytes: int
    collective_scratch_bytes: int  # gloo's temporary copy of the buffer a collective works on (CPU only)
    activation_bytes: int  # saved by autograd at the end of forward + the backward working set
    activation_method: str
    backward_peak_bytes: int  # see [Note: three peaks]: the larger of early and end of backward
    optimizer_step_peak_bytes: int
    device_bytes_offloaded: int  # shard bytes moved to CPU memory by cpu_offload
    total_bytes: int  # per-rank device memory at the peak
    fits: Optional[bool] = None
    device_memory_bytes: Optional[int] = None
    suggestions: list[str] = field(default_factory=list)
    lora_r: int = 0
    min_world_size: Optional[int] = None  # the fewest ranks at which this configuration fits (None: none does)
    offload_device_bytes: Optional[int] = None  # with --cpu-offload at this world size: per device...
    offload_host_bytes: Optional[int] = None  # ... and the host memory it needs per rank


# ---- the model on meta ---------------------------------------------------------------------------------


def build_meta_model(inputs: PlanInputs):
    from shardwise.hf.model_spec import resolve_model

    spec = resolve_model(inputs.model)
    model = spec.build("meta")
    master = _MASTER[inputs.dtype]
    if master != torch.float32:
        model = model.to(master)
    if inputs.lora_r:
        from shardwise.hf.lora import LoraSettings, apply_lora

        if spec.kind != "hf":
            raise ValueError(f"--lora-r needs a Hugging Face model (peft wraps its modules); {spec.name} is a "
                             f"shardwise GPT preset")
        base = _MASTER[inputs.lora_base_dtype] if inputs.lora_base_dtype else None
        model = apply_lora(model, LoraSettings(r=inputs.lora_r, target_modules=inputs.lora_target_modules,
                                               base_dtype=base))
    units = spec.units(model, inputs.auto_wrap, list(inputs.transformer_layer_cls_to_wrap))
    return spec, model, units


def _model_key(inputs: PlanInputs) -> tuple:
    return ("model", inputs.model, inputs.dtype, inputs.lora_r, inputs.lora_target_modules, inputs.lora_base_dtype)


def shard_size_for(strategy: Strategy, world_size: int, ranks_per_node: int) -> int:
    if strategy is Strategy.NO_SHARD:
        return 1
    if strategy.is_hybrid:
        return max(1, min(world_size, ranks_per_node))
    return world_size


# ---- activations, measured on meta ---------------------------------------------------------------------


def _flash_like_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as the memory-efficient kernels run it (saving q, k, v, output and logsumexp). On meta, plain
    SDPA takes the math path and would count a (T x T) attention matrix no fused kernel ever stores."""
    if key.size(-3) != query.size(-3):  # grouped-query attention: kernels see the repeated heads
        rep = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal or attn_mask is not None, scale=scale)
    return out[0]


@contextlib.contextmanager
def _meta_friendly_forward():
    """Patches for the duration of the meta forward: memory-efficient SDPA, and Hugging Face's mask helpers
    told they are being traced, so they skip data-dependent checks (``.all()`` on a meta tensor has no value)."""
    patches = [(F, "scaled_dot_product_attention", _flash_like_sdpa)]
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None and hasattr(masking, "is_tracing"):
        patches.append((masking, "is_tracing", lambda *args, **kwargs: True))
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in originals:
            setattr(obj, name, value)


@dataclass
class ActivationProfile:
    saved_bytes: int  # everything autograd keeps from one forward
    largest_saved: int  # the largest single saved storage (sizes the backward working set)
    unit_saved: list[int]  # per non-root unit: bytes saved inside it
    unit_input: list[int]  # per non-root unit: bytes of its tensor inputs (what checkpointing keeps)
    method: str = "measured: forward on meta tensors"

    def peak(self, checkpointing: bool) -> int:
        """Activation bytes at their peak, backward working set included.

        Without checkpointing: everything saved by the end of the forward, plus the gradient flowing into
        the widest saved activation and the one flowing out of it. With checkpointing, the larger of the
        end of the forward (each unit's inputs + what is saved outside units + that working set) and the
        recompute of the largest unit in backward (every unit's input + that unit's saved tensors; the
        loss and head tensors are gone by then, and the unit's own backward frees as it goes)."""
        working = 2 * self.largest_saved
        if not (checkpointing and self.unit_saved):
            return self.saved_bytes + working
        outside = self.saved_bytes - sum(self.unit_saved)
        inputs = sum(self.unit_input)
        return max(outside + inputs + working, inputs + max(self.unit_saved))


def profile_activations(spec, model: nn.Module, unit_modules: list[nn.Module], batch_size: int, seq_len: int,
                        compute_dtype: Optional[torch.dtype]) -> ActivationProfile:
    """Run one forward + loss on meta and measure what autograd saves (parameters excluded)."""
    with _cast_for_forward(model, compute_dtype):
        return _profile(spec, model, unit_modules, batch_size, seq_len)


@contextlib.contextmanager
def _cast_for_forward(model: nn.Module, dtype: Optional[torch.dtype]):
    """Floating parameters in the compute dtype for the forward, then back: the meta model is cached and
    planned again, and its dtypes are part of the plan (peft keeps LoRA adapters in fp32 beside a bf16 base)."""
    originals = [(p, p.dtype) for p in model.parameters() if dtype is not None and p.is_floating_point()]
    for p, _ in originals:
        p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, original in originals:
            p.data = p.data.to(original)


def _profile(spec, model: nn.Module, unit_modules: list[nn.Module], batch_size: int, seq_len: int) -> ActivationProfile:
    from shardwise.hf.model_spec import lm_loss

    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}
    unit_seen: list[dict[int, int]] = [dict() for _ in unit_modules]
    unit_input = [0 for _ in unit_modules]
    active: list[int] = []

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        key = s._cdata
        if key not in param_storages:
            seen[key] = s.nbytes()
            if active:
                unit_seen[active[-1]][key] = s.nbytes()
        return t

    hooks = []
    for i, m in enumerate(unit_modules):
        def pre(mod, args, kwargs, i=i):
            active.append(i)
            unit_input[i] += sum(a.untyped_storage().nbytes() for a in list(args) + list(kwargs.values())
                                 if isinstance(a, torch.Tensor) and a.is_floating_point())

        def post(mod, args, kwargs, out, i=i):
            active.pop()

        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(m.register_forward_hook(post, with_kwargs=True))
    idx = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    try:
        with _meta_friendly_forward(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lm_loss(spec, model, idx, idx)
    finally:
        for h in hooks:
            h.remove()
    return ActivationProfile(sum(seen.values()), max(seen.values(), default=0),
                             [sum(d.values()) for d in unit_seen], unit_input)


def formula_activations(spec, num_units: int, batch_size: int, seq_len: int, itemsize: int) -> ActivationProfile:
    """The textbook count (Korthikanti et al. 2022, without the attention matrix that fused kernels never
    store): about 34·b·s·h bytes per layer at 2 bytes per element, i.e. 17 elements per token and hidden
    unit, plus the fp32 log-softmax of the logits."""
    per_layer = 17 * batch_size * seq_len * spec.hidden * itemsize
    logits = batch_size * seq_len * spec.vocab_size * 4
    layer_input = batch_size * seq_len * spec.hidden * itemsize
    n = max(num_units, 1)
    return ActivationProfile(per_layer * spec.n_layer + logits, max(logits, 4 * layer_input),
                             [per_layer * spec.n_layer // n] * num_units, [layer_input] * num_units,
                             method="formula: 34·b·s·h bytes per layer (the forward could not run on meta)")


# ---- the plan ------------------------------------------------------------------------------------------


def _unit_bytes(plan: ShardingPlan, mp_dtype: Optional[torch.dtype]) -> list[tuple[bool, int, int]]:
    """(is_root, gathered bytes in compute dtype, trainable padded numel) per unit."""
    out = []
    for u in plan.units:
        gathered = 0
        trainable = 0
        for g in u.groups:
            compute = mp_dtype if (mp_dtype is not None and g.dtype.is_floating_point) else g.dtype
            gathered += g.padded_numel * compute.itemsize
            if g.requires_grad:
                trainable += g.padded_numel
        out.append((u.is_root, gathered, trainable))
    return out


def plan_memory(inputs: PlanInputs, *, _cache: Optional[dict] = None) -> MemoryPlan:
    """The per-rank memory plan for ``inputs`` (see the module docstring for what is counted)."""
    cache = _cache if _cache is not None else {}
    strategy = Strategy.parse(inputs.sharding_strategy)
    if _model_key(inputs) not in cache:
        cache[_model_key(inputs)] = build_meta_model(inputs)
    spec, model, units = cache[_model_key(inputs)]
    shard_size = shard_size_for(strategy, inputs.world_size, inputs.ranks_per_node)
    plan = build_plan(model, units, shard_size)
    mp_dtype = NAMED_DTYPES[inputs.mixed_precision]

    param_shard = grad_shard = 0
    for g in plan.groups():
        nbytes = g.shard_numel * g.dtype.itemsize
        param_shard += nbytes
        if g.requires_grad:
            grad_shard += nbytes
    optim_shard = ADAM_STATES * grad_shard
    reduce_dtype = torch.float32 if mp_dtype is not None else _MASTER[inputs.dtype]
    if strategy.all_reduces_grads and shard_size > 1:  # ZeRO-1: grads are views of the whole reduced gradient
        grad_shard = sum(g.padded_numel * reduce_dtype.itemsize for g in plan.groups() if g.requires_grad)
    num_params = sum(p.numel for p in plan.params())
    trainable_params = sum(p.numel for p in plan.params() if p.requires_grad)
    param_bytes = sum(p.numel * p.dtype.itemsize for p in plan.params())

    per_unit = _unit_bytes(plan, mp_dtype)
    blocks = sorted((b for is_root, b, _ in per_unit if not is_root), reverse=True)
    root = next(b for is_root, b, _ in per_unit if is_root)
    largest = blocks[0] if blocks else 0
    prefetched = blocks[1] if len(blocks) > 1 else 0
    aliases = shard_size == 1 and mp_dtype is None and not inputs.cpu_offload  # gathered buffer is the shard
    if aliases:
        gathered = 0
    elif strategy.reshard_after_forward:
        gathered = root + largest + prefetched
    else:
        gathered = sum(b for _, b, _ in per_unit)  # kept gathered from forward to backward

    compute_itemsize = (mp_dtype or _MASTER[inputs.dtype]).itemsize

    def reduce_bytes(trainable_numel: int) -> int:
        # A unit's post-backward holds its parameters' gradients (compute dtype) while packing them into
        # the flat buffer of the reduce-scatter (reduce dtype); with one rank that flat buffer *is* the
        # gradient shard, counted with the shards.
        return trainable_numel * (compute_itemsize + (reduce_dtype.itemsize if shard_size > 1 else 0))

    block_trainable = max((t for is_root, _, t in per_unit if not is_root), default=0)
    root_trainable = next(t for is_root, _, t in per_unit if is_root)
    grad_reduce = reduce_bytes(max(block_trainable, root_trainable))
    # gloo (CPU) stages every all-gather / reduce-scatter through a temporary buffer the size of the full
    # flat buffer (measured: +32 MiB for a 32 MiB reduce-scatter at 2 and 4 ranks); its worker runs one
    # collective at a time. NCCL works in place.
    def scratch_for(gathered_bytes: int, trainable_numel: int) -> int:
        if inputs.device != "cpu" or shard_size == 1:
            return 0
        return max(gathered_bytes, trainable_numel * reduce_dtype.itemsize)

    scratch = scratch_for(max(largest, root), max(block_trainable, root_trainable))

    key = ("act", _model_key(inputs), inputs.mixed_precision, inputs.batch_size, inputs.seq_len,
           inputs.auto_wrap, inputs.transformer_layer_cls_to_wrap)
    if key not in cache:
        unit_modules = [u.module for u in plan.units if not u.is_root]
        try:
            cache[key] = profile_activations(spec, model, unit_modules, inputs.batch_size, inputs.seq_len, mp_dtype)
        except Exception:  # a forward that cannot run on meta (data-dependent code): fall back to the formula
            cache[key] = formula_activations(spec, len(unit_modules), inputs.batch_size, inputs.seq_len,
                                             (mp_dtype or _MASTER[inputs.dtype]).itemsize)
    prof = cache[key]
    activations = prof.peak(inputs.activation_checkpointing)

    # [Note: three peaks] (1) Early in backward: every activation is still saved, the optimizer state
    # exists (from the previous step) but gradients were freed by zero_grad(set_to_none=True) and come back
    # only as activations go. A block's gradient-reduction buffers appear once that block's activations are
    # freed, so only what exceeds them adds up. (2) The end of backward: the root unit (embeddings, head)
    # reduces last, when activations are gone and nearly every gradient shard exists. (3) The optimizer
    # step: shards, gradients, AdamW state and the step's temporaries.
    offload = inputs.cpu_offload
    device_shards = 0 if offload else param_shard + optim_shard
    device_grads = 0 if offload else grad_shard
    unit_saved = max(prof.unit_saved, default=0) if not inputs.activation_checkpointing else 0
    block_reduce = reduce_bytes(block_trainable) + scratch_for(largest, block_trainable)
    backward_peak = device_shards + gathered + activations + max(0, block_reduce - unit_saved)
    root_reduce = reduce_bytes(root_trainable) + scratch_for(root, root_trainable)
    kept = gathered if strategy.keeps_params_gathered else 0  # ZeRO-1/2: gathered through the step as well
    end_of_backward_peak = device_shards + device_grads + (kept or (0 if aliases else root)) + root_reduce
    backward_peak = max(backward_peak, end_of_backward_peak)
    # AdamW's temporaries: on CUDA the foreach path allocates a denominator for the whole parameter group;
    # on CPU the per-tensor path allocates one for one (the largest) shard at a time.
    largest_shard = max((g.shard_numel * g.dtype.itemsize for g in plan.groups() if g.requires_grad), default=0)
    step_temp = grad_shard if inputs.device == "cuda" else largest_shard
    step_peak = kept + (0 if offload else param_shard + grad_shard + optim_shard + step_temp)
    total = max(backward_peak, step_peak)
    offloaded = param_shard + grad_shard + optim_shard if offload else 0
    return MemoryPlan(
        model=spec.name, num_params=num_params, trainable_params=trainable_params, world_size=inputs.world_size, shard_size=shard_size,
        sharding_strategy=strategy.value, mixed_precision=inputs.mixed_precision, cpu_offload=inputs.cpu_offload,
        activation_checkpointing=inputs.activation_checkpointing, batch_size=inputs.batch_size,
        seq_len=inputs.seq_len, num_units=len(plan.units), param_bytes=param_bytes,
        param_shard_bytes=param_shard, grad_shard_bytes=grad_shard, optim_shard_bytes=optim_shard,
        gathered_unit_bytes=largest, prefetched_unit_bytes=prefetched, root_unit_bytes=root,
        gathered_bytes=gathered, grad_reduce_bytes=grad_reduce, collective_scratch_bytes=scratch,
        activation_bytes=activations, activation_method=prof.method,
        backward_peak_bytes=backward_peak, optimizer_step_peak_bytes=step_peak,
        device_bytes_offloaded=offloaded, total_bytes=total, lora_r=inputs.lora_r)


def fewest_ranks_that_fit(inputs: PlanInputs, budget: int, cache: dict, limit: int = 65536) -> Optional[int]:
    """The smallest world size >= ``inputs.world_size`` whose plan fits ``budget`` bytes per rank, or None
    when even ``limit`` ranks do not (what does not shrink with more ranks -- activations, gathered units --
    exceeds the budget by itself). Doubling, then bisection: every byte that depends on the world size is a
    shard, which only shrinks as ranks are added."""
    from dataclasses import replace

    def fits(n: int) -> bool:
        return plan_memory(replace(inputs, world_size=n), _cache=cache).total_bytes <= budget

    lo, hi = inputs.world_size - 1, inputs.world_size  # lo: known not to fit (or below the start)
    while not fits(hi):
        lo = hi
        if hi >= limit or plan_memory(replace(inputs, world_size=hi), _cache=cache).shard_size < hi:
            return None  # no_shard / hybrid: the shard group stops growing, more ranks shrink nothing more
        hi = min(2 * hi, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def answer(plan: MemoryPlan, inputs: PlanInputs, budget: int, cache: dict) -> MemoryPlan:
    """Fill in the verdict for ``budget`` bytes per device: fits or not, the fewest ranks that fit, what CPU
    offload would leave on the device and need in host memory, and nearby configurations that fit."""
    from dataclasses import replace

    plan.device_memory_bytes = budget
    plan.fits = plan.total_bytes <= budget
    if plan.fits:
        return plan
    plan.min_world_size = fewest_ranks_that_fit(inputs, budget, cache)
    if not inputs.cpu_offload:
        off = plan_memory(replace(inputs, cpu_offload=True), _cache=cache)
        plan.offload_device_bytes, plan.offload_host_bytes = off.total_bytes, off.device_bytes_offloaded
    plan.suggestions = suggest(inputs, budget, cache)
    return plan


def suggest(inputs: PlanInputs, budget: int, cache: dict) -> list[str]:
    """Configurations close to ``inputs`` that fit in ``budget`` bytes per rank: each combination of bf16,
    activation checkpointing and CPU offload, at this world size or the fewest doublings of it that fit."""
    from dataclasses import replace

    combos: list[tuple[str, dict]] = [("", {})]
    if inputs.mixed_precision == "no":
        combos.append(("--mixed-precision bf16", {"mixed_precision": "bf16"}))
    if not inputs.activation_checkpointing:
        combos.append(("--activation-checkpointing", {"activation_checkpointing": True}))
    if len(combos) == 3:
        combos.append(("--mixed-precision bf16 --activation-checkpointing",
                       {"mixed_precision": "bf16", "activation_checkpointing": True}))
    if not inputs.cpu_offload:
        combos += [(f"{label} --cpu-offload".strip(), {**changes, "cpu_offload": True}) for label, changes in combos]
    if not Strategy.parse(inputs.sharding_strategy).reshard_after_forward:  # full parameters kept: try ZeRO-3
        combos = [(f"--sharding-strategy full_shard {label}".strip(), {**changes, "sharding_strategy": "full_shard"})
                  for label, changes in combos] + combos
    out = []
    for label, changes in combos:
        alt = replace(inputs, **changes)
        for _ in range(17):  # this world size, then doublings up to 65,536x
            p = plan_memory(alt, _cache=cache)
            if p.total_bytes <= budget:
                ranks = f"--world-size {alt.world_size}" if alt.world_size != inputs.world_size else ""
                text = " ".join(t for t in (ranks, label) if t)
                if text:
                    out.append((alt.world_size, len(changes), f"{text}: {fmt_bytes(p.total_bytes)} per rank"))
                break
            if p.shard_size == 1 and alt.world_size > 1:
                break  # no_shard: more ranks shrink nothing
            alt = replace(alt, world_size=alt.world_size * 2)
    out.sort()  # fewest ranks first, then fewest changes
    return [text for _, _, text in out[:6]]


# ---- formatting and the command line -------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


def render(p: MemoryPlan) -> str:
    rows = [
        f"memory plan per rank: {p.model} ({p.num_params / 1e9:.3f}B params, {fmt_bytes(p.param_bytes)} of weights) "
        f"on {p.world_size} rank(s)",
        *([(f"  LoRA r={p.lora_r}: {p.trainable_params:,} trainable adapter params "
            f"({100 * p.trainable_params / max(p.num_params, 1):.3f}%), the base frozen: no gradients or optimizer "
            f"state for it")] if p.lora_r else []),
        f"  {p.sharding_strategy}, shard group of {p.shard_size}, {p.num_units} units, mixed_precision={p.mixed_precision}, "
        f"cpu_offload={p.cpu_offload}, activation_checkpointing={p.activation_checkpointing}, "
        f"batch {p.batch_size} x seq {p.seq_len} per rank",
        f"  {'parameter shards':<34}{fmt_bytes(p.param_shard_bytes):>14}",
        f"  {'gradient shards':<34}{fmt_bytes(p.grad_shard_bytes):>14}",
        f"  {'optimizer shards (AdamW)':<34}{fmt_bytes(p.optim_shard_bytes):>14}",
        f"  {'largest unit, gathered':<34}{fmt_bytes(p.gathered_unit_bytes):>14}",
        f"  {'prefetched unit, gathered':<34}{fmt_bytes(p.prefetched_unit_bytes):>14}",
        f"  {'root unit (stays gathered)':<34}{fmt_bytes(p.root_unit_bytes):>14}",
        f"  {'  -> gathered at the peak':<34}{fmt_bytes(p.gathered_bytes):>14}",
        f"  {'gradient reduction buffers':<34}{fmt_bytes(p.grad_reduce_bytes):>14}",
        f"  {'collective scratch (gloo)':<34}{fmt_bytes(p.collective_scratch_bytes):>14}",
        f"  {'activations':<34}{fmt_bytes(p.activation_bytes):>14}   ({p.activation_method})",
        f"  {'peak in backward':<34}{fmt_bytes(p.backward_peak_bytes):>14}",
        f"  {'peak at the optimizer step':<34}{fmt_bytes(p.optimizer_step_peak_bytes):>14}",
    ]
    if p.cpu_offload:
        rows.append(f"  {'offloaded to CPU memory':<34}{'-' + fmt_bytes(p.device_bytes_offloaded):>14}")
    rows.append(f"  {'total per rank (the larger peak)':<34}{fmt_bytes(p.total_bytes):>14}")
    if p.fits is not None:
        verdict = "fits" if p.fits else "does NOT fit"
        rows.append(f"{verdict} in --device-memory {fmt_bytes(p.device_memory_bytes)}")
        if not p.fits:
            rows.append(f"  more ranks: {p.min_world_size} (--world-size {p.min_world_size}) is the fewest that fit"
                        if p.min_world_size else
                        "  more ranks: no number of ranks fits (activations and gathered units do not shrink "
                        "with more ranks)")
            if p.offload_device_bytes is not None:
                fit = "fits" if p.offload_device_bytes <= p.device_memory_bytes else "still does NOT fit"
                rows.append(f"  --cpu-offload on {p.world_size} rank(s): {fmt_bytes(p.offload_device_bytes)} per "
                            f"device ({fit}), and {fmt_bytes(p.offload_host_bytes)} of host memory per rank for "
                            f"the shards, gradients and optimizer state "
                            f"({fmt_bytes(p.offload_host_bytes * p.world_size)} over all ranks)")
            rows += ["what would fit:"] + [f"  {s}" for s in p.suggestions] if p.suggestions else \
                ["nothing close fits: try a smaller model or a shorter --seq-len"]
    return "\n".join(rows)


def make_parser(defaults: Any) -> argparse.ArgumentParser:
    """The ``estimate-memory`` command line; ``defaults`` (the trainer's config, passed by the caller so that
    the planner does not import the trainer) gives the batch size and sequence length a plan assumes."""
    d = defaults
    ap = argparse.ArgumentParser(prog="shardwise estimate-memory",
                                 description="Per-rank memory plan of a training configuration, from shardwise's own "
                                             "sharding plan on meta tensors (no processes, no memory).")
    ap.add_argument("--model", required=True, help="GPT preset or PATH/config.json (Hugging Face causal LM)")
    ap.add_argument("--world-size", type=int, required=True, help="number of ranks")
    ap.add_argument("--sharding-strategy", default="full_shard", choices=STRATEGY_NAMES + tuple(STRATEGY_ALIASES))
    ap.add_argument("--mixed-precision", default="no", choices=tuple(NAMED_DTYPES))
    ap.add_argument("--cpu-offload", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="per rank (default: the trainer's)")
    ap.add_argument("--seq-len", type=int, default=d.seq_len, help="(default: the trainer's)")
    ap.add_argument("--dtype", default="fp32", choices=tuple(_MASTER), help="master weight dtype")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="where training runs: cuda (NCCL) or cpu (gloo, which adds collective scratch buffers)")
    ap.add_argument("--ranks-per-node", type=int, default=8, help="shard group size of the hybrid strategies")
    ap.add_argument("--transformer-layer-cls-to-wrap", default="", help="comma-separated unit class names")
    ap.add_argument("--device-memory", default=None, help="say whether the plan fits, e.g. 80GB or 24GiB")
    ap.add_argument("--lora-r", type=int, default=0, help="plan LoRA fine-tuning: adapter rank (0: full training)")
    ap.add_argument("--lora-target-modules", default="", help="comma-separated module names (default: peft's)")
    ap.add_argument("--lora-base-dtype", default="", choices=("",) + tuple(_MASTER),
                    help="dtype of the frozen base (default: --dtype)")
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return ap


def _names(text: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in text.split(",") if c.strip())


def main(argv: Optional[Sequence[str]], defaults: Any) -> int:
    args = make_parser(defaults).parse_args(argv)
    if args.world_size < 1 or args.batch_size < 1 or args.seq_len < 1 or args.lora_r < 0:
        print("error: --world-size, --batch-size and --seq-len must be >= 1, --lora-r >= 0", file=sys.stderr)
        return 2
    inputs = PlanInputs(
        model=args.model, world_size=args.world_size, sharding_strategy=args.sharding_strategy,
        mixed_precision=args.mixed_precision, cpu_offload=args.cpu_offload,
        activation_checkpointing=args.activation_checkpointing, batch_size=args.batch_size, seq_len=args.seq_len,
        dtype=args.dtype, ranks_per_node=args.ranks_per_node, device=args.device,
        transformer_layer_cls_to_wrap=_names(args.transformer_layer_cls_to_wrap), lora_r=args.lora_r,
        lora_target_modules=_names(args.lora_target_modules), lora_base_dtype=args.lora_base_dtype)
    from shardwise.hf.model_spec import ModelError

    cache: dict = {}
    try:
        budget = parse_size(args.device_memory) if args.device_memory else None
        plan = plan_memory(inputs, _cache=cache)
        if budget is not None:
            answer(plan, inputs, budget, cache)
    except (ModelError, ValueError, ShardwiseError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if args.json else render(plan))
    return 0
