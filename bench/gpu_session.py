"""One short GPU session: what one GPU can show about shardwise, within a time budget.

    python bench/gpu_session.py --out OUT                         # a CUDA machine: ends within --budget-s (480 s)
    python bench/gpu_session.py --device cpu --tiny --out OUT     # anywhere: the same code paths, tiny shapes, gloo

Run it from a checkout: every job imports that checkout's ``shardwise``. Each job runs in processes of its own
(one per rank) under a timeout that ends before the budget does; no job starts without time for it. A job that
fails, hangs or crashes is recorded and the session goes on. Every result is appended to ``OUT/results.jsonl``
the moment it exists; ``OUT/summary.md`` (also printed) holds the tables; ``OUT/logs/`` each process's output.

Parts, in order (``--parts`` picks):

  parity     fp32, TF32 off, 4 SGD-with-momentum steps against one process on the same global batch: world 1
             over NCCL; world 2 over gloo on CUDA tensors; world 2 over ``"cuda:gloo"``, a default group with no
             CPU backend (what ``init_process_group("nccl")`` gives), the stand-in for NCCL at world 2 on one GPU.
             Every strategy, CPU offload with and without ``offload_optimizer`` (its worker thread on CUDA),
             activation checkpointing, and Muon with and without offload (the two runs must agree).
  sanitizer  the offload variants again under ``TORCH_CUDA_SANITIZER=1`` (unsynchronised use of one tensor on
             two streams raises), world 1 over NCCL and world 2 over ``"cuda:gloo"``.
  speed      bf16 compute, fp32 master and reduction, world 1, fused AdamW: shardwise against torch FSDP2 and
             plain single-GPU PyTorch (fp32 weights, autocast) on a ~1B GPT; step time, tokens/s, MFU, peak
             memory; fresh processes, implementations alternated.
  offload    CPU offload, world 1: shardwise ``CPUOffload`` + ``offload_optimizer`` against FSDP2's
             ``CPUOffloadPolicy`` + a fused CPU AdamW, both clipping at 1.0.
  qlora      the 4-bit path on CUDA: dequantised bits against the CPU's, then LoRA r=16 on a bf16 base against
             the same on a 4-bit NF4 base (step time, peak memory).

Nothing is downloaded: models are built from configs with random weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
T0 = time.monotonic()

# '+'-joined variant parts: a strategy, offload (CPUOffload), offload_optimizer, activation_checkpointing, muon.
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "shard_optim_grad", "shard_optim")
OFFLOAD_VARIANTS = ("offload", "offload+offload_optimizer", "shard_optim_grad+offload+offload_optimizer")
PARITY_VARIANTS = STRATEGIES + OFFLOAD_VARIANTS + ("activation_checkpointing", "muon")
PARITY_RTOL = 1e-5  # fp32 with TF32 off: matmuls are not bit-reproducible across layouts on a GPU
MUON_RTOL = 1e-4  # Muon with and without offload: Newton–Schulz on the GPU or the CPU (fp32), same gradients
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                   ("A100", 312e12))  # dense bf16, by device name
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ============================================================================= the jobs (child processes)

def _join(spec: dict):
    """Import torch and this checkout's shardwise, join the job's process group; returns the compute device."""
    sys.path.insert(0, str(REPO))
    import torch

    os.environ.update(RANK=str(spec["rank"]), WORLD_SIZE=str(spec["world"]), LOCAL_RANK=str(spec["rank"]),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    if spec["device"] == "cuda":
        torch.cuda.set_device(0)  # one GPU: every rank on it
        device = torch.device("cuda", 0)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    if spec.get("backend"):
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(spec["backend"], timeout=timedelta(seconds=spec.get("pg_timeout_s", 120)))
    return device


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _memory(device) -> dict:
    import resource

    import torch

    out = {"host_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device.type == "cuda":
        out.update(peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                   peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
    return out


def _append(spec: dict, record: dict) -> None:
    """One line of OUT/results.jsonl (rank 0 writes; one job runs at a time)."""
    with open(spec["results"], "a") as f:
        f.write(json.dumps({"t_s": round(time.monotonic() - spec["t0"], 1), "job": spec["job"], **record},
                           default=str) + "\n")


def _timed_steps(device, steps: int, step) -> list[float]:
    times = []
    for i in range(steps):
        _synchronize(device)
        start = time.perf_counter()
        step(i)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _measured(spec: dict, device, step, tokens: int, record: dict) -> None:
    """Run ``spec["steps"]`` timed steps (``step(i)`` returns the loss) and append their figures to
    ``record``'s line of the results: step times (the first dropped from the statistics: it pays for
    allocations and kernels' first launch), tokens/s, first and last loss, peak memory."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses = []
    times = _timed_steps(device, spec["steps"], lambda i: losses.append(step(i)))
    warm = times[1:] or times
    median = statistics.median(warm)
    _append(spec, {**record, "step_s": times, "median_s": median, "min_s": min(warm), "max_s": max(warm),
                   "tokens_per_s": tokens / median, "loss_first_last": [losses[0].item(), losses[-1].item()],
                   **_memory(device)})


