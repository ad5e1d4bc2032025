"""Ranks about to issue different collectives fail on every rank, with the culprit named, before anything of
two sizes or two meanings reaches the wire (checks/fingerprint.py); agreeing ranks pay one exchange per phase.

Where the ranks part at the start of a phase (one runs an extra forward, skips a backward, calls a unit on its
own) they meet in one exchange and fail at once, and their process group stays usable: those cases share one
spawn. Where one rank parts in the middle of a phase it waits in an exchange while the others wait in the
collective it never issues: the stall watchdog's probe names it within seconds, and the group is left with a
pending collective, so each such case ends its spawn.
"""

import os
import re
import time

import pytest
import torch

import shardwise
from harness import RankError, run_distributed
from shardwise.models import GPT, GPTConfig, Block

CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=18)
WATCHED = {"SHARDWISE_STALL_S": "4"}  # a rank that never arrives is reported, and raised, after 4 s


def _case(rank: int, world: int, scenario: str, out_dir: str = "", strategy: str = "full_shard") -> dict:
    """One scenario on a fresh model after two healthy steps (SGD with momentum: the second has an agreed
    sequence to follow). Returns the error text (or None), whether the optimizer was reached, whether every
    shard is still what the healthy steps left, and how long it took."""
    from shardwise.engine.core.runtime import runtime_of

    torch.manual_seed(0)
    options = {}
    if strategy == "hybrid_shard":
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shardwise.shard(GPT(CFG), units={Block}, strategy=strategy, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(x, x).loss.backward()
        opt.step()
        opt.zero_grad()
    shards = [g.shard for g in runtime_of(model).flat_groups()]
    before = [t.clone() for t in shards]
    reached_optimizer, start = False, time.monotonic()
    try:
        _SCENARIOS[scenario](model, x, rank, world, out_dir)
        reached_optimizer = True
        opt.step()
        error = None
    except shardwise.ShardwiseError as e:
        error = str(e)
    return {"error": error, "reached_optimizer": reached_optimizer, "seconds": time.monotonic() - start,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, shards))}


def _extra_forward(model, x, rank, world, out_dir):  # the last rank runs one forward more
    loss = model(x, x).loss
    if rank == world - 1:
        loss = loss + model(x, x).loss
    loss.backward()


def _skipped_backward(model, x, rank, world, out_dir):  # rank 0 skips one backward
    loss = model(x, x).loss
    if rank != 0:
        loss.backward()
    model(x, x).loss.backward()


def _units_called_in_another_order(model, x, rank, world, out_dir):  # same sizes, other units
    order = [0, 1, 2] if rank != 1 else [0, 2, 1]
    h = torch.randn(2, 16, CFG.n_embd, generator=torch.Generator().manual_seed(0))
    for i in order:
        h = model.blocks[i](h)
    h.sum().backward()


def _units_of_different_sizes(model, x, rank, world, out_dir):  # gloo would abort on the sizes
    h = torch.randn(2, 16, CFG.n_embd)
    (model.lm_head(h) if rank == 1 else model.blocks[0](h)).sum().backward()


def _reordered_inside_a_forward(model, x, rank, world, out_dir):  # mid-phase: rank 1 swaps two blocks
    if rank == 1:
        blocks = model.blocks
        blocks._modules["1"], blocks._modules["2"] = blocks._modules["2"], blocks._modules["1"]
    model(x, x).loss.backward()


def _reordered_inside_a_forward_without_grad(model, x, rank, world, out_dir):  # an evaluation: never returned
    # Rank 1 runs the blocks backwards. (Swapping two neighbours would not do: prefetch issues the all-gathers
    # in the recorded order either way, and without a backward nothing else differs - nor needs to.)
    with torch.no_grad():
        model(x, x)  # agreed: the same order everywhere
        if rank == 1:
            blocks = model.blocks
            blocks._modules = dict(zip(blocks._modules, reversed(list(blocks._modules.values()))))
        model(x, x)


def _mixed_gradients(model, x, rank, world, out_dir):
    # Rank 1's reduce-scatter of the root is fingerprinted as blocks.0's: the same size, another meaning.
    from shardwise.engine.core.runtime import runtime_of

    checker = runtime_of(model).checker
    original = checker.before_issue
    checker.before_issue = lambda op, unit, group, numel: original(
        op, 0 if (rank == 1 and op == "reduce_scatter" and unit == 3) else unit, group, numel)
    model(x, x).loss.backward()


def _one_rank_no_sync(model, x, rank, world, out_dir):  # rank 0 accumulates while the others reduce
    if rank == 0:
        with shardwise.no_sync(model):
            model(x, x).loss.backward()
    else:
        model(x, x).loss.backward()
    model(x, x).loss.backward()


def _never_arrives(model, x, rank, world, out_dir):  # the last rank stays away (user code) while the others step
    if rank == world - 1:
        done = os.path.join(out_dir, "done")
        start = time.monotonic()
        while not os.path.exists(done) and time.monotonic() - start < 40:
            time.sleep(0.1)
    else:
        try:
            model(x, x).loss.backward()
        finally:
            if rank == 0:
                open(os.path.join(out_dir, "done"), "w").close()


