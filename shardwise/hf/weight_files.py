"""The weight files of a Hugging Face model directory, opened safely: which files, and where each tensor lies.

A model directory names its own files (``model.safetensors.index.json`` maps every tensor to a file), and
whoever wrote the directory chose those names. So every name is checked to be a plain file name, its path
is resolved, and the file it reaches must lie directly inside the directory. One exception, because it is
how every model downloaded with ``huggingface_hub`` is laid out: in a hub cache snapshot
(``models--org--name/snapshots/REV/``) each file is a link to ``models--org--name/blobs/HASH``, and links
into that ``blobs`` directory are followed. Files are then opened without following links
(``checkpoint.files.open_inside``) and their headers are checked against their size before any tensor is
read (``checkpoint.safetensors_file``: offsets inside the data section, bytes = dtype x shape).

Tensors are read with ``pread`` from those checked offsets straight into the caller's buffer, not through
a memory map: the same "only these bytes" property, no page-cache pages counted in the process's memory,
and a file truncated while being read raises instead of killing the process with SIGBUS.

``pytorch_model.bin`` (pickle, which can run code when loaded) is refused with the conversion to run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Self

from shardwise.checkpoint.files import check_plain_name, exists as _exists, read_small_file, resolve_inside
from shardwise.checkpoint.safetensors_file import SafetensorsFile, TensorInfo
from shardwise.errors import ShardwiseError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
MAX_INDEX_BYTES = 64 << 20
CONVERT_HINT = ("convert it once, in a trusted environment: python -c \"from transformers import "
                "AutoModelForCausalLM as M; M.from_pretrained('{dir}').save_pretrained('{dir}')\"")


def weight_file_names(directory: Path) -> list[str] | None:
    """The safetensors files of ``directory``, from its index or the single file; None when it holds no
    weights at all. Raises for pickle-only weights (with the conversion) and for a damaged index."""
    directory = Path(directory)
    if _exists(directory, INDEX_FILE):
        return sorted(set(read_index(directory).values()))
    if _exists(directory, SINGLE_FILE):
        return [SINGLE_FILE]
    pickles = [n for n in PICKLE_FILES if _exists(directory, n)]
    if pickles:
        raise ShardwiseError(f"{directory / pickles[0]}: PyTorch pickle weights are not read (unpickling can run "
                             f"arbitrary code); shardwise reads safetensors only: {CONVERT_HINT.format(dir=directory)}")
    return None


def read_index(directory: Path) -> dict[str, str]:
    """``weight_map`` of ``model.safetensors.index.json``: tensor name -> plain file name inside ``directory``."""
    where = str(Path(directory) / INDEX_FILE)
    real = resolve_inside(directory, INDEX_FILE, where)
    raw = read_small_file(real.parent, real.name, MAX_INDEX_BYTES, where)
    try:
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ShardwiseError(f"{where}: not valid JSON ({type(e).__name__})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ShardwiseError(f"{where}: has no \"weight_map\" object mapping tensor names to files")
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise ShardwiseError(f"{where}: weight_map[{key[:80]!r}] is {type(name).__name__}, not a file name")
        check_plain_name(name, f"{where}: weight_map[{key[:80]!r}]")
    return weight_map


class PretrainedWeights:
    """Every safetensors file of a model directory, open and header-checked, and where each tensor lies.
    Use as a context manager; construction reads headers only (and the index), never tensor data."""

    def __init__(self, directory: os.PathLike | str):
        self.directory = Path(directory)
        self.files: list[SafetensorsFile] = []
        self.where: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        d = self.directory
        if not d.is_dir():
            raise ShardwiseError(f"{d}: not a directory; expected a Hugging Face model directory")
        names = weight_file_names(d)
        if names is None:
            raise ShardwiseError(f"{d}: holds no weights ({SINGLE_FILE}, or model-*.safetensors with {INDEX_FILE})")
        index = read_index(d) if _exists(d, INDEX_FILE) else None
        for name in names:
            real = resolve_inside(d, name, str(d / (INDEX_FILE if index else name)))
            f = SafetensorsFile(real.parent, real.name)
            f.path = d / name  # messages name the file as the directory lists it, not its hub-cache blob
            self.files.append(f)
            for key, info in f.tensors.items():
                if key in self.where:
                    raise ShardwiseError(f"{d}: tensor {key!r} is in both {self.where[key][0].path.name} and {name}")
                if index is not None and index.get(key) != name:
                    raise ShardwiseError(f"{d / INDEX_FILE}: does not match the files: {name} holds {key!r}, which "
                                         f"the index {'puts in ' + repr(index[key]) if key in index else 'does not list'}")
                self.where[key] = (f, info)
        if index is not None:
            absent = [k for k in index if k not in self.where]
            if absent:
                raise ShardwiseError(f"{d / INDEX_FILE}: lists {absent[0]!r} in {index[absent[0]]}, which does not hold "
                                     f"it{f' ({len(absent)} such tensors)' if len(absent) > 1 else ''}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []

    def info(self, key: str) -> TensorInfo:
        return self.where[key][1]

    def read_into(self, key: str, start: int, out) -> None:
        """Elements ``[start, start + out.numel())`` of tensor ``key`` (flattened) into ``out``."""
        self.where[key][0].read_into(key, start, out)

    def read(self, key: str, start: int | None = None, stop: int | None = None):
        return self.where[key][0].read(key, start, stop)


IDENTITY_SAMPLE_BYTES = 4096


def weights_identity(directory: os.PathLike | str) -> str:
    """A cheap SHA-256 identity of a model directory's weights, without reading the multi-GB payload: for
    every tensor, sorted by name, its name, dtype and shape and three samples of its bytes (start, middle
    and end, ``IDENTITY_SAMPLE_BYTES`` each).

    It is an identity of the tensors, not of the files: the same weights saved as one file or as nine
    (another ``max_shard_size``, another tool) have the same identity. Why that is enough for an
    adapter-only checkpoint to recognise its base: names, dtypes and shapes fix the architecture, config
    and dtype; and two checkpoints of one architecture (a base and its fine-tune, two training runs) differ
    in nearly every weight, so in every tensor's samples too. What it does not catch: an edit confined to
    bytes outside the samples (a few values changed in the middle of a tensor). A full SHA-256 would, at
    the cost of reading every byte."""
    import hashlib

    digest = hashlib.sha256(b"shardwise weights identity v2\0")
    with PretrainedWeights(directory) as weights:
        for key in sorted(weights.where):
            f, info = weights.where[key]
            digest.update(json.dumps([key, str(info.dtype), list(info.shape)]).encode() + b"\0")
            last = max(0, info.nbytes - IDENTITY_SAMPLE_BYTES)
            for at in sorted({0, last // 2, last}):
                digest.update(f.tensor_bytes(key, at, IDENTITY_SAMPLE_BYTES))
    return digest.hexdigest()


def file_layout_identity(directory: os.PathLike | str) -> str:
    """The identity checkpoints recorded before ``weights_identity`` (shardwise 0.1.0): SHA-256 over each
    weight file's name, size, whole header and three 64 KiB samples of its data. It depends on how the
    weights are split into files; kept only so that those checkpoints still recognise their base."""
    import hashlib

    digest = hashlib.sha256()
    with PretrainedWeights(directory) as weights:
        for f in sorted(weights.files, key=lambda f: f.path.name):
            digest.update(f.path.name.encode() + b"\0")
            f.update_fingerprint(digest)
    return digest.hexdigest()


def identity_for(directory: os.PathLike | str, recorded: str | None = None) -> str:
    """The identity of ``directory``'s weights to compare with ``recorded`` (a checkpoint's): ``recorded``
    itself when the directory has it under either rule, else ``weights_identity``."""
    identity = weights_identity(directory)
    if recorded is not None and recorded != identity and file_layout_identity(directory) == recorded:
        return recorded
    return identity