# ---- parity -------------------------------------------------------------------------------------------------

def _shard_options(variant: str) -> dict:
    import shardwise

    parts = variant.split("+")
    options = {}
    for part in parts:
        if part in STRATEGIES:
            options["strategy"] = part
        elif part == "offload":
            options["offload"] = shardwise.CPUOffload()
        elif part == "activation_checkpointing":
            options["activation_checkpointing"] = True
        elif part not in ("offload_optimizer", "muon"):
            raise ValueError(f"unknown parity variant part {part!r}")
    return options


def _sgd_parity(device, variant: str, steps: int) -> float:
    """gpu_check.py's parity run (against one process on the global batch) for one variant."""
    import torch

    import gpu_check
    import shardwise

    optimizer = None
    if "offload_optimizer" in variant:
        optimizer = lambda model: shardwise.offload_optimizer(model, torch.optim.SGD, lr=0.3, momentum=0.9)  # noqa: E731
    return gpu_check.parity(device, steps, optimizer=optimizer, **_shard_options(variant))


def _muon_offload_agreement(device, steps: int) -> float:
    """Muon on shards with and without CPU offload, same initial weights and data: the worst relative
    difference of the parameters (the exchange runs over the device group either way)."""
    import copy

    import torch
    import torch.distributed as dist

    import gpu_check
    import shardwise
    from shardwise.models import GPT, Block
    from shardwise.optim import Muon

    rank = dist.get_rank()
    cfg = gpu_check.PARITY_CONFIG
    torch.manual_seed(0)
    initial = GPT(cfg).to(device)
    finals = []
    for offload in (None, shardwise.CPUOffload()):
        model = shardwise.shard(copy.deepcopy(initial), units={Block}, device=device, offload=offload)
        opt = Muon(model.parameters(), ns_dtype=torch.float32)
        for step in range(steps):
            model(*gpu_check.batch(step, rank, 4, 64, cfg.vocab_size, device)).loss.backward()
            opt.step()
            opt.zero_grad()
        finals.append(shardwise.full_state_dict(model))
    if rank != 0:
        return 0.0
    on, off = finals
    return max(((on[k].float() - off[k].float()).norm() / (off[k].float().norm() + 1e-12)).item() for k in off)


def job_parity(spec: dict) -> None:
    device = _join(spec)
    import warnings

    import torch
    import torch.distributed as dist

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rank = dist.get_rank()
    for variant in spec["variants"]:
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if variant == "muon":
                    err, tol = _muon_offload_agreement(device, spec["steps"]), MUON_RTOL
                else:
                    err, tol = _sgd_parity(device, variant, spec["steps"]), PARITY_RTOL
                err = _max_over_ranks(err, device)
                result = {"status": "ok", "worst_rel_err": err, "pass": err <= tol, "tolerance": tol}
            except BaseException as e:  # noqa: BLE001 - recorded; the next variant runs if the group still works
                result = {"status": "failed", "error": _one_line(e), "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.monotonic() - start, 2)
        result["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught
                                     if "shardwise" in str(w.message) or "CUDA" in str(w.message)})
        print(f"[rank {rank}] {variant}: {result.get('worst_rel_err', result.get('error'))}", flush=True)
        if rank == 0 or result["status"] != "ok":
            _append(spec, {"variant": variant, "rank": rank, **result})
        if result["status"] != "ok":
            return  # a failed collective leaves the group unusable: the orchestrator records the rest as not run
    _leave()


