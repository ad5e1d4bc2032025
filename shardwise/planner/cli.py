"""``shardwise estimate-memory``: its command line, the checks on it, and the plan as text or JSON.

``shardwise.cli`` dispatches here with the trainer's defaults (batch size, sequence length and its upper
bound), so that the planner never imports the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from typing import Any, Optional, Sequence

from shardwise.engine.base.mixed_precision import NAMED_DTYPES
from shardwise.engine.base.strategy import ALIASES as STRATEGY_ALIASES, STRATEGY_NAMES
from shardwise.errors import ShardwiseError
from shardwise.hf.model_spec import ModelError, ModelSpec, resolve_model
from shardwise.hf.presets import ARCH_PRESETS
from shardwise.models.gpt import PRESETS
from shardwise.planner.memory import MASTER_DTYPES, MemoryPlan, PlanInputs, answer, fmt_bytes, plan_memory
from shardwise.usage import RaisingParser, UsageError, parse_size


def make_parser(defaults: Any) -> argparse.ArgumentParser:
    """The ``estimate-memory`` command line; ``defaults`` (the trainer's config, passed by the caller so that
    the planner does not import the trainer) gives the batch size and sequence length a plan assumes. Its
    errors raise one ``UsageError`` naming the option."""
    d = defaults
    ap = RaisingParser(prog="shardwise estimate-memory",
                       description="Per-rank memory plan of a training configuration, from shardwise's own "
                                   "sharding plan on meta tensors (no processes, no memory).")
    ap.add_argument("--model", required=True, help="GPT preset, architecture preset, or PATH/config.json "
                                                   "(Hugging Face causal LM)")
    ap.add_argument("--world-size", type=int, required=True, help="number of ranks")
    ap.add_argument("--sharding-strategy", default="full_shard", choices=STRATEGY_NAMES + tuple(STRATEGY_ALIASES))
    ap.add_argument("--mixed-precision", default="no", choices=tuple(NAMED_DTYPES))
    ap.add_argument("--cpu-offload", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="per rank (default: the trainer's)")
    ap.add_argument("--seq-len", type=int, default=d.seq_len, help="(default: the trainer's)")
    ap.add_argument("--dtype", default="fp32", choices=tuple(MASTER_DTYPES), help="master weight dtype")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="where training runs: cuda (NCCL) or cpu (gloo, which adds collective scratch buffers)")
    ap.add_argument("--ranks-per-node", type=int, default=8, help="shard group size of the hybrid strategies")
    ap.add_argument("--transformer-layer-cls-to-wrap", default="", help="comma-separated unit class names")
    ap.add_argument("--device-memory", default=None, help="say whether the plan fits, e.g. 80GB or 24GiB")
    ap.add_argument("--lora-r", type=int, default=0, help="plan LoRA fine-tuning: adapter rank (0: full training)")
    ap.add_argument("--lora-target-modules", default="", help="comma-separated module names (default: peft's)")
    ap.add_argument("--lora-base-dtype", default="", choices=("",) + tuple(MASTER_DTYPES),
                    help="dtype of the frozen base (default: --dtype)")
    ap.add_argument("--load-in-4bit", "--load_in_4bit", action="store_true",
                    help="QLoRA: the frozen base in 4 bits (bitsandbytes' NF4 layout; needs --lora-r)")
    ap.add_argument("--bnb-4bit-quant-type", "--bnb_4bit_quant_type", default="nf4", choices=("nf4", "fp4"))
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return ap


def _names(text: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in text.split(",") if c.strip())


def resolve_planned_model(name: str) -> ModelSpec:
    """``--model`` as the planner reads it; a name that is neither a preset nor an existing path (a Hub
    repository id, say: the planner runs offline) is refused with the presets it knows."""
    try:
        return resolve_model(name)
    except ModelError as e:
        if os.path.exists(name):
            raise UsageError(f"--model {name}: {e}") from None
        raise UsageError(f"--model: unknown model {name!r} (no such preset or file); presets: "
                         f"{', '.join([*PRESETS, *ARCH_PRESETS])}; or a path to a Hugging Face config.json or "
                         f"model directory") from None


def check_args(args: argparse.Namespace, max_seq_len: int) -> None:
    """Numbers ``estimate-memory`` would otherwise plan with silently (or fail on deep inside)."""
    for option, value, hi in (("--world-size", args.world_size, 2**24), ("--batch-size", args.batch_size, 2**20),
                              ("--seq-len", args.seq_len, max_seq_len),
                              ("--ranks-per-node", args.ranks_per_node, 2**16)):
        if not 1 <= value <= hi:
            raise UsageError(f"{option} {value}: must be between 1 and {hi}")
    if args.lora_r < 0:
        raise UsageError(f"--lora-r {args.lora_r}: must be >= 0 (0: full training)")
    if args.sharding_strategy.startswith("hybrid") and args.world_size > args.ranks_per_node \
            and args.world_size % args.ranks_per_node:
        raise UsageError(f"--ranks-per-node {args.ranks_per_node} does not divide --world-size {args.world_size}: "
                         f"{args.sharding_strategy} shards within a node and replicates across whole nodes")
    spec = resolve_planned_model(args.model)
    if spec.max_seq_len is not None and args.seq_len > spec.max_seq_len:
        raise UsageError(f"--seq-len {args.seq_len}: longer than {spec.name}'s {spec.max_seq_len} positions")
    if args.device_memory is not None:
        try:
            parse_size(args.device_memory)
        except ValueError:
            raise UsageError(f"--device-memory {args.device_memory!r}: not a positive memory size (e.g. 80GB, "
                             f"24GiB)") from None


def main(argv: Optional[Sequence[str]], defaults: Any, max_seq_len: int) -> int:
    """Run ``shardwise estimate-memory ARGV``: the plan on stdout; a bad command line or model raises one
    ``UsageError`` naming the option."""
    args = make_parser(defaults).parse_args(argv)
    check_args(args, max_seq_len)
    inputs = PlanInputs(
        model=args.model, world_size=args.world_size, sharding_strategy=args.sharding_strategy,
        mixed_precision=args.mixed_precision, cpu_offload=args.cpu_offload,
        activation_checkpointing=args.activation_checkpointing, batch_size=args.batch_size, seq_len=args.seq_len,
        dtype=args.dtype, ranks_per_node=args.ranks_per_node, device=args.device,
        transformer_layer_cls_to_wrap=_names(args.transformer_layer_cls_to_wrap), lora_r=args.lora_r,
        lora_target_modules=_names(args.lora_target_modules), lora_base_dtype=args.lora_base_dtype,
        load_in_4bit=args.load_in_4bit, bnb_4bit_quant_type=args.bnb_4bit_quant_type)
    cache: dict = {}
    try:
        plan = plan_memory(inputs, _cache=cache)
        if args.device_memory is not None:
            answer(plan, inputs, parse_size(args.device_memory), cache)
    except (ModelError, ValueError, ShardwiseError) as e:  # --lora-r on a GPT preset, a missing wrap class, ...
        raise UsageError(str(e)) from None
    print(json.dumps(asdict(plan), indent=2) if args.json else render(plan))
    return 0


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
        *([f"  {'  of which the 4-bit base':<34}{fmt_bytes(p.quantised_shard_bytes):>14}   (packed + scales, "
           f"1/{p.shard_size} each)",
           f"  {'largest dequantised matrix':<34}{fmt_bytes(p.dequantised_weight_bytes):>14}   (in activations)"]
          if p.quantised_shard_bytes else []),
        *([f"  {'recomputed unit, dequantised':<34}{fmt_bytes(p.recomputed_weight_bytes):>14}   (in activations: "
           f"kept for its backward)"] if p.recomputed_weight_bytes else []),
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
    rows.append(f"  {'total per rank (the larger peak)':<34}{fmt_bytes(p.total_bytes):>14}")
    if p.cpu_offload:  # the shards, gradients and optimizer state live in host memory, not on the device
        rows.append(f"  {'host memory (CPU offload)':<34}{fmt_bytes(p.offload_host_bytes):>14}   "
                    f"(shards, gradients, optimizer state; {fmt_bytes(p.offload_host_bytes * p.world_size)} "
                    f"over all ranks)")
    if p.fits is not None:
        verdict = "fits" if p.fits else "does NOT fit"
        rows.append(f"{verdict} in --device-memory {fmt_bytes(p.device_memory_bytes)}")
        if not p.fits:
            rows.append(f"  more ranks: {p.min_world_size} (--world-size {p.min_world_size}) is the fewest that fit"
                        if p.min_world_size else
                        "  more ranks: no number of ranks fits (activations and gathered units do not shrink "
                        "with more ranks)")
            if p.offload_device_bytes is not None and not p.cpu_offload:
                fit = "fits" if p.offload_device_bytes <= p.device_memory_bytes else "still does NOT fit"
                rows.append(f"  --cpu-offload on {p.world_size} rank(s): {fmt_bytes(p.offload_device_bytes)} per "
                            f"device ({fit}), and {fmt_bytes(p.offload_host_bytes)} of host memory per rank for "
                            f"the shards, gradients and optimizer state "
                            f"({fmt_bytes(p.offload_host_bytes * p.world_size)} over all ranks)")
            rows += ["what would fit:"] + [f"  {s}" for s in p.suggestions] if p.suggestions else \
                ["nothing close fits: try a smaller model or a shorter --seq-len"]
    return "\n".join(rows)
