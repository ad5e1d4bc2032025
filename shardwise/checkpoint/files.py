"""Opening the files of a checkpoint without letting the checkpoint choose what is opened.

A checkpoint names its own files (the manifest lists them), and whoever can write the directory can write
those names. So every name is checked to be a plain file name before it is joined to the directory (no
separator, no ``..``, not absolute, nothing a terminal would interpret), and every file is opened with
``O_NOFOLLOW | O_NONBLOCK`` and must then be a regular file: a symbolic link inside a checkpoint could point
a load at any file on the machine, and a FIFO would block the open forever. The directory itself may be
reached through links: the caller chose that path, the checkpoint did not.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from shardwise.errors import ShardwiseError

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")


def check_plain_name(name: object, where: str) -> str:
    """``name`` if it is a plain file name inside a directory, else a ShardwiseError saying why."""
    if not isinstance(name, str):
        raise ShardwiseError(f"{where}: file name {name!r} is not a string")
    if not _PLAIN_NAME.match(name) or name in (".", ".."):
        raise ShardwiseError(f"{where}: file name {name[:80]!r} is not a plain file name inside the "
                             f"directory (letters, digits, '_', '-', '.'; no path separators, '..' or absolute "
                             f"paths); refusing to open it")
    return name


def open_inside(directory: Path, name: str, where: str) -> tuple[int, int]:
    """Open ``directory/name`` for reading: (file descriptor, size in bytes). The caller closes the fd."""
    check_plain_name(name, where)
    path = Path(directory) / name
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ShardwiseError(f"{path}: missing") from None
    except OSError as e:
        if os.path.islink(path):
            raise ShardwiseError(f"{path}: is a symbolic link; files inside a checkpoint must be regular files "
                                 f"(a link could point a load at any file)") from None
        raise ShardwiseError(f"{path}: cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShardwiseError(f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_small_file(directory: Path, name: str, limit: int, where: str) -> bytes:
    """The whole content of a small file (JSON), refusing more than ``limit`` bytes before reading any."""
    fd, size = open_inside(directory, name, where)
    try:
        if size > limit:
            raise ShardwiseError(f"{Path(directory) / name}: {size} bytes, more than the {limit} a {name} "
                                 f"may have here; not the expected file, or a damaged one")
        chunks, remaining = [], size
        while remaining > 0:
            chunk = os.read(fd, remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def unwritable_dir_problem(path: Path) -> str | None:
    """Why a directory ``path`` (existing or to be created) cannot be written, or None. Tries for real, in
    the directory or its nearest existing ancestor, with a temporary directory it removes again: permission
    bits say nothing for root, read-only mounts or /proc."""
    import tempfile

    path = Path(path)
    probe_in = path
    while not probe_in.exists() and not probe_in.is_symlink():
        if probe_in.parent == probe_in:
            return f"no part of {path} exists"
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        return f"{probe_in} is not a directory" if probe_in != path else "exists and is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".shardwise-probe-", dir=probe_in))
    except OSError as e:
        return f"cannot write into {probe_in} ({e.strerror})"
    return None


# ---- model directories (Hugging Face layout) --------------------------------------------------------

# What export copies next to the weights: everything a tokenizer and generate() read from a model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")

RUN_MODEL_FILES = "hf_files"  # in a run directory: the model directory's tokenizer files, for export


def resolve_inside(directory: Path, name: object, where: str) -> Path:
    """The real path of file ``name`` of model directory ``directory``, refusing anything outside it."""
    check_plain_name(name, where)
    root = Path(directory).resolve()
    real = (root / str(name)).resolve()
    hub_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if real.parent != root and (hub_blobs is None or real.parent != hub_blobs):
        raise ShardwiseError(f"{where}: {name!r} leads to {real}, outside the model directory {directory}; "
                             f"refusing to read it (only files inside the directory, or a hub cache's blobs, are read)")
    return real


def exists(directory: Path, name: str) -> bool:
    return os.path.lexists(Path(directory) / name)


def copy_model_files(src: os.PathLike | str, dst: os.PathLike | str) -> list[str]:
    """Copy the tokenizer and generation files (``TOKENIZER_FILES``) that ``src`` holds into ``dst``, each
    checked to lie inside ``src`` and read without following links. Returns the names copied."""
    import shutil

    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if not exists(src, name):
            continue
        real = resolve_inside(src, name, str(src / name))
        fd, _ = open_inside(real.parent, real.name, str(src / name))
        os.makedirs(dst, exist_ok=True)
        with os.fdopen(fd, "rb") as f_in, open(dst / name, "wb") as f_out:
            shutil.copyfileobj(f_in, f_out)
        copied.append(name)
    return copied
