"""Compare shardwise with torch FSDP2, FSDP1, DDP and DeepSpeed ZeRO-3 on CPU (gloo).

    python bench/compare_cpu.py --model gpt-170m --world-size 2 --steps 6 --warmup 2 --repeats 3 \
        --impls shardwise,fsdp2,fsdp1,ddp,deepspeed

Every run trains the same GPT (same seed, hence the same initial weights) on the same synthetic tokens with
AdamW, one sharding unit per ``Block``, one CPU thread per rank. Each run gets its own fresh processes, so
peak RSS is not polluted by an earlier implementation, and runs are interleaved across repeats (A, B, C,
A, B, C, ...) so machine drift hits every implementation alike. A run that fails, times out or is killed
for memory is reported in the table instead of stopping the benchmark. See bench/README.md.

The same file is both the driver (default) and the per-rank worker (``--worker``, internal).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel

REPO_ROOT = Path(__file__).resolve().parent.parent
# Benchmark the checkout this script lives in, not whatever shardwise happens to be installed; a worker of a
# run with --code imports shardwise from the checkout the driver names.
CODE_ENV = "SHARDWISE_BENCH_CHECKOUT"
sys.path.insert(0, os.environ.get(CODE_ENV, str(REPO_ROOT)))

from shardwise.models import GPT, PRESETS, Block, GPTConfig  # noqa: E402  (needs the sys.path line above)

ALL_IMPLS = ("shardwise", "fsdp2", "fsdp1", "ddp", "deepspeed")
# Ablations of shardwise, not run by default: the collective fingerprint check off, and gloo's own
# all-gather / reduce-scatter instead of the all-reduce substitutes (see shardwise/collectives.py).
ABLATIONS = ("shardwise-nocheck", "shardwise-nativecoll", "shardwise-nativecoll-nocheck")
# shardwise's other strategies (full parameters kept across steps: ZeRO-2 and ZeRO-1), not run by default.
STRATEGY_ROWS = ("shardwise-zero2", "shardwise-zero1")
BASELINE_IMPL = "fsdp2"  # ratios in the table are relative to this one

# Per-preset (sequence length, per-rank batch): the shapes measured in shared/REFERENCE.md.
DEFAULT_SHAPES: dict[str, tuple[int, int]] = {
    "gpt-34m": (256, 8),
    "gpt-170m": (128, 2),
    "gpt-480m": (128, 1),
}
FALLBACK_BATCH = 2  # other presets (gpt-tiny, gpt-small, ...) run at their full block_size with this batch

# After one rank exits with an error its peers are usually stuck in a collective; give them this long to
# exit on their own (and write their result) before killing them.
PEER_GRACE_S = 15.0


# --------------------------------------------------------------------------------------------------------
# What the driver hands to the workers, and what comes back
# --------------------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    impl: str
    model: str
    seq_len: int
    batch: int  # per rank
    steps: int  # measured steps
    warmup: int  # steps run first and not measured
    seed: int
    lr: float
    # Keyword options for the implementation's setup function (e.g. strategy, prefetch, reduce_dtype), so
    # other benchmarks (bench/netns_bench.py) can vary them without a setup of their own. JSON-serialisable.
    options: dict[str, Any] = field(default_factory=dict)
    code: str = ""  # --code LABEL of the shardwise checkout this run imports ("": this one)
    count_elements: bool = False  # count what every collective moves (a counting wrapper of gloo, see below)


@dataclass
class RunResult:
    impl: str
    repeat: int
    status: str  # "ok", "OOM-killed", "timeout after N s", "failed: <reason>"
    median_step_s: Optional[float] = None  # max over ranks of each rank's median measured step time
    median_cpu_s: Optional[float] = None  # max over ranks of each rank's median CPU seconds per measured step
    median_page_faults: Optional[float] = None  # max over ranks of each rank's median minor page faults per step
    elements: dict[str, float] = field(default_factory=dict)  # rank 0, per measured step (--count-elements)
    load_1min: float = 0.0  # the machine's 1-minute load average when the run started
    peak_rss_gb: Optional[float] = None  # max over ranks of ru_maxrss
    rss_gb_per_rank: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)  # rank 0, warmup steps included
    losses: list[float] = field(default_factory=list)  # rank 0's local loss, every step
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --------------------------------------------------------------------------------------------------------
# Worker side: one process per rank
# --------------------------------------------------------------------------------------------------------

# A training step: takes (x, y) token batches, runs forward, backward and the optimizer step, returns the loss.
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def plain_step(model: nn.Module, opt: torch.optim.Optimizer) -> StepFn:
    """The ordinary PyTorch step, used by every implementation except DeepSpeed (which owns its step)."""

    def step(x, y):
        loss = model(x, y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def dtype_option(name: str | None) -> torch.dtype | None:
    """A dtype named in RunSpec.options ("bfloat16", "float32", ...), or None when not given."""
    return None if name is None else getattr(torch, name)


def setup_shardwise(model: nn.Module, spec: RunSpec, strategy: str = "full_shard", prefetch: bool = True,
                    reduce_dtype: str | None = None) -> StepFn:
    # Imported here, not at the top: while the API is being written its failure must fail only this row.
    import shardwise

    mp = None if reduce_dtype is None else shardwise.MixedPrecision(reduce_dtype=dtype_option(reduce_dtype))
    shardwise.shard(model, units={Block}, strategy=strategy, mixed_precision=mp, prefetch=prefetch)
    return plain_step(model, torch.optim.AdamW(model.parameters(), lr=spec.lr))


def setup_shardwise_strategy(strategy: str) -> Callable[..., StepFn]:
    return lambda model, spec, **options: setup_shardwise(model, spec, **{"strategy": strategy, **options})


def setup_shardwise_ablation(env: dict[str, str]) -> Callable[..., StepFn]:
    def setup(model: nn.Module, spec: RunSpec, **options) -> StepFn:
        os.environ.update(env)  # read by shardwise at shard() time and at its first collective
        return setup_shardwise(model, spec, **options)

    return setup


def setup_fsdp2(model: nn.Module, spec: RunSpec, reduce_dtype: str | None = None) -> StepFn:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(reduce_dtype=dtype_option(reduce_dtype))  # all None: plain fp32
    # fully_shard's default mesh is on the accelerator when there is one; the model lives on CPU here.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root unit: embeddings, final LayerNorm, head
    return plain_step(model, torch.optim.AdamW(model.parameters(), lr=spec.lr))


def setup_fsdp1(model: nn.Module, spec: RunSpec, reduce_dtype: str | None = None) -> StepFn:
    from torch.distributed.fsdp import MixedPrecision

    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        # Without it FSDP1 refuses to start on a CPU-only machine ("FSDP needs a non-CPU accelerator
        # device, but no accelerator device is detected").
        device_id=torch.device("cpu"),
        use_orig_params=True,
        mixed_precision=None if reduce_dtype is None else MixedPrecision(reduce_dtype=dtype_option(reduce_dtype)),
    )
    return plain_step(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=spec.lr))


def setup_ddp(model: nn.Module, spec: RunSpec, reduce_dtype: str | None = None) -> StepFn:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wrapped = DistributedDataParallel(model)
    if spec.count_elements and reduce_dtype is None:  # torch's Python twin of the built-in all-reduce: counted
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    # DDP's equivalent of a reduction dtype is a communication hook that casts each bucket before all-reduce.
    hooks = {None: None, "bfloat16": default_hooks.bf16_compress_hook, "float16": default_hooks.fp16_compress_hook}
    if reduce_dtype not in hooks:
        raise ValueError(f"reduce_dtype={reduce_dtype!r}: DDP has compression hooks for {list(hooks)[1:]} only")
    if hooks[reduce_dtype] is not None:
        wrapped.register_comm_hook(None, hooks[reduce_dtype])
    return plain_step(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=spec.lr))


def setup_deepspeed(model: nn.Module, spec: RunSpec, reduce_dtype: str | None = None) -> StepFn:
    import deepspeed  # optional (see bench/README.md); when missing, only this row fails

    config = {
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": spec.batch * dist.get_world_size(),
        "zero_optimization": {"stage": 3},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        # A torch optimizer is not on DeepSpeed's list of tested ZeRO optimizers; it refuses without this.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }
    if reduce_dtype is not None:  # DeepSpeed's name for the gradient-reduction dtype: "fp32", "bf16", "fp16"
        config["communication_data_type"] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[reduce_dtype]
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    # torch.distributed is already initialised (gloo); DeepSpeed wraps that process group.
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)

    def step(x, y):
        loss = engine(x, y).loss
        engine.backward(loss)
        engine.step()  # optimizer step and zero_grad
        return loss

    return step


# Each takes (model, spec, **spec.options) and returns the step.
SETUPS: dict[str, Callable[..., StepFn]] = {
    "shardwise": setup_shardwise,
    "fsdp2": setup_fsdp2,
    "fsdp1": setup_fsdp1,
    "ddp": setup_ddp,
    "deepspeed": setup_deepspeed,
    "shardwise-nocheck": setup_shardwise_ablation({"SHARDWISE_CHECK_COLLECTIVES": "0"}),
    "shardwise-nativecoll": setup_shardwise_ablation({"SHARDWISE_GLOO_NATIVE_COLLECTIVES": "1"}),
    "shardwise-zero2": setup_shardwise_strategy("shard_optim_grad"),
    "shardwise-zero1": setup_shardwise_strategy("shard_optim"),
    # the cost of the out-of-band check: native collectives with the check off
    "shardwise-nativecoll-nocheck": setup_shardwise_ablation({"SHARDWISE_GLOO_NATIVE_COLLECTIVES": "1",
                                                              "SHARDWISE_CHECK_COLLECTIVES": "0"}),
}


def make_batches(spec: RunSpec, rank: int, vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens, different per rank, identical across implementations; drawn before timing starts."""
    gen = torch.Generator().manual_seed(spec.seed * 1000 + rank)
    tokens = torch.randint(0, vocab_size, (spec.warmup + spec.steps, spec.batch, spec.seq_len + 1), generator=gen)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]  # (B, T) inputs, (B, T) targets


