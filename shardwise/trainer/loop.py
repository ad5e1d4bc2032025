"""One rank's training run: build and shard the model, then step, log, evaluate and checkpoint.

Order of events per optimizer step (every rank, same order: the collectives must line up)::

    micro-batches 1..k-1   forward + backward under shardwise.no_sync (gradients kept locally, no traffic)
    micro-batch k          forward + backward (reduce-scatter of the accumulated gradients)
    clip_grad_norm_        one all-reduce of the squared norm
    optimizer.step         on the local shards only
    every log_every        two tiny all-reduces (loss sum, peak memory)
    every eval_every       validation forwards (all-gathers), one all-reduce of the loss
    every save_every       a checkpoint (collective)
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

import shardwise
from shardwise.engine.checks import agree
from shardwise.engine.base.device import compute_device
from shardwise.engine.base.mixed_precision import named_policy
from shardwise.engine.core.runtime import runtime_of
from shardwise.hf.model_spec import ModelSpec, lm_loss, resolve_model
from shardwise.hf.quantization import num_weights
from shardwise.trainer import config as config_mod
from shardwise.trainer import (
    failures,
    launch,
    metrics,
    plot,
    preflight,
    schedule,
    state,
)
from shardwise.trainer.config import TrainConfig
from shardwise.trainer.defaults import defaults_note
from shardwise.trainer.lora_model import quant_settings, run_frozen_base, wrap_lora
from shardwise.trainer.loss import global_loss_targets, loss_targets, micro_batch_loss
from shardwise.trainer.sources import Sampler, open_training_data


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_sharded_model(cfg: TrainConfig, spec: ModelSpec, device: torch.device) -> nn.Module:
    """Build (eagerly, or on meta for big HF models) and shard. Same seed on every rank, so an eager build
    is identical everywhere and a meta build initialises every shard consistently."""
    torch.manual_seed(cfg.seed)
    meta_model = spec.build("meta")
    on_meta = spec.build_on_meta(spec.num_params(meta_model))
    model = meta_model if on_meta else spec.build("cpu")
    del meta_model
    init_fn = spec.param_init_fn(model, device) if on_meta else None
    if cfg.lora_r:
        model, init_fn = wrap_lora(cfg, spec, model, init_fn if on_meta else None, on_meta)
    units = spec.units(model, cfg.auto_wrap, cfg.transformer_layer_cls_to_wrap)
    model = shardwise.shard(
        model,
        units=units,
        strategy=cfg.sharding_strategy,
        mixed_precision=named_policy(cfg.mixed_precision),
        offload=shardwise.CPUOffload() if cfg.cpu_offload else None,
        param_init_fn=init_fn,
        device=device,
        activation_checkpointing=cfg.activation_checkpointing,
    )
    # --model DIR with weights: each rank reads its own shards (the base's, under LoRA: adapters keep peft's init)
    spec.load_weights(model, quantization=quant_settings(cfg))
    return model


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (or Muon + AdamW) over the sharded parameters; weight decay only on matrices (a sharded parameter
    has its whole shape)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if cfg.optimizer == "muon":
        from shardwise.optim import Muon
        # Moonshot's lr scaling makes Muon's update RMS match AdamW's, so AdamW's lr and weight decay carry over.
        groups = [{"params": decay, "weight_decay": cfg.weight_decay, "adamw_weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0, "adamw_weight_decay": 0.0}]
        return Muon(groups, lr=cfg.lr, adjust_lr_fn="match_rms_adamw", adamw_lr=cfg.lr,
                    adamw_betas=(cfg.adam_beta1, cfg.adam_beta2))
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.cpu_offload and cfg.mixed_precision != "fp16":
        # Steps each unit on the CPU as its gradients land and clips by the global norm itself (the same bits
        # as clip_grad_norm_ + AdamW); fp16's loss scaler needs the whole step after backward, so it keeps
        # the plain optimizer.
        # With a GPU doing the compute the host step is the bottleneck: torch's fused CPU kernel (the CPU-only
        # case keeps the default kernel, which is what makes it bitwise equal to a run without offload).
        fused = runtime_of(model).device.type == "cuda"
        return shardwise.offload_optimizer(model, torch.optim.AdamW, groups, max_grad_norm=clip_limit(cfg),
                                           lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused or None)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2))


def sharding_notes(cfg: TrainConfig, model: nn.Module, device: torch.device) -> list[str]:
    """Settings that are valid but likely not what was meant: said once, in the banner."""
    notes = []
    units = len(runtime_of(model).units)
    if cfg.auto_wrap == "no_wrap" and units == 1:
        notes.append("the whole model is one unit (--auto-wrap no_wrap, or --fsdp without auto_wrap, as in Hugging "
                     "Face): every rank gathers all of it at once; add auto_wrap (--fsdp 'full_shard auto_wrap') "
                     "for one unit per transformer block")
    if cfg.cpu_offload and device.type == "cpu":
        notes.append("--cpu-offload on a CPU-only run: the shards live in CPU memory either way; it only "
                     "matters with GPUs")
    return notes


def clip_limit(cfg: TrainConfig) -> float:
    """The global gradient-norm limit; inf (no clipping, the norm is still measured for the log) when off."""
    return cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf


@torch.no_grad()
def evaluate(model: nn.Module, spec: ModelSpec, sampler: Sampler, batches: int, device: torch.device) -> float:
    """Mean loss per loss target over every rank's fixed validation batches (collective)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in sampler.fixed_batches(batches):
        total[0] += lm_loss(spec, model, x.to(device), y.to(device), reduction="sum").double()
        total[1] += loss_targets([y])
    model.train()
    loss_sum, count = agree.all_reduce_host(total.tolist(), what="the sum of the validation loss over ranks")
    return loss_sum / count


