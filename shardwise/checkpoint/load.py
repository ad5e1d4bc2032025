"""``load_checkpoint``: each rank reads exactly the element ranges its shards need, whatever world size
and strategy wrote the checkpoint, after the checkpoint has been verified as a whole.

[Note: resharding by element ranges] A checkpoint stores each parameter as 1-D pieces of its flattened
values, ``[start, stop)`` per piece, one piece per writing rank. A loading rank owns ``[lo, hi)`` of the
same flattened parameter (from its own plan). It reads the intersection of ``[lo, hi)`` with every
piece, by ``pread`` of exactly those bytes. Optimizer state pieces have the same ranges as their
parameter's pieces, so they are resharded by the same reads.

Order of events (each step ends in an agreement, so one rank's bad file raises on every rank, and
nothing is written into the model or optimizer until every check has passed on every rank)::

    all ranks   commit.json -> manifest.json -> schema                         (verify.read_manifest)
    all ranks   the manifest describes this model and optimizer                 (match.check_model)
    all ranks   open the files they will read and their share of all files (file i: rank i mod N):
                regular files, recorded sizes, headers holding exactly what the manifest says; their
                share also SHA-256 hashed, so together the ranks hash every file once (verify.open_verified)
    all ranks   read their slices into the shards, the optimizer state, buffers and extra
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from shardwise.engine.checks import agree
from shardwise.engine.surface.optimizer_guard import show_state_as_pieces
from shardwise.engine.surface.pieces import local_of
from shardwise.checkpoint.format import dtype_from_name
from shardwise.checkpoint.match import alias_map, check_model, decode_option, saved_name_of
from shardwise.checkpoint.model_index import optimizer_param_names, persistent_buffers, unique_params
from shardwise.checkpoint.safetensors_file import SafetensorsFile
from shardwise.checkpoint.schema import numel_of
from shardwise.checkpoint.values import decode, decode_scalar_tensor
from shardwise.checkpoint.verify import close_all, open_verified, read_manifest
from shardwise.errors import ShardwiseError

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class CheckpointInfo:
    """The facts about a checkpoint that need no model: read from its (verified) manifest."""

    path: Path
    step: Optional[int]
    world_size: int
    strategy: str
    library_version: str
    has_optimizer: bool
    num_params: int  # elements, over unique parameters


def checkpoint_info(path: PathLike) -> CheckpointInfo:
    m = read_manifest(Path(path))
    numel = sum(numel_of(p["shape"]) for p in m["params"].values())
    return CheckpointInfo(Path(path), m["step"], m["world_size"], m["strategy"], m["library_version"],
                          m["optimizer"] is not None, numel)


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    verify_checksums: bool = True,
    frozen_base: Optional[dict] = None,
) -> Any:
    """Load a checkpoint written by ``save_checkpoint`` into ``model`` (and ``optimizer``); return ``extra``.

    Every rank must call it. Works at any world size and strategy. ``extra`` is the calling rank's own when
    the world size is unchanged, else rank 0's. Raises ``ShardwiseError`` on every rank, naming the file,
    for a missing, truncated, corrupt, tampered-with or foreign checkpoint, or one of a different model;
    then the model and optimizer are untouched. ``verify_checksums=False`` skips only the SHA-256 of the
    rank files (commit record, schema, sizes and headers are always checked).

    A checkpoint saved with ``frozen_base`` (adapters only) leaves the model's frozen parameters as they
    are: load them first (``shardwise.load_pretrained``) and pass their ``frozen_base`` record, which
    must name the same weights (identity and dtype), else this raises before touching anything.
    """
    from shardwise.engine.core.runtime import runtime_of

    ckpt = Path(path)
    rt = runtime_of(model)
    manifest = agree.agreed(lambda: read_manifest(ckpt), f"reading {ckpt}")
    agree.agreed(lambda: check_model(ckpt, manifest, rt, model, optimizer, frozen_base), f"checking {ckpt}")
    plan = agree.agreed(lambda: _plan(manifest, rt, model, optimizer), f"planning reads from {ckpt}")

    names = sorted(manifest["files"])
    share = names[agree.rank()::agree.world_size()]  # file i is hashed by rank i mod N: each file once
    files, problem = agree.attempt(
        lambda: open_verified(ckpt, manifest, plan.files | set(share), share if verify_checksums else ()),
        f"checking {ckpt}")
    try:
        agree.raise_if_any(problem)
        return agree.agreed(lambda: _read_all(manifest, plan, files, rt, optimizer), f"loading {ckpt}")
    finally:
        close_all(files or {})


# ---- planning -----------------------------------------------------------------------------------------


@dataclass
class _Read:
    """Copy elements [a, b) of a saved piece into a destination at ``dest_at``."""

    fqn: str
    piece: dict
    a: int
    b: int
    dest: torch.Tensor  # the flat shard the parameter's local piece lives in
    dest_at: int
    local_lo: int  # first element of the parameter this rank owns: where the optimizer tensors start
    optim_dest: dict  # state name -> local 1-D tensor (elements [lo, hi) of the parameter) to fill


@dataclass
class _Plan:
    reads: list[_Read]
    optim_dest: dict[str, dict[str, torch.Tensor]]  # parameter -> state name -> this rank's piece
    buffers: list[tuple[str, torch.Tensor]]
    extra: dict
    files: set[str]


def _plan(manifest: dict, rt, model: nn.Module, optimizer) -> _Plan:
    saved, alias_of = manifest["params"], alias_map(manifest)
    optim_info = manifest["optimizer"]["state"] if optimizer is not None else {}
    held = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
    reads, files, optim_dest = [], set(), {}
    for spec, group, i in unique_params(rt):
        name = saved_name_of(spec, saved, alias_of)
        lo, hi, at = group.local_slices[i]
        if hi <= lo or name is None:  # None: a frozen parameter of an adapter-only checkpoint (check_model)
            continue
        dest = {}
        if id(group.shard_params[i]) in held and name in optim_info:
            for state_name, dt in optim_info[name]["tensors"].items():
                dest[state_name] = torch.empty(hi - lo, dtype=dtype_from_name(dt, name), device=group.shard.device)
            optim_dest[name] = dest
        for piece in saved[name]["pieces"]:  # the schema checked that they tile the parameter in order
            a, b = max(lo, piece["start"]), min(hi, piece["stop"])
            if a < b:
                reads.append(_Read(name, piece, a, b, group.shard, at + (a - lo), lo, dest))
                files.add(piece["file"])
    extra = _own_extra(manifest)
    files.add(extra["file"])
    buffers = persistent_buffers(model, rt)
    files.update(manifest["buffers"][fqn]["file"] for fqn, _ in buffers)
    return _Plan(reads, optim_dest, buffers, extra, files)


def _own_extra(manifest: dict) -> dict:
    extras = manifest["extra"]
    same_world = manifest["world_size"] == agree.world_size()
    return extras[agree.rank()] if same_world else extras[0]


# ---- reading ------------------------------------------------------------------------------------------


def _read_all(manifest: dict, plan: _Plan, files: dict[str, SafetensorsFile], rt, optimizer) -> Any:
    rt.shards_written()
    with torch.no_grad():
        for r in plan.reads:
            p = r.piece
            src = files[p["file"]].read(p["key"], r.a - p["start"], r.b - p["start"])
            r.dest.narrow(0, r.dest_at, r.b - r.a).copy_(src)
            for state_name, dest in r.optim_dest.items():
                src = files[p["file"]].read(p["optim"][state_name], r.a - p["start"], r.b - p["start"])
                dest.narrow(0, r.a - r.local_lo, r.b - r.a).copy_(src)
        for fqn, buf in plan.buffers:
            entry = manifest["buffers"][fqn]
            buf.copy_(files[entry["file"]].read(entry["key"]))
    if optimizer is not None:
        _load_optimizer(manifest, rt, optimizer, plan.optim_dest)
    entry = plan.extra
    return decode(entry["value"], lambda key: files[entry["file"]].read(key))


def _load_optimizer(manifest: dict, rt, optimizer: torch.optim.Optimizer, pieces: dict) -> None:
    """Build a torch optimizer state dict (integer ids, as torch expects) and hand it to load_state_dict,
    which applies torch's own rules for state placement (e.g. Adam's ``step`` stays on the CPU). ProcessGroups,
    options and dtypes have been checked against this optimizer already (``match.check_model``)."""
    saved = manifest["optimizer"]
    names = optimizer_param_names(rt, optimizer)
    alias_of = alias_map(manifest)
    local_numel = {id(g.shard_params[i]): local_of(g.shard_params[i]).numel() for _s, g, i in unique_params(rt)}
    state: dict[int, dict] = {}
    groups = []
    index = 0
    for group, sgroup in zip(optimizer.param_groups, saved["param_groups"]):
        options = {k: decode_option(v) for k, v in sgroup["options"].items()}
        ids = []
        for p in group["params"]:
            name = alias_of.get(names[id(p)], names[id(p)])
            info = saved["state"].get(name)
            if info is not None:
                entry: dict[str, Any] = {}
                for sname, scalar in info["scalars"].items():
                    entry[sname] = scalar["python"] if "python" in scalar else decode_scalar_tensor(scalar, name)
                got = pieces.get(name, {})
                for sname, dt in info["tensors"].items():
                    if sname in got:
                        entry[sname] = got[sname]
                    else:  # this rank owns none of the parameter: an empty piece, as the optimizer would have
                        entry[sname] = torch.empty(local_numel[id(p)], dtype=dtype_from_name(dt, name), device=p.device)
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**options, "params": ids})
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, TypeError, RuntimeError) as e:  # torch's own checks; ours should have caught it first
        raise ShardwiseError(f"{type(optimizer).__name__}.load_state_dict refused the checkpoint's state: {e}") from None
    show_state_as_pieces(optimizer)  # this rank's elements, shown as pieces of their parameters as after a step
