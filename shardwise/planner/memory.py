"""The per-rank memory plan of a training configuration, from the real sharding plan, with no processes and
no memory (the arithmetic behind ``shardwise estimate-memory``; ``planner.cli`` is the command).

The model is built on the meta device (shapes only) and handed to ``shardwise.engine.base.plan.build_plan`` with the
shard size the strategy would use on N ranks: the flat-group sizes, padding included, are exactly those
``shardwise.shard`` would allocate. The engine's own rules size the rest: ``Strategy.shard_group_size``
(how many ranks share a shard), ``named_policy`` (compute and reduce dtypes), ``gathered_aliases_shard``
(when the gathered buffer is the shard itself) and ``ModelRuntime.MAX_GRAD_FLATS_ALIVE`` (gradient flats
alive at once). Activations are measured on meta tensors (``planner.activations``).

What is counted, per rank (see engine/core/flat_group.py for the buffer lifetimes)::

    param shards      sum(shard_numel) x stored bytes per element (``_stored_bytes``)
    grad shards       trainable shard_numel x master dtype (shard_optim / ZeRO-1: the whole reduced
                      gradient, trainable padded_numel x reduce dtype)
    optimizer shards  AdamW: 2 x trainable shard_numel x master dtype
    gathered          root unit (gathered from forward until its backward is done) + the largest two units
                      next to each other in module order, which is the order they run in (one computing, the
                      next prefetched; a Hugging Face model's untied embedding and head are such units, so
                      the root holds only its final norm); shard_grad_op / no_shard keep every unit gathered
                      from forward to backward; shard_optim / shard_optim_grad (ZeRO-1/2) keep every unit
                      gathered all the time, through the optimizer step too
    grad reduction    one unit's unsharded gradients (compute dtype) + the gradient flats alive at once
                      (reduce dtype: the one being packed and those still in flight)
    scratch           what a gloo collective allocates beside its buffer (CPU only): the all-reduce ring's
                      chunks, or a whole copy under gloo's native all-gather / reduce-scatter
    activations       what autograd saves in forward + the backward working set (two of the largest)

With ``lora_r`` the meta model is wrapped by peft exactly as the trainer wraps it (``shardwise.hf.lora``): the
frozen base gets its own flat groups (no gradient or optimizer shards), the adapters theirs. ``answer``
turns a plan and a device budget into the verdict: fits or not, the fewest ranks that fit, and what CPU
offload leaves on the device and needs in host memory.

The total is the largest of three peaks: early in backward, at its end, and at the optimizer step ([Note: three peaks]
in ``_peaks``). "Memory" is live bytes: what a caching allocator or malloc keeps beyond that (freed
blocks not yet returned) is not predicted. With ``cpu_offload`` the shards live in CPU memory and are not
counted against the device: the plan states them as the host memory each rank needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from shardwise.engine.base import flags
from shardwise.engine.core.flat_group import gathered_aliases_shard
from shardwise.engine.base.mixed_precision import MixedPrecision, named_policy
from shardwise.engine.base.plan import FlatGroupPlan, ShardingPlan, build_plan
from shardwise.engine.core.runtime import ModelRuntime
from shardwise.engine.base.strategy import Strategy
from shardwise.planner.activations import ActivationProfile, measure_activations, quiet_libraries

MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ADAM_STATES = 2  # exp_avg and exp_avg_sq, each the size and dtype of the shard
# What a gloo all-reduce allocates beside its buffer: measured (VmHWM, torch 2.13) 0.4 MiB for 1 MiB buffers
# and 1.8-1.9 MiB for 4-64 MiB ones, at 2 and 4 ranks, fp32 and bf16. gloo's native all-gather and
# reduce-scatter allocate the whole buffer again (+64 MiB for 64 MiB).
GLOO_RING_SCRATCH = 2 * 2**20


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
    device: str = "cuda"  # cuda (NCCL) or cpu (gloo, whose collectives allocate scratch buffers)
    auto_wrap: str = "transformer_based_wrap"
    transformer_layer_cls_to_wrap: tuple[str, ...] = ()
    lora_r: int = 0  # > 0: peft LoRA adapters of this rank, the base frozen (no gradients, no optimizer state)
    lora_target_modules: tuple[str, ...] = ()  # () -> peft's default for the architecture
    lora_base_dtype: str = ""  # the frozen base's dtype (fp32/bf16); "" -> the master dtype
    load_in_4bit: bool = False  # QLoRA: the Linears' weights in bitsandbytes' 4-bit format (planner/quantized.py)
    bnb_4bit_quant_type: str = "nf4"
    double_quant: bool = True


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
    gathered_unit_bytes: int  # the larger of the two units gathered together at the peak, in compute dtype
    prefetched_unit_bytes: int  # the other one (the unit running and the next, prefetched)
    root_unit_bytes: int
    gathered_bytes: int  # everything gathered at the peak (units above, or all of them without resharding)
    grad_reduce_bytes: int
    collective_scratch_bytes: int  # what a gloo collective allocates beside its buffer (CPU only)
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
    quantised_shard_bytes: int = 0  # --load-in-4bit: this rank's 4-bit base bytes (in param_shard_bytes)
    dequantised_weight_bytes: int = 0  # --load-in-4bit: the largest matrix dequantised for its matmul
    recomputed_weight_bytes: int = 0  # ... with activation checkpointing: the largest unit's dequantised
    # weights, kept from its recompute to its backward


# ---- the model on meta ---------------------------------------------------------------------------------


def frozen_base_dtype(inputs: PlanInputs) -> Optional[torch.dtype]:
    """The dtype the frozen base of a LoRA plan is stored in (None: the master dtype). The one place the
    base's storage is decided; what a stored element costs is ``_stored_bytes``."""
    return MASTER_DTYPES[inputs.lora_base_dtype] if inputs.lora_base_dtype else None


