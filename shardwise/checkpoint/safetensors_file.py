"""One safetensors file of a checkpoint, read through a single file descriptor after its header has been
checked against the bytes on disk.

Why not ``safetensors.safe_open``: it opens the file by name itself (a symbolic link swapped in after our
checks would be followed) and its errors are bare ``SafetensorError`` tracebacks. Instead the file is
opened once (``files.open_inside``: no links, regular files only), its size taken from that descriptor,
and its header parsed and bounded by that size before anything is allocated: every tensor's bytes must
lie inside the data section and match its dtype and shape exactly, and the tensors must tile the data
section, as the format requires. The SHA-256 is computed from the same descriptor, and tensor bytes are
read from it with ``pread`` straight into tensors of exactly the size the checked header gives. So no
read leaves the file, and no allocation exceeds what the file holds.

Format: 8 bytes little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}``, then the data section (offsets are relative to it).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from shardwise.checkpoint.files import open_inside
from shardwise.checkpoint.format import SAFETENSORS_DTYPES
from shardwise.engine.base.device import on_host
from shardwise.errors import ShardwiseError

MAX_HEADER_BYTES = 100 * 2**20  # the limit safetensors itself enforces
MAX_DIMS = 16
_TAG_TO_DTYPE = {tag: dtype for dtype, tag in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie in the file, from its checked header entry."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    nbytes: int


class SafetensorsFile:
    """An open, header-checked safetensors file inside a checkpoint directory. Use as a context manager."""

    def __init__(self, directory: Path, name: str, expected_bytes: Optional[int] = None,
                 expected_sha256: Optional[str] = None):
        """Open and check, in this order: the size (``expected_bytes``), the SHA-256 (``expected_sha256``), the
        header. A size or checksum that differs from the manifest's is the clearer message for a damaged file
        than whatever the damage then does to the header."""
        self.path = Path(directory) / name
        self.fd, self.size = open_inside(directory, name, str(self.path))
        try:
            if expected_bytes is not None and self.size != expected_bytes:
                kind = "truncated" if self.size < expected_bytes else "longer than recorded"
                raise ShardwiseError(f"{self.path}: {kind}: {self.size} bytes on disk, the manifest records "
                                     f"{expected_bytes}")
            if expected_sha256 is not None:
                actual = self.sha256()
                if actual != expected_sha256:
                    raise ShardwiseError(f"{self.path}: SHA-256 checksum mismatch (file {actual[:16]}..., manifest "
                                         f"{expected_sha256[:16]}...); the file is corrupt")
            self.tensors, self.metadata = self._parse_header()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _bad(self, why: str) -> ShardwiseError:
        return ShardwiseError(f"{self.path}: not a valid safetensors file: {why}")

    def _parse_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        if self.size < 8:
            raise self._bad(f"{self.size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", self._pread(8, 0))
        if n > min(self.size - 8, MAX_HEADER_BYTES):
            raise self._bad(f"its header claims {n} bytes, but the file has {self.size - 8} after the length "
                            f"(and headers are at most {MAX_HEADER_BYTES})")
        try:
            header = json.loads(self._pread(n, 8).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise self._bad(f"its header is not valid JSON ({type(e).__name__})") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        metadata = header.pop("__metadata__", {}) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("__metadata__ is not a map of strings to strings")
        data_start, data_len = 8 + n, self.size - 8 - n
        tensors = {name: self._tensor_info(name, entry, data_start, data_len) for name, entry in header.items()}
        # The format requires the tensors to tile the data section: no gaps, no overlaps, no trailing bytes.
        end = 0
        for info in sorted(tensors.values(), key=lambda t: (t.begin, t.nbytes)):
            if info.begin - data_start != end:
                raise self._bad(f"tensor data does not tile the data section (a gap or overlap at byte {end})")
            end += info.nbytes
        if end != data_len:
            raise self._bad(f"the data section has {data_len} bytes but its tensors cover {end}")
        return tensors, metadata

    def _tensor_info(self, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
        what = f"tensor {name[:80]!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise self._bad(f"{what}: entry must have exactly dtype, shape and data_offsets")
        dtype = _TAG_TO_DTYPE.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise self._bad(f"{what}: unknown dtype {str(entry['dtype'])[:20]!r}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and 0 <= d <= data_len for d in shape)):
            raise self._bad(f"{what}: shape is not a list of at most {MAX_DIMS} sizes that fit the file")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_len):
            raise self._bad(f"{what}: data_offsets do not lie inside the data section of {data_len} bytes")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = offsets[1] - offsets[0]
        if numel * dtype.itemsize != nbytes:
            raise self._bad(f"{what}: {nbytes} bytes of data for shape {shape} of {dtype} "
                            f"({numel * dtype.itemsize} expected)")
        return TensorInfo(dtype, tuple(shape), data_start + offsets[0], nbytes)

    # ---- reading -----------------------------------------------------------------------------------------

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise ShardwiseError(f"{self.path}: shrank while being read (wanted {n} bytes at {offset})")
        return data

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise ShardwiseError(f"{self.path}: has no tensor {key!r}, which the manifest lists "
                                 f"(renamed, or a file from another checkpoint)") from None

    def read(self, key: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        """The whole tensor ``key``, or elements ``[start, stop)`` of it flattened (1-D), read from disk now."""
        info = self.info(key)
        if start is None:
            out = torch.empty(info.shape, dtype=info.dtype)
            self.read_into(key, 0, out)
        else:
            out = torch.empty(max(0, stop - start), dtype=info.dtype)
            self.read_into(key, start, out)
        return out

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of tensor ``key`` flattened, read straight into ``out`` (a
        contiguous CPU tensor of the file's dtype): only those bytes are read, and nothing else is allocated."""
        info = self.info(key)
        numel = info.nbytes // info.dtype.itemsize if info.dtype.itemsize else 0
        stop = start + out.numel()
        if not 0 <= start <= stop <= numel or out.dtype != info.dtype or not out.is_contiguous() or not on_host(out):
            raise ShardwiseError(f"{self.path}: cannot read elements [{start}, {stop}) of tensor {key!r} "
                                 f"(shape {list(info.shape)}, {info.dtype}) into a {out.dtype} tensor")
        if stop > start:
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            self._read_into(view, info.begin + start * info.dtype.itemsize)

    def _read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = self._pread_into(view[done:], offset + done)
            if got <= 0:
                raise ShardwiseError(f"{self.path}: shrank while being read")
            done += got

    def _pread_into(self, view: memoryview, offset: int) -> int:
        if hasattr(os, "preadv"):
            return os.preadv(self.fd, [view], offset)
        data = os.pread(self.fd, len(view), offset)  # platforms without preadv: one extra copy
        view[: len(data)] = data
        return len(data)

    def update_fingerprint(self, digest, sample_bytes: int = 1 << 16) -> None:
        """Feed ``digest`` this file's size, its whole header (names, dtypes, shapes, offsets) and up to three
        ``sample_bytes`` samples of its data section (start, middle, end): a cheap identity of a big file,
        ``weight_files.file_layout_identity``, which older LoRA checkpoints recorded."""
        (n,) = struct.unpack("<Q", self._pread(8, 0))
        digest.update(struct.pack("<Q", self.size))
        digest.update(self._pread(8 + n, 0))
        start, length = 8 + n, self.size - 8 - n
        for at in sorted({start, start + max(0, length - sample_bytes) // 2, start + max(0, length - sample_bytes)}):
            digest.update(self._pread(min(sample_bytes, self.size - at), at))

    def tensor_bytes(self, key: str, start: int, n: int) -> bytes:
        """Bytes ``[start, start + n)`` of tensor ``key``'s data, clipped to the tensor."""
        info = self.info(key)
        start = min(max(0, start), info.nbytes)
        return self._pread(min(n, info.nbytes - start), info.begin + start)

    def sha256(self, chunk_bytes: int = 16 << 20) -> str:
        """SHA-256 of the file's bytes, read from this descriptor into one reused buffer. Not a memory map:
        a file truncated while mapped would kill the process with SIGBUS instead of raising."""
        digest = hashlib.sha256()
        view = memoryview(bytearray(max(1, min(chunk_bytes, self.size))))
        offset = 0
        while offset < self.size:
            got = self._pread_into(view[: min(len(view), self.size - offset)], offset)
            if got <= 0:
                raise ShardwiseError(f"{self.path}: shrank while being hashed")
            digest.update(view[:got])
            offset += got
        return digest.hexdigest()
