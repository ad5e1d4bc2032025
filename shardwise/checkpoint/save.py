"""``save_checkpoint``: every rank writes its own shard pieces, in parallel, into one temporary directory
that rank 0 then renames into place.

Order of events (every arrow between ranks is a collective, and each one also carries errors, so a
failure on any rank raises on all of them instead of leaving the others waiting)::

    all ranks   build their payload in memory: views of the shards, no copies
    rank 0      remove a stale <parent>/.tmp-<name> left by a crashed save, create it afresh
                ---- agree ----
    all ranks   write rank-XXXXX-of-YYYYY.safetensors (streamed, hashed while written, fsynced)
                ---- agree; gather each rank's file index (JSON) on rank 0 ----
    rank 0      write manifest.json, then commit.json (the manifest's size and SHA-256), fsync both and
                the directory, rename .tmp-<name> -> <name>, fsync the parent (the rename is the commit
                point)
                ---- agree ----

A failed save (a full disk, say) raises on every rank with one line naming the file and errno; rank 0
then removes the temporary directory, so the space is freed and earlier checkpoints stay as they were.

Nothing is gathered on one rank but a few kilobytes of JSON per rank. Under hybrid and no_shard
strategies only the ranks of replicate index 0 write parameters and optimizer state (the others hold
identical copies); every rank still writes a file, for its own ``extra`` tensors.
"""

from __future__ import annotations

import operator
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.checks import agree
from shardwise.engine.surface.pieces import local_of
from shardwise.checkpoint.commit import write_commit_record
from shardwise.checkpoint.frozen_base import check_record
from shardwise.checkpoint.format import (FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, TMP_PREFIX, TRASH_PREFIX,
                                         dtype_name, fsync_dir, rank_file_name, replace_dir, write_json_durably,
                                         write_safetensors)
from shardwise.checkpoint.model_description import describe
from shardwise.checkpoint.model_index import (frozen_dtype, optimizer_class_name, optimizer_param_names,
                                              persistent_buffers, trains, unique_params)
from shardwise.checkpoint.values import encode, encode_scalar_tensor
from shardwise.errors import ShardwiseError
from shardwise.engine.surface.optimizer_guard import STAMP_KEY

PathLike = Union[str, os.PathLike]


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    step: Optional[int] = None,
    extra: Any = None,
    frozen_base: Optional[dict] = None,
) -> Path:
    """Save ``model`` (sharded by ``shardwise.shard``) and ``optimizer`` to the directory ``path``.

    Every rank must call it. ``extra`` is per rank (RNG states differ between ranks): any mix of
    None/bool/int/float/str/list/tuple/dict/tensor/ndarray, stored without pickle; ``load_checkpoint``
    gives each rank back its own when the world size is unchanged. The directory appears atomically,
    complete, or not at all; an existing directory of the same name is replaced. Returns ``path``.

    ``frozen_base`` (``checkpoint.frozen_base.base_record``: where the frozen parameters' weights are and
    their identity): the parameters that do not require gradients are not stored, the record is; a load
    then needs the same base in the model (LoRA: the checkpoint holds the adapters only).
    """
    from shardwise.engine.core.runtime import runtime_of

    final = Path(path)
    rt = runtime_of(model)
    me, world = agree.rank(), agree.world_size()
    tmp = final.parent / f"{TMP_PREFIX}{final.name}"
    file_name = rank_file_name(me, world)
    step = _checked_step(step)
    if frozen_base is not None:
        check_record(frozen_base, "save_checkpoint(frozen_base=...)")

    payload = agree.agreed(lambda: _build_payload(model, rt, optimizer, extra, file_name,
                                                   frozen_base is not None), "preparing the checkpoint")
    tensors, index = payload

    def prepare_dir() -> None:
        if me == 0:
            final.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a save that crashed: never mix its files with ours
            tmp.mkdir()

    agree.agreed(prepare_dir, f"creating {tmp}")

    def write_own_file() -> None:
        size, sha = write_safetensors(tmp / file_name, tensors, metadata={"format": "pt", "writer": FORMAT_NAME})
        index["bytes"], index["sha256"] = size, sha
        tensors.clear()  # views of the shards and optimizer state; nothing to keep

    def commit() -> None:
        if me != 0:
            return
        manifest = _manifest(indexes, rt, model, optimizer, step, world, frozen_base)
        write_commit_record(tmp, write_json_durably(tmp / MANIFEST_NAME, manifest))
        fsync_dir(tmp)  # every file's entry is durable before the directory can appear under its name
        _commit_dir(tmp, final)

    try:
        agree.agreed(write_own_file, f"writing {tmp / file_name}")
        indexes = agree.gather_json(index)
        agree.agreed(commit, f"committing {final}")
    except ShardwiseError as e:
        if me == 0:  # every rank is past its writes (the failure was agreed): free the space they took
            shutil.rmtree(tmp, ignore_errors=True)
        raise ShardwiseError(f"{e}; {final} was not saved (earlier checkpoints are untouched)") from None
    return final


