"""The commit record: ``commit.json``, the last file written into a checkpoint before the directory is
renamed into place, and the only thing that vouches for the manifest.

The manifest lists every rank file with its size and SHA-256, so it protects the tensors; the commit
record does the same for the manifest (its size and SHA-256). Without it an edited or bit-flipped
manifest that still parses would change what a load restores (a learning rate, Adam's step, which element
range comes from which file) with no error. With it, every byte a load uses is covered by a checksum
chain that starts at a 200-byte file. Checksums detect damage, not tampering: whoever can write the
directory can rewrite the whole chain; docs/CHECKPOINTS.md says what such a writer can and cannot do.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from shardwise.checkpoint.files import read_small_file
from shardwise.checkpoint.format import COMMIT_NAME, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, write_json_durably
from shardwise.checkpoint.schema import short
from shardwise.errors import ShardwiseError

COMMIT_FORMAT = "shardwise-checkpoint-commit"
MAX_COMMIT_BYTES = 4096
# A manifest is a few hundred bytes per parameter and rank; 256 MiB is thousands of parameters at thousands
# of ranks. The bound exists so that a hostile manifest cannot make a load read gigabytes of JSON.
MAX_MANIFEST_BYTES = 256 * 2**20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def write_commit_record(directory: Path, manifest_bytes: bytes) -> None:
    """Record the manifest's size and SHA-256 in ``directory/commit.json`` (fsynced)."""
    write_json_durably(Path(directory) / COMMIT_NAME, commit_record(manifest_bytes))


def commit_record(manifest_bytes: bytes) -> dict:
    return {
        "format": COMMIT_FORMAT,
        "format_version": FORMAT_VERSION,
        "manifest_bytes": len(manifest_bytes),
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
    }


def read_committed_manifest(ckpt: Path) -> dict:
    """The manifest of checkpoint ``ckpt`` as parsed JSON, after checking it against the commit record.
    Only the commit chain is checked here; the manifest's schema is ``schema.check_manifest``'s job."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ShardwiseError(f"{ckpt}: no such checkpoint directory")
    commit_path, manifest_path = ckpt / COMMIT_NAME, ckpt / MANIFEST_NAME
    if not commit_path.exists() and not commit_path.is_symlink():
        raise _why_uncommitted(ckpt)
    commit = _parse_json(read_small_file(ckpt, COMMIT_NAME, MAX_COMMIT_BYTES, str(commit_path)), commit_path)
    size, digest = _check_commit_record(commit, commit_path)
    data = read_small_file(ckpt, MANIFEST_NAME, MAX_MANIFEST_BYTES, str(manifest_path))
    manifest = _parse_json(data, manifest_path, torn_hint=True)
    _check_format_marker(manifest, manifest_path)  # more useful than "checksum mismatch" for a foreign file
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        kind = f"{len(data)} bytes, {COMMIT_NAME} records {size}" if len(data) != size else "SHA-256 mismatch"
        raise ShardwiseError(f"{manifest_path}: does not match {COMMIT_NAME} ({kind}); the manifest was changed or "
                             f"damaged after the checkpoint was committed")
    return manifest


def _why_uncommitted(ckpt: Path) -> ShardwiseError:
    manifest_path = ckpt / MANIFEST_NAME
    if manifest_path.is_file() and not manifest_path.is_symlink():
        try:
            old = json.loads(read_small_file(ckpt, MANIFEST_NAME, MAX_MANIFEST_BYTES, str(manifest_path)))
        except (ShardwiseError, ValueError, RecursionError):
            old = None
        if isinstance(old, dict) and old.get("format") == FORMAT_NAME and old.get("format_version") == 1:
            return ShardwiseError(f"{ckpt}: written by an older shardwise (checkpoint format 1), which kept no "
                                  f"{COMMIT_NAME}, so its manifest cannot be verified; load it with that version "
                                  f"and save it again")
        return ShardwiseError(f"{ckpt / COMMIT_NAME}: missing, so {ckpt} is not a complete checkpoint (a committed "
                              f"checkpoint always has it: the file was deleted, or the directory was not written "
                              f"by shardwise's save)")
    if (ckpt / ".metadata").exists():
        return ShardwiseError(f"{ckpt}: not a shardwise checkpoint (it looks like a torch.distributed.checkpoint "
                              f"directory: it has .metadata but no {MANIFEST_NAME})")
    return ShardwiseError(f"{ckpt}: not a shardwise checkpoint, or an incomplete one: {COMMIT_NAME} and "
                          f"{MANIFEST_NAME} are missing")


def _parse_json(data: bytes, path: Path, torn_hint: bool = False) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and integers too long to convert; RecursionError deep nesting.
        detail = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0][:120]
        hint = "; the file is truncated or not a shardwise manifest" if torn_hint else "; the file is damaged"
        raise ShardwiseError(f"{path}: not valid JSON ({detail}){hint}") from None


def _check_commit_record(commit: Any, path: Path) -> tuple[int, str]:
    expected = {"format", "format_version", "manifest_bytes", "manifest_sha256"}
    if not isinstance(commit, dict) or commit.get("format") != COMMIT_FORMAT:
        raise ShardwiseError(f"{path}: not a shardwise commit record (expected \"format\": {COMMIT_FORMAT!r})")
    if set(commit) != expected:
        raise ShardwiseError(f"{path}: damaged commit record (its keys must be {', '.join(sorted(expected))})")
    _check_version(commit["format_version"], path)
    size, digest = commit["manifest_bytes"], commit["manifest_sha256"]
    if type(size) is not int or not 0 < size <= MAX_MANIFEST_BYTES:
        raise ShardwiseError(f"{path}: manifest_bytes {short(size)} is not a size between 1 and {MAX_MANIFEST_BYTES}")
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise ShardwiseError(f"{path}: manifest_sha256 is not 64 lowercase hex digits")
    return size, digest


def _check_version(version: Any, path: Path) -> None:
    if type(version) is not int or version != FORMAT_VERSION:
        newer = type(version) is int and version > FORMAT_VERSION
        raise ShardwiseError(f"{path}: checkpoint format version {short(version)}; this shardwise reads version "
                             f"{FORMAT_VERSION}" + ("; upgrade shardwise" if newer else ""))


def _check_format_marker(manifest: Any, path: Path) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        if isinstance(manifest, dict) and "format" in manifest:
            found = f"its format is {short(manifest['format'])}"
        else:
            found = "it has no \"format\" entry" if isinstance(manifest, dict) else f"it holds a JSON {type(manifest).__name__}"
        raise ShardwiseError(f"{path}: not a shardwise checkpoint manifest ({found}, expected "
                             f"\"format\": {FORMAT_NAME!r})")
    _check_version(manifest.get("format_version"), path)
