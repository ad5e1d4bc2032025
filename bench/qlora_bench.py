"""QLoRA (4-bit NF4 base) against LoRA on a bf16 base, both sharded by shardwise: step time (wall and CPU
seconds per rank), per-rank peak memory beside the planner's figure, dequantisations per 4-bit weight per
step, and the bytes each rank receives through weight all-gathers per step.

    python bench/qlora_bench.py --workdir runs/qlora-bench            # ~1.1 GB bf16 Llama, world size 2
    python bench/qlora_bench.py --workdir runs/qlora-bench --hidden 1024 --layers 4 --repeats 3 \\
        --code before=/path/to/old/checkout,after=.                     # two checkouts, interleaved
    python bench/qlora_bench.py --device cuda --world-size 1 --hidden 2048 --heads 16 --kv-heads 8 --layers 8 \\
        --batch 4 --seq-len 1024 --steps 6 --repeats 2                  # one GPU: step time and peak memory

CPU (default): both runs load the same bf16 Hugging Face directory (written once into --workdir: a random
Llama of the given shape), build the model on meta, wrap every projection with LoRA r=16, shard with the units
``shardwise train`` gives it in that checkout (``trainer_units``), bf16 mixed precision and activation
checkpointing, and train with AdamW on random tokens. The QLoRA run quantises the base on load (each rank only
its bytes). One process per rank (gloo, one thread each, as in
compare_cpu.py). Runs alternate (for each repeat: every checkout, every mode), each in fresh processes.

CUDA (``--device cuda``, world size 1, NCCL): the model is built on the CPU with random bf16 weights (the
QLoRA run quantises them there), then sharded onto the GPU; peak memory is ``torch.cuda.max_memory_allocated``
(and reserved) over the timed steps, step time is wall time between device synchronisations.

Memory on CPU: per rank, the peak RSS (VmHWM) of each phase of a timed step -- forward, backward, optimizer
step, reset between them through /proc/self/clear_refs -- less the RSS once the model is built on meta (so the
libraries it imports, ~0.2 GB, are not counted and neither is the load's own peak), against ``estimate-memory
--device cpu`` for the same configuration (the measured checkout's planner). The planner counts live bytes;
run with ``MALLOC_MMAP_THRESHOLD_=65536`` to make RSS track them (glibc then returns every freed block of 64
KiB or more at once), without it RSS also holds what glibc keeps of freed blocks.

Dequantisations: calls of ``Layout4bit.dequantize`` during the timed steps (counted by wrapping it, so any
checkout is measured alike) per 4-bit matrix per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from proc_rss import current_rss, peak_rss, reset_peak_rss  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODES = ("qlora", "lora-bf16")


def config_dict(args) -> dict:
    heads = args.heads or args.hidden // 128
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=args.vocab,
                hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=heads, num_key_value_heads=args.kv_heads or heads, max_position_embeddings=4096,
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, torch_dtype="bfloat16")


def random_llama(args):
    """A random bf16 Llama of the requested shape on the CPU (seeded: every run gets the same weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = config_dict(args)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


def make_model_dir(args) -> Path:
    """``random_llama`` saved as Hugging Face saves it (once per shape)."""
    heads = f"-a{args.heads}-kv{args.kv_heads}" if args.heads or args.kv_heads else ""
    d = Path(args.workdir) / f"llama-h{args.hidden}-i{args.intermediate}-l{args.layers}-v{args.vocab}{heads}"
    if not (d / "model.safetensors").exists():
        random_llama(args).save_pretrained(d)
    return d


class Memory:
    """Per-phase peaks of a timed step: RSS on the CPU, the caching allocator's figures on CUDA."""

    def __init__(self, device: torch.device, baseline: int):
        self.device, self.baseline, self.phases = device, baseline, {}

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()

    def record(self, name: str, timed: bool) -> None:
        """The peak since the last reset as ``phases[name]`` (the largest over the timed steps), then reset."""
        if timed:
            if self.device.type == "cuda":
                figures = {name: torch.cuda.max_memory_allocated(self.device),
                           f"{name}_reserved": torch.cuda.max_memory_reserved(self.device)}
            else:
                figures = {name: peak_rss() - self.baseline}
            for k, v in figures.items():
                self.phases[k] = max(self.phases.get(k, 0), v)
        self.reset()


def quantised_bytes(model) -> tuple[int, int, int]:
    """(this rank's uint8 shard bytes: the 4-bit base's packed data and scales; every 4-bit module's stored
    bytes in all, unsharded; how many 4-bit matrices the model has)."""
    import shardwise
    from shardwise.quant.linear import QuantLinear

    mine = sum(shardwise.param_info(p).local_numel for p in model.parameters() if p.dtype == torch.uint8)
    quantised = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return mine, sum(sum(m.layout.nbytes().values()) for m in quantised), len(quantised)


def engine_collectives():
    """The engine's collectives module: ``engine/collectives.py``, or ``engine/base/collectives.py`` in
    checkouts after the engine was split into layers (so one script measures both)."""
    import importlib

    try:
        return importlib.import_module("shardwise.engine.base.collectives")
    except ModuleNotFoundError:
        return importlib.import_module("shardwise.engine.collectives")


def count_gathers(counts: dict):
    """Count the bytes every all-gather delivers to this rank, by dtype (patches the engine's collectives)."""
    collectives = engine_collectives()
    original = collectives.all_gather_into

    def counted(output, shard, *a, **kw):
        header = kw.get("header")  # (checkouts before issue #24 put an in-band header in the gather)
        n = output.numel() - (header.numel() if header is not None else 0)
        key = str(output.dtype).replace("torch.", "")
        counts[key] = counts.get(key, 0) + n * output.element_size()
        return original(output, shard, *a, **kw)

    collectives.all_gather_into = counted


def count_dequantizations(counter: list) -> None:
    """``counter[0]`` += 1 at every ``Layout4bit.dequantize`` (any checkout has it)."""
    from shardwise.quant.format import Layout4bit

    original = Layout4bit.dequantize

    def counted(self, *a, **kw):
        counter[0] += 1
        return original(self, *a, **kw)

    Layout4bit.dequantize = counted


def trainer_units(model, args):
    """The units ``shardwise train`` gives this model in the checkout being measured (its ``ModelSpec.units``):
    the decoder layers before issue #26's last change, "auto+head" after (an untied embedding and head each a
    unit); what its planner plans for."""
    from shardwise.hf.model_spec import resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config_dict(args)))
        return resolve_model(str(path)).units(model, "transformer_based_wrap", [])


