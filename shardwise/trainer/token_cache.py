"""The tokenised form of .jsonl data, built once and kept in the run directory.

``RUN_DIR/data-cache/<name>-<key>/`` holds, for each split, ``<split>.tokens`` (uint16 token ids, uint32 for
vocabularies beyond 65,536) and ``<split>.mask`` (uint8, 1 where the token is in the loss), both raw arrays
read by memory map, plus ``meta.json`` (counts, dtype, what the key covers).

The key is a SHA-256 of everything the tokens depend on: the data files' names and bytes, the tokenizer's
files (``jsonl_data.TOKENIZER_FILES``), ``val_fraction`` and the format version. Editing the data, swapping
the tokenizer or changing the split therefore builds a new cache beside the old one; anything else reuses it.

The cache is built in a private temporary directory and renamed into place in one step, so a reader sees a
complete cache or none. Two builders racing (torchrun workers on several nodes) each write their own
temporary directory; the first rename wins and the other discards its copy, whose content is identical.

Validation split: every ``round(1 / val_fraction)``-th record (at least every 2nd), as for directories of
text files; a dataset with fewer records than that holds out its last record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from shardwise.trainer import jsonl_data
from shardwise.trainer.data import DataError, Piece, TokenStream

FORMAT_VERSION = 1
CACHE_DIR = "data-cache"
SPLITS = ("train", "val")
_FLUSH_TOKENS = 1 << 20  # tokens buffered per split before they are appended to its file


def _hash_file(h, path: str) -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def cache_key(data: str, model: str, val_fraction: float) -> str:
    """SHA-256 (hex) over the data files, the tokenizer files and the settings."""
    h = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, "val_fraction": val_fraction}).encode())
    for label, paths in (("data", jsonl_data.jsonl_files(data)), ("tokenizer", jsonl_data.tokenizer_file_paths(model))):
        for path in paths:
            h.update(f"\0{label}\0{os.path.basename(path)}\0".encode())
            _hash_file(h, path)
    return h.hexdigest()


def cache_path(data: str, model: str, val_fraction: float, run_dir: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(data.rstrip("/")).stem)[:40] or "data"
    return Path(run_dir) / CACHE_DIR / f"{name}-{cache_key(data, model, val_fraction)[:16]}"


def ensure_cache(data: str, model: str, val_fraction: float, run_dir: str, progress: bool = True) -> Path:
    """The cache directory for this data and tokenizer, built now if it does not exist yet."""
    jsonl_data.check_files(data)
    tok = jsonl_data.load_tokenizer(model, data)
    final = cache_path(data, model, val_fraction, run_dir)
    if (final / "meta.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        meta = _build(tok, data, val_fraction, tmp, progress)
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same cache first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _build(tok, data: str, val_fraction: float, out: Path, progress: bool) -> dict:
    """Tokenise every record of every file into ``out``; returns meta.json's content."""
    dtype = np.uint16 if len(tok) <= 1 << 16 else np.uint32
    every = max(2, round(1 / val_fraction))
    files = jsonl_data.jsonl_files(data)
    files_open = contextlib.ExitStack()
    handles = {s: tuple(files_open.enter_context((out / f"{s}.{part}").open("wb")) for part in ("tokens", "mask"))
               for s in SPLITS}
    pending: dict[str, tuple[list[int], list[int]]] = {s: ([], []) for s in SPLITS}
    counts = {"records": {s: 0 for s in SPLITS}, "tokens": {s: 0 for s in SPLITS}, "loss_tokens": {s: 0 for s in SPLITS},
              "kinds": {k: 0 for k in jsonl_data.KINDS}}

    def flush(split: str) -> None:
        ids, mask = pending[split]
        handles[split][0].write(np.asarray(ids, dtype=dtype).tobytes())
        handles[split][1].write(np.asarray(mask, dtype=np.uint8).tobytes())
        pending[split] = ([], [])

    bar = _progress_bar(sum(os.path.getsize(p) for p in files), progress)
    last: Optional[tuple[list[int], list[int]]] = None
    index = 0
    try:
        for path in files:
            for number, record in jsonl_data.read_records(path, bar.update if bar is not None else None):
                where = f"{path}:{number}"
                counts["kinds"][jsonl_data.record_kind(record, where)] += 1
                ids, mask = jsonl_data.encode_record(tok, record, where)
                split = "val" if index % every == every - 1 else "train"
                if last is not None:  # held back one record: the last one goes to val if val got none
                    _add(pending, counts, *last)
                last = (split, ids, mask)
                index += 1
                if len(pending[split][0]) >= _FLUSH_TOKENS:
                    flush(split)
        if last is not None:
            split, ids, mask = last
            _add(pending, counts, "val" if counts["records"]["val"] == 0 else split, ids, mask)
        for s in SPLITS:
            flush(s)
    finally:
        files_open.close()
        if bar is not None:
            bar.close()
    if index == 0:
        raise DataError(f"--data {data}: holds no records")
    return {"format": FORMAT_VERSION, "dtype": np.dtype(dtype).name, "eos_token_id": tok.eos_token_id,
            "vocab_size": len(tok), "files": files, "val_fraction": val_fraction, **counts}


def _add(pending, counts, split: str, ids: list[int], mask: list[int]) -> None:
    pending[split][0].extend(ids)
    pending[split][1].extend(mask)
    counts["records"][split] += 1
    counts["tokens"][split] += len(ids)
    counts["loss_tokens"][split] += sum(mask)


def _progress_bar(total_bytes: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total_bytes, desc="tokenise", unit="B", unit_scale=True, file=sys.stderr, dynamic_ncols=True)


def open_cache(path: Path) -> dict[str, tuple[TokenStream, TokenStream]]:
    """{split: (token stream, mask stream)} of a built cache (memory-mapped when read)."""
    with open(path / "meta.json") as f:
        meta = json.load(f)
    dtype = np.dtype(meta["dtype"])
    out = {}
    for s in SPLITS:
        n = meta["tokens"][s]
        out[s] = (TokenStream([Piece(str(path / f"{s}.tokens"), 0, n)], dtype),
                  TokenStream([Piece(str(path / f"{s}.mask"), 0, n)], np.uint8))
    return out
