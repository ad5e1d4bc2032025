"""The collectives layer (``shardwise/engine/base/collectives.py``): on gloo a reduce-scatter, and an
all-gather above ``GLOO_NATIVE_ALL_GATHER_MAX`` elements, run as one all-reduce (see its Note: the wire);
this checks the substitution's layout against references and that the choice is made by size.

Each rank's data is a function of its rank, so every rank can compute the expected results itself; gloo's
native collectives (a second process group, created with ``SHARDWISE_GLOO_NATIVE_COLLECTIVES=1``) must give
the same data. World size 3 with shards of 1, 5 and 7 elements: nothing divides evenly. Collectives from the
offload worker's thread are refused (two threads would issue in different orders on different ranks).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

from harness import error_of, run_distributed
from parity_utils import run_scenarios, scenario, spawn_once
from shardwise.engine.base import collectives

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
        assert not collectives.runs_as_all_reduce("reduce_scatter", group, torch.device("cpu"), 10**9)
    finally:
        del os.environ["SHARDWISE_GLOO_NATIVE_COLLECTIVES"]
    return group


def _data_layout(rank, ws):
    """All-gather and reduce-scatter, substituted and native, against the references, every size and dtype.
    The substituted all-gather is forced by lowering the size above which it applies."""
    world, native = dist.group.WORLD, _native_group()
    out = {}
    saved = collectives.GLOO_NATIVE_ALL_GATHER_MAX
    try:
        for dtype in DTYPES:
            for n in SIZES:
                want = torch.cat([_shard_of(r, n, dtype) for r in range(ws)])
                want_chunk = sum(_flat_of(r, n, ws, dtype) for r in range(ws)).narrow(0, rank * n, n)
                for name, group, limit in (("all_reduce", world, 0), ("native", native, saved)):
                    collectives.GLOO_NATIVE_ALL_GATHER_MAX = limit
                    gathered = torch.full((n * ws,), 99, dtype=dtype)  # stale contents must not leak through
                    collectives.all_gather_into(gathered, _shard_of(rank, n, dtype), group, async_op=False)
                    chunk = torch.full((n,), 99, dtype=dtype)
                    flat = _flat_of(rank, n, ws, dtype)
                    work = collectives.reduce_scatter_into(chunk, flat, group, async_op=True)
                    collectives.wait(work)
                    out[f"{name}/{dtype}/{n}"] = (torch.equal(gathered, want), torch.equal(chunk, want_chunk))
    finally:
        collectives.GLOO_NATIVE_ALL_GATHER_MAX = saved
    return out


def _choices(rank, ws):
    """Which wire each collective takes on gloo, by size, and with the switch that makes every one native."""
    world, native, cpu = dist.group.WORLD, _native_group(), torch.device("cpu")
    big = collectives.GLOO_NATIVE_ALL_GATHER_MAX
    return {name: collectives.runs_as_all_reduce(op, group, cpu, numel) for name, (op, group, numel) in {
        "small all_gather": ("all_gather", world, big), "large all_gather": ("all_gather", world, big + 1),
        "small reduce_scatter": ("reduce_scatter", world, 8), "native switch": ("all_gather", native, big + 1),
        "native switch reduce_scatter": ("reduce_scatter", native, 8)}.items()}


def _from_the_offload_thread(rank, ws):
    """A thread marked as running beside the training thread may not issue a collective (the offload worker
    is marked by its executor's initializer); the training thread still may."""
    result = {}

    def worker():
        collectives.forbid_collectives_here()
        result["error"] = error_of(lambda: collectives.all_reduce_sum(torch.ones(2), dist.group.WORLD))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    t2 = torch.ones(2)
    collectives.all_reduce_sum(t2, dist.group.WORLD)
    return {"refused": result["error"], "training_thread": t2.tolist()}


def _worker(rank, ws):
    return run_scenarios({"data": _data_layout, "choices": _choices, "thread": _from_the_offload_thread}, rank, ws)


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


def test_gloo_gathers_natively_up_to_the_measured_size_and_reduce_scatters_by_all_reduce():
    """bench/gloo_wire.py's table decided it: native all-gathers up to GLOO_NATIVE_ALL_GATHER_MAX elements, an
    all-reduce above; reduce-scatters always by all-reduce; SHARDWISE_GLOO_NATIVE_COLLECTIVES=1: all native."""
    for r in report():
        assert scenario(r, "choices") == {"small all_gather": False, "large all_gather": True,
                                          "small reduce_scatter": True, "native switch": False,
                                          "native switch reduce_scatter": False}


def test_a_collective_from_the_offload_worker_thread_is_refused():
    for r in report():
        t = scenario(r, "thread")
        assert t["refused"].startswith("ShardwiseError: internal error: an all-reduce issued from thread"), t
        assert t["training_thread"] == [float(WS)] * 2
