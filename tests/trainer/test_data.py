"""The data pipeline: stdlib corpus, splits, per-rank slices, and batches that depend only on (seed, step,
micro-batch, rank), so that a resumed run sees exactly the data of an unbroken one."""

import numpy as np
import torch

from shardwise.trainer.data import BatchSampler, open_splits, stdlib_files


def test_stdlib_corpus_is_deterministic_and_split_by_file():
    files = stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert files == stdlib_files()
    assert not any("site-packages" in f for f in files)
    train, val = open_splits("stdlib", 0.05)
    train_files = {p.path for p in train.pieces}
    val_files = {p.path for p in val.pieces}
    assert train_files.isdisjoint(val_files)
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.10
    # both splits span the library, not one corner of it
    assert len({f.split("/")[-2] for f in val_files}) > 5


def test_stream_reads_across_file_boundaries(tmp_path):
    for name, text in [("a.txt", b"hello "), ("b.txt", b"world"), ("c.txt", b"!!"), ("d.txt", b"xyz")]:
        (tmp_path / name).write_bytes(text)
    train, val = open_splits(str(tmp_path), 0.25)  # every 4th file held out
    assert [p.path.split("/")[-1] for p in val.pieces] == ["d.txt"]
    assert bytes(train.read(0, len(train))) == b"hello world!!"
    assert bytes(train.read(4, 8)) == b"o wo"


def test_bin_tokens(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    tokens.tofile(tmp_path / "toks.bin")
    train, val = open_splits(str(tmp_path / "toks.bin"), 0.1)
    assert len(train) == 900 and len(val) == 100
    assert train.read(10, 13).tolist() == [10, 11, 12] and val.read(0, 2).tolist() == [900, 901]


def test_ranks_read_disjoint_slices_and_batches_are_pure_functions_of_the_step():
    train, _ = open_splits("stdlib", 0.05)
    r0 = BatchSampler(train, 64, 4, rank=0, world_size=2, seed=1)
    r1 = BatchSampler(train, 64, 4, rank=1, world_size=2, seed=1)
    assert r0.num_tokens + r1.num_tokens == len(train)
    assert r0.num_tokens < len(train)  # each rank holds only its own slice
    x, y = r0.batch(step=5, micro=0)
    assert x.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    # a fresh sampler (a resumed run) draws the same batch for the same step
    again = BatchSampler(train, 64, 4, rank=0, world_size=2, seed=1)
    assert torch.equal(again.batch(step=5)[0], x)
    # and different steps, micro-batches, ranks and seeds draw different data
    assert not torch.equal(r0.batch(step=6)[0], x)
    assert not torch.equal(r0.batch(step=5, micro=1)[0], x)
    assert not torch.equal(BatchSampler(train, 64, 4, rank=0, world_size=2, seed=2).batch(step=5)[0], x)


def test_resumed_sequence_equals_unbroken_sequence():
    train, _ = open_splits("stdlib", 0.05)
    unbroken = BatchSampler(train, 32, 2, rank=1, world_size=2, seed=0)
    seen = [unbroken.batch(s)[0] for s in range(1, 9)]
    first = BatchSampler(train, 32, 2, rank=1, world_size=2, seed=0)
    resumed = [first.batch(s)[0] for s in range(1, 5)]
    second = BatchSampler(train, 32, 2, rank=1, world_size=2, seed=0)  # "after the restart"
    resumed += [second.batch(s)[0] for s in range(5, 9)]
    assert all(torch.equal(a, b) for a, b in zip(seen, resumed))


def test_validation_batches_are_fixed():
    _, val = open_splits("stdlib", 0.05)
    s = BatchSampler(val, 32, 2, rank=0, world_size=1, seed=0, stream_id=1)
    a = [x for x, _ in s.fixed_batches(3)]
    b = [x for x, _ in s.fixed_batches(3)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
