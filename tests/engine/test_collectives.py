"""The collectives layer (``shardwise/engine/collectives.py``): on gloo, all-gather and reduce-scatter run as
one all-reduce (see its Note); this checks that substitution's layout against references.

Each rank's data is a function of its rank, so every rank can compute the expected results itself; gloo's
native collectives (a second process group, created with ``SHARDWISE_GLOO_NATIVE_COLLECTIVES=1``) must give
the same data. The fingerprint header, when one is passed, sits after the data (after the N gathered chunks,
after the N gradient chunks, at the end of an all-reduced tensor), is ``ranks x SLOT`` elements, and arrives
as every rank's slot side by side. World size 3 with shards of 1, 5 and 7 elements: nothing divides evenly.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from parity_utils import run_scenarios, scenario, spawn_once
from shardwise.engine.base import collectives
from shardwise.engine.checks.fingerprint import SLOT, CollectiveChecker

WS = 3
SIZES = (1, 5, 7)
DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _shard_of(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + n)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def _flat_of(rank: int, n: int, ws: int, dtype: torch.dtype) -> torch.Tensor:
    """A rank's packed gradient for a reduce-scatter: small integers, so a sum in any dtype is exact."""
    g = torch.Generator().manual_seed(7 * rank + n)
    return torch.randint(-8, 8, (n * ws,), generator=g).to(dtype)


def _native_group():
    """A process group on which the substitution is off (the choice is made, and cached, per group)."""
    os.environ["SHARDWISE_GLOO_NATIVE_COLLECTIVES"] = "1"
    try:
        group = dist.new_group()
        assert not collectives.gathers_by_all_reduce(group)
    finally:
        del os.environ["SHARDWISE_GLOO_NATIVE_COLLECTIVES"]
    return group


def _data_layout(rank, ws):
    """All-gather and reduce-scatter, substituted and native, against the references, every size and dtype."""
    world, native = dist.group.WORLD, _native_group()
    assert collectives.gathers_by_all_reduce(world)
    out = {}
    for dtype in DTYPES:
        for n in SIZES:
            want = torch.cat([_shard_of(r, n, dtype) for r in range(ws)])
            want_chunk = sum(_flat_of(r, n, ws, dtype) for r in range(ws)).narrow(0, rank * n, n)
            for name, group in (("all_reduce", world), ("native", native)):
                gathered = torch.full((n * ws,), 99, dtype=dtype)  # stale contents must not leak through
                collectives.all_gather_into(gathered, _shard_of(rank, n, dtype), group, async_op=False)
                chunk = torch.full((n,), 99, dtype=dtype)
                work = collectives.reduce_scatter_into(chunk, _flat_of(rank, n, ws, dtype), group, async_op=True)
                collectives.wait(work)
                out[f"{name}/{dtype}/{n}"] = (torch.equal(gathered, want), torch.equal(chunk, want_chunk))
    return out


def _headers(rank, ws):
    """Each collective with a fingerprint header from a real checker: where the header lands, its size, and
    that every rank's slot arrives (verify_stamp accepts the table)."""
    checker = CollectiveChecker(["unit"], lambda: "forward")
    ranks, n, out = list(range(ws)), 5, {}

    def stamp(op):
        return checker.stamp(op, 0, 0, n * ws, ranks, rank, torch.float32, torch.device("cpu"))

    s = stamp("all_gather")
    gathered = torch.full((n * ws + s.header.numel(),), 99.0)
    collectives.all_gather_into(gathered, _shard_of(rank, n, torch.float32), dist.group.WORLD, async_op=False,
                                header=s.header)
    checker.verify_stamp(s, gathered)
    out["all_gather"] = dict(header=s.header.numel(), data=torch.equal(gathered[:n * ws], torch.cat(
        [_shard_of(r, n, torch.float32) for r in ranks])))

    s = stamp("reduce_scatter")
    flat = torch.cat([_flat_of(rank, n, ws, torch.float32), torch.full((s.header.numel(),), 99.0)])
    chunk = torch.empty(n)
    collectives.reduce_scatter_into(chunk, flat, dist.group.WORLD, async_op=False, header=s.header)
    checker.verify_stamp(s, flat)
    want = sum(_flat_of(r, n, ws, torch.float32) for r in ranks)
    out["reduce_scatter"] = dict(header=s.header.numel(), data=torch.equal(chunk, want.narrow(0, rank * n, n)),
                                 flat_is_the_whole_sum=torch.equal(flat[:n * ws], want))

    s = stamp("all_reduce")
    tensor = torch.cat([_flat_of(rank, n, ws, torch.float32), torch.full((s.header.numel(),), 99.0)])
    collectives.all_reduce_sum(tensor, dist.group.WORLD, header=s.header)
    checker.verify_stamp(s, tensor)
    out["all_reduce"] = dict(header=s.header.numel(), data=torch.equal(tensor[:n * ws], want))

    # Without a header the buffer must be exactly the data: room left unfilled would be summed garbage.
    try:
        collectives.all_gather_into(torch.empty(n * ws + 1), _shard_of(rank, n, torch.float32), dist.group.WORLD)
        out["room_without_header"] = None
    except ValueError as e:
        out["room_without_header"] = str(e)
    return out


def _worker(rank, ws):
    return run_scenarios({"data": _data_layout, "headers": _headers}, rank, ws)


@spawn_once
def report() -> list:
    return run_distributed(_worker, WS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("substitution", ["all_reduce", "native"])
def test_all_gather_and_reduce_scatter_give_the_reference_layout(substitution, dtype):
    """Gathered: every rank's shard, rank-major, nothing of the output's old contents. Reduce-scatter: the
    rank's contiguous chunk of the sum. The all-reduce substitution and gloo's own collectives agree."""
    for rank, r in enumerate(report()):
        results = scenario(r, "data")
        for n in SIZES:
            gathered_ok, chunk_ok = results[f"{substitution}/{dtype}/{n}"]
            assert gathered_ok, f"rank {rank}: all-gather of {n} elements per rank"
            assert chunk_ok, f"rank {rank}: reduce-scatter chunk of {n} elements"


def test_the_fingerprint_header_follows_the_data_and_carries_every_rank_s_slot():
    for rank, r in enumerate(report()):
        h = scenario(r, "headers")
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            assert h[op]["header"] == WS * SLOT, (op, h[op])
            assert h[op]["data"], f"rank {rank}: {op}'s data changed by its header"
        assert h["reduce_scatter"]["flat_is_the_whole_sum"]  # the substitution sums the packed buffer in place


def test_room_after_the_data_without_a_header_is_refused():
    for r in report():
        msg = scenario(r, "headers")["room_without_header"]
        assert msg == "buffer of 16 elements for 15 elements of data and no header", msg
