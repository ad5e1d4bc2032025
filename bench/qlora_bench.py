"""QLoRA (4-bit NF4 base) against LoRA on a bf16 base, both sharded by shardwise: step time, per-rank peak
memory beside the planner's figure, and the bytes each rank receives through weight all-gathers per step.

    python bench/qlora_bench.py --workdir runs/qlora-bench            # ~1.1 GB bf16 Llama, world size 2

Both runs load the same bf16 Hugging Face directory (written once into --workdir: a random Llama of the
given shape, >= 1 GB on disk by default), build the model on meta, wrap every projection with LoRA r=16,
shard with bf16 mixed precision and activation checkpointing, and train with AdamW on random tokens. The
QLoRA run quantises the base on load (each rank only its bytes). One process per rank (gloo, one thread
each, as in compare_cpu.py).

Memory: per rank, the peak RSS (VmHWM) of each phase of a timed step -- forward, backward, optimizer step,
reset between them through /proc/self/clear_refs -- less the RSS once the model is built on meta (so the
libraries it imports, ~0.2 GB, are not counted and neither is the load's own peak), against ``estimate-memory
--device cpu`` for the same configuration. The planner counts live bytes; run with
``MALLOC_MMAP_THRESHOLD_=65536`` to make RSS track them (glibc then returns every freed block of 64 KiB or
more at once), without it RSS also holds what glibc keeps of freed blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config_dict(args) -> dict:
    heads = args.hidden // 128
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=args.vocab,
                hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, torch_dtype="bfloat16")


def make_model_dir(args) -> Path:
    """A random bf16 Llama of the requested shape, saved as Hugging Face saves it (once per shape)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = Path(args.workdir) / f"llama-h{args.hidden}-i{args.intermediate}-l{args.layers}-v{args.vocab}"
    if (d / "model.safetensors").exists():
        return d
    cfg = config_dict(args)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(d)
    return d


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """VmHWM: the most this process has had resident since it started or since ``reset_peak_rss``."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> None:
    """Start VmHWM afresh from the current RSS (Linux >= 4.0: "5" to clear_refs), so a step's peak is not
    the load's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def quantised_bytes(model) -> tuple[int, int]:
    """(this rank's uint8 shard bytes: the 4-bit base's packed data and scales, padding included; every
    QuantLinear's stored bytes in all, unsharded)."""
    from shardwise.engine.core.runtime import STATE_ATTR
    from shardwise.quant.linear import QuantLinear

    runtime = getattr(model, STATE_ATTR)
    mine = sum(g.shard.numel() for u in runtime.units for g in u.flat_groups if g.shard.dtype == torch.uint8)
    every = sum(sum(m.layout.nbytes().values()) for m in model.modules() if isinstance(m, QuantLinear))
    return mine, every


def record_peak(phases: dict, name: str, baseline: int, timed: bool) -> None:
    """The peak RSS since the last reset (less ``baseline``) as ``phases[name]`` (the largest over the timed
    steps), then reset, so each phase of a step reports its own peak."""
    if timed:
        phases[name] = max(phases.get(name, 0), peak_rss() - baseline)
    reset_peak_rss()


def count_gathers(counts: dict):
    """Count the bytes every all-gather delivers to this rank, by dtype (patches the engine's collectives)."""
    from shardwise.engine.base import collectives

    original = collectives.all_gather_into

    def counted(output, shard, *a, header=None, **kw):
        n = output.numel() - (header.numel() if header is not None else 0)
        key = str(output.dtype).replace("torch.", "")
        counts[key] = counts.get(key, 0) + n * output.element_size()
        return original(output, shard, *a, header=header, **kw)

    collectives.all_gather_into = counted