def check_model_fits_data(cfg: TrainConfig, spec: ModelSpec, max_token: int) -> None:
    """The launcher checked this already (``preflight``); a rank calling ``train`` directly checks here."""
    preflight.check_seq_len(cfg, spec)
    preflight.check_token_ids(cfg, spec, max_token)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train on this rank (the process group is up). Returns a summary (rank 0's is complete)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = compute_device(())  # the current GPU when the world moves CUDA tensors over NCCL, else the CPU
    spec = resolve_model(cfg.model)
    seed_everything(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    if rank == 0:
        spec.save_model_files(cfg.out)  # a Hugging Face model directory's tokenizer, for export

    data = open_training_data(cfg, rank, world)
    train_data, val_data = data.train, data.val
    check_model_fits_data(cfg, spec, max(train_data.max_token(), val_data.max_token()))

    model = build_sharded_model(cfg, spec, device)
    num_params = num_weights(model)  # a 4-bit base: the weights it encodes, not its packed bytes
    optimizer = build_optimizer(model, cfg)
    # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
    scaler = shardwise.ShardedGradScaler() if cfg.mixed_precision == "fp16" else None
    # LoRA over DIR's weights: adapter-only checkpoints, which record the base's identity
    frozen_base = run_frozen_base(cfg, spec, state.recorded_base(cfg.out, cfg.resume))
    start_step, note = state.restore_training_state(cfg.out, cfg.resume, model, optimizer, seed=cfg.seed,
                                                    train_tokens=data.train_tokens, grad_scaler=scaler,
                                                    frozen_base=frozen_base)

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.gradient_accumulation_steps * world
    log = metrics.MetricsLogger(
        cfg.out, total_steps=cfg.steps, start_step=start_step, tokens_per_step=tokens_per_step,
        flops_per_token=spec.flops_per_token(num_params, cfg.seq_len),
        peak_tflops=metrics.peak_tflops_per_rank(device, torch.get_num_threads(), cfg.peak_tflops),
        device=device, progress=cfg.progress, fresh=start_step == 0)
    _write_banner(log, cfg, spec, model, data, device, num_params, tokens_per_step, start_step, note)

    summary: dict[str, Any] = {"start_step": start_step, "val_losses": []}
    if start_step == 0 and cfg.eval_every:
        summary["val_losses"].append((0, _evaluate_start(cfg, spec, model, data, device, log)))

    grad_norm = float("nan")
    lr = 0.0
    accum = cfg.gradient_accumulation_steps
    clip_to = clip_limit(cfg)
    t_start = time.perf_counter()
    for step in range(start_step + 1, cfg.steps + 1):
        lr = schedule.lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
                            schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio)
        for g in optimizer.param_groups:
            g["lr"] = lr
        step_loss = 0.0
        batches = [train_data.batch(step, micro) for micro in range(accum)]
        loss_targets = global_loss_targets([y for _, y in batches], device) if train_data.masked else None
        for micro, (x, y) in enumerate(batches):
            with shardwise.no_sync(model) if micro < accum - 1 else nullcontext():
                loss = micro_batch_loss(spec, model, x.to(device), y.to(device), accumulation_steps=accum,
                                        global_targets=loss_targets, world_size=world)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            step_loss += float(loss.detach())
        grad_norm = _optimizer_step(model, optimizer, scaler, clip_to)
        log.add_step(step_loss)

        last = step == cfg.steps
        val = None
        if cfg.eval_every and (step % cfg.eval_every == 0 or last):
            val = evaluate(model, spec, val_data, cfg.eval_batches, device)
            summary["val_losses"].append((step, val))
        if step % cfg.log_every == 0 or last or val is not None:
            log.log(step, grad_norm=grad_norm, lr=lr, val_loss=val)
        if (cfg.save_every and step % cfg.save_every == 0) or last:
            path = state.save_training_state(cfg.out, model, optimizer, step=step, seed=cfg.seed,
                                             train_tokens=data.train_tokens, grad_scaler=scaler,
                                             frozen_base=frozen_base)
            if last:
                summary["checkpoint"] = str(path)
                if cfg.lora_r:
                    summary["adapter"] = _save_adapter(cfg, spec, model)
    log.close()
    summary["train_seconds"] = time.perf_counter() - t_start
    summary["final_step"] = cfg.steps
    summary["grad_norm"] = grad_norm
    if rank == 0:
        summary["metrics_png"] = _plot_and_summarise(cfg, spec, log.path, world, start_step, summary)
    return summary


def _evaluate_start(cfg: TrainConfig, spec: ModelSpec, model: nn.Module, data, device: torch.device, log) -> float:
    """The starting point of both curves: fixed batches of each split (training steps draw steps >= 1)."""
    v = evaluate(model, spec, data.val, cfg.eval_batches, device)
    t = evaluate(model, spec, data.train, cfg.eval_batches, device)
    log.write(f"step 0 | loss {t:.4f} | val_loss {v:.4f}")
    log.append({"step": 0, "loss": t, "val_loss": v, "time": time.time()})
    return v


def _save_adapter(cfg: TrainConfig, spec: ModelSpec, model: nn.Module) -> str:
    """The adapters as peft saves them, for ``PeftModel.from_pretrained(base, RUN/adapter)``."""
    from shardwise.hf.lora import save_adapter

    out = os.path.join(cfg.out, "adapter")
    save_adapter(model, out, base=os.path.abspath(spec.weights_dir) if spec.weights_dir else None)
    return out


def _write_banner(log, cfg: TrainConfig, spec: ModelSpec, model: nn.Module, data, device: torch.device,
                  num_params: int, tokens_per_step: int, start_step: int, note: Optional[str]) -> None:
    """The lines a run starts with: what trains on what, whose defaults, sharding notes, the resume."""
    log.write(f"shardwise train | model {spec.name} ({num_params / 1e6:.2f}M params) | {dist.get_world_size()} "
              f"rank(s), {dist.get_backend()}, {cfg.sharding_strategy} | data {cfg.data}: {data.train_tokens:,} "
              f"train / {data.val_tokens:,} val tokens | {tokens_per_step:,} tokens/step | run dir {cfg.out}")
    log.write(defaults_note(cfg))
    for line in sharding_notes(cfg, model, device):
        log.write(f"note: {line}")
    if note:
        log.write(f"resume: {note}")
    if start_step == 0 and dist.get_rank() == 0 and any(n.startswith("step-") for n in os.listdir(cfg.out)):
        log.write(f"note: {cfg.out} already holds checkpoints and this run starts fresh (no --resume): "
                  f"they will be overwritten step by step; pass --resume latest to continue instead")
    if start_step:
        log.write(f"resumed at step {start_step}")


def _optimizer_step(model: nn.Module, optimizer, scaler, clip_to: float) -> float:
    """Clip and step (skipped by the fp16 scaler on an overflow), then drop the gradients. Returns the
    gradient norm before clipping."""
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip true gradients; an overflow makes the norm inf and the step skip
    if isinstance(optimizer, shardwise.OffloadOptimizer):
        optimizer.step()  # clips inside: the per-unit norms were taken as the gradients landed
        grad_norm = float(optimizer.last_grad_norm)
    else:
        grad_norm = float(shardwise.clip_grad_norm_(model, clip_to))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _plot_and_summarise(cfg: TrainConfig, spec: ModelSpec, metrics_path: str, world: int, start_step: int,
                        summary: dict) -> str:
    """Rank 0: metrics.png and the one summary line of the whole run's curve (metrics.jsonl spans resumes)."""
    png = os.path.join(cfg.out, "metrics.png")
    plot.plot_metrics(metrics_path, png, title=f"{spec.name} | {world} ranks | {cfg.sharding_strategy}")
    vals = [(r["step"], r["val_loss"]) for r in plot.read_metrics(metrics_path) if r.get("val_loss") is not None]
    if vals:
        resumed = f" (resumed at step {start_step})" if start_step else ""
        print(f"validation loss {vals[0][1]:.4f} (step {vals[0][0]}) -> {vals[-1][1]:.4f} (step {vals[-1][0]})"
              f"{resumed} | checkpoint {summary.get('checkpoint')} | {png}", flush=True)
    return png


@record  # with --debug, a failing rank's traceback reaches the launcher's error report
def train_worker(cfg_values: dict[str, Any]) -> dict[str, Any]:
    """Entry point of one rank (module-level so the elastic launcher can pickle it). A failure leaves this
    rank's one-line message for the launcher (``failures``) and exits with status 1, no traceback."""
    cfg = TrainConfig(**cfg_values)
    try:
        launch.init_worker(cfg.backend, cfg.timeout_s, cfg.threads_per_rank)
        return train(cfg)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: the launcher says it once
        if failures.debug_enabled():
            raise
        sys.stdout.flush()
        os._exit(128 + 2)
    except Exception as e:
        if failures.debug_enabled():
            raise
        failures.report_worker_failure(e)  # first: the launcher stops the other ranks once one has exited
        # The process group may be broken (a peer failed or died mid-collective): tearing it down, or the
        # interpreter's own teardown of gloo's threads, can abort in C++ ("terminate called without an
        # active exception") and print past the one line. The line is reported and every file this run
        # writes is closed or committed by now: leave without destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        sys.stdout.flush()
        launch.shutdown_worker()


def run(cfg: TrainConfig) -> dict[int, Any]:
    """Save the resolved config and run every rank (launching them unless torchrun already did)."""
    if not launch.under_torchrun() or int(os.environ.get("RANK", "0")) == 0:
        config_mod.save(cfg, cfg.out)
    return launch.launch(train_worker, dataclasses.asdict(cfg), cfg.nproc)
