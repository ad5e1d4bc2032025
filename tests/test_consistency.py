"""Ranks that disagree about what they communicate fail fast, on every rank, with the culprit named."""

import os
import time

import pytest
import torch

import shardwise
from harness import RankError, run_distributed
from shardwise.models import GPT, GPTConfig, Block

CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=18)


def _diverge(rank: int, world: int, scenario: str) -> str:
    torch.manual_seed(0)
    cfg = CFG
    if scenario == "different_model" and rank == 1:
        cfg = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=20)
    model = GPT(cfg)
    shardwise.shard(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 61, (2, 16))
    model(x, x).loss.backward()  # one healthy step first: the check must not fire on agreement
    opt.step()
    opt.zero_grad()
    start = time.monotonic()
    if scenario == "extra_forward":
        loss = model(x, x).loss
        if rank == 0:
            loss = loss + model(x, x).loss
        loss.backward()
    elif scenario == "skipped_backward":
        loss = model(x, x).loss
        if rank != 0:
            loss.backward()
        model(x, x).loss.backward()
    elif scenario == "different_order":
        # rank 1 calls the blocks in reverse order: same shapes, different units
        blocks = list(model.blocks) if rank == 0 else list(model.blocks)[::-1]
        h = torch.randn(2, 16, CFG.n_embd, generator=torch.Generator().manual_seed(0))
        for b in blocks:
            h = b(h)
        h.sum().backward()
    elif scenario == "rank_dies":
        if rank == 1:
            os._exit(3)
        model(x, x).loss.backward()
    return f"no error after {time.monotonic() - start:.1f}s"


def _errors(results):
    return [r for r in results if isinstance(r, RankError)]


@pytest.mark.parametrize("scenario", ["extra_forward", "skipped_backward"])
def test_a_rank_that_runs_ahead_makes_every_rank_fail_naming_unit_and_ranks(scenario):
    """One rank runs an extra forward (or skips a backward): both ranks raise, naming units and ranks."""
    results = run_distributed(_diverge, 2, scenario, timeout_s=30, allow_errors=True)
    errors = _errors(results)
    assert len(errors) == 2, results
    for e in errors:
        assert "ShardwiseError: ranks disagree about the next collective" in e
        assert "ranks [0] are at all_gather of unit 'blocks.0'" in e
        assert "ranks [1] are at all_gather of unit 'blocks.2'" in e
        assert "(flat group 0" in e and "backward" in e and "forward" in e


def test_units_called_in_a_different_order_are_detected():
    """Same shapes, different units: the fingerprint still tells them apart."""
    errors = _errors(run_distributed(_diverge, 2, "different_order", timeout_s=30, allow_errors=True))
    assert len(errors) == 2
    assert all("unit 'blocks.0'" in e and "unit 'blocks.2'" in e for e in errors)


def test_ranks_with_different_models_fail_at_shard_time():
    """A rank that built another model is caught by the plan hash before any training collective."""
    errors = _errors(run_distributed(_diverge, 2, "different_model", timeout_s=30, allow_errors=True))
    assert len(errors) == 2
    assert all("ranks built different models or sharding plans" in e for e in errors)


def test_a_dead_rank_makes_the_others_fail_fast_not_after_the_timeout():
    """Rank 1 exits mid-run: rank 0 fails with a message about its peer well inside the timeout."""
    start = time.monotonic()
    results = run_distributed(_diverge, 2, "rank_dies", timeout_s=120, allow_errors=True)
    assert time.monotonic() - start < 100  # fails on the closed connection, not the 120 s timeout
    assert "another rank died, left, or stopped communicating" in results[0] or "a peer rank died" in results[0]


def _agree(rank: int, world: int) -> int:
    torch.manual_seed(0)
    model = GPT(CFG)
    shardwise.shard(model, units={Block})
    for _ in range(2):
        model(torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))).loss.backward()
    return shardwise.api.runtime_of(model).units[0].groups[0].checker.seq


def test_agreeing_ranks_exchange_one_fingerprint_per_collective():
    """3 blocks + root, 2 steps: per step 4 gathers in forward, 3 re-gathers in backward, 4 reduce-scatters."""
    seqs = run_distributed(_agree, 3)
    assert seqs == [2 * (4 + 3 + 4)] * 3
