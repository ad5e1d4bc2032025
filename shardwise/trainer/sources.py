"""Which sampler reads ``--data``: the byte / token-id sources of ``data.py`` (``BatchSampler``: random
windows, every target in the loss) or .jsonl records (``PackedSampler``: packed sequences with a loss mask,
from the token cache).

For .jsonl data, rank 0 builds the token cache if it is not there (the launcher normally built it already,
in ``preflight``) while the other ranks wait in an agreement collective, so a malformed line fails every
rank at once with the line named; then every rank reads its own share of the cache by memory map.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from shardwise.trainer import jsonl_data, token_cache
from shardwise.trainer.config import TrainConfig
from shardwise.trainer.data import BatchSampler, PackedSampler, TokenStream, open_splits

Sampler = Union[BatchSampler, PackedSampler]


@dataclass
class TrainingData:
    train: Sampler
    val: Sampler
    train_tokens: int  # tokens in the whole training split (recorded in checkpoints)
    val_tokens: int
    cache: Optional[Path] = None  # the token cache of .jsonl data


def open_streams(cfg: TrainConfig, build: bool, progress: bool = False):
    """(train, val) as (tokens, mask or None) stream pairs, and the cache directory (.jsonl only). With
    ``build`` a missing cache is built here; without, it is only located (a worker whose rank 0 built it)."""
    if not jsonl_data.is_jsonl_source(cfg.data):
        train, val = open_splits(cfg.data, cfg.val_fraction)
        return (train, None), (val, None), None
    if build:
        path = token_cache.ensure_cache(cfg.data, cfg.model, cfg.val_fraction, cfg.out, progress)
    else:
        path = token_cache.cache_path(cfg.data, cfg.model, cfg.val_fraction, cfg.out)
    splits = token_cache.open_cache(path)
    return splits["train"], splits["val"], path


def _sampler(pair: tuple[TokenStream, Optional[TokenStream]], cfg: TrainConfig, rank: int, world: int,
             stream_id: int) -> Sampler:
    tokens, mask = pair
    if mask is None:
        return BatchSampler(tokens, cfg.seq_len, cfg.batch_size, rank, world, cfg.seed, stream_id=stream_id)
    return PackedSampler(tokens, mask, cfg.seq_len, cfg.batch_size, rank, world, cfg.seed, stream_id=stream_id,
                         micro_batches=cfg.gradient_accumulation_steps)


def open_training_data(cfg: TrainConfig, rank: int, world: int) -> TrainingData:
    """This rank's samplers for ``cfg.data`` (collective for .jsonl data: see the module docstring)."""
    if jsonl_data.is_jsonl_source(cfg.data):
        from shardwise.engine.checks import agree
        def build() -> None:
            if rank == 0:
                token_cache.ensure_cache(cfg.data, cfg.model, cfg.val_fraction, cfg.out, cfg.progress)

        agree.agreed(build, f"tokenising --data {cfg.data}")
    train, val, path = open_streams(cfg, build=False)
    return TrainingData(_sampler(train, cfg, rank, world, 0), _sampler(val, cfg, rank, world, 1),
                        len(train[0]), len(val[0]), path)
