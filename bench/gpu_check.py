"""GPU check: parity with real NCCL collectives, then step time and peak memory against torch FSDP2.

    torchrun --standalone --nproc-per-node 1 bench/gpu_check.py                  # on a GPU machine
    torchrun --standalone --nproc-per-node 8 bench/gpu_check.py --model gpt-1b
    torchrun --standalone --nproc-per-node 2 bench/gpu_check.py --backend gloo --parity-only   # 2 ranks, 1 GPU
    python bench/gpu_check.py --device cpu --model gpt-tiny --steps 3            # smoke-test the script itself

1. Parity (fp32): a small GPT trained for a few steps with shardwise (full_shard) must match a
   single-process reference fed the same global batch (losses and parameters, 1e-5 relative on GPU where
   matmul reductions are not bit-reproducible across layouts; TF32 is turned off).
2. Speed and memory (bf16 compute, fp32 master and reduce): median step time and peak
   ``torch.cuda.max_memory_allocated`` for shardwise and torch FSDP2 on the same ~1B-parameter GPT,
   same data, one after the other in this process. Printed as a table with ratios.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import shardwise
from shardwise.models import GPT, GPTConfig, Block


def init(device_kind: str, backend: str = "nccl") -> torch.device:
    if "RANK" not in os.environ:  # plain `python bench/gpu_check.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # NCCL refuses two ranks on one GPU; gloo on CUDA tensors still runs the sharded device path
        # (several ranks, real shards, in-band fingerprints) when only one GPU is at hand.
        dist.init_process_group(backend, timeout=timedelta(minutes=5))
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    return torch.device("cpu")


def batch(step: int, rank: int, b: int, t: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (b, t + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)


PARITY_CONFIG = GPTConfig(vocab_size=509, block_size=64, n_layer=3, n_head=4, n_embd=68)


def parity(device: torch.device, steps: int, optimizer=None, **shard_options) -> float:
    """Worst relative error of the global loss (every step) and of every parameter (at the end) against one
    process on the global batch, SGD with momentum; ``optimizer``: the sharded model's, made from it (default:
    torch's SGD)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = PARITY_CONFIG
    torch.manual_seed(0)
    ref = GPT(cfg).to(device)
    model = copy.deepcopy(ref)
    shardwise.shard(model, units={Block}, device=device, **shard_options)
    opt = optimizer(model) if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
    worst = 0.0
    for step in range(steps):
        xs, ys = zip(*(batch(step, r, 4, 64, cfg.vocab_size, device) for r in range(world)))
        loss = model(xs[rank], ys[rank]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(torch.cat(xs), torch.cat(ys)).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst = max(worst, abs(mean.item() / world - ref_loss.item()) / abs(ref_loss.item()))
    full = shardwise.full_state_dict(model)
    if rank == 0:
        for k, v in ref.state_dict().items():
            err = (full[k] - v.cpu()).norm() / (v.norm().cpu() + 1e-12)
            worst = max(worst, err.item())
    return worst


PHASE_PEAKS: dict[str, list[dict[str, float]]] = {"shardwise": [], "fsdp2": []}


class PhaseMemory:
    """Peak allocated GiB within each phase of a step (and what is still live at its end), to show where
    a difference in overall peak comes from."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peaks: dict[str, float] = {"start": torch.cuda.memory_allocated() / 2**30 if self.cuda else 0.0}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def mark(self, phase: str) -> None:
        if self.cuda:
            self.peaks[phase] = torch.cuda.max_memory_allocated() / 2**30
            self.peaks[phase + " end"] = torch.cuda.memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()


def speed(impl: str, device: torch.device, preset: str, b: int, t: int, steps: int) -> tuple[float, float]:
    if device.type == "cuda":
        gc.collect()
        leftover = torch.cuda.memory_allocated()
        # torch FSDP2 leaves its model as cyclic garbage (5.3 GiB at gpt-1b): collect it, or the next run
        # is measured on top of it.
        assert leftover < 2**28, f"{leftover / 2**30:.2f} GiB still allocated from the previous run"
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT.from_preset(preset, block_size=max(t, 128))
    bf16 = torch.bfloat16
    if impl == "shardwise":
        shardwise.shard(model, units={Block}, device=device,
                        mixed_precision=shardwise.MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32))
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for blk in model.blocks:
            fully_shard(blk, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.to_empty(device=device)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank(), b, t, model.config.vocab_size, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        marks = PhaseMemory(device)
        loss = model(x, y).loss
        marks.mark("forward")
        loss.backward()
        marks.mark("backward")
        opt.step()
        marks.mark("step")
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    PHASE_PEAKS[impl].append(marks.peaks)
    peak = max(marks.peaks[p] for p in ("forward", "backward", "step")) if device.type == "cuda" else float("nan")
    # `loss` keeps the autograd graph, and through its hooks the model, alive: drop it too, or the next
    # implementation's run would be measured with this one's parameters still allocated.
    del model, opt, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[1:] if len(times) > 1 else times), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="gpt-1b")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl", help="for --device cuda")
    ap.add_argument("--parity-only", action="store_true")
    args = ap.parse_args()
    device = init(args.device, args.backend)
    rank = dist.get_rank()
    variants = {
        "full_shard": {}, "shard_grad_op": {"strategy": "shard_grad_op"}, "no_shard": {"strategy": "no_shard"},
        "full_shard + CPU offload": {"offload": shardwise.CPUOffload()},
        "full_shard + activation checkpointing": {"activation_checkpointing": True},
    }
    for label, options in variants.items():
        err = parity(device, steps=4, **options)
        if rank == 0:
            print(f"parity (fp32, {label}, world {dist.get_world_size()}, {dist.get_backend()}): "
                  f"worst relative error {err:.2e}", flush=True)
    if args.parity_only:
        dist.destroy_process_group()
        return
    rows: dict[str, list[tuple[float, float]]] = {"shardwise": [], "fsdp2": []}
    for _ in range(args.repeats):
        for impl in rows:
            rows[impl].append(speed(impl, device, args.model, args.batch_size, args.seq_len, args.steps))
    if rank == 0:
        base_t = statistics.median(t for t, _ in rows["fsdp2"])
        base_m = statistics.median(m for _, m in rows["fsdp2"])
        print(f"\n{args.model}, bf16, batch {args.batch_size} x {args.seq_len} per rank, world {dist.get_world_size()}")
        print("| impl | step s (min/median/max) | peak GiB | time vs fsdp2 | memory vs fsdp2 |")
        print("|---|---|---|---|---|")
        for impl, rs in rows.items():
            ts = sorted(t for t, _ in rs)
            m = statistics.median(x for _, x in rs)
            print(f"| {impl} | {ts[0]:.3f} / {statistics.median(ts):.3f} / {ts[-1]:.3f} | {m:.2f} | "
                  f"{statistics.median(ts) / base_t:.2f} | {m / base_m:.2f} |")
        if args.device == "cuda":
            phases = ["start", "forward", "forward end", "backward", "backward end", "step", "step end"]
            print("\nGiB allocated in the last step: live at the start, peak within each phase, live at its end")
            print("| impl | " + " | ".join(phases) + " |")
            print("|---|" + "---|" * len(phases))
            for impl, runs in PHASE_PEAKS.items():
                last = runs[-1]
                print(f"| {impl} | " + " | ".join(f"{last[p]:.2f}" for p in phases) + " |")
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
