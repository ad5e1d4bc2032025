"""CPU offload on one GPU: the largest Llama that trains with offload given this machine's host memory, and
its tokens/s and peak memory under shardwise (``CPUOffload`` + ``offload_optimizer``), torch FSDP2
(``CPUOffloadPolicy``) and DeepSpeed ZeRO-Offload, on the same model, data and batch.

    python bench/gpu_offload.py                        # on a CUDA machine: every implementation, one table
    python bench/gpu_offload.py --model llama-1b --steps 6 --impls shardwise,fsdp2
    python bench/gpu_offload.py --dry-run              # anywhere: the model chosen, each configuration, no run

Each implementation runs in its own child process (``--child IMPL``: a fresh CUDA context, host memory given
back), bf16 compute, fp32 masters and optimizer state on the host, AdamW, clipping at 1.0, a Llama built
from ``transformers.LlamaConfig`` with random weights. The model: ``--model auto`` takes the largest size in
SIZES whose host footprint (fp32 master + fp32 gradient + AdamW's two fp32 moments + a pinned gradient
buffer: 20 bytes per parameter) fits in ``--host-fraction`` of MemAvailable. What the table does not
show: the time to first step (DeepSpeed compiles its CPU Adam), and host memory beyond the peak RSS of
the measured process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = {  # Llama-shaped: hidden, layers, heads, kv heads, intermediate; vocab 32000
    "llama-tiny": (64, 2, 4, 4, 172),
    "llama-1b": (2048, 16, 32, 8, 5632),
    "llama-3b": (3072, 26, 24, 8, 8192),
    "llama-7b": (4096, 32, 32, 32, 11008),
    "llama-13b": (5120, 40, 40, 40, 13824),
    "llama-20b": (6144, 44, 48, 8, 16384),
}
VOCAB = 32000
HOST_BYTES_PER_PARAM = 20
IMPLS = ("shardwise", "fsdp2", "deepspeed")


def llama_config(name: str, seq_len: int):
    from transformers import LlamaConfig

    hidden, layers, heads, kv, inter = SIZES[name]
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=max(seq_len, 128),
                       tie_word_embeddings=False)


def param_count(name: str) -> int:
    hidden, layers, heads, kv, inter = SIZES[name]
    head_dim = hidden // heads
    attn = hidden * (hidden + 2 * kv * head_dim) + hidden * hidden
    return 2 * VOCAB * hidden + layers * (attn + 3 * hidden * inter + 2 * hidden) + hidden


def host_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def choose_model(requested: str, host_fraction: float) -> str:
    if requested != "auto":
        if requested not in SIZES:
            raise SystemExit(f"--model {requested!r}: valid: auto, {', '.join(SIZES)}")
        return requested
    budget = host_available() * host_fraction
    fitting = [n for n in SIZES if param_count(n) * HOST_BYTES_PER_PARAM <= budget]
    if not fitting:
        raise SystemExit(f"no size in SIZES fits {budget / 2**30:.0f} GiB of host memory")
    return max(fitting, key=param_count)


def deepspeed_config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": args.deepspeed_stage,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            **({"offload_param": {"device": "cpu", "pin_memory": True}} if args.deepspeed_stage == 3 else {}),
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
    }


def plan(args, model: str) -> dict:
    """What each child will build: printed by --dry-run, passed to the children."""
    n = param_count(model)
    config = llama_config(model, args.seq_len)  # built here too, so a dry run catches a bad configuration
    return {
        "model": model, "parameters": n, "config": {k: getattr(config, k) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")}, "host_gib_needed": round(n * HOST_BYTES_PER_PARAM / 2**30, 1),
        "batch": [args.batch_size, args.seq_len], "steps": args.steps,
        "shardwise": "shard(model, units='auto', offload=CPUOffload(), mixed_precision=bf16/fp32); "
                     "offload_optimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, max_grad_norm=1.0)",
        "fsdp2": "fully_shard(each decoder layer, then the model, offload_policy=CPUOffloadPolicy(pin_memory=True), "
                 "mp_policy=bf16/fp32); torch.optim.AdamW(lr=1e-4, fused=True) on the CPU parameters; "
                 "torch.nn.utils.clip_grad_norm_(1.0)",
        "deepspeed": deepspeed_config(args),
    }


def build(model_name: str, seq_len: int):
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(llama_config(model_name, seq_len))


def run_child(impl: str, args) -> dict:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29541"))
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = build(args.model, args.seq_len)
    bf16, fp32 = torch.bfloat16, torch.float32
    clip = None
    if impl == "shardwise":
        import shardwise

        shardwise.shard(model, units="auto", device=device, offload=shardwise.CPUOffload(),
                        mixed_precision=shardwise.MixedPrecision(param_dtype=bf16, reduce_dtype=fp32))
        opt = shardwise.offload_optimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, max_grad_norm=1.0)
        engine = model
    elif impl == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        policy = CPUOffloadPolicy(pin_memory=True)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, offload_policy=policy)
        fully_shard(model, mp_policy=mp, offload_policy=policy)
        model.to_empty(device="cpu")
        model.apply(model._init_weights)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
        engine = model
    else:
        import deepspeed

        model.to_empty(device="cpu")
        model.apply(model._init_weights)
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                 config=deepspeed_config(args))
    torch.cuda.reset_peak_memory_stats()
    times = []
    g = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB, (args.batch_size, args.seq_len), generator=g).to(device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        if impl == "deepspeed":
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            if clip is not None:
                clip()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    import resource

    warm = times[1:] if len(times) > 2 else times
    return {"impl": impl, "step_s": [min(warm), statistics.median(warm), max(warm)],
            "tokens_per_s": args.batch_size * args.seq_len / statistics.median(warm),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "loss": float(loss)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="auto", help=f"auto or one of {', '.join(SIZES)}")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--host-fraction", type=float, default=0.7, help="of MemAvailable the model may take")
    ap.add_argument("--deepspeed-stage", type=int, choices=[2, 3], default=2,
                    help="2: ZeRO-Offload (optimizer on the CPU); 3: parameters offloaded too (ZeRO-Infinity, CPU)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the configurations; run nothing")
    ap.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    impls = [s for s in args.impls.split(",") if s]
    for impl in impls:
        if impl not in IMPLS:
            raise SystemExit(f"--impls: {impl!r} is not one of {', '.join(IMPLS)}")
    args.model = choose_model(args.model, args.host_fraction)
    if args.dry_run:
        print(json.dumps(plan(args, args.model), indent=2))
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_offload.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "--dry-run prints the plan anywhere")
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, args)), flush=True)
        return
    rows = []
    for impl in impls:
        cmd = [sys.executable, __file__, "--child", impl, "--model", args.model, "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--deepspeed-stage", str(args.deepspeed_stage)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append(f"| {impl} | failed: {last[:120]} | | | |")
            continue
        r = json.loads(line[len("RESULT "):])
        lo, med, hi = r["step_s"]
        rows.append(f"| {impl} | {r['tokens_per_s']:,.0f} | {lo:.2f} / {med:.2f} / {hi:.2f} | "
                    f"{r['peak_gpu_gib']:.1f} | {r['peak_host_rss_gib']:.1f} |")
    print(f"{args.model} ({param_count(args.model) / 1e9:.2f}B parameters), batch {args.batch_size} x {args.seq_len}, "
          f"{args.steps} steps, bf16 compute, AdamW on the CPU, clip 1.0")
    print("| implementation | tokens/s | step s (min / median / max) | peak GPU GiB | peak host RSS GiB |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