class Meter:
    """Something measured around the timed steps (e.g. bytes on a network link); by default nothing."""

    def start(self) -> None:
        """Called after the warmup steps, just before the first measured step."""

    def stop(self) -> dict:
        """Called right after the last measured step; what it returns goes into the rank's result."""
        return {}


def train(spec: RunSpec, rank: int, meter: Meter | None = None) -> dict:
    """Build, wrap and train the model; return the per-step numbers. Everything it built dies with its frame."""
    meter = meter or Meter()
    torch.manual_seed(spec.seed)  # identical initial weights on every rank and for every implementation
    model = GPT.from_preset(spec.model)
    batches = make_batches(spec, rank, model.config.vocab_size)
    step = SETUPS[spec.impl](model, spec, **spec.options)

    times, cpu, faults, losses = [], [], [], []
    for i, (x, y) in enumerate(batches):
        if i == spec.warmup:
            meter.start()
        start, start_cpu = time.perf_counter(), time.process_time()
        start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = step(x, y)
        losses.append(loss.item())  # also makes sure the step has really finished
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)  # every thread of the rank: gloo's included
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start_faults)  # pages first touched
    measured = meter.stop()
    return {"step_times_s": times, "losses": losses, "median_step_s": statistics.median(times[spec.warmup :]),
            "median_cpu_s": statistics.median(cpu[spec.warmup :]),
            "median_page_faults": statistics.median(faults[spec.warmup :]), **measured}