def _max_over_ranks(value: float, device) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400] if text else ''}"


# ---- speed --------------------------------------------------------------------------------------------------

def _peak_flops(device):
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def job_speed(spec: dict) -> None:
    impl = spec["impl"]
    device = _join({**spec, "backend": None if impl == "plain" else spec["backend"]})
    import torch

    from shardwise.models import GPT, Block

    torch.backends.cuda.matmul.allow_tf32 = True  # as a training run would have it
    batch, seq = spec["batch"], spec["seq"]
    bf16, fp32 = torch.bfloat16, torch.float32
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT.from_preset(spec["model"], block_size=max(seq, 128))
    params = sum(p.numel() for p in model.parameters())
    # FLOPs come from the parameters that multiply: not the position embedding, nor an untied token embedding.
    matmul_params = params - model.wpe.weight.numel() - (
        0 if model.lm_head.weight is model.wte.weight else model.wte.weight.numel())
    cfg = model.config
    autocast = None
    if impl == "shardwise":
        import shardwise

        shardwise.shard(model, units={Block}, device=device,
                        mixed_precision=shardwise.MixedPrecision(param_dtype=bf16, reduce_dtype=fp32))
    else:
        if impl == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        else:
            autocast = torch.autocast(device.type, dtype=bf16)
        model.to_empty(device=device)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    data = torch.Generator().manual_seed(0)

    def step(_):
        x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=data)
        inputs, targets = x[:, :-1].to(device), x[:, 1:].to(device)
        with autocast if autocast is not None else contextlib.nullcontext():
            loss = model(inputs, targets).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    flops_per_token = 6 * matmul_params + 12 * cfg.n_layer * cfg.n_embd * seq  # PaLM, appendix B
    peak = _peak_flops(device)
    _measured(spec, device, step, batch * seq, {"impl": impl, "model": spec["model"], "params": params,
                                                 "batch": [batch, seq], "flops_per_token": flops_per_token,
                                                 "peak_flops": peak})
    _leave()


# ---- offload ------------------------------------------------------------------------------------------------

def job_offload(spec: dict) -> None:
    impl = spec["impl"]
    device = _join(spec)
    import torch

    from shardwise.models import GPT, Block

    bf16, fp32 = torch.bfloat16, torch.float32
    batch, seq = spec["batch"], spec["seq"]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT.from_preset(spec["model"], block_size=max(seq, 128))
    setup_start = time.perf_counter()
    clip = None
    if impl == "shardwise":
        import shardwise

        shardwise.shard(model, units={Block}, device=device, offload=shardwise.CPUOffload(),
                        mixed_precision=shardwise.MixedPrecision(param_dtype=bf16, reduce_dtype=fp32))
        opt = shardwise.offload_optimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, max_grad_norm=1.0)
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = dict(mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32),
                      offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"))
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        model.to_empty(device="cpu")
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
    setup_s = time.perf_counter() - setup_start
    data = torch.Generator().manual_seed(0)

    def step(_):
        x = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=data)
        loss = model(x[:, :-1].to(device), x[:, 1:].to(device)).loss
        loss.backward()
        if clip is not None:
            clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    _measured(spec, device, step, batch * seq, {"impl": impl, "model": spec["model"], "batch": [batch, seq],
                                                 "setup_s": setup_s})
    _leave()


# ---- qlora --------------------------------------------------------------------------------------------------