def _stored_bytes(group: FlatGroupPlan, numel: int) -> int:
    """Bytes ``numel`` elements of ``group`` take in its shard (its master or frozen-base dtype)."""
    return numel * group.dtype.itemsize


def build_meta_model(inputs: PlanInputs):
    """(spec, model on meta, units) as the trainer would build and wrap them; third-party warnings silenced."""
    from shardwise.hf.model_spec import resolve_model

    spec = resolve_model(inputs.model)
    with quiet_libraries():
        model = spec.build("meta")
        master = MASTER_DTYPES[inputs.dtype]
        if master != torch.float32:
            model = model.to(master)
        if inputs.load_in_4bit:
            from shardwise.planner.quantized import quantise_meta_model

            quantise_meta_model(model, inputs.bnb_4bit_quant_type, inputs.double_quant, inputs.lora_r)
        if inputs.lora_r:
            if spec.kind != "hf":
                raise ValueError(f"--lora-r needs a Hugging Face model (peft wraps its modules); {spec.name} is a "
                                 f"shardwise GPT preset")
            from shardwise.hf.lora import LoraSettings, apply_lora

            model = apply_lora(model, LoraSettings(r=inputs.lora_r, target_modules=inputs.lora_target_modules,
                                                   base_dtype=frozen_base_dtype(inputs)))
        units = spec.units(model, inputs.auto_wrap, list(inputs.transformer_layer_cls_to_wrap))
    return spec, model, units


def _model_key(inputs: PlanInputs) -> tuple:
    return ("model", inputs.model, inputs.dtype, inputs.lora_r, inputs.lora_target_modules, inputs.lora_base_dtype,
            inputs.load_in_4bit, inputs.bnb_4bit_quant_type, inputs.double_quant)


# ---- the plan ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _UnitBytes:
    """One unit's buffers as the engine sizes them."""

    is_root: bool
    edge: bool  # an embedding or head unit ("auto" / "auto+head"): gathered in forward, never recomputed
    gathered: int  # its gathered buffers in compute dtype (0 for a group whose gathered buffer is the shard)
    grads: int  # its unsharded gradients as autograd produces them (compute dtype)
    grad_flat: int  # the flat buffer they are packed into for the reduction (reduce dtype)


def _unit_bytes(plan: ShardingPlan, policy: MixedPrecision, shard_size: int, offload: bool) -> list[_UnitBytes]:
    out = []
    for u in plan.units:
        gathered = grads = flat = 0
        for g in u.groups:
            compute = policy.compute_dtype(g.dtype)
            if not gathered_aliases_shard(shard_size, g.dtype, compute, offload):
                gathered += g.padded_numel * compute.itemsize
            if g.requires_grad:
                grads += g.padded_numel * compute.itemsize
                flat += g.padded_numel * policy.grad_reduce_dtype(g.dtype).itemsize
        out.append(_UnitBytes(u.is_root, u.edge is not None, gathered, grads, flat))
    return out


