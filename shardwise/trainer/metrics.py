"""What the user sees while training: a progress bar on rank 0, one line every ``log_every`` steps, and
``metrics.jsonl`` (one JSON object per logged step) in the run directory.

The line follows torchtitan's::

    step 120 | loss 2.31 | grad_norm 0.84 | tok/s 5,210 | mfu 1.2% | mem 1.41 GiB (max over ranks)

``loss`` is the mean over ranks and over the steps since the last line; ``tok/s`` counts every rank's
tokens; ``mfu`` is per rank (FLOPs per token x tokens/s per rank / peak FLOP/s per rank); ``mem`` is
the peak over ranks of each process's peak resident memory on CPU, or of peak allocated memory on CUDA.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardwise.engine.checks import agree

GIB = 1024**3

# Dense bf16 peak TFLOP/s of common accelerators (fp32 runs are judged against the same figure, as
# torchtitan does). Unknown GPUs get 100; CPUs get cpu_peak_tflops_per_thread().
_GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def cpu_peak_tflops_per_thread() -> float:
    """Nominal fp32 peak of one core: clock x FLOP/cycle of two FMA units (AVX-512: 64, AVX2: 32, else 8),
    read from /proc/cpuinfo; 0.1 when it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read(200_000)
    except OSError:
        return 0.1
    flops_per_cycle = 64 if " avx512f" in info else 32 if " avx2" in info else 8
    for line in info.splitlines():
        if line.startswith("cpu MHz"):
            return float(line.split(":")[1]) * 1e6 * flops_per_cycle / 1e12
    return 0.1


def peak_tflops_per_rank(device: torch.device, threads: int, configured: float = 0.0) -> float:
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in _GPU_PEAK_TFLOPS.items():
            if key in name:
                return tf
        return 100.0
    return cpu_peak_tflops_per_thread() * max(1, threads)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: peak allocated on CUDA, peak resident set (VmHWM) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def format_line(rec: dict[str, Any]) -> str:
    parts = [f"step {rec['step']}", f"loss {rec['loss']:.4f}"]
    if rec.get("val_loss") is not None:
        parts.append(f"val_loss {rec['val_loss']:.4f}")
    parts += [f"grad_norm {rec['grad_norm']:.2f}", f"lr {rec['lr']:.2e}", f"tok/s {rec['tok_per_s']:,.0f}",
              f"mfu {rec['mfu_pct']:.1f}%", f"mem {rec['mem_gib']:.2f} GiB (max over ranks)"]
    return " | ".join(parts)


class MetricsLogger:
    """Accumulates per-step numbers on every rank; ``log`` reduces them over ranks (a collective, so every
    rank calls it at the same steps) and rank 0 prints and appends to metrics.jsonl."""

    def __init__(self, run_dir: str, *, total_steps: int, start_step: int, tokens_per_step: int,
                 flops_per_token: float, peak_tflops: float, device: torch.device, progress: bool,
                 fresh: bool):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = device
        self.tokens_per_step = tokens_per_step  # global: all ranks, all micro-batches
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_tflops * 1e12
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if self.rank == 0 and fresh and os.path.exists(self.path):
            os.remove(self.path)  # a fresh run in a reused directory starts a fresh file
        self._loss_sum = 0.0
        self._loss_count = 0
        self._steps = 0
        self._t0 = time.perf_counter()
        self.bar = None
        if self.rank == 0 and progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, smoothing=0.1)

    def add_step(self, loss: float) -> None:
        self._loss_sum += loss
        self._loss_count += 1
        self._steps += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    def write(self, text: str) -> None:
        """Print on rank 0 without tearing the progress bar."""
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text)
        sys.stdout.flush()

    def _reduce(self, values: list[float], op) -> list[float]:
        # Control traffic: host numbers on shardwise's control group, no device tensor (engine/base/device.py).
        return agree.all_reduce_host(values, op, what="the metrics' reduction over ranks")

    def log(self, step: int, *, grad_norm: float, lr: float, val_loss: Optional[float] = None) -> Optional[dict]:
        """Reduce and emit one record (collective). Returns the record on rank 0."""
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        loss_sum, count = self._reduce([self._loss_sum, float(self._loss_count)], dist.ReduceOp.SUM)
        (mem,) = self._reduce([float(peak_memory_bytes(self.device))], dist.ReduceOp.MAX)
        tok_per_s = self.tokens_per_step * self._steps / elapsed
        rec = {
            "step": step,
            "loss": loss_sum / max(count, 1.0),
            "grad_norm": grad_norm,
            "lr": lr,
            "tok_per_s": tok_per_s,
            "mfu_pct": 100.0 * self.flops_per_token * tok_per_s / self.world / self.peak_flops if self.peak_flops else 0.0,
            "mem_gib": mem / GIB,
            "time": time.time(),
        }
        if val_loss is not None:
            rec["val_loss"] = val_loss
        self._loss_sum, self._loss_count, self._steps = 0.0, 0, 0
        self._t0 = time.perf_counter()
        if self.rank != 0:
            return None
        self.write(format_line(rec))
        self.append(rec)
        return rec

    def append(self, rec: dict) -> None:
        """Add one record to metrics.jsonl (rank 0)."""
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