def build(mode: str, args, model_dir: str, device: torch.device):
    """The LoRA model of ``mode``, sharded onto ``device`` (bf16 compute, activation checkpointing), its
    weights loaded; and (load seconds, RSS once built on meta)."""
    import shardwise
    from shardwise.hf.lora import LoraSettings, apply_lora, lora_param_init_fn, pretrained_name

    q = shardwise.QuantSettings("nf4", True) if mode == "qlora" else None
    if device.type == "cpu":
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    else:
        model = random_llama(args)  # real weights on the CPU; the QLoRA run quantises them there
    model.config.use_cache = False
    if q is not None:
        shardwise.quantize_model(model, q)
    model = apply_lora(model, LoraSettings(r=16, alpha=32, target_modules=TARGETS, base_dtype=torch.bfloat16))
    for p in model.parameters():  # adapters: fp32 masters (peft made them in the model's bf16)
        if p.requires_grad:
            p.data = p.data.float()
    # The baseline: the model built on meta (no tensor data yet), so every library it needs (transformers'
    # modelling code, peft: ~0.2 GB of RSS) is already loaded and not counted as the model's memory.
    baseline = current_rss()
    mp = shardwise.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = trainer_units(model, args)
    if device.type == "cpu":
        shardwise.shard(model, units=units, mixed_precision=mp, activation_checkpointing=True,
                        param_init_fn=lora_param_init_fn(model, shardwise.skip_weight_init(model)))
        t0 = time.perf_counter()
        shardwise.load_pretrained(model, model_dir, rename=pretrained_name, quantization=q)
        return model, time.perf_counter() - t0, baseline
    shardwise.shard(model, units=units, device=device, mixed_precision=mp, activation_checkpointing=True)
    return model, 0.0, baseline


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, world: int, init: str, model_dir: str, mode: str, code: str, args, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world))
    if args.device == "cpu":
        torch.set_num_threads(1)
    sys.path.insert(0, code)  # the checkout to measure
    import torch.distributed as dist

    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=1800))
    import shardwise

    model, load_s, baseline = build(mode, args, model_dir, device)
    memory = Memory(device, baseline)
    phases = memory.phases
    if device.type == "cpu":
        phases.update(loaded=current_rss() - baseline, load_peak=peak_rss() - baseline)
    phases["base_bytes"], phases["all_base_bytes"], matrices = quantised_bytes(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=device.type == "cuda")
    g = torch.Generator().manual_seed(rank)
    counts: dict = {}
    dequantized = [0]
    wall, cpu = [], []
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g).to(device)
        if step == args.warmup:
            count_gathers(counts)
            count_dequantizations(dequantized)
        timed = step >= args.warmup
        sync(device)
        t, c = time.perf_counter(), time.process_time()
        memory.reset()
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        memory.record("forward_peak", timed)
        loss.backward()
        memory.record("backward_peak", timed)
        opt.step()
        opt.zero_grad(set_to_none=True)
        memory.record("optimizer_peak", timed)
        loss_value = loss.item()  # synchronises with the device
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    phases["step_peak"] = max(phases["forward_peak"], phases["backward_peak"], phases["optimizer_peak"])
    wall, cpu = wall[args.warmup:], cpu[args.warmup:]
    report = {"mode": mode, "rank": rank, "step_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
              "load_s": load_s, "peak": phases["step_peak"], "phases": phases,
              "gathered_per_step": {k: v / len(wall) for k, v in counts.items()},
              "dequant_per_weight_step": dequantized[0] / len(wall) / matrices if matrices else 0.0,
              "loss": loss_value}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def planner_total(model_dir: Path, mode: str, args, code: str) -> int:
    """``code``'s planner (in a fresh process): its per-rank total for this run."""
    import subprocess

    script = f"""
import sys
sys.path.insert(0, {code!r})
from shardwise.planner.memory import PlanInputs, plan_memory
inputs = PlanInputs({str(model_dir / "config.json")!r}, {args.world_size}, mixed_precision="bf16",
                    activation_checkpointing=True, batch_size={args.batch}, seq_len={args.seq_len}, dtype="bf16",
                    device={args.device!r}, lora_r=16, lora_target_modules={TARGETS!r}, lora_base_dtype="bf16",
                    load_in_4bit={mode == "qlora"})
print(plan_memory(inputs).total_bytes)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return int(out.stdout.strip().splitlines()[-1])


def run(mode: str, code: str, model_dir: Path, args) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report")
        mp.start_processes(worker, args=(args.world_size, os.path.join(tmp, "rdv"), str(model_dir), mode, code, args,
                                         out), nprocs=args.world_size, start_method="spawn", join=True)
        return [json.load(open(f"{out}.rank{r}.json")) for r in range(args.world_size)]


def time_dequantize(code: str, shape: tuple[int, int], device: str, repeats: int = 20) -> dict:
    """One ``[out, in]`` bf16 matrix dequantised from its 4-bit bytes on ``device`` by ``code``'s shardwise
    (in a fresh process): milliseconds per matrix, median of ``repeats`` warm calls, wall and CPU."""
    import subprocess

    script = f"""
