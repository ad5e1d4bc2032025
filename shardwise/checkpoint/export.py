"""Export a sharded checkpoint as one full model: safetensors files (several, with an index, for big
models) plus, for a model built from a Hugging Face config, the ``config.json`` that lets
``AutoModelForCausalLM.from_pretrained(OUT)`` load it, and the tokenizer and generation files of the model
directory a run started from (``shardwise train --model DIR`` keeps them in the run directory's ``hf_files/``).

Runs in one process with no process group. Before writing anything, the checkpoint is verified as a
whole (``verify.py``: commit record, manifest schema, every file's size, SHA-256 and header) and the
tensors are checked against the model the manifest describes (``model_description.py``): export
refuses any inconsistency rather than casting or reshaping. Each output tensor is then assembled from
its pieces right before it is written and dropped right after, so memory holds one parameter at a time.

The output appears atomically: everything is written into a temporary directory beside ``OUT``, which is
renamed to ``OUT`` only once complete. An existing ``OUT`` is replaced only then, and only if it holds
nothing but files an export writes (an empty directory, or an earlier export); a failed export leaves it
as it was. Only parameters and buffers are exported; optimizer state and ``extra`` stay in the checkpoint.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from shardwise.checkpoint.files import RUN_MODEL_FILES, TOKENIZER_FILES, copy_model_files, unwritable_dir_problem
from shardwise.checkpoint.format import (COMMIT_NAME, MANIFEST_NAME, dtype_from_name, fsync_dir, replace_dir,
                                         write_json_durably,
                                         write_safetensors_streamed)
from shardwise.checkpoint.manager import find_latest
from shardwise.checkpoint.safetensors_file import SafetensorsFile
from shardwise.errors import ShardwiseError

PathLike = Union[str, os.PathLike]
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_EXPORT_OUTPUT = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json"
                            r"|shardwise_model\.json|adapter_model\.safetensors|adapter_config\.json|"
                            + "|".join(re.escape(n) for n in TOKENIZER_FILES) + ")$")


def resolve_checkpoint(src: PathLike) -> Path:
    """A checkpoint directory as is; a run directory -> its newest checkpoint (``find_latest``)."""
    src = Path(src)
    if not src.exists():
        raise ShardwiseError(f"{src}: no such checkpoint or run directory")
    if not src.is_dir():
        raise ShardwiseError(f"{src}: not a directory; expected a checkpoint or a run directory")
    if any((src / n).exists() or (src / n).is_symlink() for n in (COMMIT_NAME, MANIFEST_NAME)):
        return src
    latest = find_latest(src)
    if latest is None:
        raise ShardwiseError(f"{src}: neither a shardwise checkpoint ({COMMIT_NAME} and {MANIFEST_NAME} missing) nor "
                             f"a run directory holding one (no step-* directory)")
    return latest


def check_output(out: PathLike, ckpt: Optional[Path] = None) -> Path:
    """Refuse an ``OUT`` that export could not write, or should not replace. Returns it as a Path."""
    out = Path(out)
    if out.is_symlink():
        raise ShardwiseError(f"{out}: is a symbolic link; give export the real directory to write")
    if ckpt is not None:
        a, b = out.resolve(), Path(ckpt).resolve()
        if a == b or a in b.parents or b in a.parents:
            raise ShardwiseError(f"{out}: overlaps the checkpoint {ckpt}; export into a directory outside it")
    if out.exists():
        if not out.is_dir():
            raise ShardwiseError(f"{out}: exists and is not a directory; export writes a directory of files")
        foreign = sorted(p.name for p in out.iterdir() if not (_EXPORT_OUTPUT.match(p.name) and p.is_file()))
        if foreign:
            raise ShardwiseError(f"{out}: exists and holds {', '.join(foreign[:3])}"
                                 f"{' and more' if len(foreign) > 3 else ''}, which export does not write; "
                                 f"export replaces only an empty directory or an earlier export: choose a new "
                                 f"directory")
    problem = unwritable_dir_problem(out.resolve().parent)
    if problem:
        raise ShardwiseError(f"{out}: {problem}")
    return out


def write_atomically(out: Path, ckpt: Path, fill: Callable[[Path], list[str]]) -> list[Path]:
    """Run ``fill(tmp)`` on a fresh temporary directory beside ``out``, add the run's tokenizer files, then put
    it in ``out``'s place; on any failure remove it and leave ``out`` as it was. Returns the files ``fill``
    names."""
    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}-{time.time_ns()}"
    try:
        tmp.mkdir()
        file_names = fill(tmp)
        # A run started from a Hugging Face model directory kept its tokenizer files (trainer: save_model_files).
        if (ckpt.parent / RUN_MODEL_FILES).is_dir():
            copy_model_files(ckpt.parent / RUN_MODEL_FILES, tmp)
        fsync_dir(tmp)
        replace_dir(tmp, out, out.parent / f".{out.name}.export-old-{os.getpid()}-{time.time_ns()}")
    except OSError as e:  # a full disk, say: one line naming the file, and OUT as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShardwiseError(f"{e.filename or tmp}: {e.strerror or e}; nothing was exported, {out} is as it "
                             f"was") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / name for name in file_names]


def write_model(tmp: Path, manifest: dict, layout: list, produce: Callable[[str], torch.Tensor],
                 max_shard_bytes: int) -> list[str]:
    """The tensors of ``layout`` (each made by ``produce`` right before it is written) as one safetensors
    file or several with an index, and the model's config. Returns the safetensors file names."""
    file_names = write_weight_files(tmp, layout, produce, max_shard_bytes)
    _write_config(manifest, tmp, written_dtype(layout))
    return file_names