def _llama(shape: tuple, seq: int, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, intermediate = shape
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate,
                      max_position_embeddings=max(seq, 128), tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def _quantise_projections(model, dtype) -> int:
    """Every projection becomes a 4-bit NF4 QuantLinear; one matrix per shape is quantised (on the CPU) and its
    bytes loaded into every Linear of that shape: the dequantisation work per step is what distinct weights
    would cost, and building takes seconds instead of minutes."""
    from torch import nn

    from shardwise.quant.format import quantize_4bit
    from shardwise.quant.linear import QuantLinear

    by_shape: dict = {}
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name in LLAMA_PROJECTIONS:
                shape = (child.out_features, child.in_features)
                if shape not in by_shape:
                    by_shape[shape] = quantize_4bit(child.weight.detach(), "nf4", True, name=name)
                q = QuantLinear(child.in_features, child.out_features, child.bias is not None, quant_type="nf4",
                                double_quant=True, dtype=dtype)
                q.load_quantized(by_shape[shape])
                setattr(module, name, q)
                count += 1
    return count


def _dequantisation_on_device(model, device, dtype) -> dict:
    """One 4-bit matrix dequantised on the device: the same bits as on the CPU? And how long it takes."""
    import torch

    from shardwise.quant.linear import QuantLinear

    q = next(m for m in model.modules() if isinstance(m, QuantLinear))
    on_cpu = q.dequantized_weight(dtype)
    stored = {k: v.to(device) for k, v in q.stored().items()}
    on_device = q.layout.dequantize(stored, dtype)
    times = _timed_steps(device, 11, lambda _: q.layout.dequantize(stored, dtype))
    return {"dequant_bits_equal_cpu": bool(torch.equal(on_cpu, on_device.cpu())), "dequant_shape": list(q.layout.shape),
            "dequant_ms": statistics.median(times[1:]) * 1e3}


def job_qlora(spec: dict) -> None:
    device = _join(spec)
    import torch

    import shardwise
    from shardwise.hf.lora import LoraSettings, apply_lora

    bf16, fp32 = torch.bfloat16, torch.float32
    record: dict = {"base": spec["base"], "shape": spec["shape"]}
    model = _llama(tuple(spec["shape"]), spec["seq"], bf16)
    if spec["base"] == "nf4":
        record["quantised_linears"] = _quantise_projections(model, bf16)
        record.update(_dequantisation_on_device(model, device, bf16))
    model = apply_lora(model, LoraSettings(r=16, alpha=32, target_modules=LLAMA_PROJECTIONS, base_dtype=bf16))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 adapter masters
    shardwise.shard(model, device=device, activation_checkpointing=True,
                    mixed_precision=shardwise.MixedPrecision(param_dtype=bf16, reduce_dtype=fp32))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=device.type == "cuda")
    batch, seq = spec["batch"], spec["seq"]
    data = torch.Generator().manual_seed(0)

    def step(_):
        x = torch.randint(0, 32000, (batch, seq + 1), generator=data)
        logits = model(input_ids=x[:, :-1].to(device)).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten().to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    _measured(spec, device, step, batch * seq, record)
    _leave()


JOBS = {"parity": job_parity, "speed": job_speed, "offload": job_offload, "qlora": job_qlora}


# ================================================================================= the session (orchestrator)

@dataclass
class Job:
    name: str
    kind: str  # a key of JOBS
    spec: dict  # what every rank gets; rank and port are added
    world: int = 1
    timeout_s: float = 90.0
    env: dict = field(default_factory=dict)


