"""The data pipeline: a token stream split into train and validation, each rank reading only its own slice,
and batches that are a pure function of (seed, step, micro-batch, rank).

Because a batch depends on nothing but those numbers, there is no loader state to save: a run resumed at
step s (same seed, same world size) draws exactly the batches the uninterrupted run would have drawn.

Sources (all byte-level unless a .bin of token ids is given):
- ``stdlib``: the ``.py`` files of this Python's standard library (site-packages excluded), in sorted path
  order; every ``round(1 / val_fraction)``-th file is held out for validation, so both splits span the
  whole library instead of the validation set being, say, all of ``xml/``.
- a directory: its text files, the same way; a single text file: its last ``val_fraction`` bytes;
- a ``.bin`` file of uint16 token ids (nanoGPT's format), memory-mapped: its last ``val_fraction`` tokens.
- a ``.jsonl`` file (or a directory holding .jsonl files): records tokenised with the model's tokenizer into a
  cache with a loss mask (``jsonl_data``, ``token_cache``), read by ``PackedSampler``; ``sources`` picks.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from shardwise.hf.model_spec import IGNORE_INDEX

BYTE_VOCAB = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".yaml", ".yml", ".html", ".js")


class DataError(ValueError):
    """A data source that cannot be used; the message says why."""


@dataclass(frozen=True)
class Piece:
    """A contiguous range of one file: bytes (or uint16 tokens) ``[start, stop)`` of ``path``."""

    path: str
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


class TokenStream:
    """A virtual concatenation of file pieces; ``slice(lo, hi)`` reads only the pieces it overlaps."""

    def __init__(self, pieces: Sequence[Piece], dtype: np.dtype):
        self.pieces = [p for p in pieces if p.length > 0]
        self.dtype = np.dtype(dtype)
        self.offsets = np.cumsum([0] + [p.length for p in self.pieces])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def max_token(self) -> int:
        """The largest token id in the stream (-1 if empty). Reads all of it, one piece at a time."""
        best = -1
        for p in self.pieces:
            best = max(best, int(np.memmap(p.path, dtype=self.dtype, mode="r")[p.start:p.stop].max()))
        return best

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens ``[lo, hi)`` of the stream as a numpy array (read from disk now)."""
        lo, hi = max(0, lo), min(len(self), hi)
        parts = []
        first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        for i in range(max(first, 0), len(self.pieces)):
            base = int(self.offsets[i])
            if base >= hi:
                break
            p = self.pieces[i]
            a, b = max(lo - base, 0) + p.start, min(hi - base, p.length) + p.start
            if self.dtype == np.uint8:
                with open(p.path, "rb") as f:
                    f.seek(a)
                    parts.append(np.frombuffer(f.read(b - a), dtype=np.uint8))
            else:
                parts.append(np.asarray(np.memmap(p.path, dtype=self.dtype, mode="r")[a:b]))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files, sorted by path relative to the stdlib root."""
    root = sysconfig.get_paths()["stdlib"]
    return _walk_sorted(root, (".py",))


def _walk_sorted(root: str, suffixes: tuple[str, ...]) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(suffixes)]
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def _split_files(files: list[str], val_fraction: float) -> tuple[list[Piece], list[Piece]]:
    every = max(2, round(1 / val_fraction))
    train, val = [], []
    for i, path in enumerate(files):
        size = os.path.getsize(path)
        (val if i % every == every - 1 else train).append(Piece(path, 0, size))
    return train, val


def open_splits(source: str, val_fraction: float) -> tuple[TokenStream, TokenStream]:
    """(train, validation) streams for a data source; nothing is read yet beyond file sizes."""
    if source == "stdlib":
        files = stdlib_files()
        if not files:
            raise DataError("found no standard-library .py files on this machine; pass --data PATH")
        train, val = _split_files(files, val_fraction)
        return TokenStream(train, np.uint8), TokenStream(val, np.uint8)
    if os.path.isdir(source):
        files = _walk_sorted(source, _TEXT_SUFFIXES)
        if len(files) < 2:
            raise DataError(f"--data {source}: the directory holds {len(files)} text file(s), fewer than 2 (one at least "
                            f"for training, one for validation; text files end in {', '.join(_TEXT_SUFFIXES)})")
        train, val = _split_files(files, val_fraction)
        return TokenStream(train, np.uint8), TokenStream(val, np.uint8)
    if os.path.isfile(source):
        dtype = np.uint16 if source.endswith(".bin") else np.uint8
        n = os.path.getsize(source) // np.dtype(dtype).itemsize
        cut = int(n * (1 - val_fraction))
        return TokenStream([Piece(source, 0, cut)], dtype), TokenStream([Piece(source, cut, n)], dtype)
    raise DataError(f"--data {source}: no such file or directory; valid: 'stdlib', a text file, a directory of "
                    f"text files, a .bin file of uint16 token ids, or a .jsonl file (or a directory of them)")


def rank_bounds(total: int, rank: int, world_size: int) -> tuple[int, int]:
    return total * rank // world_size, total * (rank + 1) // world_size


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from this rank's slice of a stream.

    The slice is read into memory once (1/world_size of the split: each rank reads only its own part); the
    windows of micro-batch ``micro`` of step ``step`` come from a generator seeded with
    ``(seed, stream_id, step, micro, rank)``: no state, so resuming is exact.
    """

    masked = False  # every target is in the loss

    def __init__(self, stream: TokenStream, seq_len: int, batch_size: int, rank: int, world_size: int,
                 seed: int, stream_id: int = 0, whole: bool = False):
        lo, hi = (0, len(stream)) if whole else rank_bounds(len(stream), rank, world_size)
        if hi - lo < seq_len + 2:
            what = "the validation split" if stream_id else "this rank's slice of the training data"
            raise DataError(f"{what} has {hi - lo} tokens, fewer than seq_len + 2 = {seq_len + 2}; "
                            f"use more data, fewer ranks or a shorter --seq-len")
        self.tokens = torch.from_numpy(stream.read(lo, hi).astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.seed, self.stream_id = rank, seed, stream_id

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def max_token(self) -> int:
        return int(self.tokens.max())

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch_size, seq_len) int64; targets are inputs shifted by one."""
        rng = np.random.default_rng([self.seed, self.stream_id, step, micro, self.rank])
        starts = rng.integers(0, self.num_tokens - self.seq_len - 1, size=self.batch_size)
        idx = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)  # (B, T+1)
        window = self.tokens[idx]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def fixed_batches(self, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same ``count`` batches every time (validation): seeded by the micro index only."""
        for i in range(count):
            yield self.batch(step=0, micro=i)