def write_weight_files(tmp: Path, layout: list, produce: Callable[[str], torch.Tensor],
                       max_shard_bytes: int) -> list[str]:
    """The tensors of ``layout``, in order, as Hugging Face lays out a model's weights: one
    ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` of at most ``max_shard_bytes`` each (a
    larger tensor alone) plus ``model.safetensors.index.json``. Returns the safetensors file names."""
    shards = _split(layout, max_shard_bytes)
    file_names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file_name, shard in zip(file_names, shards):
        write_safetensors_streamed(tmp / file_name, shard, produce, metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(_nbytes(dt, shape) for _, dt, shape in layout)
        weight_map = {name: file_name for file_name, shard in zip(file_names, shards) for name, _, _ in shard}
        write_json_durably(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return file_names


def layout_of(manifest: dict, dtype: Optional[torch.dtype]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    out = []
    for name, p in list(manifest["params"].items()) + list(manifest["buffers"].items()):
        dt = dtype_from_name(p["dtype"], name)
        if dtype is not None and dt.is_floating_point:
            dt = dtype
        out.append((name, dt, tuple(p["shape"])))
    return out


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _split(layout, max_shard_bytes: int) -> list[list]:
    """Greedy, in order: a new file when the next tensor would push the current one past the limit."""
    shards, current, size = [], [], 0
    for entry in layout:
        nbytes = _nbytes(entry[1], entry[2])
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def produce(manifest: dict, files: dict[str, SafetensorsFile], name: str, dtype: Optional[torch.dtype]) -> torch.Tensor:
    t = assemble(manifest, files, name)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)  # asked for by the caller (--dtype), never implied by a mismatch
    return t


def assemble(manifest: dict, files: dict[str, SafetensorsFile], name: str) -> torch.Tensor:
    """One full tensor from its verified pieces: their headers hold exactly ``stop - start`` elements of the
    manifest's dtype each, and the pieces tile the shape, so this allocates what the files hold."""
    if name in manifest["params"]:
        p = manifest["params"][name]
        full = torch.empty(tuple(p["shape"]), dtype=dtype_from_name(p["dtype"], name))
        flat = full.view(-1)
        for piece in p["pieces"]:
            flat[piece["start"]: piece["stop"]].copy_(files[piece["file"]].read(piece["key"]))
        return full
    b = manifest["buffers"][name]
    return files[b["file"]].read(b["key"])


def written_dtype(layout) -> Optional[torch.dtype]:
    """The dtype a config.json states for these tensors: that of the floating-point ones, the widest if
    they differ (so that ``from_pretrained``'s ``dtype="auto"`` never rounds what was written)."""
    floats = {dt for _, dt, _ in layout if dt.is_floating_point}
    return max(floats, key=lambda dt: (dt.itemsize, dt == torch.float32)) if floats else None


def _write_config(manifest: dict, out: Path, dtype: Optional[torch.dtype]) -> None:
    """config.json (Hugging Face) or shardwise_model.json. The source config's dtype (say bf16) is replaced
    by ``dtype``, the dtype of the tensors written: transformers 5 loads with ``dtype="auto"`` by default and
    would otherwise silently load fp32 masters in bf16."""
    model = manifest["model"]
    if "hf_config" in model:
        config = dict(model["hf_config"])
        config["architectures"] = config.get("architectures") or model.get("hf_architectures")
        if dtype is not None:
            config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
        write_json_durably(out / "config.json", config)
    elif "config" in model:
        write_json_durably(out / "shardwise_model.json", {"class": model["class"], "config": model["config"]})
