"""One Lightning checkpoint path for a sharded model: a file that one process loads, and beside it a sidecar
directory that resumes training at any world size. Used by both strategies in ``lightning.py``; nothing here
imports Lightning.

    PATH                          Lightning's checkpoint dict, written by rank 0 through the strategy's
                                  CheckpointIO (torch.save). Its "state_dict" is the whole model: full CPU
                                  tensors under the module's own names, gathered one flat group at a time, so
                                  ``LightningModule.load_from_checkpoint(PATH)`` and ``torch.load`` read it in
                                  one process as they read a DDP checkpoint. Each optimizer's entry is a marker,
                                  ``{"shardwise_sidecar": "optimizer-<i>-<token>"}``, not its state.
    PATH.shardwise/optimizer-<i>-<token>/
                                  ``shardwise.save_checkpoint`` of the model and optimizer i: every rank writes
                                  its own pieces (docs/CHECKPOINTS.md), and ``load_checkpoint`` reshards them to
                                  any world size and strategy.

Saving (every rank): the sidecar directories first (each appears atomically), then PATH on rank 0, then rank 0
removes the sidecar entries PATH does not name (an earlier save to the same PATH, a crashed one). So a PATH on
disk names directories that exist, and the token, new for every save, ties PATH to its own directories: next
to another save's sidecar it finds no directory of its name and is refused by name.

Restoring (every rank): with optimizers (a resumed fit), each optimizer and the model from its directory;
without, the model from the first directory when there is one (each rank reads only its own bytes), else from
PATH's whole state dict (rank 0's copy, broadcast one flat group at a time). PATH is memory-mapped when read
with torch.load, so the ranks that do not use its tensors never read them.

``state_dict_type="sharded"`` (both strategies): PATH's model entry is a marker too, naming a sidecar directory
that holds the model (an optimizer's, or ``model-<i>-<token>/`` when none is saved), and no rank ever holds the
whole model: what a model too big for one host's memory needs (a 70B model is 140 GB in bf16). One process
reads such a file after ``consolidate_checkpoint(PATH, OUT)``. With the default ``"full"``, a save that would not
fit in rank 0's available host memory (``FULL_SAVE_COPIES``) is refused by name before anything is gathered.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

import shardwise
from shardwise.errors import ShardwiseError

SIDECAR_SUFFIX = ".shardwise"
MARKER = "shardwise_sidecar"  # the key of an optimizer's entry in PATH
MODEL_MARKER = "shardwise_sharded_model"  # the key of a model's entry in PATH, state_dict_type="sharded"
STATE_DICT_TYPES = ("full", "sharded")
# The only directory names a save writes into a sidecar (``new_token``: 12 hex digits). A name PATH gives is
# read only if it is one of these: a file that names "../elsewhere" must not make a load read outside it.
_DIRECTORY_NAME = re.compile(r"(optimizer|model)-[0-9]+-[0-9a-f]{12}")


def _checked_name(name: str) -> str:
    if not _DIRECTORY_NAME.fullmatch(name):
        raise ShardwiseError(f"the checkpoint file names sidecar directory {name!r}, which is not a name a shardwise "
                             f"save writes (optimizer-<i>-<token> or model-<i>-<token>): refused, a checkpoint is "
                             f"read only inside its own {SIDECAR_SUFFIX} directory")
    return name


def check_state_dict_type(value: Any, owner: str) -> str:
    if value not in STATE_DICT_TYPES:
        raise ShardwiseError(f"{owner}(state_dict_type={value!r}): one of {', '.join(map(repr, STATE_DICT_TYPES))} "
                             f"(\"full\": the whole model in the checkpoint file, gathered on rank 0; \"sharded\": "
                             f"every rank's pieces in the sidecar directory, for models rank 0's memory cannot hold)")
    return value


def local_path(path: Union[str, os.PathLike]) -> Path:
    """``path`` as a local path; a URL is refused (every rank writes its own pieces into the sidecar)."""
    text = os.fspath(path)
    if "://" in text:
        raise ShardwiseError(f"checkpoint path {text!r}: the shardwise Lightning strategies save to a local (or "
                             f"shared, mounted) directory, where every rank writes its own pieces; copy the "
                             f"file and its {SIDECAR_SUFFIX} directory to remote storage afterwards")
    return Path(text)


def sidecar_of(path: Path) -> Path:
    """``PATH.shardwise`` beside the file PATH is (a ``last.ckpt`` link finds its target's sidecar)."""
    real = path.resolve()
    return real.with_name(real.name + SIDECAR_SUFFIX)


def unlink_link(path: Path) -> None:
    """Rank 0, before a save to ``path``: remove ``path`` if it is a symbolic link (never its target), so the
    save's file and sidecar are both ``path``'s own."""
    if path.is_symlink():
        path.unlink()


def placeholder() -> dict:
    """An optimizer's entry until ``save`` names its directory (``optimizer_state()`` returns it)."""
    return {MARKER: None}


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def whole_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls it; rank 0 gets ``{name: full CPU tensor}`` of the whole model, the others ``{}``.

    Lightning's checkpoint is one ``torch.save``'d dict whose "state_dict" ``load_from_checkpoint`` reads, so
    the whole model goes into it as the state dict the engine defines for a sharded model
    (``shardwise.full_state_dict``: rank 0 holds every whole tensor on the CPU, as a DDP checkpoint does),
    not through ``save_whole_model``, which writes a model directory of safetensors files."""
    return shardwise.full_state_dict(model)


def write_sidecar(path: Path, token: str, pairs: Sequence[tuple[nn.Module, torch.optim.Optimizer]],
                  step: Optional[int]) -> list[dict]:
    """Every rank: one shardwise checkpoint per (sharded model, optimizer); the markers PATH stores for them."""
    side = sidecar_of(path)
    markers = []
    for i, (model, optimizer) in enumerate(pairs):
        name = f"optimizer-{i}-{token}"
        shardwise.save_checkpoint(side / name, model, optimizer, step=step)
        markers.append({MARKER: name})
    return markers


def write_model_sidecar(path: Path, token: str, model: nn.Module, index: int = 0,
                        step: Optional[int] = None) -> dict:
    """Every rank: the sharded ``model`` alone into PATH's sidecar (``state_dict_type="sharded"`` with no
    optimizer saved beside it); the entry PATH stores in its place."""
    name = f"model-{index}-{token}"
    shardwise.save_checkpoint(sidecar_of(path) / name, model, step=step)
    return {MODEL_MARKER: name}


def sharded_placeholder() -> dict:
    """A sharded model's entry until ``save`` names its directory (the strategies' model state dict)."""
    return {MODEL_MARKER: None}


def is_sharded_placeholder(entry: Any) -> bool:
    return isinstance(entry, Mapping) and set(entry) == {MODEL_MARKER}


def model_marker(model: nn.Module, pairs: Sequence[tuple[nn.Module, torch.optim.Optimizer]],
                 markers: Sequence[dict]) -> Optional[dict]:
    """The model entry naming the first sidecar directory already written that holds ``model`` (an
    optimizer's holds its model's pieces too), or None."""
    return next(({MODEL_MARKER: m[MARKER]} for (owner, _), m in zip(pairs, markers) if owner is model), None)


def marked_name(entry: Any) -> Optional[str]:
    """The sidecar directory a model entry of PATH names (``state_dict_type="sharded"``), else None."""
    if is_sharded_placeholder(entry) and isinstance(entry[MODEL_MARKER], str):
        return _checked_name(entry[MODEL_MARKER])
    return None


def entry_name(entry: Mapping) -> str:
    """The directory an optimizer's or a sharded model's entry names."""
    return entry[MARKER] if MARKER in entry else entry[MODEL_MARKER]


# A "full" save holds the whole model on rank 0 at least twice: the state dict, and Lightning's
# TorchCheckpointIO serialising the checkpoint into a BytesIO before writing it (``_atomic_save``). Measured:
# rank 0's peak rose by 1.63-2.53x the model's bytes over a save (bench/lightning_checkpoint_memory.py,
# gpt-34m), so a save refused here could never have fitted; one just under the limit may still not.
FULL_SAVE_COPIES = 2


def check_whole_model_fits(model: nn.Module, what: str, available: Optional[int]) -> None:
    """Before ``state_dict_type="full"`` gathers the whole model into rank 0's host memory: refuse by name when
    it cannot fit (``available``: rank 0's available host memory in bytes, None where unknown), rather than be
    killed by the kernel halfway through a save."""
    if available is None:
        return
    whole = whole_model_bytes(model)
    if whole * FULL_SAVE_COPIES > available:
        raise ShardwiseError(
            f"saving {what}: state_dict_type='full' gathers the whole model ({whole / 1e9:.2f} GB) into rank 0's "
            f"host memory, and Lightning serialises it there once more before writing, which needs "
            f"{whole * FULL_SAVE_COPIES / 1e9:.2f} GB; {available / 1e9:.2f} GB are available. Pass "
            f"state_dict_type='sharded' to the strategy (every rank writes its own pieces; "
            f"consolidate_checkpoint makes a one-process file later)")


def whole_model_bytes(model: nn.Module) -> int:
    """What ``shardwise.full_state_dict`` builds on rank 0: every parameter and persistent buffer, whole."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def available_host_memory() -> Optional[int]:
    """This host's available memory in bytes (Linux ``MemAvailable``), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def prune_sidecar(path: Path, markers: Sequence[dict]) -> None:
    """Rank 0, once PATH is written: remove what PATH does not name from its sidecar (all of it when PATH names
    no directory)."""
    side = sidecar_of(path)
    keep = {entry_name(m) for m in markers}
    if not side.is_dir():
        return
    if not keep:
        shutil.rmtree(side, ignore_errors=True)
        return
    for entry in side.iterdir():
        if entry.name in keep:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def remove(path: Path) -> None:
    """Rank 0: the sidecar of a checkpoint Lightning removes (``ModelCheckpoint(save_top_k=...)``)."""
    shutil.rmtree(sidecar_of(path), ignore_errors=True)


def read(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """PATH's dict on this rank, its tensors memory-mapped (read only where they are used)."""
    if not path.is_file():
        raise ShardwiseError(f"{path}: no checkpoint file there")
    return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)


