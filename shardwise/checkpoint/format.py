"""The on-disk format of a shardwise checkpoint: file names, the safetensors writer, checksums, and the
checks that turn a damaged or foreign directory into one clear error.

A checkpoint is one directory::

    step-00000123/
        commit.json                          written last: the manifest's size and SHA-256
        manifest.json                        everything that is not a tensor
        rank-00000-of-00002.safetensors      everything rank 0 wrote (its shard pieces, its extra tensors)
        rank-00001-of-00002.safetensors

Tensors live only in safetensors files, everything else only in JSON, so reading a checkpoint never
unpickles anything. The commit record covers the manifest; the manifest records, for every file, its size
and SHA-256, and for every parameter its global shape and dtype and which file holds which element range
of its flattened values (see ``docs/CHECKPOINTS.md`` for the full schema). Reading and checking all of
that is ``verify.py``'s job; this module only names and writes.

The writer below streams tensors straight from memory to disk (no serialised copy of the whole file in
memory) and hashes the bytes as it writes them, so a file's checksum costs no second read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from shardwise.errors import ShardwiseError

FORMAT_NAME = "shardwise-checkpoint"
FORMAT_VERSION = 2  # 2: commit.json covers the manifest (version 1 had no commit record)
MANIFEST_NAME = "manifest.json"
COMMIT_NAME = "commit.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"

# torch dtype <-> the safetensors dtype tag (the format's own names, so other readers understand the files).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _tag in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                    ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _tag

_DTYPE_NAMES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the name the manifest uses)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str) -> torch.dtype:
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise ShardwiseError(f"{where}: unknown dtype {name!r}") from None


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


# ---- writing ------------------------------------------------------------------------------------------


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when it is already contiguous on the CPU."""
    t = t.detach().cpu().contiguous()  # (.cpu() of a host tensor is the tensor itself)
    if t.numel() == 0:
        return memoryview(b"")
    # Through uint8 so that dtypes numpy lacks (bfloat16, float8) work too.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> tuple[int, str]:
    """Write ``tensors`` as a safetensors file, fsync it, and return ``(size in bytes, SHA-256 hex)``.

    Tensors are written one at a time from their own memory, so peak extra memory is one tensor's worth
    (only for non-contiguous or non-CPU tensors), whatever the file's size.
    """
    layout = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    return write_safetensors_streamed(path, layout, tensors.__getitem__, metadata)


def write_safetensors_streamed(
    path: Path,
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor],
    metadata: Optional[dict[str, str]] = None,
) -> tuple[int, str]:
    """Write a safetensors file whose tensors are produced one at a time, in ``layout`` order.

    The header (names, dtypes, shapes, offsets) is known up front, so ``produce(name)`` can build each
    tensor just before it is written and drop it right after: memory holds one tensor, not the file.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in layout:
        if dtype not in SAFETENSORS_DTYPES:
            raise ShardwiseError(f"{path}: tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data section to 8 bytes
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(header_bytes)), header_bytes):
            f.write(chunk)
            digest.update(chunk)
        for name, dtype, shape in layout:
            t = produce(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ShardwiseError(f"{path}: tensor {name!r} came out as {t.dtype} {tuple(t.shape)}, "
                                     f"expected {dtype} {tuple(shape)}")
            data = _raw_bytes(t)
            f.write(data)
            digest.update(data)
            del t, data
        f.flush()
        # The rename that commits the checkpoint must never become durable before the data it names.
        os.fsync(f.fileno())
    return 8 + len(header_bytes) + offset, digest.hexdigest()


def write_json_durably(path: Path, obj: Any) -> bytes:
    """Write JSON and fsync it (callers rename or fsync the directory afterwards); return the bytes written."""
    data = json.dumps(obj, indent=1, sort_keys=False, allow_nan=True).encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed, removed files) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (IsADirectoryError, PermissionError):  # platforms that cannot open a directory (Windows)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        # Some network filesystems cannot fsync a directory; their renames are durable on their own terms.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path, aside: Path) -> None:
    """Put the finished directory ``tmp`` where ``final`` is, durably: a rename, after moving an existing
    ``final`` to ``aside`` (os.rename cannot replace a non-empty directory), which is removed last."""
    moved = False
    if final.exists():
        os.rename(final, aside)
        moved = True
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if moved:
        shutil.rmtree(aside, ignore_errors=True)
