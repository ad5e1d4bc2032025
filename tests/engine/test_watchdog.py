"""The stall watchdog: a rank stuck in a shardwise collective raises within seconds, naming where every rank
is, and every rank prints the report; healthy or merely slow training reports nothing.

The process group timeout is 120 s and the stall threshold 2 s (``SHARDWISE_STALL_S``), so an error well
inside 30 s comes from the watchdog, not from the timeout. Each worker sends its stderr to a file per rank.
``watchdog.note_step()`` is called by the test at every step, as the runtime does at every root forward.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import shardwise
from harness import RankError, run_distributed
from models import GPT, Block, gpt_loss, tiny_gpt_config
from parity_utils import spawn_once
from shardwise.engine.base import watchdog
PG_TIMEOUT_S = 120
STALL_S = 4  # well above a loaded 2-core machine's scheduling skew between ranks
STALL = {"SHARDWISE_STALL_S": str(STALL_S)}
VOCAB = tiny_gpt_config().vocab_size


def _stderr_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"stderr{rank}.txt")


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def _wait_for(predicate, limit_s: float = 20.0) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _step(model, opt, x) -> None:
    watchdog.note_step()
    gpt_loss(model, x, x).backward()
    shardwise.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()


def _stall(rank: int, world: int, scenario: str, out_dir: str) -> dict:
    """Healthy steps first, then rank 0 enters a collective rank 1 never joins.

    * skipped_forward: four steps with clipping, two of them slowed on rank 0 by less than the threshold (rank 1
      waits ~1 s in the all-gather), and a full state dict: nothing may be reported there. Then rank 0 runs
      one more forward (all-gather of the root unit) while rank 1 does user work.
    * clip_alone: two steps; then both run a forward and backward, rank 0 alone calls clip_grad_norm_ and
      rank 1 waits in a collective of its own, on a group of its own.

    Rank 0 re-raises the ShardwiseError with the seconds it waited. Both ranks return (or report in their
    error) what they had printed before the stall and whether the watchdog thread was running."""
    sys.stderr = open(_stderr_path(out_dir, rank), "w", buffering=1)
    user_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = GPT(tiny_gpt_config())
    shardwise.shard(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(rank))
    healthy = 4 if scenario == "skipped_forward" else 2
    for step in range(healthy):
        if rank == 0 and scenario == "skipped_forward" and step in (1, 3):
            time.sleep(1.0)
        _step(model, opt, x)
    if scenario == "skipped_forward":
        assert shardwise.full_state_dict(model) or rank != 0
    before = dict(printed=_read(_stderr_path(out_dir, rank)), watching=any(
        t.name == "shardwise-watchdog" for t in threading.enumerate()))
    done = os.path.join(out_dir, "rank0_done")
    if rank == 0:
        watchdog.note_step()
        try:
            if scenario == "clip_alone":
                gpt_loss(model, x, x).backward()
                start = time.monotonic()
                shardwise.clip_grad_norm_(model, 1.0)
            else:
                start = time.monotonic()
                model(x, x)
        except shardwise.ShardwiseError as e:
            waited = time.monotonic() - start
            # rank 1's report, before this rank exits and rank 1's waits fail
            _wait_for(lambda: "stall report" in _read(_stderr_path(out_dir, 1)))
            open(done, "w").close()
            raise RuntimeError(f"raised after {waited:.2f} s; before: {before!r}; error: {e}") from None
        return dict(before, outcome="rank 0 was not stopped")
    if scenario == "clip_alone":
        watchdog.note_step()
        gpt_loss(model, x, x).backward()
        try:
            dist.all_reduce(torch.ones(1), group=user_group)  # never joined by rank 0: fails when rank 0 exits
        except RuntimeError as e:
            return dict(before, outcome=f"own collective failed: {e}")
        return dict(before, outcome="own collective finished")
    _wait_for(lambda: os.path.exists(done), 60)  # user work, outside shardwise, until rank 0 gave up
    return dict(before, outcome="idle")


@spawn_once
def _run_stall(scenario: str, out_dir: str) -> list:
    return run_distributed(_stall, 2, scenario, out_dir, timeout_s=PG_TIMEOUT_S, env=STALL, allow_errors=True)


@pytest.fixture(scope="module")
def out_dirs(tmp_path_factory):
    return {s: str(tmp_path_factory.mktemp(s)) for s in ("skipped_forward", "clip_alone")}


def _rank0(results) -> tuple[float, dict, str]:
    error = results[0]
    assert isinstance(error, RankError), results
    found = re.search(r"raised after ([0-9.]+) s; before: (.*?); error: ", error)
    assert found, error
    return float(found.group(1)), ast.literal_eval(found.group(2)), error


@pytest.mark.parametrize("scenario", ["skipped_forward", pytest.param("clip_alone", marks=pytest.mark.slow)])
def test_a_rank_stuck_in_a_collective_raises_within_seconds_and_every_rank_reports(scenario, out_dirs):
    results = _run_stall(scenario, out_dirs[scenario])
    waited, _, error = _rank0(results)
    assert waited < 30, error  # the process group's timeout is 120 s
    assert "ShardwiseError" in error and "rank 0: stopped waiting in" in error
    if scenario == "skipped_forward":  # its extra forward's agreement is where rank 0 waits alone
        assert "in the agreement before the start of a forward" in error, error
    else:  # the agreement before clipping's all-reduce, while rank 1 is in its own collective: a deadlock
        assert "in the agreement before clip_grad_norm of the model" in error, error
        assert "ranks [1] are blocked in a collective of their own (torch.distributed.all_reduce()" in error, error
    # rank 1's whereabouts: outside shardwise since its last step, with its last shardwise wait
    assert re.search(r"rank 1: outside shardwise since step \d+(, blocked in .+?)? \(its last shardwise wait, .+, "
                     r"ended", error), error
    assert "  rank 0: in " in error
    for rank in (0, 1):
        printed = _read(_stderr_path(out_dirs[scenario], rank))
        assert printed.count("stall report:") == 1, printed
        assert f"[shardwise rank {rank}]   rank 1: outside shardwise since step" in printed, printed
        assert f"[shardwise rank {rank}]   rank 0: in " in printed, printed
    if scenario == "clip_alone":  # rank 1 was in its own collective until rank 0 gave up and exited
        assert results[1]["outcome"].startswith("own collective failed"), results[1]


def test_healthy_and_slow_but_progressing_steps_report_nothing(out_dirs):
    """The four steps before the stall (two slowed by 1 s against a 4 s threshold, clipping, a full state
    dict) printed nothing on either rank, with the watchdog running."""
    results = _run_stall("skipped_forward", out_dirs["skipped_forward"])
    _, before0, _ = _rank0(results)
    for before in (before0, results[1]):
        assert before["watching"] and before["printed"] == "", before


def test_threshold_defaults_to_five_longest_steps_with_a_floor_and_unset_only_reports(monkeypatch):
    """Unset, a long wait is reported, never raised: before the process group's own timeout only a proven
    disagreement raises (rank-local work between steps is a healthy reason to wait)."""
    monkeypatch.delenv("SHARDWISE_STALL_S", raising=False)
    state = watchdog._State()
    monkeypatch.setattr(watchdog, "_state", state)
    assert watchdog.threshold() == (watchdog.FIRST_STEP_S, False)
    state.step, state.longest = 5, 1.0
    assert watchdog.threshold() == (watchdog.FLOOR_S, False)
    state.longest = 20.0
    assert watchdog.threshold() == (100.0, False)
    monkeypatch.setenv("SHARDWISE_STALL_S", "7.5")
    assert watchdog.threshold() == (7.5, True)
    monkeypatch.setenv("SHARDWISE_STALL_S", "0")
    assert watchdog.threshold() == (None, False)


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A world of one in this process, and a fresh watchdog state with no thread: the test ticks it."""
    state = watchdog._State()
    state.started = True
    monkeypatch.setattr(watchdog, "_state", state)
    monkeypatch.setenv("SHARDWISE_STALL_S", "2")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield state
    dist.destroy_process_group()