def _rank_dies(model, x, rank, world, out_dir):
    if rank == 1:
        os._exit(3)
    model(x, x).loss.backward()


_SCENARIOS = {f.__name__.lstrip("_"): f for f in (
    _extra_forward, _skipped_backward, _units_called_in_another_order, _units_of_different_sizes,
    _reordered_inside_a_forward, _reordered_inside_a_forward_without_grad, _mixed_gradients, _one_rank_no_sync,
    _never_arrives, _rank_dies)}
AT_ONCE = ["extra_forward", "skipped_backward", "units_called_in_another_order", "units_of_different_sizes"]


def _cases(rank: int, world: int, scenarios: list[str], out_dir: str, strategy: str = "full_shard") -> dict:
    return {s: _case(rank, world, s, out_dir, strategy) for s in scenarios}


def _assert_named(error: str, at: dict[int, str]) -> None:
    assert error.startswith("ranks disagree about the next collective"), error
    for rank, what in at.items():
        assert re.search(rf"ranks \[[^\]]*\b{rank}\b[^\]]*\] are at {re.escape(what)}", error), (rank, what, error)


def _assert_stopped_before_the_optimizer(results: list, scenarios: list[str], skip_rank=None) -> None:
    assert not [r for r in results if isinstance(r, RankError)], results
    for scenario in scenarios:
        for rank, res in enumerate(results):
            case = res[scenario]
            if rank == skip_rank:
                continue
            assert case["error"], (scenario, rank, case)
            assert not case["reached_optimizer"] and case["unchanged"], (scenario, rank, case)
            assert case["seconds"] < 30, (scenario, rank, case)  # the collective timeout is 60 s


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ranks_that_part_at_the_start_of_a_phase_fail_at_once_naming_both_sides(world):
    """One extra forward, a skipped backward, units called on their own in another order or of different
    sizes (where gloo would abort the process): every rank raises at the exchange they meet in, with the
    ranks and calls named, before any optimizer step; the group stays usable for the next case."""
    scenarios = AT_ONCE if world == 2 else AT_ONCE[:2]
    results = run_distributed(_cases, world, scenarios, "", timeout_s=60, allow_errors=True)
    _assert_stopped_before_the_optimizer(results, scenarios)
    errors = {s: [res[s]["error"] for res in results] for s in scenarios}
    for e in errors["extra_forward"]:
        _assert_named(e, {world - 1: "the start of a forward", 0: "the start of a backward"})
    for e in errors["skipped_backward"]:
        _assert_named(e, {0: "the start of a forward", 1: "the start of a backward"})
    if world == 2:
        for e in errors["units_called_in_another_order"]:
            _assert_named(e, {0: "all_gather of unit 'blocks.1'", 1: "all_gather of unit 'blocks.2'"})
        for e in errors["units_of_different_sizes"]:
            # (the head is the root unit's: calling it alone starts a root forward)
            _assert_named(e, {0: "all_gather of unit 'blocks.0'", 1: "the start of a forward"})


@pytest.mark.parametrize("scenario", ["reordered_inside_a_forward", "reordered_inside_a_forward_without_grad",
                                      "mixed_gradients",
                                      pytest.param("one_rank_no_sync", marks=pytest.mark.slow)])
def test_a_rank_that_parts_inside_a_phase_is_named_by_the_watchdog_within_seconds(scenario):
    """A rank whose collective differs from the agreed sequence in the middle of a phase (another unit order,
    the same size with another meaning, no reduce-scatter under no_sync) exchanges it instead of issuing it,
    while the others wait in the one it never issues: the watchdog's probe finds the ranks' last collectives
    differing at one call and every rank raises, without SHARDWISE_STALL_S, before any optimizer step."""
    results = run_distributed(_cases, 2, [scenario], "", timeout_s=60, allow_errors=True)
    _assert_stopped_before_the_optimizer(results, [scenario])
    for res in results:
        e = res[scenario]["error"]
        assert e.startswith("ranks disagree about the next collective") and "Found by the stall watchdog" in e, e
        assert "are behind" not in e, e  # proven parted: no rank is merely behind
    if scenario == "mixed_gradients":
        for res in results:
            _assert_named(res[scenario]["error"], {0: "reduce_scatter of unit '<root>'",
                                                    1: "reduce_scatter of unit 'blocks.0'"})


def test_a_rank_that_never_arrives_is_reported_behind_and_raised_at_the_threshold(tmp_path):
    """World size 3, rank 2 away in user code (not in a collective): nothing proves the ranks parted, so the
    ranks waiting for it raise at SHARDWISE_STALL_S, naming it as behind and outside shardwise."""
    results = run_distributed(_cases, 3, ["never_arrives"], str(tmp_path), timeout_s=60, env=WATCHED,
                              allow_errors=True)
    _assert_stopped_before_the_optimizer(results, ["never_arrives"], skip_rank=2)
    for res in results[:2]:
        e = res["never_arrives"]["error"]
        assert "stopped waiting in the agreement before the start of a forward" in e, e
        assert "rank 2: outside shardwise since step" in e, e
        assert re.search(r"ranks \[2\] are behind: their last collective is call \d+", e), e


