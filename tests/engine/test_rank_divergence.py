"""Ranks that take different paths through user code, as common training scripts do by mistake: named on every
rank within seconds, never a gloo abort, never a wait to the process group's timeout (60 s here).

* a forward on the master rank only (evaluation under ``if rank == 0:``) while the others train on;
* ``dist.all_reduce(p.grad)`` after backward (the tutorial habit): refused at once on every rank, world sizes 2
  and 3 (3: the pieces differ in size);
* an exception caught on one rank only, in the middle of a forward;
* a layer dropped on one rank only in the middle of a forward, its units of different sizes (gloo would abort
  on the sizes);
* uneven evaluation batches, then ``dist.all_reduce(metric)``;
* a rank-0-only evaluation, then ``dist.barrier()``.

In the last two a rank blocks in a collective of its own while another waits in one of ours: the ranks in
ours raise (the stall report proves the deadlock); the rank in its own call prints the same report, and its
call fails when the raising rank exits (gloo: the connection closes), as a RuntimeError, not an abort.
"""

from __future__ import annotations

import io
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardwise
from harness import RankError, error_of, run_distributed
from shardwise.models import GPT, Block, GPTConfig

CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=18)
TIMEOUT_S = 60  # the process group's timeout: no test here may come near it
WITHIN_S = 30  # from the parting to the error on each rank (the processes' start is not counted: slow under load)


def _timed(fn):
    """``fn()``; a ShardwiseError it raises is raised again with the seconds it took appended (``[3.1 s]``):
    the time from the parting to the error, read by ``_seconds`` from the rank's error text."""
    start = time.monotonic()
    try:
        return fn()
    except shardwise.ShardwiseError as e:
        raise shardwise.ShardwiseError(f"{e} [{time.monotonic() - start:.1f} s]") from None


def _seconds(error: str) -> float:
    return float(re.search(r"\[(\d+\.\d) s\]", error).group(1))


def _trained(rank: int):
    torch.manual_seed(0)
    model = shardwise.shard(GPT(CFG), units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # two healthy steps: the second follows an agreed sequence
        model(x, x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt, x


def _all_reduce_grad(rank: int, world: int) -> str:
    model, opt, x = _trained(rank)
    model(x, x).loss.backward()
    return error_of(lambda: [dist.all_reduce(p.grad) for p in model.parameters()])


def _forward_on_the_master_rank(rank: int, world: int) -> str:
    model, opt, x = _trained(rank)

    def step():
        if rank == 0:  # evaluation on the master rank only
            with torch.no_grad():
                model(x, x)
        model(x, x).loss.backward()

    return error_of(step)


def _usable_after(rank: int, world: int) -> dict:
    """The patterns met without a collective in flight, then one more healthy step on a fresh model."""
    out = {"all_reduce_grad": _all_reduce_grad(rank, world),
           "forward_on_the_master_rank": _forward_on_the_master_rank(rank, world)}
    model, opt, x = _trained(rank)
    model(x, x).loss.backward()
    out["then"] = "trained"
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_of_a_gradient_and_a_master_only_forward_fail_at_once_on_every_rank(world):
    start = time.monotonic()
    results = run_distributed(_usable_after, world, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S
    for rank, r in enumerate(results):
        assert r["all_reduce_grad"].startswith(
            "ShardwiseError: torch.distributed.all_reduce on a sharded parameter or its gradient"), r
        e = r["forward_on_the_master_rank"]
        assert e.startswith("ShardwiseError: ranks disagree about the next collective"), e
        assert "ranks [0] are at the start of a forward without grad" in e, e
        assert f"ranks {list(range(1, world))} are at the start of a forward (call" in e, e
        assert r["then"] == "trained"  # nothing was left in flight: the group still works


def _exception_on_one_rank(rank: int, world: int) -> None:
    model, opt, x = _trained(rank)

    def fail_on_rank_0(module, args):
        if rank == 0:
            raise ValueError("a bad batch on rank 0")

    # prepend: before shardwise's own entry of blocks.1, which would prefetch blocks.2's gather first
    handle = model.blocks[1].register_forward_pre_hook(fail_on_rank_0, prepend=True)
    def parted():
        try:
            model(x, x).loss.backward()
        except ValueError:
            handle.remove()  # caught, and training goes on, on rank 0 only
        model(x, x).loss.backward()

    _timed(parted)


def test_an_exception_caught_on_one_rank_inside_a_forward_is_named_on_every_rank():
    """Rank 0 leaves its forward before entering blocks.1 and starts the next one; rank 1 goes on to blocks.2's
    gather, which rank 0 never issued. Rank 0 waits in the next forward's agreement, rank 1 in the gather: the
    watchdog's probe names both. (Had rank 0 issued all of its forward's gathers before raising, the two
    would meet at once in their next agreements: the start of a forward against the start of a backward.)"""
    results = run_distributed(_exception_on_one_rank, 2, timeout_s=TIMEOUT_S, allow_errors=True)
    for e in results:
        assert isinstance(e, RankError) and "ShardwiseError: ranks disagree about the next collective" in e, e
        assert _seconds(e) < WITHIN_S, e
        assert "ranks [0] are at the start of a forward" in e and "Found by the stall watchdog" in e, e


class _Widths(nn.Module):
    """Four units, each mapping 16 features to 16, of different sizes: dropping one moves a rank to a unit
    whose collectives are of another size than the others' next ones."""

    def __init__(self):
        super().__init__()
        self.units = nn.ModuleList([nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 48), nn.Linear(48, 16)),
                                    nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 96), nn.Linear(96, 16))])

    def forward(self, x, drop=None):
        for i, unit in enumerate(self.units):
            if i != drop:
                x = torch.relu(unit(x))
        return x.square().mean()