class Session:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.results = self.out / "results.jsonl"
        self.lines: list[str] = []

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - T0)

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def record(self, obj: dict) -> None:
        with open(self.results, "a") as f:
            f.write(json.dumps({"t_s": round(time.monotonic() - T0, 1), **obj}, default=str) + "\n")

    def run(self, job: Job) -> tuple[str, list[dict]]:
        """Run one job's ranks to the end or to the timeout; returns (status, the records it appended).
        Never raises: a job that cannot start, fails or hangs is a status."""
        timeout = min(job.timeout_s, self.left_s() - 5)
        if timeout < 10:
            self.record({"job": job.name, "status": "skipped: budget spent"})
            return "skipped: budget spent", []
        port = _free_port()
        before = _count_lines(self.results)
        procs = []
        for rank in range(job.world):
            spec = {**job.spec, "rank": rank, "world": job.world, "port": port, "job": job.name,
                    "results": str(self.results), "t0": T0,
                    "device": self.args.device}
            log = open(self.out / "logs" / f"{job.name}.rank{rank}.log", "w")
            procs.append((subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--job", job.kind,
                                            "--spec", json.dumps(spec)], cwd=REPO, stdout=log,
                                           stderr=subprocess.STDOUT, env={**os.environ, **job.env},
                                           start_new_session=True), log))
        status, start = "ok", time.monotonic()
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                status = f"timeout after {timeout:.0f} s"
                break
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the rank and anything it started
                proc.wait()
            log.close()
        codes = [proc.returncode for proc, _ in procs]
        if status == "ok" and any(codes):
            status = f"exit codes {codes}"
        records = [r for r in _read_jsonl(self.results)[before:] if r.get("job") == job.name]
        if status != "ok":
            self.record({"job": job.name, "status": status, "log_tail": _tail(self.out / "logs" / f"{job.name}.rank0.log")})
        return status, records

    # ------------------------------------------------------------------------------------------- parts
    def parity(self) -> None:
        cuda = self.args.device == "cuda"
        self.say(f"\n## parity (fp32, TF32 off; worst relative error of losses and parameters vs one process; "
                 f"tolerance {PARITY_RTOL:g}, Muon on/off offload {MUON_RTOL:g})")
        groups = [("parity-w1", "world 1, " + ("nccl" if cuda else "gloo"), 1, "nccl" if cuda else "gloo"),
                  ("parity-w2-gloo", "world 2, gloo" + (" on CUDA tensors" if cuda else ""), 2, "gloo")]
        if cuda:
            groups.append(("parity-w2-cuda-gloo", 'world 2, "cuda:gloo" (no CPU backend, as under NCCL)', 2,
                           "cuda:gloo"))
        for name, label, world, backend in groups:
            self._parity_job(name, label, world, backend, PARITY_VARIANTS, {})

    def sanitizer(self) -> None:
        if self.args.device != "cuda":
            self.say("\n## sanitizer: CUDA only, skipped")
            return
        self.say("\n## sanitizer (TORCH_CUDA_SANITIZER=1: unsynchronised use of a tensor on two streams raises)")
        env = {"TORCH_CUDA_SANITIZER": "1"}
        self._parity_job("sanitizer-w1", "world 1, nccl", 1, "nccl", OFFLOAD_VARIANTS, env, steps=2)
        self._parity_job("sanitizer-w2", 'world 2, "cuda:gloo"', 2, "cuda:gloo", OFFLOAD_VARIANTS, env, steps=2)

    def _parity_job(self, name, label, world, backend, variants, env, steps=4) -> None:
        job = Job(name, "parity", {"backend": backend, "variants": list(variants), "steps": steps}, world,
                  self.args.parity_timeout_s, env)
        status, records = self.run(job)
        self.say(f"{label}: {status}")
        by_variant: dict = {}
        for r in records:  # a variant that failed on some rank: that rank's error wins
            if r.get("variant") and (r["variant"] not in by_variant or r.get("status") != "ok"):
                by_variant[r["variant"]] = r
        for v in variants:
            r = by_variant.get(v)
            if r is None:
                self.say(f"  {v:44s} not run")
            elif r["status"] == "ok":
                self.say(f"  {v:44s} {r['worst_rel_err']:.2e} {'PASS' if r['pass'] else 'FAIL'} ({r['seconds']} s)")
            else:
                self.say(f"  {v:44s} FAILED on rank {r['rank']}: {r['error'][:240]}")
            for w in (r or {}).get("warnings", []):
                self.say(f"    warning: {w}")

    def speed(self) -> None:
        a = self.args
        self.say(f"\n## speed: bf16 compute, fp32 master and reduction, world 1, {a.speed_model}, batch "
                 f"{a.speed_batch} x {a.speed_seq}, {a.speed_steps} steps (first dropped), AdamW")
        rows: dict = {"shardwise": [], "fsdp2": [], "plain": []}
        for repeat in range(a.speed_repeats):
            for impl in rows:
                spec = {"impl": impl, "backend": self._backend(), "model": a.speed_model, "batch": a.speed_batch,
                        "seq": a.speed_seq, "steps": a.speed_steps}
                status, records = self.run(Job(f"speed-{impl}-{repeat}", "speed", spec, 1, a.speed_timeout_s))
                rows[impl] += records if status == "ok" and records else [status]
        self.say("| impl | step s min / median / max (over runs' medians) | tokens/s | MFU | peak alloc GiB | "
                 "peak reserved GiB | loss first -> last |")
        self.say("|---|---|---|---|---|---|---|")
        for impl, runs in rows.items():
            ok = [r for r in runs if isinstance(r, dict)]
            if not ok:
                self.say(f"| {impl} | failed: {'; '.join(map(str, runs))[:200]} | | | | | |")
                continue
            medians = sorted(r["median_s"] for r in ok)
            median = statistics.median(medians)
            mfu = [r["flops_per_token"] * r["tokens_per_s"] / r["peak_flops"] for r in ok if r.get("peak_flops")]
            self.say(f"| {impl} | {medians[0]:.3f} / {median:.3f} / {medians[-1]:.3f} | "
                     f"{ok[0]['batch'][0] * ok[0]['batch'][1] / median:,.0f} | "
                     f"{f'{statistics.median(mfu):.1%}' if mfu else '-'} | {_median_of(ok, 'peak_alloc_gib')} | "
                     f"{_median_of(ok, 'peak_reserved_gib')} | {_losses(ok[0])} |"
                     + ("" if len(ok) == len(runs) else f" ({len(ok)}/{len(runs)} runs ok)"))

    def offload(self) -> None:
        a = self.args
        self.say(f"\n## offload: world 1, {a.offload_model}, batch {a.offload_batch} x {a.offload_seq}, "
                 f"{a.offload_steps} steps (first dropped), AdamW on the CPU, clip 1.0, bf16 compute")
        self.say("| impl | step s min / median / max | tokens/s | peak alloc GiB | host max RSS GiB | setup s | "
                 "loss first -> last |")
        self.say("|---|---|---|---|---|---|---|")
        for impl in ("shardwise", "fsdp2"):
            spec = {"impl": impl, "backend": self._backend(), "model": a.offload_model, "batch": a.offload_batch,
                    "seq": a.offload_seq, "steps": a.offload_steps}
            r = self._record_or_failed_row(Job(f"offload-{impl}", "offload", spec, 1, a.offload_timeout_s), impl, 7)
            if r is None:
                continue
            self.say(f"| {impl} | {r['min_s']:.3f} / {r['median_s']:.3f} / {r['max_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{_gib(r, 'peak_alloc_gib')} | {_gib(r, 'host_maxrss_gib')} | {r['setup_s']:.1f} | "
                     f"{_losses(r)} |")

    def qlora(self) -> None:
        a = self.args
        shape = tuple(int(x) for x in a.qlora_shape.split(","))
        self.say(f"\n## qlora: Llama (hidden, layers, heads, kv heads, intermediate) = {shape}, LoRA r=16 on every "
                 f"projection, batch {a.qlora_batch} x {a.qlora_seq}, bf16 compute, activation checkpointing, world 1")
        self.say("| base | step s min / median / max | tokens/s | peak alloc GiB | loss first -> last | dequantisation |")
        self.say("|---|---|---|---|---|---|")
        for base in ("bf16", "nf4"):
            spec = {"base": base, "backend": self._backend(), "shape": shape, "batch": a.qlora_batch,
                    "seq": a.qlora_seq, "steps": a.qlora_steps}
            r = self._record_or_failed_row(Job(f"qlora-{base}", "qlora", spec, 1, a.qlora_timeout_s), base, 6)
            if r is None:
                continue
            notes = (f"bits equal to the CPU's: {r['dequant_bits_equal_cpu']}; one {r['dequant_shape']} matrix "
                     f"{r['dequant_ms']:.2f} ms; {r['quantised_linears']} 4-bit Linears") if base == "nf4" else ""
            self.say(f"| {base} | {r['min_s']:.3f} / {r['median_s']:.3f} / {r['max_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{_gib(r, 'peak_alloc_gib')} | {_losses(r)} | {notes} |")

    def _record_or_failed_row(self, job: Job, label: str, columns: int) -> dict | None:
        """Run a job of one record and return it; or say its table row of ``columns`` cells as failed (with
        the last line of rank 0's log) and return None."""
        status, records = self.run(job)
        if status == "ok" and records:
            return records[0]
        self.say(f"| {label} | failed: {status}: {_tail(self.out / 'logs' / f'{job.name}.rank0.log', 1)[:200]} |"
                 + " |" * (columns - 2))
        return None

    def _backend(self) -> str:
        return "nccl" if self.args.device == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _count_lines(path: Path) -> int:
    return len(_read_jsonl(path))


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = [ln.rstrip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])[-2000:]


