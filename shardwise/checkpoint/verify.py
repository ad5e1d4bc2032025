"""A checkpoint verified as a whole before anything from it is used.

The chain of trust, each link checked before the next is followed::

    commit.json     strict schema; records the manifest's size and SHA-256          (commit.py)
    manifest.json   matches the commit record; strict schema: types, ranges, file    (commit.py, schema.py)
                    names that save would write, element ranges that tile each shape
    rank files      regular files inside the directory, opened without following    (files.py)
                    links; size and SHA-256 as the manifest records; safetensors
                    header bounded by the file and holding exactly the tensors the    (safetensors_file.py)
                    manifest places in that file, with the dtypes and shapes it says

Only then are tensors read, by ``pread`` from the same descriptors, into tensors of the sizes the checked
headers give: a load cannot read outside the directory, nor allocate more than the files hold. The
checks against the model being loaded into are ``match.py``'s.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, Optional

import torch

from shardwise.checkpoint.commit import read_committed_manifest
from shardwise.checkpoint.format import MANIFEST_NAME, dtype_from_name
from shardwise.checkpoint.safetensors_file import SafetensorsFile
from shardwise.checkpoint.schema import check_manifest, extra_tensor_keys
from shardwise.errors import ShardwiseError

# key -> (dtype, shape), or None where the manifest does not fix them (extra tensors are the user's)
Expected = dict[str, Optional[tuple[torch.dtype, tuple[int, ...]]]]


def read_manifest(ckpt: Path) -> dict:
    """The manifest of ``ckpt``, checked against its commit record and against the schema."""
    ckpt = Path(ckpt)
    manifest = read_committed_manifest(ckpt)
    check_manifest(manifest, ckpt / MANIFEST_NAME)
    return manifest


def expected_tensors(manifest: dict) -> dict[str, Expected]:
    """For every file, the tensors the manifest places in it: exactly these, no more, no fewer."""
    out: dict[str, Expected] = {name: {} for name in manifest["files"]}
    state = (manifest["optimizer"] or {}).get("state", {})
    for name, p in manifest["params"].items():
        dtype = dtype_from_name(p["dtype"], name)
        for piece in p["pieces"]:
            shape = (piece["stop"] - piece["start"],)
            out[piece["file"]][piece["key"]] = (dtype, shape)
            for sname, key in piece["optim"].items():
                out[piece["file"]][key] = (dtype_from_name(state[name]["tensors"][sname], name), shape)
    for name, b in manifest["buffers"].items():
        out[b["file"]][b["key"]] = (dtype_from_name(b["dtype"], name), tuple(b["shape"]))
    for entry in manifest["extra"]:
        for key in extra_tensor_keys(entry["value"]):
            out[entry["file"]][key] = None
    return out


def open_verified(ckpt: Path, manifest: dict, names: Iterable[str], hash_names: Iterable[str] = ()) -> dict[str, SafetensorsFile]:
    """Open the files ``names`` (manifest-listed names only), check each against the manifest, and SHA-256
    those in ``hash_names`` too. Returns them open; the caller closes them (``close_all``)."""
    ckpt = Path(ckpt)
    expected = expected_tensors(manifest)
    hash_names = set(hash_names)
    opened: dict[str, SafetensorsFile] = {}
    try:
        for name in sorted(set(names) | hash_names):
            entry = manifest["files"][name]  # the schema allows only names save writes: no path can get here
            f = SafetensorsFile(ckpt, name, expected_bytes=entry["bytes"],
                                expected_sha256=entry["sha256"] if name in hash_names else None)
            opened[name] = f
            _check_header(f, expected[name])
    except BaseException:
        close_all(opened)
        raise
    return opened


def close_all(files: dict[str, SafetensorsFile]) -> None:
    for f in files.values():
        f.close()


def _check_header(f: SafetensorsFile, expected: Expected) -> None:
    for key, want in expected.items():
        info = f.info(key)  # raises "has no tensor ..., which the manifest lists"
        if want is not None and (info.dtype, info.shape) != want:
            raise ShardwiseError(f"{f.path}: tensor {key!r} is {str(info.dtype).removeprefix('torch.')} "
                                 f"{list(info.shape)}, the manifest records {str(want[0]).removeprefix('torch.')} "
                                 f"{list(want[1])}")
    foreign = sorted(set(f.tensors) - set(expected))
    if foreign:
        raise ShardwiseError(f"{f.path}: holds tensor {foreign[0][:80]!r}, which the manifest does not list "
                             f"(a file from another checkpoint?)")


def listed_files_problem(ckpt: Path, manifest: dict) -> Optional[str]:
    """Why a listed file is not a regular file of its recorded size (None if all are): no hashing."""
    for name, entry in sorted(manifest["files"].items()):
        path = Path(ckpt) / name
        try:
            st = os.lstat(path)
        except OSError:
            return f"{path}: missing (the manifest lists it; was a rank's file deleted or not copied?)"
        if stat.S_ISLNK(st.st_mode):
            return f"{path}: is a symbolic link; files inside a checkpoint must be regular files"
        if not stat.S_ISREG(st.st_mode):
            return f"{path}: not a regular file"
        if st.st_size != entry["bytes"]:
            kind = "truncated" if st.st_size < entry["bytes"] else "longer than recorded"
            return f"{path}: {kind}: {st.st_size} bytes on disk, the manifest records {entry['bytes']}"
    return None


def is_complete(ckpt: Path) -> bool:
    """Cheap completeness test (no hashing of rank files): the commit record vouches for a manifest of sound
    schema, and every listed file is a regular file of its recorded size."""
    try:
        return listed_files_problem(ckpt, read_manifest(ckpt)) is None
    except ShardwiseError:
        return False


def verify_checkpoint(ckpt: Path, verify_checksums: bool = True) -> dict:
    """Verify everything in ``ckpt`` in this process (every file opened and checked, hashed unless
    ``verify_checksums`` is False); return the manifest. For single-process users such as export."""
    manifest = read_manifest(ckpt)
    names = list(manifest["files"])
    close_all(open_verified(ckpt, manifest, names, names if verify_checksums else ()))
    return manifest