@dataclass(frozen=True)
class _Buffers:
    """What ``_peaks`` adds up: the shards and the transient buffers, per rank."""

    param_shard: int
    grad_shard: int
    optim_shard: int
    gathered: int
    recompute_gathered: int  # gathered while a block recomputes (checkpointing): the root, two blocks
    kept: int  # gathered bytes kept through the optimizer step (ZeRO-1/2)
    last_blocks: int  # the two blocks gathered in the last blocks' backward (one in backward, one prefetched)
    block_reduce: int  # the widest block's unsharded gradients + its gradient flat (+ gloo scratch)
    pending_flats: int  # the blocks' gradient flats still in flight beside it (bytes)
    pending_count: int  # ... and how many
    root_reduce: int  # the root's reduction at the end of backward, the blocks' flats in flight included
    largest_trainable_shard: int


def _gathered_together(gathered: list[int]) -> tuple[int, int]:
    """The two units gathered at once at the peak, larger first: the engine gathers a unit and prefetches the
    next in forward order, taken here as module order (the plan's: embedding, blocks, head), and in backward
    the previous one, the same pairs. (0, 0) without units; (the one, 0) with one."""
    if len(gathered) < 2:
        return (gathered[0] if gathered else 0), 0
    a, b = max(zip(gathered, gathered[1:]), key=sum)
    return max(a, b), min(a, b)