def _checked_step(step: Any) -> Optional[int]:
    if step is None:
        return None
    try:
        value = operator.index(step)
    except TypeError:
        raise ShardwiseError(f"save_checkpoint(step={step!r}): the step must be an integer or None") from None
    if value < 0:
        raise ShardwiseError(f"save_checkpoint(step={step!r}): the step must be >= 0")
    return value


def _commit_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``: the commit point. A crash in between leaves only .trash-/.tmp- names,
    which readers skip."""
    replace_dir(tmp, final, final.parent / f"{TRASH_PREFIX}{final.name}-{time.time_ns()}")


def _is_writer(rt) -> bool:
    """Replicas hold identical shards: only replicate index 0 writes them."""
    return rt.pgs.replicate is None or dist.get_rank(rt.pgs.replicate) == 0


def _stored_params(rt, omit_frozen: bool):
    """The parameters a checkpoint stores: all, or with a frozen base recorded, those that train."""
    return [(spec, group, i) for spec, group, i in unique_params(rt) if trains(group, i) or not omit_frozen]


def _build_payload(model, rt, optimizer, extra, file_name: str, omit_frozen: bool
                   ) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's tensors (views, nothing copied) and the JSON index describing them."""
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, Any] = {"rank": agree.rank(), "file": file_name, "params": {}, "optim_state": {}}
    writer = _is_writer(rt)
    names = optimizer_param_names(rt, optimizer) if optimizer is not None else {}
    if writer:
        for spec, group, i in _stored_params(rt, omit_frozen):
            lo, hi, at = group.local_slices[i]
            shard_param = group.shard_params[i]
            entry: dict[str, Any] = {"start": lo, "stop": hi}
            if hi > lo:
                entry["key"] = f"param/{spec.fqn}"
                tensors[entry["key"]] = group.shard.narrow(0, at, hi - lo).detach()
            if optimizer is not None and shard_param in optimizer.state:
                entry["optim"], info = _optimizer_pieces(spec.fqn, shard_param, optimizer.state[shard_param], tensors)
                index["optim_state"][spec.fqn] = info
            index["params"][spec.fqn] = entry
    if optimizer is not None and agree.rank() == 0:
        index["optimizer"] = {"class": optimizer_class_name(optimizer),
                              "param_groups": _param_groups(optimizer, names)}
    if agree.rank() == 0:
        index["buffers"] = {}
        for fqn, buf in persistent_buffers(model, rt):
            key = f"buffer/{fqn}"
            tensors[key] = buf.detach()
            index["buffers"][fqn] = {"key": key, "shape": list(buf.shape), "dtype": dtype_name(buf.dtype)}

    def sink(where: str, t: torch.Tensor) -> str:
        key = f"extra/{len([k for k in tensors if k.startswith('extra/')])}"
        tensors[key] = t.detach()
        return key

    index["extra"] = encode(extra, sink)
    return tensors, index