def sidecar_names(path: Path, entries: Optional[Sequence[Any]], count: int) -> list[str]:
    """The directories of ``count`` optimizers from PATH's entries for them, or a ``ShardwiseError`` that
    says why they cannot be resumed."""
    if entries is None:
        raise ShardwiseError(f"{path} holds no optimizer state (saved with weights only), so training cannot "
                             f"resume from it; load its weights with load_from_checkpoint and start a new fit")
    if len(entries) != count:
        raise ShardwiseError(f"{path} holds the state of {len(entries)} optimizer(s) and this run has {count}: "
                             f"resume with the same optimizers")
    names = names_in(entries)
    if len(names) != count:
        raise ShardwiseError(f"{path} holds whole-tensor optimizer state (written by another strategy, such as "
                             f"DDP): the shardwise strategy resumes only the checkpoints it wrote. To start from "
                             f"its weights, load them with load_from_checkpoint and fit without ckpt_path")
    return names


def names_in(entries: Optional[Sequence[Any]]) -> list[str]:
    """The sidecar directories PATH's optimizer entries name; [] unless every entry is a marker."""
    names = [e.get(MARKER) if isinstance(e, Mapping) else None for e in entries or ()]
    return [_checked_name(n) for n in names] if all(isinstance(n, str) for n in names) else []