def plan_memory(inputs: PlanInputs, *, _cache: Optional[dict] = None) -> MemoryPlan:
    """The per-rank memory plan for ``inputs`` (see the module docstring for what is counted)."""
    cache = _cache if _cache is not None else {}
    strategy = Strategy.parse(inputs.sharding_strategy)
    if _model_key(inputs) not in cache:
        cache[_model_key(inputs)] = build_meta_model(inputs)
    spec, model, units = cache[_model_key(inputs)]
    shard_size = strategy.shard_group_size(inputs.world_size, inputs.ranks_per_node)
    plan = build_plan(model, units, shard_size)
    policy = named_policy(inputs.mixed_precision) or MixedPrecision()

    param_shard = sum(_stored_bytes(g, g.shard_numel) for g in plan.groups())
    grad_shard = sum(_stored_bytes(g, g.shard_numel) for g in plan.groups() if g.requires_grad)
    optim_shard = ADAM_STATES * grad_shard
    if strategy.all_reduces_grads and shard_size > 1:  # ZeRO-1: grads are views of the whole reduced gradient
        grad_shard = sum(g.padded_numel * policy.grad_reduce_dtype(g.dtype).itemsize
                         for g in plan.groups() if g.requires_grad)

    per_unit = _unit_bytes(plan, policy, shard_size, inputs.cpu_offload)
    root = next(u for u in per_unit if u.is_root)
    largest, prefetched = _gathered_together([u.gathered for u in per_unit if not u.is_root])
    if strategy.reshard_after_forward:
        gathered = root.gathered + largest + prefetched
        # A block's recompute comes after the head's backward released the head: two blocks beside it.
        recompute_gathered = root.gathered + sum(_gathered_together(
            [u.gathered for u in per_unit if not u.is_root and not u.edge]))
    else:
        gathered = recompute_gathered = sum(u.gathered for u in per_unit)  # kept from forward to backward
    widest = max((u for u in per_unit if not u.is_root), key=lambda u: u.grad_flat,
                 default=_UnitBytes(False, False, 0, 0, 0))
    # Gradient flats alive at once: the one being packed and those still in flight. With one rank per
    # shard group the flat *is* the gradient shard (the engine hands out views of it), counted with the shards.
    alive = ModelRuntime.MAX_GRAD_FLATS_ALIVE if shard_size > 1 else 0

    pending = max(0, alive - 1)

    def reduce_bytes(unit: _UnitBytes) -> int:
        return unit.grads + (unit.grad_flat if alive else 0) + pending * widest.grad_flat

    # gloo (CPU): its worker runs one collective at a time. The engine carries all-gather and reduce-scatter
    # as all-reduces in the buffers it holds anyway, whose ring needs at most GLOO_RING_SCRATCH; gloo's own
    # all-gather / reduce-scatter (SHARDWISE_GLOO_NATIVE_COLLECTIVES) stage the whole buffer in a temporary
    # one. NCCL works in place.
    native = flags.enabled(flags.GLOO_NATIVE_COLLECTIVES)

    def scratch_for(gathered_bytes: int, flat_bytes: int) -> int:
        if inputs.device != "cpu" or shard_size == 1:
            return 0
        largest_buffer = max(gathered_bytes, flat_bytes)
        return largest_buffer if native else min(largest_buffer, GLOO_RING_SCRATCH)

    scratch = scratch_for(max(largest, root.gathered), max(widest.grad_flat, root.grad_flat))
    prof = _activations(inputs, cache, spec, model, plan, policy)
    # The end of backward gathers nothing (the root was gathered in forward): its collective is the
    # root's reduction or, for a root with nothing trainable (LoRA's frozen embeddings and head), the last
    # block's still in flight.
    buffers = _Buffers(param_shard, grad_shard, optim_shard, gathered, recompute_gathered,
                       kept=gathered if strategy.keeps_params_gathered else 0,
                       last_blocks=largest + prefetched,
                       block_reduce=reduce_bytes(widest) - pending * widest.grad_flat
                       + scratch_for(largest, widest.grad_flat),
                       pending_flats=pending * widest.grad_flat, pending_count=pending,
                       root_reduce=reduce_bytes(root) + scratch_for(0, root.grad_flat or widest.grad_flat),
                       largest_trainable_shard=max((_stored_bytes(g, g.shard_numel) for g in plan.groups()
                                                    if g.requires_grad), default=0))
    quantised_shard = dequantised = recomputed = uncounted = 0
    if inputs.load_in_4bit:
        from shardwise.planner.quantized import quantised_figures

        compute_itemsize = (policy.param_dtype or MASTER_DTYPES[inputs.dtype]).itemsize
        q = quantised_figures(model, plan, compute_itemsize, inputs.device)
        quantised_shard, dequantised, uncounted = q.shard_bytes, q.matrix_bytes, q.uncounted
        recomputed = max(q.recomputed_bytes, default=0) if inputs.activation_checkpointing else 0
        phases = prof.phases(inputs.activation_checkpointing, transient=dequantised, recomputed=q.recomputed_bytes)
    else:
        phases = prof.phases(inputs.activation_checkpointing)
    activations = max(phases)
    backward_peak, step_peak = _peaks(inputs, buffers, phases, prof)
    total = max(backward_peak, step_peak)
    offloaded = param_shard + grad_shard + optim_shard if inputs.cpu_offload else 0
    params = list(plan.params())
    return MemoryPlan(
        model=spec.name, num_params=sum(p.numel for p in params) + uncounted,
        trainable_params=sum(p.numel for p in params if p.requires_grad), world_size=inputs.world_size,
        shard_size=shard_size, sharding_strategy=strategy.value, mixed_precision=inputs.mixed_precision,
        cpu_offload=inputs.cpu_offload, activation_checkpointing=inputs.activation_checkpointing,
        batch_size=inputs.batch_size, seq_len=inputs.seq_len, num_units=len(plan.units),
        param_bytes=sum(p.numel * p.dtype.itemsize for p in params),
        param_shard_bytes=param_shard, grad_shard_bytes=grad_shard, optim_shard_bytes=optim_shard,
        gathered_unit_bytes=largest, prefetched_unit_bytes=prefetched, root_unit_bytes=root.gathered,
        gathered_bytes=gathered, grad_reduce_bytes=max(reduce_bytes(widest), reduce_bytes(root)),
        collective_scratch_bytes=scratch, activation_bytes=activations, activation_method=prof.method,
        backward_peak_bytes=backward_peak, optimizer_step_peak_bytes=step_peak,
        device_bytes_offloaded=offloaded, total_bytes=total, lora_r=inputs.lora_r,
        offload_device_bytes=total if inputs.cpu_offload else None,
        offload_host_bytes=offloaded if inputs.cpu_offload else None,
        quantised_shard_bytes=quantised_shard, dequantised_weight_bytes=dequantised,
        recomputed_weight_bytes=recomputed)