import json, statistics, sys, time, torch
sys.path.insert(0, {code!r})
torch.set_num_threads(1)
from shardwise.quant.linear import QuantLinear
device = torch.device({device!r})
torch.manual_seed(0)
linear = torch.nn.Linear({shape[1]}, {shape[0]}, bias=False, dtype=torch.bfloat16)
torch.nn.init.normal_(linear.weight, 0, 0.02)
q = QuantLinear.from_linear(linear)
stored = {{k: v.to(device) for k, v in q.stored().items()}}
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
q.layout.dequantize(stored, torch.bfloat16); sync()
wall, cpu = [], []
for _ in range({repeats}):
    t, c = time.perf_counter(), time.process_time()
    q.layout.dequantize(stored, torch.bfloat16); sync()
    wall.append(time.perf_counter() - t); cpu.append(time.process_time() - c)
print(json.dumps({{"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * statistics.median(cpu)}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """min / median / max."""
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="runs/qlora-bench")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=0, help="attention heads (default: hidden / 128)")
    ap.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: as many as heads)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="alternated runs of every checkout and mode")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--code", default=f"this={REPO_ROOT}",
                    help="LABEL=CHECKOUT[,LABEL=CHECKOUT...]: the shardwise checkouts to measure, alternated")
    ap.add_argument("--dequant-shape", default="2048x2048",
                    help="OUTxIN: first time one matrix's dequantisation alone ('' to skip)")
    ap.add_argument("--json", help="write every run's per-rank reports here")
    args = ap.parse_args()
    if args.device == "cuda" and args.world_size != 1:
        ap.error("--device cuda runs at --world-size 1 (one GPU)")
    codes = [(label, str(Path(path).resolve())) for label, path in (c.split("=", 1) for c in args.code.split(","))]
    modes = args.modes.split(",")
    model_dir = make_model_dir(args) if args.device == "cpu" else Path(args.workdir) / "in-memory"
    print(f"Llama h{args.hidden} i{args.intermediate} l{args.layers} v{args.vocab} on {args.device}; world size "
          f"{args.world_size}, batch {args.batch} x seq {args.seq_len}, LoRA r=16 on {','.join(TARGETS)}, bf16 compute, "
          f"activation checkpointing; {args.warmup} warm-up + {args.steps} timed steps, {args.repeats} repeat(s)",
          flush=True)
    if args.dequant_shape:
        shape = tuple(int(n) for n in args.dequant_shape.split("x"))
        for repeat in range(args.repeats):
            for label, path in codes:
                t = time_dequantize(path, shape, args.device)
                print(f"dequantise one {list(shape)} bf16 matrix on {args.device}, {label}: {t['wall_ms']:.2f} ms "
                      f"({t['cpu_ms']:.2f} CPU ms), load {os.getloadavg()[0]:.1f}", flush=True)
    runs = []  # (repeat, code label, mode, load average at start, per-rank reports)
    for repeat in range(args.repeats):
        for label, path in codes:
            for mode in modes:
                load = os.getloadavg()[0]
                reports = run(mode, path, model_dir, args)
                runs.append((repeat, label, mode, load, reports))
                step, cpu = max(r["step_s"] for r in reports), max(r["cpu_s"] for r in reports)
                print(f"repeat {repeat} {label} {mode}: load {load:.1f}, step {step:.3f} s, cpu {cpu:.3f} s/rank, peak "
                      f"{max(r['peak'] for r in reports) / 1e9:.3f} GB, dequantisations per weight per step "
                      f"{reports[0]['dequant_per_weight_step']:.2f}, loss {reports[0]['loss']:.4f}", flush=True)
                for r in reports:
                    print("    rank {}: ".format(r["rank"]) + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in r["phases"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    unit = "GB (max over ranks; RSS)" if args.device == "cpu" else "GiB (max_memory_allocated)"
    scale = 1e9 if args.device == "cpu" else 2**30
    print(f"\n| checkout | run | step s (slowest rank's median) min / median / max | CPU s per step per rank | peak "
          f"{unit} | planner | dequantisations per weight per step | all-gathered per rank per step | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, path in codes:
        for mode in modes:
            mine = [rs for _, lb, m, _, rs in runs if lb == label and m == mode]
            loads = [ld for _, lb, m, ld, _ in runs if lb == label and m == mode]
            planned = planner_total(model_dir, mode, args, path) if args.device == "cpu" else None
            gathered = ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in sorted(mine[0][0]["gathered_per_step"].items()))
            print(f"| {label} | {mode} | {spread([max(r['step_s'] for r in rs) for rs in mine], '{:.3f}')} | "
                  f"{spread([max(r['cpu_s'] for r in rs) for rs in mine], '{:.3f}')} | "
                  f"{spread([max(r['peak'] for r in rs) / scale for rs in mine], '{:.3f}')} | "
                  f"{'-' if planned is None else f'{planned / 1e9:.3f}'} | {mine[0][0]['dequant_per_weight_step']:.2f} | "
                  f"{gathered} | {spread(loads, '{:.1f}')} |")
    if set(MODES) <= set(modes):
        print("\nqlora / lora-bf16, pairs from the same repeat and checkout:")
        print("| checkout | step time (wall) min / median / max | CPU s per step | peak memory |")
        print("|---|---|---|---|")
        for label, _ in codes:
            by = {(rep, m): rs for rep, lb, m, _, rs in runs if lb == label}
            ratios = {k: [] for k in ("step_s", "cpu_s", "peak")}
            for rep in range(args.repeats):
                q, b = by[(rep, "qlora")], by[(rep, "lora-bf16")]
                for k in ratios:
                    ratios[k].append(max(r[k] for r in q) / max(r[k] for r in b))
            print(f"| {label} | {spread(ratios['step_s'])} | {spread(ratios['cpu_s'])} | {spread(ratios['peak'])} |")


if __name__ == "__main__":
    main()
