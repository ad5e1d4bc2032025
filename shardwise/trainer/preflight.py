"""Everything about a ``shardwise train`` run that can be checked before a worker starts, checked in the
launching process: this machine (backend, ranks), the model (config, block classes, positions), the
data (present, long enough for every rank, token ids inside the vocabulary), the run directory
(writable) and the checkpoint to resume from (verified, of this model).

A problem found here is one line naming the option and what is valid. Found inside the workers instead,
it would arrive after every process had started, once per rank, wrapped in the launcher's report.
Under torchrun each worker runs these checks itself before joining the process group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from shardwise.engine.base.device import nccl_usable, pick_backend
from shardwise.trainer.config import ConfigError, TrainConfig
from shardwise.trainer.data import BYTE_VOCAB, DataError, open_splits, rank_bounds
from shardwise.trainer.jsonl_data import check_files, is_jsonl_source, load_tokenizer
from shardwise.hf.model_spec import ModelError, ModelSpec, resolve_model
from shardwise.trainer.sources import open_streams

RANKS_PER_CORE = 4  # local gloo ranks beyond this many per core only wait on each other until they time out


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def check_before_launch(cfg: TrainConfig, world_size: int, local_ranks: int, launching: bool) -> ModelSpec:
    """Raise ConfigError / ModelError / DataError / ShardwiseError for a run that cannot work; return the
    model spec. ``launching``: this process is about to start ``local_ranks`` workers itself."""
    check_machine(cfg, local_ranks, launching)
    try:
        spec = resolve_model(cfg.model)
    except ModelError as e:
        named = str(e).startswith("--model") or cfg.model in str(e)  # say the path once
        raise ModelError(str(e) if str(e).startswith("--model") else
                         f"--model: {e}" if named else f"--model {cfg.model}: {e}") from None
    model = build_meta(cfg, spec)
    check_weights(cfg, spec, model)
    check_out(cfg)  # before the data: .jsonl data is tokenised into the run directory
    check_data(cfg, spec, world_size, build_cache=launching)
    check_resume(cfg, spec, model)
    return spec


def check_machine(cfg: TrainConfig, local_ranks: int, launching: bool) -> None:
    nccl = pick_backend(cfg.backend) == "nccl"
    if cfg.backend == "nccl" and not nccl_usable():
        raise ConfigError("--backend nccl needs CUDA GPUs and a torch built with NCCL; this machine has "
                          f"{'no usable GPU' if not torch.cuda.is_available() else 'no NCCL'}: use --backend gloo "
                          f"(or auto)")
    if nccl and local_ranks > torch.cuda.device_count():
        raise ConfigError(f"--nproc {local_ranks}: NCCL runs one rank per GPU and this machine has "
                          f"{torch.cuda.device_count()}; use --nproc {torch.cuda.device_count()} or --backend gloo")
    cores = usable_cores()
    if launching and not nccl and local_ranks > max(2, RANKS_PER_CORE * cores):
        raise ConfigError(f"--nproc {local_ranks}: this machine has {cores} usable CPU core(s), and more than "
                          f"{RANKS_PER_CORE} gloo ranks per core would only wait on each other until --timeout-s; "
                          f"use --nproc {max(2, RANKS_PER_CORE * cores)} or fewer, or torchrun across machines")


def build_meta(cfg: TrainConfig, spec: ModelSpec) -> nn.Module:
    """The model on the meta device (nothing allocated): its units must exist, and seq_len must fit."""
    try:
        model = spec.build("meta")
    except ModelError:
        raise
    except Exception as e:  # a config that its own model class refuses (heads not dividing the width, ...)
        raise ModelError(f"--model {cfg.model}: cannot build the model from it: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if cfg.lora_r:
        from shardwise.trainer.lora_model import wrap_lora

        model, _ = wrap_lora(cfg, spec, model, None, True)  # raises for a GPT preset or unknown target modules
    spec.units(model, cfg.auto_wrap, cfg.transformer_layer_cls_to_wrap)  # raises for unknown block classes
    check_seq_len(cfg, spec)
    return model


def check_weights(cfg: TrainConfig, spec: ModelSpec, model: nn.Module) -> None:
    """--model DIR with weights: headers, index, names and shapes against the meta model, no tensor data read."""
    from shardwise.errors import ShardwiseError
    from shardwise.hf.pretrained import check_loadable

    if spec.weights_dir is None:
        return
    try:
        check_loadable(model, spec.weights_dir)
    except ShardwiseError as e:
        raise ModelError(f"--model {cfg.model}: {e}") from None


def check_seq_len(cfg: TrainConfig, spec: ModelSpec) -> None:
    if spec.max_seq_len is not None and cfg.seq_len > spec.max_seq_len:
        raise ConfigError(f"--seq-len {cfg.seq_len}: longer than {spec.name}'s {spec.max_seq_len} positions; "
                          f"use --seq-len {spec.max_seq_len} or less")


def check_token_ids(cfg: TrainConfig, spec: ModelSpec, largest: int) -> None:
    if largest >= spec.vocab_size:
        raise DataError(f"--data {cfg.data}: holds token id {largest}, but {spec.name}'s vocabulary has "
                        f"{spec.vocab_size} entries (ids 0..{spec.vocab_size - 1}); use a model with a larger "
                        f"vocabulary or other data")


def check_data(cfg: TrainConfig, spec: ModelSpec, world_size: int, build_cache: bool = True) -> None:
    """``build_cache``: tokenise .jsonl data now (the launcher, with a progress bar); without it (a torchrun
    worker, whose rank 0 tokenises once the group is up) only the files and the tokenizer are checked."""
    if is_jsonl_source(cfg.data):
        if not build_cache:
            check_files(cfg.data)
            load_tokenizer(cfg.model, cfg.data)
            return
        check_packed_data(cfg, spec, world_size)
        return
    train, val = open_splits(cfg.data, cfg.val_fraction)
    need = cfg.seq_len + 2  # one window of seq_len + 1 tokens, and at least two places to start it
    for stream, what in ((train, "training"), (val, "validation")):
        smallest = min(hi - lo for lo, hi in (rank_bounds(len(stream), r, world_size) for r in range(world_size)))
        if smallest < need:
            raise DataError(f"--data {cfg.data}: the {what} split holds {len(stream)} tokens, {smallest} for the "
                            f"smallest of {world_size} rank(s), fewer than --seq-len + 2 = {need}; use more data, "
                            f"fewer ranks or a shorter --seq-len")
    # Byte-level data cannot exceed 255: scan only when the vocabulary is smaller or the ids are wider.
    if train.dtype.itemsize > 1 or spec.vocab_size < BYTE_VOCAB:
        check_token_ids(cfg, spec, max(train.max_token(), val.max_token()))


def check_packed_data(cfg: TrainConfig, spec: ModelSpec, world_size: int) -> None:
    """.jsonl data, tokenised into the cache now: one packed sequence per rank at least, ids in the vocabulary."""
    train, val, _ = open_streams(cfg, build=True, progress=cfg.progress)
    for (tokens, _mask), what in ((train, "training"), (val, "validation")):
        chunks = max(len(tokens) - 1, 0) // cfg.seq_len
        if chunks < world_size:
            raise DataError(f"--data {cfg.data}: the {what} split holds {len(tokens)} tokens, {chunks} sequence(s) "
                            f"of --seq-len {cfg.seq_len}, fewer than one per rank ({world_size}); use more data, "
                            f"fewer ranks or a shorter --seq-len")
    check_token_ids(cfg, spec, max(train[0].max_token(), val[0].max_token()))


def check_out(cfg: TrainConfig) -> None:
    from shardwise.checkpoint.files import unwritable_dir_problem

    problem = unwritable_dir_problem(Path(cfg.out))
    if problem:
        raise ConfigError(f"--out {cfg.out}: {problem}; the run directory must be a directory shardwise can write")


def check_resume(cfg: TrainConfig, spec: ModelSpec, model: nn.Module) -> Optional[Path]:
    """The checkpoint a resume would load, verified (commit record, schema, files' sizes) and compared
    with the model (names, ties, shapes) and, for an adapter-only LoRA checkpoint, with --model DIR's
    weights; None when the run starts fresh."""
    from shardwise.checkpoint.manager import find_latest
    from shardwise.checkpoint.model_description import compare_with_model
    from shardwise.checkpoint.verify import listed_files_problem, read_manifest
    from shardwise.errors import ShardwiseError
    from shardwise.trainer.state import check_adapter_settings

    if not cfg.resume:
        return None
    if cfg.resume in ("latest", "auto", "true"):
        path = find_latest(cfg.out)  # raises, naming it, if the newest step-* entry is damaged
        if path is None:
            return None
    else:
        path = Path(cfg.resume)
        if not path.exists():
            raise ConfigError(f"--resume {cfg.resume}: no such checkpoint or run directory; valid: latest, auto, a "
                              f"checkpoint directory, or a run directory")
        if path.is_dir() and not any((path / n).exists() for n in ("commit.json", "manifest.json")):
            latest = find_latest(path)
            if latest is None:
                raise ConfigError(f"--resume {cfg.resume}: neither a checkpoint nor a run directory holding one")
            path = latest
    manifest = read_manifest(path)
    problem = listed_files_problem(path, manifest)
    if problem:
        raise ShardwiseError(f"--resume {path}: {problem}")
    check_adapter_settings(path, model)  # another --lora-r: one line naming it, not the tensors it changes
    problem = compare_with_model(model, manifest)
    if problem:
        raise ShardwiseError(f"--resume {path}: checkpoint of a different model than --model {cfg.model}: {problem}")
    saved_base = manifest.get("frozen_base")
    if saved_base is not None:
        from shardwise.trainer.lora_model import run_frozen_base
        from shardwise.trainer.state import check_frozen_base

        check_frozen_base(path, run_frozen_base(cfg, spec, saved_base))
    return path
