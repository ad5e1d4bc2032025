"""Export a sharded checkpoint as one full model: safetensors files (several, with an index, for big
models) plus, for a model built from a Hugging Face config, the ``config.json`` that lets
``AutoModelForCausalLM.from_pretrained(OUT)`` load it.

Runs in one process with no process group. Each output tensor is assembled from its pieces (lazy reads
of the rank files) right before it is written and dropped right after, so memory holds one parameter at
a time, never a unit, let alone the model. Only parameters and buffers are exported; optimizer state
and ``extra`` stay in the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from safetensors import safe_open

from shardwise.checkpoint.format import (MANIFEST_NAME, dtype_from_name, files_problem, read_manifest,
                                         write_json_durably, write_safetensors_streamed)
from shardwise.checkpoint.manager import find_latest
from shardwise.errors import ShardwiseError

PathLike = Union[str, os.PathLike]
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_OUR_WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def resolve_checkpoint(src: PathLike) -> Path:
    """A checkpoint directory as is; a run directory -> its newest complete checkpoint."""
    src = Path(src)
    if (src / MANIFEST_NAME).is_file():
        return src
    if not src.is_dir():
        raise ShardwiseError(f"{src}: no such checkpoint or run directory")
    latest = find_latest(src)
    if latest is None:
        raise ShardwiseError(f"{src}: neither a shardwise checkpoint ({MANIFEST_NAME} missing) nor a run directory "
                             f"holding a complete one (no step-* directory with a complete manifest)")
    return latest


def export_checkpoint(
    src: PathLike,
    out: PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Optional[torch.dtype] = None,
    verify_checksums: bool = True,
) -> list[Path]:
    """Write the full model of checkpoint (or run directory) ``src`` into directory ``out``.

    Tensors keep their saved names (tied parameters appear once, under their first name, as Hugging Face
    writes them); ``dtype`` casts floating-point tensors. Returns the safetensors files written.
    """
    ckpt = resolve_checkpoint(src)
    manifest = read_manifest(ckpt)
    problem = files_problem(ckpt, manifest, manifest["files"], verify_checksums)
    if problem:
        raise ShardwiseError(problem)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Weight files of an earlier export into the same directory would be picked up beside ours.
    for old in out.iterdir():
        if _OUR_WEIGHT_FILE.match(old.name):
            old.unlink()

    layout = _layout(manifest, dtype)
    shards = _split(layout, max_shard_bytes)
    handles: dict[str, object] = {}

    def open_file(name: str):
        if name not in handles:
            handles[name] = safe_open(str(ckpt / name), framework="pt", device="cpu")
        return handles[name]

    def produce(name: str) -> torch.Tensor:
        t = _assemble(manifest, name, open_file)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t

    written = []
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file_name, shard in zip(names, shards):
        write_safetensors_streamed(out / file_name, shard, produce, metadata={"format": "pt"})
        written.append(out / file_name)
    if len(shards) > 1:
        total = sum(_nbytes(dt, shape) for _, dt, shape in layout)
        weight_map = {name: file_name for file_name, shard in zip(names, shards) for name, _, _ in shard}
        write_json_durably(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_config(manifest, out, dtype)
    return written


def _layout(manifest: dict, dtype: Optional[torch.dtype]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    out = []
    for name, p in list(manifest["params"].items()) + list(manifest.get("buffers", {}).items()):
        dt = dtype_from_name(p["dtype"], name)
        if dtype is not None and dt.is_floating_point:
            dt = dtype
        out.append((name, dt, tuple(p["shape"])))
    return out


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


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


def _assemble(manifest: dict, name: str, open_file) -> torch.Tensor:
    if name in manifest["params"]:
        p = manifest["params"][name]
        full = torch.empty(tuple(p["shape"]), dtype=dtype_from_name(p["dtype"], name))
        flat = full.view(-1)
        covered = 0
        for piece in p["pieces"]:
            if piece["start"] != covered:
                break
            flat[piece["start"]: piece["stop"]].copy_(open_file(piece["file"]).get_tensor(piece["key"]))
            covered = piece["stop"]
        if covered != full.numel():
            raise ShardwiseError(f"checkpoint has no values for elements [{covered}, {full.numel()}) of {name!r}; "
                                 f"its manifest is damaged")
        return full
    b = manifest["buffers"][name]
    return open_file(b["file"]).get_tensor(b["key"])


def _write_config(manifest: dict, out: Path, dtype: Optional[torch.dtype]) -> None:
    model = manifest.get("model") or {}
    if "hf_config" in model:
        config = dict(model["hf_config"])
        config["architectures"] = config.get("architectures") or model.get("hf_architectures")
        if dtype is not None:
            config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
        write_json_durably(out / "config.json", config)
    elif "config" in model:
        write_json_durably(out / "shardwise_model.json", {"class": model.get("class"), "config": model["config"]})


# ---- command line ---------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def export_main(argv: Optional[Sequence[str]] = None) -> int:
    """``shardwise export CHECKPOINT_OR_RUN_DIR OUT``: returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="shardwise export",
        description="Write the full model of a shardwise checkpoint (or a run directory's newest complete one) "
                    "as safetensors, loadable by from_pretrained when the model came from a Hugging Face config.")
    parser.add_argument("src", metavar="CHECKPOINT_OR_RUN_DIR")
    parser.add_argument("out", metavar="OUT")
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                        help="split the output into files of at most this size, with an index (default 5GB)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="cast floating-point tensors (default: keep the checkpoint's dtypes)")
    parser.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the rank files")
    args = parser.parse_args(argv)
    try:
        files = export_checkpoint(args.src, args.out, max_shard_bytes=args.max_shard_size,
                                  dtype=_DTYPES[args.dtype] if args.dtype else None,
                                  verify_checksums=not args.no_verify)
    except ShardwiseError as e:
        print(f"shardwise export: error: {e}", file=sys.stderr)
        return 1
    src = resolve_checkpoint(args.src)
    print(f"exported {src} -> {args.out} ({len(files)} file{'s' if len(files) != 1 else ''})")
    return 0


if __name__ == "__main__":  # python -m shardwise.checkpoint.export
    sys.exit(export_main())