def _activations(inputs: PlanInputs, cache: dict, spec, model, plan: ShardingPlan,
                 policy: MixedPrecision) -> ActivationProfile:
    """The activation profile, measured once per model, precision, batch shape and wrapping."""
    key = ("act", _model_key(inputs), inputs.mixed_precision, inputs.batch_size, inputs.seq_len,
           inputs.auto_wrap, inputs.transformer_layer_cls_to_wrap)
    if key not in cache:
        unit_modules = [u.module for u in plan.units if u.checkpointed]
        compute = policy.compute_dtype(MASTER_DTYPES[inputs.dtype])
        cache[key] = measure_activations(spec, model, unit_modules, inputs.batch_size, inputs.seq_len,
                                         policy.param_dtype, compute.itemsize)
    return cache[key]


def _peaks(inputs: PlanInputs, b: _Buffers, activations: tuple[int, int], prof: ActivationProfile) -> tuple[int, int]:
    """(peak in backward, peak at the optimizer step) per device.

    [Note: three peaks] (1) Early in backward: every activation is still saved, the optimizer state
    exists (from the previous step) but gradients were freed by zero_grad(set_to_none=True) and come back
    only as activations go. A block's gradient-reduction buffers appear once that block's activations are
    freed, so only what exceeds them adds up; so do the flats still in flight, each of a block whose
    activations are gone. (2) The end of backward, when activations are gone and nearly every gradient shard
    exists: the last blocks' backward (one gathered, the next prefetched, its reduction) or the root unit's
    reduction, which comes last; the root itself is no longer gathered by then (released once its head's
    backward is done: [Note: releasing a unit in backward] in engine/core/unit.py), unless the strategy
    keeps every unit gathered. (3) The optimizer step: shards, gradients, AdamW state and the step's
    temporaries. Early in backward has two moments with checkpointing (``ActivationProfile.phases``): the end of
    the forward, every unit's input saved, beside the units the forward ended with (the head's backward is
    next), and the largest block's recompute, beside two blocks (the head released by then)."""
    offload = inputs.cpu_offload
    device_shards = 0 if offload else b.param_shard + b.optim_shard
    device_grads = 0 if offload else b.grad_shard
    unit_saved = max(prof.unit_saved, default=0) if not inputs.activation_checkpointing else 0
    forward_end, recompute = activations
    early = (device_shards + max(b.gathered + forward_end, b.recompute_gathered + recompute)
             + max(0, b.block_reduce - unit_saved) + max(0, b.pending_flats - b.pending_count * unit_saved))
    last_blocks = (b.kept or b.last_blocks) + b.block_reduce + b.pending_flats
    end = device_shards + device_grads + max(last_blocks, b.kept + b.root_reduce)
    # AdamW's temporaries: on CUDA the foreach path allocates a denominator for the whole parameter group;
    # on CPU the per-tensor path allocates one for one (the largest) shard at a time.
    step_temp = b.grad_shard if inputs.device == "cuda" else b.largest_trainable_shard
    step = b.kept + (0 if offload else b.param_shard + b.grad_shard + b.optim_shard + step_temp)
    return max(early, end), step


def fewest_ranks_that_fit(inputs: PlanInputs, budget: int, cache: dict, limit: int = 65536) -> Optional[int]:
    """The smallest world size >= ``inputs.world_size`` whose plan fits ``budget`` bytes per rank, or None
    when even ``limit`` ranks do not (what does not shrink with more ranks -- activations, gathered units --
    exceeds the budget by itself). Doubling, then bisection: every byte that depends on the world size is a
    shard, which only shrinks as ranks are added."""

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
    plan.device_memory_bytes = budget
    plan.fits = plan.total_bytes <= budget
    if plan.fits:
        return plan
    plan.min_world_size = fewest_ranks_that_fit(inputs, budget, cache)
    if not inputs.cpu_offload:
        off = plan_memory(replace(inputs, cpu_offload=True), _cache=cache)
        plan.offload_device_bytes, plan.offload_host_bytes = off.offload_device_bytes, off.offload_host_bytes
    plan.suggestions = suggest(inputs, budget, cache)
    return plan


def suggest(inputs: PlanInputs, budget: int, cache: dict) -> list[str]:
    """Configurations close to ``inputs`` that fit in ``budget`` bytes per rank: each combination of bf16,
    activation checkpointing and CPU offload, at this world size or the fewest doublings of it that fit."""
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


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"