def _optimizer_pieces(fqn: str, shard_param: torch.Tensor, state: dict, tensors: dict) -> tuple[dict, dict]:
    """Store per-element state pieces (same shape as the shard piece); describe scalars in JSON."""
    keys: dict[str, str] = {}
    info: dict[str, Any] = {"tensors": {}, "scalars": {}}
    for name, value in state.items():
        if name == STAMP_KEY:
            continue  # which rank's piece the state belongs to: a checkpoint reshards, so it does not apply
        value = local_of(value)  # (between steps optimizer.state shows this rank's elements as pieces)
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                info["scalars"][name] = encode_scalar_tensor(value)
            elif value.shape == local_of(shard_param).shape:
                info["tensors"][name] = dtype_name(value.dtype)
                if value.numel():
                    keys[name] = f"optim/{fqn}/{name}"
                    tensors[keys[name]] = value.detach()
            else:
                raise ShardwiseError(
                    f"optimizer state {name!r} of parameter {fqn!r} has shape {tuple(value.shape)}, neither a scalar "
                    f"nor the shape of the parameter's shard {tuple(local_of(shard_param).shape)}: it cannot be resharded"
                )
        elif value is None or isinstance(value, (bool, int, float, str)):
            info["scalars"][name] = {"python": value}
        else:
            raise ShardwiseError(f"optimizer state {name!r} of parameter {fqn!r} is a {type(value).__name__}; "
                                 f"only tensors and plain scalars can be checkpointed")
    return keys, info


def _param_groups(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict]:
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        options = {}
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                if v.dim() != 0:
                    raise ShardwiseError(f"optimizer param_groups[{gi}][{k!r}] is a non-scalar tensor; cannot store it")
                options[k] = {"__scalar_tensor__": encode_scalar_tensor(v)}
            else:
                options[k] = encode(v, _no_tensors, f"optimizer.param_groups[{gi}][{k!r}]")
        groups.append({"params": [names[id(p)] for p in group["params"]], "options": options})
    return groups


def _no_tensors(where: str, t: torch.Tensor) -> str:
    raise ShardwiseError(f"{where}: tensors are not supported here")


def _manifest(indexes: list[dict], rt, model: nn.Module, optimizer, step: Optional[int], world: int,
              frozen_base: Optional[dict]) -> dict:
    """Merge the ranks' indexes into the one description loaders read."""
    from shardwise.version import __version__
    params: dict[str, Any] = {}
    for spec, group, i in _stored_params(rt, frozen_base is not None):
        params[spec.fqn] = {
            "shape": list(spec.shape),
            "dtype": dtype_name(spec.dtype),
            "requires_grad": trains(group, i),
            "aliases": [r.fqn for r in spec.refs[1:]],  # tied names: stored once, under the first
            "pieces": [],
        }
    optim_state: dict[str, Any] = {}
    for ix in indexes:
        for fqn, entry in ix["params"].items():
            if entry["stop"] > entry["start"]:
                params[fqn]["pieces"].append({"file": ix["file"], "start": entry["start"], "stop": entry["stop"],
                                              "key": entry["key"], "optim": entry.get("optim", {})})
        for fqn, info in ix["optim_state"].items():
            optim_state.setdefault(fqn, info)  # scalars (Adam's step) are equal on every rank
    for p in params.values():
        p["pieces"].sort(key=lambda piece: piece["start"])
    rank0 = indexes[0]
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "created_unix": time.time(),
        "step": step,
        "world_size": world,
        "strategy": rt.strategy.value,
        "shard_size": rt.pgs.shard_size,
        "replicate_size": rt.pgs.replicate_size,
        "model": describe(model),
        "files": {ix["file"]: {"rank": ix["rank"], "bytes": ix["bytes"], "sha256": ix["sha256"]} for ix in indexes},
        "params": params,
        "buffers": {k: {**v, "file": rank0["file"]} for k, v in rank0.get("buffers", {}).items()},
        "optimizer": None,
        "extra": [{"file": ix["file"], "value": ix["extra"]} for ix in indexes],
    }
    if optimizer is not None:
        manifest["optimizer"] = {**rank0["optimizer"], "state": optim_state}
    if frozen_base is not None:
        manifest["frozen_base"] = {**frozen_base, "dtype": frozen_dtype(rt)}
    return manifest