class PackedSampler:
    """Batches of packed sequences from a token stream and its loss mask (.jsonl data, ``token_cache``).

    The stream (documents joined by EOS) is cut into chunks of ``seq_len + 1`` tokens that overlap by one, so
    every token is a target exactly once per epoch; chunk ``c`` is tokens ``[c * seq_len, (c + 1) * seq_len]``.
    This rank owns a contiguous range of the chunks (``rank_bounds``) and reads only those tokens. Targets
    whose token is outside the loss (mask 0: prompts, user turns) are ``IGNORE_INDEX``.

    Order: micro-batch ``micro`` of step ``step`` is the ``k = (step - 1) * micro_batches + micro``-th batch
    of this rank's chunks taken in the order of a permutation drawn per epoch from ``(seed, stream_id, rank,
    epoch)``; each chunk is seen once per epoch. A batch is a pure function of those numbers, so a resumed
    run (same seed, world size and accumulation) draws exactly the batches of an unbroken one.
    """

    masked = True  # targets may be IGNORE_INDEX: the loss is normalised by the global count of the others

    def __init__(self, tokens: TokenStream, mask: TokenStream, seq_len: int, batch_size: int, rank: int,
                 world_size: int, seed: int, stream_id: int = 0, micro_batches: int = 1):
        total_chunks = max(len(tokens) - 1, 0) // seq_len
        lo, hi = rank_bounds(total_chunks, rank, world_size)
        if hi - lo < 1:
            what = "the validation split" if stream_id else "this rank's share of the training data"
            raise DataError(f"{what} has {len(tokens)} tokens in all, less than one sequence of --seq-len + 1 = "
                            f"{seq_len + 1} per rank; use more data, fewer ranks or a shorter --seq-len")
        span = (lo * seq_len, hi * seq_len + 1)
        self.tokens = torch.from_numpy(tokens.read(*span).astype(np.int64))
        keep = torch.from_numpy(mask.read(*span).astype(np.bool_))
        self.targets = torch.where(keep[1:], self.tokens[1:], IGNORE_INDEX)
        self.num_chunks = hi - lo
        self.seq_len, self.batch_size, self.micro_batches = seq_len, batch_size, micro_batches
        self.rank, self.seed, self.stream_id = rank, seed, stream_id
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=np.int64))

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def max_token(self) -> int:
        return int(self.tokens.max())

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, self.stream_id, self.rank, epoch])
            self._order = (epoch, rng.permutation(self.num_chunks))
        return self._order[1]

    def _gather(self, chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = chunks[:, None] * self.seq_len + torch.arange(self.seq_len)  # (B, T)
        return self.tokens[idx], self.targets[idx]

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch_size, seq_len) int64; ``step`` counts from 1."""
        first = ((step - 1) * self.micro_batches + micro) * self.batch_size
        chunks = []
        for position in range(first, first + self.batch_size):
            epoch, i = divmod(position, self.num_chunks)
            chunks.append(int(self._epoch_order(epoch)[i]))
        return self._gather(torch.tensor(chunks, dtype=torch.int64))

    def fixed_batches(self, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same ``count`` batches every time (validation): the chunks in stored order, wrapping around."""
        for i in range(count):
            yield self._gather(torch.arange(i * self.batch_size, (i + 1) * self.batch_size) % self.num_chunks)
