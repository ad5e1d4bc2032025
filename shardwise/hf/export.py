"""``export_checkpoint`` and the ``shardwise export`` command: a sharded checkpoint out as a model directory.

The writing itself (verified reads, streamed safetensors, atomic replace of OUT) is checkpoint/export.py;
this module adds what needs the model's libraries: the tensors are checked against the model the manifest
describes, rebuilt on meta (hf/rebuild.py: GPT, transformers, peft), and a LoRA run's checkpoint goes out as a
peft adapter directory or merged into its base (hf/export_lora.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from shardwise.checkpoint import export
from shardwise.checkpoint.format import MANIFEST_NAME
from shardwise.checkpoint.verify import close_all, open_verified, read_manifest
from shardwise.errors import ShardwiseError
from shardwise.hf import export_lora
from shardwise.hf.rebuild import description_problem
from shardwise.usage import RaisingParser, UsageError, parse_size

PathLike = Union[str, os.PathLike]


def export_checkpoint(
    src: PathLike,
    out: PathLike,
    *,
    max_shard_bytes: int = export.DEFAULT_MAX_SHARD_BYTES,
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

    A LoRA run's checkpoint (``hf/export_lora.py``) exports as a peft adapter directory, or with ``merge`` as
    the full model with the adapters merged into the base, read from the checkpoint or, for an adapter-only
    checkpoint, from its base directory (``base`` overrides the recorded one, e.g. after a move).
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ShardwiseError(f"max_shard_bytes={max_shard_bytes!r}: must be a positive number of bytes")
    ckpt = export.resolve_checkpoint(src)
    out = export.check_output(out, ckpt)
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
            return export.write_atomically(out, ckpt, lambda tmp: export_lora.write_adapter(manifest, files, tmp))
        if is_lora:
            with export_lora.merged_source(ckpt, manifest, files, base, dtype) as (layout, produce):
                return export.write_atomically(out, ckpt, lambda tmp: export.write_model(tmp, manifest, layout, produce,
                                                                               max_shard_bytes))
        layout = export.layout_of(manifest, dtype)
        return export.write_atomically(out, ckpt, lambda tmp: export.write_model(
            tmp, manifest, layout, lambda name: export.produce(manifest, files, name, dtype), max_shard_bytes))
    finally:
        close_all(files)


# ---- the `shardwise export` command ---------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def export_main(argv: Optional[Sequence[str]] = None) -> int:
    """``shardwise export CHECKPOINT_OR_RUN_DIR OUT``: returns the process exit code. Every failure is one
    line on stderr naming the argument or file; no traceback."""
    parser = RaisingParser(
        prog="shardwise export",
        description="Write the full model of a shardwise checkpoint (or a run directory's newest complete one) "
                    "as safetensors, loadable by from_pretrained when the model came from a Hugging Face config.")
    parser.add_argument("src", metavar="CHECKPOINT_OR_RUN_DIR")
    parser.add_argument("out", metavar="OUT")
    parser.add_argument("--max-shard-size", type=parse_size, default=export.DEFAULT_MAX_SHARD_BYTES,
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
        src = export.resolve_checkpoint(args.src)
        files = export_checkpoint(src, args.out, max_shard_bytes=args.max_shard_size,
                                  dtype=_DTYPES[args.dtype] if args.dtype else None,
                                  verify_checksums=not args.no_verify, merge=args.merge, base=args.base)
    except ShardwiseError as e:  # refused, naming the file (shardwise.cli: one exit-status rule)
        print(f"shardwise export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {src} -> {args.out} ({len(files)} file{'s' if len(files) != 1 else ''})")
    if args.merge:
        print(f"merged the adapters into {export_lora.merge_base_description(src, read_manifest(src), args.base)}")
    return 0


if __name__ == "__main__":  # python -m shardwise.hf.export
    sys.exit(export_main())