def _layer_dropped_on_one_rank(rank: int, world: int, grad: bool) -> None:
    """Two healthy steps, then rank 1 drops units.1 (as stochastic depth drawn per rank would) in the middle
    of a forward, with grad (then a backward) or without (an evaluation, then the next one)."""
    torch.manual_seed(0)
    model = shardwise.shard(_Widths(), units="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(x).backward()
        opt.step()
        opt.zero_grad()
    def parted():
        with torch.set_grad_enabled(grad):
            loss = model(x, drop=1 if rank == 1 else None)
            if grad:
                loss.backward()
            model(x)

    _timed(parted)


@pytest.mark.parametrize("grad", [True, False], ids=["training", "evaluation"])
def test_a_layer_dropped_on_one_rank_mid_forward_is_named_on_every_rank_not_a_gloo_abort(grad):
    """The two ranks' next collectives differ in size in the middle of a phase (rank 0 needs units.1, rank 1
    the next unit): the rank off the agreed sequence exchanges its collective instead of issuing it, so nothing
    of two sizes meets on the wire; the watchdog's probe names the parting on every rank within seconds, and
    the ranks exit (a collective is left pending: the group is unusable)."""
    results = run_distributed(_layer_dropped_on_one_rank, 2, grad, timeout_s=TIMEOUT_S, allow_errors=True)
    for e in results:
        assert isinstance(e, RankError) and "ShardwiseError: ranks disagree about the next collective" in e, e
        assert _seconds(e) < WITHIN_S, e
        assert "ranks [0] are at all_gather of unit 'units.1'" in e and "Found by the stall watchdog" in e, e


def _own_collective(rank: int, world: int, pattern: str) -> dict:
    """Rank 0 runs more forwards than rank 1 (uneven evaluation batches, or an evaluation on rank 0 only), then
    both make a collective of their own. Rank 1's own call is watched: its error and what it printed."""
    model, opt, x = _trained(rank)
    batches = {"uneven_eval": 3 if rank == 0 else 2, "rank_0_eval_then_barrier": 1 if rank == 0 else 0}[pattern]
    with torch.no_grad():
        metric = _timed(lambda: sum(float(model(x, x).loss) for _ in range(batches)))
    printed, saved = io.StringIO(), sys.stderr
    sys.stderr = printed  # the watchdog thread prints the stall report here
    start = time.monotonic()
    try:
        if pattern == "uneven_eval":
            dist.all_reduce(torch.tensor([metric]))
        else:
            dist.barrier()
        error = "no error"
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        sys.stderr = saved
    return {"error": error, "printed": printed.getvalue(), "seconds": time.monotonic() - start}


@pytest.mark.parametrize("pattern", ["uneven_eval", "rank_0_eval_then_barrier"])
def test_a_collective_of_your_own_on_some_ranks_is_a_deadlock_named_within_seconds(pattern):
    """Rank 0 waits in the agreement of its extra forward, rank 1 in its own all_reduce / barrier: each waits
    for the other. Rank 0 raises the report naming rank 1's call; rank 1 printed it, and its call fails when
    rank 0 exits (gloo closes the connection), well before the process group's timeout."""
    results = run_distributed(_own_collective, 2, pattern, timeout_s=TIMEOUT_S, allow_errors=True)
    assert isinstance(results[0], RankError) and _seconds(results[0]) < WITHIN_S, results
    assert "ShardwiseError: ranks [1] are blocked in a collective of their own" in results[0], results[0]
    call = "all_reduce" if pattern == "uneven_eval" else "barrier"
    assert f"torch.distributed.{call}() called at test_rank_divergence.py:" in results[0], results[0]
    assert "wait in shardwise's the agreement before the start of a forward without grad" in results[0], results[0]
    rank1 = results[1]
    assert isinstance(rank1, dict) and rank1["error"].startswith("RuntimeError"), rank1
    assert rank1["seconds"] < WITHIN_S, rank1
    assert "ranks [1] are blocked in a collective of their own" in rank1["printed"], rank1
