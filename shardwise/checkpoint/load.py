"""``load_checkpoint``: each rank reads exactly the element ranges its shards need, whatever world size
and strategy wrote the checkpoint.

[Note: resharding by element ranges] A checkpoint stores each parameter as 1-D pieces of its flattened
values, ``[start, stop)`` per piece, one piece per writing rank. A loading rank owns ``[lo, hi)`` of the
same flattened parameter (from its own plan). It reads the intersection of ``[lo, hi)`` with every
piece, through ``safe_open(...).get_slice(key)[a:b]``, which reads those bytes and no others. Optimizer
state pieces have the same ranges as their parameter's pieces, so they are resharded by the same reads.

Order of events (each step ends in an agreement, so one rank's bad file raises on every rank)::

    all ranks   read manifest.json; check it describes this model (names, shapes, dtypes)
    all ranks   check the files they are about to read: present, full size, SHA-256 as recorded
    all ranks   read their slices into the shards, build the optimizer state, read buffers and extra
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from safetensors import safe_open

from shardwise.checkpoint import agree
from shardwise.checkpoint.format import dtype_from_name, dtype_name, files_problem, read_manifest
from shardwise.checkpoint.model_index import optimizer_param_names, persistent_buffers, unique_params
from shardwise.checkpoint.values import decode, decode_scalar_tensor
from shardwise.errors import ShardwiseError

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class CheckpointInfo:
    """The facts about a checkpoint that need no model: read from its manifest."""

    path: Path
    step: Optional[int]
    world_size: int
    strategy: str
    library_version: str
    has_optimizer: bool
    num_params: int  # elements, over unique parameters


def checkpoint_info(path: PathLike) -> CheckpointInfo:
    m = read_manifest(Path(path))
    numel = 0
    for p in m["params"].values():
        n = 1
        for d in p["shape"]:
            n *= d
        numel += n
    return CheckpointInfo(Path(path), m.get("step"), m["world_size"], m.get("strategy", "?"),
                          m.get("library_version", "?"), m.get("optimizer") is not None, numel)


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    verify_checksums: bool = True,
) -> Any:
    """Load a checkpoint written by ``save_checkpoint`` into ``model`` (and ``optimizer``); return ``extra``.

    Every rank must call it. Works at any world size and strategy. ``extra`` is the calling rank's own when
    the world size is unchanged, else rank 0's. Raises ``ShardwiseError`` on every rank, naming the file,
    for a missing, truncated, corrupt or foreign checkpoint, or one of a different model.
    """
    from shardwise.api import runtime_of

    ckpt = Path(path)
    rt = runtime_of(model)
    manifest = agree.agreed(lambda: read_manifest(ckpt), f"reading {ckpt}")
    agree.raise_if_any(agree.agreed(lambda: _model_mismatch(ckpt, manifest, rt, optimizer), f"checking {ckpt}"))

    def plan() -> tuple[list[_Read], set[str], dict, list]:
        reads, files = _plan_reads(manifest, rt, optimizer)
        extra_entry = _own_extra(manifest)
        files.add(extra_entry["file"])
        model_buffers = persistent_buffers(model, rt)
        files.update(manifest["buffers"][fqn]["file"] for fqn, _ in model_buffers if fqn in manifest["buffers"])
        return reads, files, extra_entry, model_buffers

    # A damaged manifest can fail here on one rank only (the pieces it needs): agree, never hang.
    reads, files, extra_entry, model_buffers = agree.agreed(plan, f"planning reads from {ckpt}")
    agree.raise_if_any(agree.agreed(lambda: files_problem(ckpt, manifest, files, verify_checksums), f"checking {ckpt}"))

    def read_all() -> Any:
        with _Reader(ckpt) as reader:
            optim_tensors = _read_params(reads, reader)
            if optimizer is not None:
                _load_optimizer(manifest, rt, optimizer, optim_tensors)
            _read_buffers(manifest, model_buffers, reader)
            entry = extra_entry
            return decode(entry["value"], lambda key: reader.whole(entry["file"], key))

    return agree.agreed(read_all, f"loading {ckpt}")


# ---- checks -------------------------------------------------------------------------------------------


def _model_mismatch(ckpt: Path, manifest: dict, rt, optimizer) -> Optional[str]:
    saved = manifest["params"]
    alias_of = {a: name for name, p in saved.items() for a in p.get("aliases", [])}
    problems, missing = [], []
    seen = set()
    for spec, _g, _i in unique_params(rt):
        name = _saved_name(spec, saved, alias_of)
        if name is None:
            missing.append(spec.fqn)
            continue
        seen.add(name)
        entry = saved[name]
        if list(spec.shape) != list(entry["shape"]):
            problems.append(f"{spec.fqn}: shape {tuple(entry['shape'])} in the checkpoint, {tuple(spec.shape)} in the model")
        elif dtype_name(spec.dtype) != entry["dtype"]:
            problems.append(f"{spec.fqn}: dtype {entry['dtype']} in the checkpoint, {dtype_name(spec.dtype)} in the model")
    unexpected = [n for n in saved if n not in seen]
    if missing:
        problems.insert(0, f"parameters missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        problems.insert(1 if missing else 0, f"parameters in the checkpoint but not in the model: {_listing(unexpected)}")
    if optimizer is not None and manifest.get("optimizer") is None:
        problems.append("an optimizer was passed but the checkpoint holds no optimizer state")
    elif optimizer is not None and manifest["optimizer"]["class"] != type(optimizer).__name__:
        problems.append(f"optimizer state was saved from {manifest['optimizer']['class']}, "
                        f"not {type(optimizer).__name__}")
    if len(problems) > 6:
        problems = problems[:6] + [f"and {len(problems) - 6} more differences"]
    if problems:
        return f"{ckpt}: checkpoint of a different model: " + "; ".join(problems)
    return None


def _saved_name(spec, saved: dict, alias_of: dict) -> Optional[str]:
    for ref in spec.refs:
        if ref.fqn in saved:
            return ref.fqn
        if ref.fqn in alias_of:
            return alias_of[ref.fqn]
    return None


def _listing(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _own_extra(manifest: dict) -> dict:
    extras = manifest.get("extra") or [{"file": next(iter(manifest["files"])), "value": None}]
    same_world = manifest["world_size"] == agree.world_size() and len(extras) == agree.world_size()
    return extras[agree.rank()] if same_world else extras[0]


# ---- reading ------------------------------------------------------------------------------------------


@dataclass
class _Read:
    """Copy elements [a, b) of a saved piece into a destination at ``dest_at``."""

    fqn: str
    piece: dict
    a: int
    b: int
    dest: torch.Tensor  # the parameter's local 1-D shard piece
    dest_at: int
    local_lo: int  # first element of the parameter this rank owns: where the optimizer tensors start
    optim_dest: dict  # state name -> local 1-D tensor (elements [lo, hi) of the parameter) to fill


def _plan_reads(manifest: dict, rt, optimizer) -> tuple[list[_Read], set[str]]:
    saved = manifest["params"]
    alias_of = {a: name for name, p in saved.items() for a in p.get("aliases", [])}
    optim_info = (manifest.get("optimizer") or {}).get("state", {}) if optimizer is not None else {}
    held = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
    reads, files = [], set()
    for spec, group, i in unique_params(rt):
        name = _saved_name(spec, saved, alias_of)
        lo, hi, at = group.local_slices[i]
        if hi <= lo:
            continue
        optim_dest = {}
        shard_param = group.shard_params[i]
        if id(shard_param) in held and name in optim_info:
            for state_name, dt in optim_info[name]["tensors"].items():
                optim_dest[state_name] = torch.empty(hi - lo, dtype=dtype_from_name(dt, name), device=group.shard.device)
        covered = lo
        for piece in saved[name]["pieces"]:
            a, b = max(lo, piece["start"]), min(hi, piece["stop"])
            if a >= b:
                continue
            if a != covered:
                break
            reads.append(_Read(name, piece, a, b, group.shard, at + (a - lo), lo, optim_dest))
            files.add(piece["file"])
            covered = b
        if covered != hi:
            raise ShardwiseError(f"checkpoint manifest has no values for elements [{covered}, {hi}) of parameter "
                                 f"{name!r}; the manifest is damaged")
    return reads, files


class _Reader:
    """Open safetensors files once each and read slices of their tensors (memory-mapped, lazy)."""

    def __init__(self, ckpt: Path):
        self.ckpt = ckpt
        self._open: dict[str, Any] = {}

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc) -> None:
        self._open.clear()  # drops the memory maps

    def _handle(self, file: str):
        if file not in self._open:
            path = self.ckpt / file
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:
                raise ShardwiseError(f"{path}: not a readable safetensors file ({e})") from None
            self._open[file] = (handle, set(handle.keys()))
        return self._open[file]

    def _check_key(self, file: str, key: str):
        handle, keys = self._handle(file)
        if key not in keys:
            raise ShardwiseError(f"{self.ckpt / file}: has no tensor {key!r}, which the manifest lists "
                                 f"(renamed, or a file from another checkpoint)")
        return handle

    def range(self, file: str, key: str, start: int, stop: int, expect_numel: int) -> torch.Tensor:
        handle = self._check_key(file, key)
        sl = handle.get_slice(key)
        shape = sl.get_shape()
        if len(shape) != 1 or shape[0] != expect_numel:
            raise ShardwiseError(f"{self.ckpt / file}: tensor {key!r} has shape {shape}, the manifest records "
                                 f"[{expect_numel}]")
        return sl[start:stop]

    def whole(self, file: str, key: str) -> torch.Tensor:
        return self._check_key(file, key).get_tensor(key)


def _read_params(reads: list[_Read], reader: _Reader) -> dict[str, dict[str, torch.Tensor]]:
    """Fill the shards; return the optimizer state pieces read on the way, by parameter name."""
    optim: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for r in reads:
            p = r.piece
            n = p["stop"] - p["start"]
            src = reader.range(p["file"], p["key"], r.a - p["start"], r.b - p["start"], n)
            r.dest.narrow(0, r.dest_at, r.b - r.a).copy_(src)
            if r.optim_dest:
                optim[r.fqn] = r.optim_dest
                for state_name, dest in r.optim_dest.items():
                    key = p["optim"].get(state_name)
                    if key is None:
                        raise ShardwiseError(f"{reader.ckpt / p['file']}: no {state_name!r} optimizer state for "
                                             f"parameter {r.fqn!r}, which the manifest says it has")
                    src = reader.range(p["file"], key, r.a - p["start"], r.b - p["start"], n)
                    dest.narrow(0, r.a - r.local_lo, r.b - r.a).copy_(src)
    return optim


def _read_buffers(manifest: dict, model_buffers: list, reader: _Reader) -> None:
    saved = manifest.get("buffers", {})
    with torch.no_grad():
        for fqn, buf in model_buffers:
            entry = saved.get(fqn)
            if entry is None:
                raise ShardwiseError(f"{reader.ckpt}: checkpoint has no value for buffer {fqn!r}")
            t = reader.whole(entry["file"], entry["key"])
            if t.shape != buf.shape:
                raise ShardwiseError(f"{reader.ckpt}: buffer {fqn!r} has shape {tuple(t.shape)} in the checkpoint, "
                                     f"{tuple(buf.shape)} in the model")
            buf.copy_(t)


# ---- optimizer ----------------------------------------------------------------------------------------


def _load_optimizer(manifest: dict, rt, optimizer: torch.optim.Optimizer, pieces: dict) -> None:
    """Build a torch optimizer state dict (integer ids, as torch expects) and hand it to load_state_dict,
    which applies torch's own rules for state dtype and device (e.g. Adam's ``step`` stays on the CPU)."""
    saved = manifest["optimizer"]
    names = optimizer_param_names(rt, optimizer)
    saved_alias = {a: n for n, p in manifest["params"].items() for a in p.get("aliases", [])}
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ShardwiseError(f"optimizer has {len(optimizer.param_groups)} param groups, the checkpoint's had "
                             f"{len(saved_groups)}")
    local_numel = {id(g.shard_params[i]): g.shard_params[i].numel() for _s, g, i in unique_params(rt)}
    state: dict[int, dict] = {}
    groups = []
    index = 0
    for gi, (group, sgroup) in enumerate(zip(optimizer.param_groups, saved_groups)):
        current = [saved_alias.get(names[id(p)], names[id(p)]) for p in group["params"]]
        if set(current) != set(sgroup["params"]):
            raise ShardwiseError(f"optimizer param_groups[{gi}] holds different parameters than the checkpoint's "
                                 f"(e.g. {_listing(sorted(set(current) ^ set(sgroup['params'])), 3)})")
        options = {k: _decode_option(v) for k, v in sgroup["options"].items()}
        ids = []
        for p, name in zip(group["params"], current):
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
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _decode_option(value: Any) -> Any:
    if isinstance(value, dict) and len(value) == 1 and "__scalar_tensor__" in value:
        return decode_scalar_tensor(value["__scalar_tensor__"], "optimizer param_groups")
    return decode(value, _no_tensor)


def _no_tensor(key: str) -> torch.Tensor:
    raise ShardwiseError(f"optimizer options refer to tensor {key!r}; the manifest is damaged")