def _stuck(state, what: str, seconds: float) -> None:
    state.what, state.blocking, state.since, state.wid = what, True, time.monotonic() - seconds, 7


def test_without_a_store_a_stalled_wait_reports_its_own_position_and_raises(one_rank, monkeypatch, capsys):
    monkeypatch.setattr(watchdog, "_default_store", lambda: None)
    _stuck(one_rank, "all_gather of unit 'x'", 3.0)
    watchdog._Watchdog().tick()
    assert one_rank.abort is not None and one_rank.abort[0] == 7, one_rank.abort
    assert "other ranks unknown" in one_rank.abort[1]
    printed = capsys.readouterr().err
    assert "[shardwise rank 0] stall report:" in printed
    assert "rank 0: in all_gather of unit 'x' for 3.0 s (step 0)" in printed


def test_ranks_all_in_the_same_collective_are_reported_not_raised(one_rank, capsys):
    """Every rank (here the only one) waits in the same collective: slow, not out of step."""
    _stuck(one_rank, "all_gather of unit 'x'", 3.0)
    dog = watchdog._Watchdog()
    dog.tick()
    assert one_rank.abort is None
    printed = capsys.readouterr().err
    assert "Report only, nothing raised: every rank is in this same collective" in printed, printed
    dog.tick()  # reported once per threshold, not at every poll
    assert capsys.readouterr().err == ""


def test_unset_threshold_reports_a_long_wait_and_leaves_it_to_the_process_group_timeout(one_rank, monkeypatch,
                                                                                       capsys):
    """Rank-local work between steps (evaluation, torch.save on rank 0) makes the others wait past the
    threshold in a healthy run: with SHARDWISE_STALL_S unset that is reported, never raised."""
    monkeypatch.delenv("SHARDWISE_STALL_S")
    monkeypatch.setattr(watchdog, "_default_store", lambda: None)
    monkeypatch.setattr(watchdog, "FLOOR_S", 1.0)
    one_rank.step, one_rank.longest = 5, 0.1
    _stuck(one_rank, "all_gather of unit 'x'", 3.0)
    watchdog._Watchdog().tick()
    assert one_rank.abort is None
    printed = capsys.readouterr().err
    assert "rank 0: in all_gather of unit 'x' for 3.0 s" in printed and "Report only, nothing raised" in printed, \
        printed