def worker(rank: int, world: int, init: str, model_dir: str, mode: str, args, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import shardwise
    from shardwise.hf.lora import LoraSettings, apply_lora, lora_param_init_fn, pretrained_name

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    q = shardwise.QuantSettings("nf4", True) if mode == "qlora" else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    model.config.use_cache = False
    if q is not None:
        shardwise.quantize_model(model, q)
    model = apply_lora(model, LoraSettings(r=16, alpha=32, target_modules=TARGETS, base_dtype=torch.bfloat16))
    for p in model.parameters():  # adapters: fp32 masters (peft made them in the meta model's bf16)
        if p.requires_grad:
            p.data = p.data.float()
    # The baseline: the model built on meta (no tensor data yet), so every library it needs (transformers'
    # modelling code, peft: ~0.2 GB of RSS) is already loaded and not counted as the model's memory.
    baseline = current_rss()
    mp = shardwise.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shardwise.shard(model, mixed_precision=mp, activation_checkpointing=True,
                    param_init_fn=lora_param_init_fn(model, shardwise.skip_weight_init(model)))
    rss_after_shard = current_rss()
    t0 = time.perf_counter()
    shardwise.load_pretrained(model, model_dir, rename=pretrained_name, quantization=q)
    load_s = time.perf_counter() - t0
    phases = {"built_and_sharded": rss_after_shard - baseline, "loaded": current_rss() - baseline,
              "load_peak": peak_rss() - baseline}
    phases["base_bytes"], phases["all_base_bytes"] = quantised_bytes(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    counts: dict = {}
    times = []
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
        if step == args.warmup:
            count_gathers(counts)
            phases["after_warmup"] = current_rss() - baseline
        timed_step = step >= args.warmup
        t = time.perf_counter()
        reset_peak_rss()
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        record_peak(phases, "forward_peak", baseline, timed_step)
        loss.backward()
        record_peak(phases, "backward_peak", baseline, timed_step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        record_peak(phases, "optimizer_peak", baseline, timed_step)
        times.append(time.perf_counter() - t)
    phases["step_peak"] = max(phases["forward_peak"], phases["backward_peak"], phases["optimizer_peak"])
    timed = times[args.warmup:]
    report = {"mode": mode, "rank": rank, "step_s": sorted(timed)[len(timed) // 2], "load_s": load_s,
              "peak_delta": phases["step_peak"], "phases": phases, "gathered_per_step": {k: v / len(timed) for k, v in counts.items()},
              "loss": loss.item()}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def planner_total(model_dir: Path, mode: str, args) -> int:
    from shardwise.planner.memory import PlanInputs, plan_memory

    inputs = PlanInputs(str(model_dir / "config.json"), args.world_size, mixed_precision="bf16",
                        activation_checkpointing=True, batch_size=args.batch, seq_len=args.seq_len, dtype="bf16",
                        device="cpu", lora_r=16, lora_target_modules=TARGETS, lora_base_dtype="bf16",
                        load_in_4bit=mode == "qlora")
    return plan_memory(inputs).total_bytes


def run(mode: str, model_dir: Path, args) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report")
        mp.start_processes(worker, args=(args.world_size, os.path.join(tmp, "rdv"), str(model_dir), mode, args, out),
                           nprocs=args.world_size, start_method="spawn", join=True)
        return [json.load(open(f"{out}.rank{r}.json")) for r in range(args.world_size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="runs/qlora-bench")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--modes", default="qlora,lora-bf16")
    args = ap.parse_args()
    model_dir = make_model_dir(args)
    size = (model_dir / "model.safetensors").stat().st_size
    print(f"model {model_dir.name}: {size / 1e9:.2f} GB bf16 on disk; world size {args.world_size}, batch "
          f"{args.batch} x seq {args.seq_len}, LoRA r=16 on {','.join(TARGETS)}, bf16 compute, act. checkpointing")
    rows = []
    for mode in args.modes.split(","):
        reports = run(mode, model_dir, args)
        planned = planner_total(model_dir, mode, args)
        peak = max(r["peak_delta"] for r in reports)
        for r in reports:
            print(f"{mode} rank {r['rank']}: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in r["phases"].items()),
                  flush=True)
        gathered = reports[0]["gathered_per_step"]
        rows.append((mode, max(r["step_s"] for r in reports), max(r["load_s"] for r in reports), peak, planned,
                     gathered))
    print("| run | step s (median, slowest rank) | load s | step peak per rank GB (VmHWM) | planner GB | "
          "measured / planner | all-gathered per rank per step |")
    print("|---|---|---|---|---|---|---|")
    for mode, step, load, peak, planned, gathered in rows:
        wire = ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in sorted(gathered.items()))
        print(f"| {mode} | {step:.2f} | {load:.1f} | {peak / 1e9:.3f} | {planned / 1e9:.3f} | {peak / planned:.2f} | {wire} |")
    if len(rows) == 2:
        total = [sum(r[5].values()) for r in rows]
        print(f"weight all-gather bytes, {rows[0][0]} / {rows[1][0]}: {total[0] / total[1]:.3f}")


if __name__ == "__main__":
    main()