def _median_of(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def _gib(r: dict, key: str) -> str:
    return f"{r[key]:.2f}" if r.get(key) is not None else "-"


def _losses(r: dict) -> str:
    first, last = r["loss_first_last"]
    return f"{first:.3f} -> {last:.3f}"


PARTS = ("parity", "sanitizer", "speed", "offload", "qlora")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=list(JOBS), help=argparse.SUPPRESS)  # internal: one rank of one job
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_session_out"))
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--budget-s", type=float, default=480.0, help="no job runs past this many seconds")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes everywhere (a CPU run of the script itself)")
    ap.add_argument("--parity-timeout-s", type=float, default=100)
    ap.add_argument("--speed-model", default="gpt-1b")
    ap.add_argument("--speed-batch", type=int, default=4)
    ap.add_argument("--speed-seq", type=int, default=1024)
    ap.add_argument("--speed-steps", type=int, default=8)
    ap.add_argument("--speed-repeats", type=int, default=2)
    ap.add_argument("--speed-timeout-s", type=float, default=75)
    ap.add_argument("--offload-model", default="gpt-1b")
    ap.add_argument("--offload-batch", type=int, default=4)
    ap.add_argument("--offload-seq", type=int, default=1024)
    ap.add_argument("--offload-steps", type=int, default=4)
    ap.add_argument("--offload-timeout-s", type=float, default=110)
    ap.add_argument("--qlora-shape", default="2048,8,16,8,5632", help="hidden,layers,heads,kv_heads,intermediate")
    ap.add_argument("--qlora-batch", type=int, default=4)
    ap.add_argument("--qlora-seq", type=int, default=1024)
    ap.add_argument("--qlora-steps", type=int, default=4)
    ap.add_argument("--qlora-timeout-s", type=float, default=90)
    args = ap.parse_args(argv)
    if args.tiny:
        args.speed_model = args.offload_model = "gpt-tiny"
        args.speed_batch = args.offload_batch = args.qlora_batch = 2
        args.speed_seq = args.offload_seq = args.qlora_seq = 32
        args.speed_steps = args.offload_steps = args.qlora_steps = 3
        args.speed_repeats = 1
        args.qlora_shape = "64,2,2,2,128"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.job:
        JOBS[args.job](json.loads(args.spec))
        # Its records are written and its process group destroyed: leave without the interpreter's teardown,
        # where gloo's threads can still abort a finished process ("terminate called without an active
        # exception", seen with plain torch + gloo too: bench/README, the floor run), which would turn a
        # finished job into a failed one. A job that raised never gets here: its exit code stays 1.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    session = Session(args)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    where = f" ({torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})" if args.device == "cuda" else ""
    session.say(f"# shardwise GPU session: torch {torch.__version__}, {args.device}{where}, python "
                f"{platform.python_version()}, checkout {rev or '?'}, budget {args.budget_s:.0f} s")
    session.record({"job": "session", "torch": torch.__version__, "device": args.device, "checkout": rev,
                    "args": vars(args)})
    for part in args.parts.split(","):
        start = time.monotonic()
        try:
            getattr(session, part)()
        except Exception as e:  # noqa: BLE001 - a part's own bug must not lose the parts after it
            session.say(f"part {part} raised {_one_line(e)}")
            session.record({"job": part, "status": "raised", "traceback": traceback.format_exc()})
        session.say(f"({part}: {time.monotonic() - start:.0f} s; {time.monotonic() - T0:.0f} s so far)")
    (session.out / "summary.md").write_text("\n".join(session.lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