def worker_main(spec: RunSpec, result_path: Path, meter: Meter | None = None) -> None:
    """Run one rank of one run and write its numbers (or its error) to result_path as JSON."""
    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 from the driver already; this makes it explicit
    rank = int(os.environ["RANK"])
    result: dict = {"rank": rank}
    try:
        # The driver enforces the wall-clock limit; this only keeps a lone survivor from waiting forever.
        if spec.count_elements:
            ElementCount.install()
            meter = ElementCount(spec.steps)
        dist.init_process_group("gloo", timeout=timedelta(minutes=30))
        result.update(train(spec, rank, meter))
    except BaseException as exc:  # report every failure, including KeyboardInterrupt, then exit non-zero
        result["error"] = f"{type(exc).__name__}: {exc}".strip()
        traceback.print_exc()
    finally:
        # ru_maxrss is KiB on Linux. Taken whether or not the run succeeded: a failure's peak is still telling.
        result["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result_path.write_text(json.dumps(result))
        # FSDP2 sometimes aborts in destroy_process_group while its modules still await collection.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    if "error" in result:
        sys.exit(1)


class ElementCount(Meter):
    """Elements per measured step, by collective: every ``ProcessGroup`` method torch.distributed's Python API
    calls is wrapped, so shardwise's, FSDP's and a DDP comm hook's collectives are counted alike (DDP's
    built-in C++ all-reduce is not: under counting DDP runs torch's equivalent Python hook,
    ``default_hooks.allreduce_hook``). ``wire``: what one rank sends for them under ring algorithms,
    2 (N-1)/N of an all-reduce's elements and (N-1)/N of any other's. shardwise's control exchanges (a few
    int64 each) count too."""

    moved: dict[str, float] = {}
    # ProcessGroup method -> (the collective's name, which argument holds the elements, wire factor)
    METHODS = {"allreduce": ("all_reduce", 0, 2), "allgather": ("all_gather", 0, 1),
               "all_gather_single": ("all_gather", 0, 1), "_allgather_base": ("all_gather", 0, 1),
               "reduce_scatter": ("reduce_scatter", 1, 1), "reduce_scatter_single": ("reduce_scatter", 1, 1),
               "_reduce_scatter_base": ("reduce_scatter", 1, 1), "alltoall_base": ("all_to_all", 1, 1),
               "all_to_all_single": ("all_to_all", 1, 1), "broadcast": ("broadcast", 0, 1)}

    def __init__(self, steps: int):
        self.steps = steps

    @classmethod
    def install(cls) -> None:
        for method, (name, arg, factor) in cls.METHODS.items():
            original = getattr(dist.ProcessGroup, method, None)
            if original is None:
                continue

            def counted(group, *args, _orig=original, _name=name, _arg=arg, _factor=factor, **kwargs):
                numel = sum(t.numel() for t in _flat_tensors(args[_arg]))
                size = group.size()
                cls.moved[_name] = cls.moved.get(_name, 0) + numel
                cls.moved["wire"] = cls.moved.get("wire", 0) + numel * _factor * (size - 1) / size
                return _orig(group, *args, **kwargs)

            setattr(dist.ProcessGroup, method, counted)

    def start(self) -> None:
        ElementCount.moved = {}

    def stop(self) -> dict:
        return {"elements": {op: n / self.steps for op, n in ElementCount.moved.items()}}


def _flat_tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _flat_tensors(item)]