def restore_optimizers(path: Path, names: Sequence[str],
                       pairs: Sequence[tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    """Every rank: each optimizer, and its model, from its sidecar directory."""
    for name, (model, optimizer) in zip(names, pairs):
        _load_directory(path, name, model, optimizer)


def restore_model(path: Path, model: nn.Module, names: Sequence[str], whole: Optional[Mapping[str, torch.Tensor]],
                  strict: bool) -> None:
    """Every rank: the model alone, from the sidecar directory PATH's model entry names (a sharded
    checkpoint), else from the first optimizer's directory if PATH names one (and ``strict``), else from
    PATH's whole state dict ``whole`` (only rank 0's is read)."""
    sharded = marked_name(whole)
    if sharded is not None:
        if not strict:
            raise ShardwiseError(f"{path} is a sharded checkpoint (state_dict_type='sharded'): it loads strictly, "
                                 f"into the model it was saved from; for a non-strict load, consolidate it first "
                                 f"(shardwise.integrations.lightning.consolidate_checkpoint)")
        _load_directory(path, sharded, model, None)
    elif names and strict:
        _load_directory(path, names[0], model, None)
    elif whole is None:
        raise ShardwiseError(f"{path} holds no model state dict")
    else:
        load_whole_state_dict(model, whole, strict)


def load_whole_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
    """Every rank: a whole-model state dict into the sharded ``model``; rank 0's ``state_dict`` is the one
    read. ``strict=False``: keys the model lacks are ignored and the parameters the dict lacks keep their
    values (one whole-model gather builds the merged dict on rank 0)."""
    if not strict:
        current = shardwise.full_state_dict(model)  # rank 0: the whole model; {} elsewhere
        state_dict = {k: state_dict.get(k, v) for k, v in current.items()}
    shardwise.load_full_state_dict(model, state_dict if dist.get_rank() == 0 else {})


def _load_directory(path: Path, name: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    directory = sidecar_of(path) / name
    try:
        shardwise.load_checkpoint(directory, model, optimizer)
    except ShardwiseError:
        if not directory.is_dir():  # the load's own error names the directory; this one says what to do
            raise ShardwiseError(
                f"{path}: its shards and optimizer state are in {directory}, which does not exist. A checkpoint "
                f"of the shardwise Lightning strategies is the file and its {SIDECAR_SUFFIX} directory: copy "
                f"or move them together") from None
        raise


def consolidate_checkpoint(path: Union[str, os.PathLike], out: Union[str, os.PathLike], *,
                           weights_only: bool = True) -> Path:
    """One process, no process group: write ``out``, a copy of the checkpoint file ``path`` in which every
    sharded model entry (``state_dict_type="sharded"``) is the whole model, read from ``path``'s sidecar
    directory (verified first: checkpoint/verify.py), so ``LightningModule.load_from_checkpoint(out)`` and
    ``torch.load(out)`` read it as a DDP checkpoint. Optimizer entries are left out (their state stays in the
    sidecar, for resuming from ``path``). Memory: the whole model, one tensor added at a time. ``out`` appears
    atomically. Returns ``out``."""
    from shardwise.checkpoint.export import assemble
    from shardwise.checkpoint.match import alias_map
    from shardwise.checkpoint.verify import close_all, open_verified, read_manifest

    path, out = Path(path), Path(out)
    if out.resolve() == path.resolve():
        raise ShardwiseError(f"consolidate_checkpoint: out is {path} itself; write the whole-model copy elsewhere")
    checkpoint = read(path, weights_only)
    sharded = {k: name for k, name in ((k, marked_name(v)) for k, v in checkpoint.items()) if name is not None}
    if not sharded:
        raise ShardwiseError(f"{path} holds no sharded model (it was not saved with state_dict_type='sharded'): "
                             f"it loads in one process as it is")
    for key, name in sharded.items():
        directory = sidecar_of(path) / name
        if not directory.is_dir():
            raise ShardwiseError(f"{path}: its model {key!r} is in {directory}, which does not exist: copy or move "
                                 f"the file and its {SIDECAR_SUFFIX} directory together")
        manifest = read_manifest(directory)
        files = open_verified(directory, manifest, list(manifest["files"]), list(manifest["files"]))
        try:
            whole = {}
            aliases = alias_map(manifest)
            for name_ in list(manifest["params"]) + list(manifest["buffers"]):
                whole[name_] = assemble(manifest, files, name_)
            for alias, name_ in aliases.items():
                whole[alias] = whole[name_]  # a tied weight under each of its names, as state_dict() gives it
        finally:
            close_all(files)
        checkpoint[key] = whole
    if isinstance(checkpoint.get("optimizer_states"), list) and names_in(checkpoint["optimizer_states"]):
        del checkpoint["optimizer_states"]
    for key in [k for k, v in checkpoint.items() if isinstance(v, Mapping) and set(v) == {MARKER}]:
        del checkpoint[key]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