def test_in_a_hybrid_mesh_every_rank_names_the_rank_that_ran_ahead():
    """2 x 2 hybrid: rank 3 runs an extra forward. Phases are agreed over every rank of the model, so all
    four raise the same disagreement at once (none is left to a peer's exit)."""
    results = run_distributed(_cases, 4, ["extra_forward"], "", "hybrid_shard", timeout_s=60, allow_errors=True)
    _assert_stopped_before_the_optimizer(results, ["extra_forward"])
    for res in results:
        _assert_named(res["extra_forward"]["error"], {3: "the start of a forward", 0: "the start of a backward"})


def test_a_dead_rank_makes_the_others_fail_fast_not_after_the_timeout():
    """Rank 1 exits mid-run: rank 0 fails with a message about its peer well inside the timeout."""
    start = time.monotonic()
    results = run_distributed(_cases, 2, ["rank_dies"], "", timeout_s=120, allow_errors=True)
    assert time.monotonic() - start < 100  # fails on the closed connection, not the 120 s timeout
    e = results[0]["rank_dies"]["error"] if isinstance(results[0], dict) else results[0]
    assert "a peer rank died" in e or "another rank died" in e, e


def _different_model(rank: int, world: int) -> str:
    torch.manual_seed(0)
    cfg = CFG if rank == 0 else GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=20)
    shardwise.shard(GPT(cfg), units={Block})
    return "no error"


def test_ranks_with_different_models_fail_at_shard_time():
    """A rank that built another model is caught by the plan's digest before any other collective."""
    results = run_distributed(_different_model, 2, timeout_s=30, allow_errors=True)
    assert all(isinstance(r, RankError) and "ranks built different models or sharding plans" in r for r in results)


def _exchanges_per_step(rank: int, world: int, strategy: str, reorder_at: int) -> list[tuple[int, int]]:
    """(exchanges, collectives) per step over 5 steps; at step ``reorder_at`` every rank swaps two blocks
    (a change the ranks make alike: more exchanges that step, no error)."""
    from shardwise.engine.checks.fingerprint import CollectiveChecker

    torch.manual_seed(0)
    options = {}
    if strategy == "hybrid_shard":
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shardwise.shard(GPT(CFG), units={Block}, strategy=strategy, **options)
    checker = shardwise.engine.core.runtime.runtime_of(model).checker
    exchanges = []
    original = CollectiveChecker._exchange
    CollectiveChecker._exchange = lambda self, *a, **k: (exchanges.append(a[0]), original(self, *a, **k))[1]
    out = []
    try:
        for step in range(5):
            if step == reorder_at:
                blocks = model.blocks
                blocks._modules["1"], blocks._modules["2"] = blocks._modules["2"], blocks._modules["1"]
            n, seq = len(exchanges), checker.seq
            model(torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))).loss.backward()
            starts = exchanges[n:].count("phase_start")  # the others are collectives exchanged one by one
            out.append((len(exchanges) - n, checker.seq - seq - starts))
    finally:
        CollectiveChecker._exchange = original
    return out


@pytest.mark.parametrize("strategy, world, collectives", [
    ("full_shard", 3, 4 + 3 + 4),  # 4 gathers in forward, 3 re-gathers in backward, 4 reduce-scatters
    ("no_shard", 2, 4),  # one all-reduce per unit
    ("hybrid_shard", 4, 4 + 3 + 4 + 4),  # full_shard inside the pair, plus one replica all-reduce per unit
])
def test_agreeing_ranks_exchange_once_per_phase_after_the_first_step(strategy, world, collectives):
    """Step 1 has no agreed sequence yet: every collective is exchanged. From step 2 on, one exchange at the
    start of the forward and one at the start of the backward, whatever the number of collectives, plus one
    at its end: the agreement on which parameters got a gradient (core/grad_usage.py), a control collective
    outside the unit schedule, exchanged before it is issued like every such collective. A change every
    rank makes alike (two blocks swapped at step 3) costs exchanges from where it starts, no error, and one
    more step (prefetch follows the new order from the step after it), then again three a step."""
    results = run_distributed(_exchanges_per_step, world, strategy, 2)
    usage = 1  # the grad-usage agreement: one exchange and one call a step
    for per_step in results:
        exchanges, counts = zip(*per_step)
        assert set(counts) == {collectives + usage}, per_step
        assert exchanges[0] == 2 + collectives + usage and exchanges[1] == 2 + usage, per_step
        assert exchanges[4] == 2 + usage, per_step
        assert 2 + usage < exchanges[2] <= 2 + collectives + usage, per_step