# --------------------------------------------------------------------------------------------------------
# Driver side: launch runs, collect results, print the table
# --------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def short(reason: str, limit: int = 100) -> str:
    """First line of a failure reason, truncated, with '|' escaped so it fits in a markdown table cell."""
    reason = reason.splitlines()[0].replace("|", "\\|") if reason else reason
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def kill_rank(proc: subprocess.Popen) -> None:
    """SIGKILL a rank and everything it started (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it exited between our poll and the kill
        pass
    proc.wait()


def wait_for_ranks(procs: list[subprocess.Popen], timeout_s: float) -> tuple[set[int], list[int], bool]:
    """Poll the ranks until all exit, killing them on timeout or when survivors hang after a peer failed.

    Returns (ranks we killed, ranks in the order they exited on their own, whether the run timed out).
    """
    start = time.monotonic()
    killed: set[int] = set()
    exit_order: list[int] = []
    first_failure_at: Optional[float] = None
    while True:
        for rank, p in enumerate(procs):
            if rank not in exit_order and p.poll() is not None:
                exit_order.append(rank)
                if p.returncode != 0 and first_failure_at is None:
                    first_failure_at = time.monotonic()
        running = [rank for rank, p in enumerate(procs) if p.poll() is None]
        if not running:
            return killed, exit_order, False
        now = time.monotonic()
        timed_out = now - start > timeout_s
        peers_stuck = first_failure_at is not None and now - first_failure_at > PEER_GRACE_S
        if timed_out or peers_stuck:
            for rank in running:
                kill_rank(procs[rank])
                killed.add(rank)
            return killed, exit_order, timed_out
        time.sleep(0.2)


def launch_run(spec: RunSpec, repeat: int, world_size: int, timeout_s: float, log_dir: Path,
               checkout: Optional[str] = None) -> RunResult:
    """Start world_size fresh worker processes for one run, wait for them, and turn what they left into a result.
    ``checkout``: the shardwise checkout the workers import (default: this one)."""
    run_dir = log_dir / f"{spec.impl}{'-' + spec.code if spec.code else ''}-r{repeat}"
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    load = os.getloadavg()[0]
    start = time.monotonic()
    procs: list[subprocess.Popen] = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            # One thread per rank: set before torch loads so OpenMP/MKL pools are created that size.
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            **({CODE_ENV: checkout} if checkout else {}),
        }
        cmd = [sys.executable, __file__, "--worker", json.dumps(dataclasses.asdict(spec)),
               "--result", str(run_dir / f"rank{rank}.json")]
        with open(run_dir / f"rank{rank}.log", "w") as log:
            # A new session per rank so a timeout can kill the rank together with any children it spawned.
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        killed, exit_order, timed_out = wait_for_ranks(procs, timeout_s)
    finally:  # also on Ctrl-C: the ranks live in their own sessions and would otherwise outlive the driver
        for p in procs:
            if p.poll() is None:
                kill_rank(p)
    wall = time.monotonic() - start

    reports = [json.loads(path.read_text()) if (path := run_dir / f"rank{r}.json").exists() else None
               for r in range(world_size)]
    result = RunResult(impl=spec.impl, repeat=repeat, status="ok", wall_s=wall, load_1min=load)
    result.rss_gb_per_rank = [r["peak_rss_kib"] * 1024 / 1e9 for r in reports if r is not None]
    # A rank killed by a signal we did not send is, on a Linux box without swap, the OOM killer's doing.
    oom = [r for r, p in enumerate(procs) if p.returncode == -signal.SIGKILL and r not in killed]
    # The first rank to fail holds the cause; its peers then typically fail with "connection closed".
    failed = [r for r in exit_order if procs[r].returncode != 0]
    if oom:
        result.status = "OOM-killed"
    elif timed_out:
        result.status = f"timeout after {timeout_s:.0f} s"
    elif failed:
        rank = failed[0]
        if reports[rank] is not None and "error" in reports[rank]:
            result.status = "failed: " + short(reports[rank]["error"])
        else:
            log_tail = last_line(run_dir / f"rank{rank}.log")
            result.status = f"failed: rank {rank} exit {procs[rank].returncode}: {short(log_tail)}"
    elif None in reports:
        result.status = "failed: a rank exited 0 without writing its result"
    else:
        result.median_step_s = max(r["median_step_s"] for r in reports)
        result.median_cpu_s = max(r["median_cpu_s"] for r in reports)
        result.elements = reports[0].get("elements", {})
        result.median_page_faults = max(r["median_page_faults"] for r in reports)
        result.peak_rss_gb = max(result.rss_gb_per_rank)
        result.step_times_s = reports[0]["step_times_s"]
        result.losses = reports[0]["losses"]
    return result


def min_med_max(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def row_name(impl: str, code: str) -> str:
    return f"{impl} [{code}]" if code else impl


def summarize(results: list[RunResult], rows: list[str], baseline: str = BASELINE_IMPL) -> str:
    """The markdown table: one row per implementation (and checkout), stats over its successful repeats."""
    by_row = {name: [r for r in results if r.impl == name] for name in rows}

    def medians(name: str) -> tuple[Optional[float], Optional[float], Optional[float]]:
        ok = [r for r in by_row.get(name, []) if r.ok]
        if not ok:
            return None, None, None
        return (statistics.median(r.median_step_s for r in ok), statistics.median(r.median_cpu_s for r in ok),
                statistics.median(r.peak_rss_gb for r in ok))

    base_time, base_cpu, base_rss = medians(baseline)
    header = ("| impl | step time s (min / median / max) | CPU s per step per rank (min / median / max) "
              f"| peak RSS per rank GB (min / median / max) | time vs {baseline} | CPU vs {baseline} "
              f"| RSS vs {baseline} | load (1 min) | loss rank 0 (first → last step) |")
    counted = any(r.elements for r in results)
    if counted:
        header += " elements moved per step (by collective) · wire elements per rank |"
    lines = [header, "|---|---|---|---|---|---|---|---|---|" + ("---|" if counted else "")]
    for name in rows:
        runs = by_row[name]
        ok = [r for r in runs if r.ok]
        if not ok:
            reasons = sorted({r.status for r in runs})
            lines.append(f"| {name} | {'; '.join(reasons)} | — | — | — | — | — | — | — |" + (" — |" if counted else ""))
            continue
        time_med, cpu_med, rss_med = medians(name)
        times = min_med_max([r.median_step_s for r in ok], ".3f")
        cpus = min_med_max([r.median_cpu_s for r in ok], ".3f")
        rss = min_med_max([r.peak_rss_gb for r in ok], ".3f")
        if len(ok) < len(runs):  # some repeats failed: say how many and why
            failed = sorted({r.status for r in runs if not r.ok})
            times += f" ({len(ok)}/{len(runs)} ok; {'; '.join(failed)})"
        ratios = [f"{v / b:.2f}" if b else "—" for v, b in ((time_med, base_time), (cpu_med, base_cpu), (rss_med, base_rss))]
        load = min_med_max([r.load_1min for r in runs], ".1f")
        loss = f"{ok[0].losses[0]:.4f} → {ok[0].losses[-1]:.4f}"
        row = f"| {name} | {times} | {cpus} | {rss} | {' | '.join(ratios)} | {load} | {loss} |"
        if counted:
            moved = ok[0].elements
            by_op = ", ".join(f"{op} {n / 1e6:.1f}M" for op, n in sorted(moved.items()) if op != "wire")
            row += f" {by_op} · {moved.get('wire', 0) / 1e6:.1f}M |"
        lines.append(row)
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-170m", help="a preset from shardwise.models.PRESETS")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    p.add_argument("--repeats", type=int, default=3, help="runs per implementation, interleaved")
    p.add_argument("--impls", default=",".join(ALL_IMPLS), help=f"comma-separated subset of {','.join(ALL_IMPLS)}")
    p.add_argument("--seq-len", type=int, default=None, help="default: per preset (see bench/README.md)")
    p.add_argument("--batch", type=int, default=None, help="per-rank batch; default: per preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--timeout", type=float, default=1200.0, help="wall-clock limit per run, seconds")
    p.add_argument("--baseline", default=BASELINE_IMPL, help="the row the ratio columns divide by")
    p.add_argument("--code", default="", help="LABEL=CHECKOUT[,...]: run the shardwise rows once per checkout "
                                              "(alternated), labelled; the other rows once per repeat")
    p.add_argument("--count-elements", action="store_true",
                   help="count the elements every collective moves per step (a counting wrapper of gloo)")
    p.add_argument("--json", type=Path, default=None, help="write the raw per-run numbers here")
    p.add_argument("--log-dir", type=Path, default=None, help="keep each rank's output here (default: a temp dir, deleted)")
    # Internal: the driver re-runs this file with these to start one rank.
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None:
        args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
        unknown = [i for i in args.impls if i not in SETUPS]
        if unknown:
            p.error(f"unknown impl(s) {unknown}; valid: {','.join(ALL_IMPLS)}")
        if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.world_size < 1:
            p.error("need --steps >= 1, --warmup >= 0, --repeats >= 1, --world-size >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker_main(RunSpec(**json.loads(args.worker)), args.result)
        return

    if args.model not in PRESETS:
        sys.exit(f"unknown model {args.model!r}; valid: {', '.join(PRESETS)}")
    block_size = GPTConfig(**PRESETS[args.model]).block_size
    default_t, default_b = DEFAULT_SHAPES.get(args.model, (block_size, FALLBACK_BATCH))
    spec_kw = dict(model=args.model, seq_len=args.seq_len or default_t, batch=args.batch or default_b,
                   steps=args.steps, warmup=args.warmup, seed=args.seed, lr=args.lr, count_elements=args.count_elements)
    if spec_kw["seq_len"] > block_size:
        sys.exit(f"--seq-len {spec_kw['seq_len']} exceeds {args.model}'s block_size {block_size}")

    keep_logs = args.log_dir is not None
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="shardwise-bench-"))
    print(f"# {args.model}, world size {args.world_size}, T={spec_kw['seq_len']}, batch {spec_kw['batch']} per rank, "
          f"{args.warmup} warmup + {args.steps} measured steps, {args.repeats} repeat(s), 1 thread per rank, gloo",
          flush=True)

    codes = [tuple(c.split("=", 1)) for c in args.code.split(",") if c] if args.code else []
    # (impl, code label, checkout): every shardwise row once per checkout, the others once
    plan = [(impl, label, str(Path(path).resolve())) for impl in args.impls
            for label, path in (codes if codes and impl.startswith("shardwise") else [("", "")])]
    results: list[RunResult] = []
    for repeat in range(args.repeats):
        for impl, label, checkout in plan:  # interleaved: A, B, C, A, B, C, ...
            res = launch_run(RunSpec(impl=impl, code=label, **spec_kw), repeat, args.world_size, args.timeout, log_dir,
                             checkout or None)
            res.impl = row_name(impl, label)
            results.append(res)
            detail = (f"{res.median_step_s:.3f} s/step, {res.median_cpu_s:.3f} CPU s, "
                      f"{res.median_page_faults / 1e3:.0f}k page faults, peak RSS {res.peak_rss_gb:.3f} GB"
                      if res.ok else res.status)
            print(f"  repeat {repeat + 1}/{args.repeats} {res.impl:>9}: {detail}  (load {res.load_1min:.1f}, "
                  f"{res.wall_s:.0f} s wall)", flush=True)

    print()
    print(summarize(results, [row_name(impl, label) for impl, label, _ in plan], args.baseline))

    if args.json is not None:
        payload = {"config": {**spec_kw, "world_size": args.world_size, "repeats": args.repeats, "impls": args.impls},
                   "runs": [dataclasses.asdict(r) for r in results]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2))
    if keep_logs:
        print(f"\nper-rank logs: {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
