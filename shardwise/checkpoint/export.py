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

import argparse
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from shardwise.checkpoint.files import unwritable_dir_problem
from shardwise.checkpoint.format import (COMMIT_NAME, MANIFEST_NAME, dtype_from_name, fsync_dir, write_json_durably,
                                         write_safetensors_streamed)
from shardwise.checkpoint.manager import find_latest
from shardwise.checkpoint.model_description import description_problem
from shardwise.checkpoint.safetensors_file import SafetensorsFile
from shardwise.checkpoint.verify import close_all, open_verified, read_manifest
from shardwise.errors import ShardwiseError
from shardwise.pretrained_files import RUN_MODEL_FILES, TOKENIZER_FILES, copy_model_files

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


def export_checkpoint(
    src: PathLike,
    out: PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Optional[torch.dtype] = None,
    verify_checksums: bool = True,
    merge: bool = False,
    base: Optional[PathLike] = None,
) -> list[Path]:
    """Write the full model of checkpoint (or run directory) ``src`` into directory ``out``.

    Tensors keep their saved names (tied parameters appear once, under their first name, as Hugging Face
    writes them); ``dtype`` casts floating-point tensors, and the written ``config.json`` states the dtype
    of the tensors written (so ``from_pretrained(out)``'s default ``dtype="auto"`` loads what was written).
    Returns the safetensors files written. Raises ShardwiseError, naming the file at fault, with ``out``
    left as it was, for a damaged checkpoint, one whose tensors disagree with its model description, or an
    ``out`` it cannot or should not replace.

    A LoRA run's checkpoint (``export_lora.py``) exports as a peft adapter directory, or with ``merge`` as
    the full model with the adapters merged into the base, read from the checkpoint or, for an adapter-only
    checkpoint, from its base directory (``base`` overrides the recorded one, e.g. after a move).
    """
    from shardwise.checkpoint import export_lora

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ShardwiseError(f"max_shard_bytes={max_shard_bytes!r}: must be a positive number of bytes")
    ckpt = resolve_checkpoint(src)
    out = check_output(out, ckpt)
    manifest = read_manifest(ckpt)
    is_lora = export_lora.is_lora(manifest)
    if base is not None and not merge:
        raise ShardwiseError("--base: the base directory is read by --merge only; add --merge or drop --base")
    if (merge or base is not None) and not is_lora:
        option = "--merge" if merge else "--base"
        raise ShardwiseError(f"{option}: {ckpt} is not a LoRA run's checkpoint (its model has no peft config); "
                             f"export it without {option}")
    names = list(manifest["files"])
    files = open_verified(ckpt, manifest, names, names if verify_checksums else ())
    try:
        problem = description_problem(manifest)
        if problem:
            raise ShardwiseError(f"{ckpt / MANIFEST_NAME}: {problem}")
        if is_lora and not merge:
            return _write_atomically(out, ckpt, lambda tmp: export_lora.write_adapter(manifest, files, tmp))
        if is_lora:
            with export_lora.merged_source(ckpt, manifest, files, base, dtype) as (layout, produce):
                return _write_atomically(out, ckpt, lambda tmp: _write_model(tmp, manifest, layout, produce,
                                                                               max_shard_bytes))
        layout = _layout(manifest, dtype)
        return _write_atomically(out, ckpt, lambda tmp: _write_model(
            tmp, manifest, layout, lambda name: _produce(manifest, files, name, dtype), max_shard_bytes))
    finally:
        close_all(files)


def _write_atomically(out: Path, ckpt: Path, fill: Callable[[Path], list[str]]) -> list[Path]:
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
        _replace(tmp, out)
    except OSError as e:  # a full disk, say: one line naming the file, and OUT as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShardwiseError(f"{e.filename or tmp}: {e.strerror or e}; nothing was exported, {out} is as it "
                             f"was") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / name for name in file_names]


def _write_model(tmp: Path, manifest: dict, layout: list, produce: Callable[[str], torch.Tensor],
                 max_shard_bytes: int) -> list[str]:
    """The tensors of ``layout`` (each made by ``produce`` right before it is written) as one safetensors
    file or several with an index, and the model's config. Returns the safetensors file names."""
    shards = _split(layout, max_shard_bytes)
    file_names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file_name, shard in zip(file_names, shards):
        write_safetensors_streamed(tmp / file_name, shard, produce, metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(_nbytes(dt, shape) for _, dt, shape in layout)
        weight_map = {name: file_name for file_name, shard in zip(file_names, shards) for name, _, _ in shard}
        write_json_durably(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_config(manifest, tmp, written_dtype(layout))
    return file_names


def _replace(tmp: Path, out: Path) -> None:
    """Put the finished ``tmp`` where ``out`` is: a rename, after moving an earlier export aside."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.export-old-{os.getpid()}-{time.time_ns()}"
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _layout(manifest: dict, dtype: Optional[torch.dtype]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
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


def _produce(manifest: dict, files: dict[str, SafetensorsFile], name: str, dtype: Optional[torch.dtype]) -> torch.Tensor:
    t = _assemble(manifest, files, name)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)  # asked for by the caller (--dtype), never implied by a mismatch
    return t


def _assemble(manifest: dict, files: dict[str, SafetensorsFile], name: str) -> torch.Tensor:
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


# ---- command line ---------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size (e.g. 5GB, 500MB, 2GiB)")
    return value


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class UsageError(Exception):
    """A command line argparse refused; the message names the argument."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line from the caller instead of argparse's usage block and exit(2)
        raise UsageError(message)


def export_main(argv: Optional[Sequence[str]] = None) -> int:
    """``shardwise export CHECKPOINT_OR_RUN_DIR OUT``: returns the process exit code. Every failure is one
    line on stderr naming the argument or file; no traceback."""
    parser = _Parser(
        prog="shardwise export",
        description="Write the full model of a shardwise checkpoint (or a run directory's newest complete one) "
                    "as safetensors, loadable by from_pretrained when the model came from a Hugging Face config.")
    parser.add_argument("src", metavar="CHECKPOINT_OR_RUN_DIR")
    parser.add_argument("out", metavar="OUT")
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                        help="split the output into files of at most this size, with an index (default 5GB)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="cast floating-point tensors (default: keep the checkpoint's dtypes, fp32 masters; "
                             "--merge: fp32); config.json states the dtype written")
    parser.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the rank files")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA runs: write the full model with the adapters merged in (default: the peft "
                             "adapter directory)")
    parser.add_argument("--base", metavar="DIR", default=None,
                        help="LoRA runs with --merge: the base model directory, if it moved since training "
                             "(its weights must be the recorded base's)")
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(f"shardwise export: error: {e}", file=sys.stderr)
        return 2
    try:
        src = resolve_checkpoint(args.src)
        files = export_checkpoint(src, args.out, max_shard_bytes=args.max_shard_size,
                                  dtype=_DTYPES[args.dtype] if args.dtype else None,
                                  verify_checksums=not args.no_verify, merge=args.merge, base=args.base)
    except ShardwiseError as e:  # refused, naming the file (shardwise.cli: one exit-status rule)
        print(f"shardwise export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {src} -> {args.out} ({len(files)} file{'s' if len(files) != 1 else ''})")
    return 0


if __name__ == "__main__":  # python -m shardwise.checkpoint.export
    sys.exit(export_main())
