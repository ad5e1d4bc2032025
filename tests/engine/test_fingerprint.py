"""Ranks that disagree about what they communicate fail fast, on every rank, with the culprit named."""

import os
import re
import time

import pytest
import torch

import shardwise
from harness import RankError, run_distributed
from shardwise.models import GPT, GPTConfig, Block

CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=18)


def _diverge(rank: int, world: int, scenario: str, variant: str = "fp32", ahead: int = 0) -> str:
    """``variant``: fp32, bf16 (the in-band fingerprint travels in a bf16 buffer), native (gloo's own
    all-gather / reduce-scatter, fingerprint out of band) or hybrid (2 x 2 mesh: in band within each
    shard group). ``ahead``: the rank that runs the extra forward."""
    torch.manual_seed(0)
    cfg = CFG
    if scenario == "different_model" and rank == 1:
        cfg = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=20)
    model = GPT(cfg)
    options = {}
    if variant == "bf16":
        options["mixed_precision"] = shardwise.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if variant == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        options["strategy"] = "hybrid_shard"
        options["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shardwise.shard(model, units={Block}, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 61, (2, 16))
    model(x, x).loss.backward()  # one healthy step first: the check must not fire on agreement
    opt.step()
    opt.zero_grad()
    start = time.monotonic()
    if scenario == "extra_forward":
        loss = model(x, x).loss
        if rank == ahead:
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
    elif scenario in ("clip_alone", "full_state_dict_alone"):
        model(x, x).loss.backward()
        if rank == 0:
            if scenario == "clip_alone":
                shardwise.clip_grad_norm_(model, 1.0)
            else:
                shardwise.full_state_dict(model)
        opt.step()
        model(x, x).loss.backward()
    elif scenario == "rank_dies":
        if rank == 1:
            os._exit(3)
        model(x, x).loss.backward()
    return f"no error after {time.monotonic() - start:.1f}s"


def _errors(results):
    return [r for r in results if isinstance(r, RankError)]


def _assert_names_both_sides(error: str, ahead: int, behind: int) -> None:
    assert "ShardwiseError: ranks disagree about the next collective" in error
    assert f"ranks [{ahead}] are at all_gather of unit 'blocks.0'" in error
    assert f"ranks [{behind}] are at all_gather of unit 'blocks.2'" in error
    assert "(flat group 0" in error and "backward" in error and "forward" in error


@pytest.mark.parametrize("scenario", ["extra_forward", "skipped_backward"])
@pytest.mark.parametrize("variant", ["fp32", pytest.param("bf16", marks=pytest.mark.slow), "native"])
def test_a_rank_that_runs_ahead_makes_every_rank_fail_naming_unit_and_ranks(scenario, variant):
    """One rank runs an extra forward (or skips a backward): both ranks raise, naming units and ranks,
    whether the fingerprint rides in band (fp32, bf16) or out of band (gloo's native collectives)."""
    env = {"SHARDWISE_GLOO_NATIVE_COLLECTIVES": "1"} if variant == "native" else None
    results = run_distributed(_diverge, 2, scenario, variant, timeout_s=30, env=env, allow_errors=True)
    errors = _errors(results)
    assert len(errors) == 2, results
    for e in errors:
        _assert_names_both_sides(e, ahead=0, behind=1)


# Each op once in band (fp32) and once out of band (native) by default; the other two pairs under -m slow.
@pytest.mark.parametrize("scenario,op,variant", [
    ("clip_alone", "clip_grad_norm", "native"), ("full_state_dict_alone", "state_dict", "fp32"),
    pytest.param("clip_alone", "clip_grad_norm", "fp32", marks=pytest.mark.slow),
    pytest.param("full_state_dict_alone", "state_dict", "native", marks=pytest.mark.slow)])
def test_a_collective_outside_the_unit_schedule_called_by_one_rank_fails_on_every_rank(scenario, op, variant):
    """Rank 0 alone calls clip_grad_norm_ / full_state_dict, then both ranks go on training. Every rank
    raises ShardwiseError naming the operation: at once where the others' next collective is fingerprinted
    out of band (the fingerprints differ), through the stall watchdog where it rides in band (rank 0 waits in
    the consistency exchange that the others never join). Never gloo's own abort on mismatched sizes."""
    env = {"SHARDWISE_STALL_S": "3"}
    if variant == "native":
        env["SHARDWISE_GLOO_NATIVE_COLLECTIVES"] = "1"
    start = time.monotonic()
    results = run_distributed(_diverge, 2, scenario, variant, timeout_s=60, env=env, allow_errors=True)
    assert time.monotonic() - start < 50, results
    assert len(_errors(results)) == 2, results
    for e in results:
        assert "ShardwiseError" in e and op in e, e


def _grad_norm_on_one_rank(rank: int, world: int) -> None:
    """Every rank's ``p.grad.norm()`` equals the single-process norm; then rank 0 alone logs one (the
    habit ``if rank == 0: print(p.grad.norm())``) and every rank goes on training: that must raise."""
    from parity_utils import local_slice

    x = torch.randint(0, 61, (2 * world, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref(x, x).loss.backward()
    torch.manual_seed(0)
    model = shardwise.shard(GPT(CFG), units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mine = local_slice(x, rank, world)
    model(mine, mine).loss.backward()
    for (name, p), want in zip(model.named_parameters(), ref.parameters()):
        got, expected = float(p.grad.norm()), float(want.grad.norm())  # every rank calls: exact
        assert abs(got - expected) <= 1e-5 * expected, (name, got, expected)
    for step in range(3):  # the first step also checks the optimizer's state (its own agreed collective)
        if rank == 0 and step == 2:
            print(float(next(model.parameters()).grad.norm()))
        opt.step()
        opt.zero_grad()
        model(mine, mine).loss.backward()


@pytest.mark.parametrize("variant", ["in_band", "native"])
def test_a_gradient_norm_taken_on_one_rank_fails_on_every_rank_naming_it(variant):
    """``p.grad`` of a sharded parameter is a piece whose norm is a collective (surface/pieces.py). Called on
    every rank it is exact; called on rank 0 alone every rank raises the disagreement naming the gradient
    reduction: at the others' next compare (native collectives), or found by the stall watchdog's probe of
    every rank's recent collectives within seconds (in band: the others wait in their next gather), with no
    SHARDWISE_STALL_S set, never paired with another rank's collective or left to the timeout."""
    env = {"SHARDWISE_GLOO_NATIVE_COLLECTIVES": "1"} if variant == "native" else None
    start = time.monotonic()
    results = run_distributed(_grad_norm_on_one_rank, 2, timeout_s=60, env=env, allow_errors=True)
    assert time.monotonic() - start < 45, results  # the collective timeout is 60 s
    assert len(_errors(results)) == 2, results
    for e in results:
        assert "ShardwiseError: ranks disagree about the next collective" in e, e
        assert re.search(r"ranks \[0\] are at grad_reduction \(p\.grad\.norm\(\)", e), e
        if variant == "in_band":
            assert "Found by the stall watchdog" in e and "ranks [1] are at all_gather of unit" in e, e
        assert "are behind" not in e, e  # proven parted: no rank is merely behind


def test_in_a_hybrid_mesh_the_disagreeing_shard_group_names_global_ranks():
    """2 x 2 hybrid: rank 3 runs ahead inside shard group {2, 3}. Ranks 2 and 3 name each other by global
    rank; ranks 0 and 1 then fail at the replica all-reduce their partners never reach, instead of hanging."""
    results = run_distributed(_diverge, 4, "extra_forward", "hybrid", 3, timeout_s=30, allow_errors=True)
    errors = _errors(results)
    assert len(errors) == 4, results
    for rank in (2, 3):
        _assert_names_both_sides(results[rank], ahead=3, behind=2)
    for rank in (0, 1):
        assert "another rank died" in results[rank] or "a peer rank died" in results[rank], results[rank]


def test_units_called_in_a_different_order_are_detected():
    """Same shapes, different units: the fingerprint still tells them apart."""
    errors = _errors(run_distributed(_diverge, 2, "different_order", timeout_s=30, allow_errors=True))
    assert len(errors) == 2
    assert all("unit 'blocks.0'" in e and "unit 'blocks.2'" in e for e in errors)


def _different_sizes(rank: int, world: int) -> str:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 32))
    shardwise.shard(model, units={torch.nn.Linear})
    model[rank](torch.randn(2, 8))  # rank 0 gathers 72 elements, rank 1 gathers 288
    return "no error"


def test_ranks_gathering_units_of_different_sizes_abort_instead_of_hanging():
    """Sizes differ, so no fingerprint can be read: gloo itself aborts both ranks ("Received data size
    doesn't match expected size") well inside the timeout, rather than waiting or mixing data."""
    start = time.monotonic()
    results = run_distributed(_different_sizes, 2, timeout_s=30, allow_errors=True)
    assert time.monotonic() - start < 60
    assert all(isinstance(r, RankError) for r in results), results


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


def _agree(rank: int, world: int, strategy: str = "full_shard") -> tuple[int, int]:
    from shardwise.engine.checks.fingerprint import CollectiveChecker

    torch.manual_seed(0)
    model = GPT(CFG)
    options = {}
    if strategy == "hybrid_shard":
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shardwise.shard(model, units={Block}, strategy=strategy, **options)
    checker = shardwise.engine.core.runtime.runtime_of(model).units[0].flat_groups[0].checker
    separate = []
    original = CollectiveChecker.check
    CollectiveChecker.check = lambda self, *a: (separate.append(a), original(self, *a))[1]
    try:
        for _ in range(2):
            model(torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))).loss.backward()
    finally:
        CollectiveChecker.check = original
    return checker.seq, len(separate)


def test_agreeing_ranks_fingerprint_every_collective_inside_the_collective_itself():
    """3 blocks + root, 2 steps: per step 4 gathers in forward, 3 re-gathers in backward, 4 reduce-scatters,
    each fingerprinted; on gloo every fingerprint rides in band, so no separate exchange happens. (Plus one
    at shard(): the comparison of every rank's initial weights, agreed like every collective outside steps.)"""
    results = run_distributed(_agree, 3)
    assert results == [(1 + 2 * (4 + 3 + 4), 0)] * 3


@pytest.mark.parametrize("strategy, world, per_step", [
    ("no_shard", 2, 4),  # one all-reduce per unit
    ("hybrid_shard", 4, 4 + 3 + 4 + 4),  # full_shard inside the pair, plus one replica all-reduce per unit
])
def test_replica_all_reduces_carry_their_fingerprint_in_band_too(strategy, world, per_step):
    results = run_distributed(_agree, world, strategy)
    assert results == [(1 + 2 * per_step, 0)] * world  # (1: the initial weights' comparison at shard())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_in_band_fingerprint_digits_survive_every_float_dtype(dtype):
    """The header is base-256 digits: exact in bf16 (8-bit significand) and wider, so a fingerprint read
    back from a summed buffer decodes to exactly what was sent, large element counts included."""
    from shardwise.engine.checks.fingerprint import SLOT, _decode, _encode

    values = [3_000_000_000, 2, 70_000, 5, 987_654_321_012, 1]
    digits = torch.tensor(_encode(values), dtype=dtype) + torch.zeros(SLOT, dtype=dtype)
    assert len(digits) == SLOT
    assert _decode(digits.to(torch.int64).tolist()) == values


# ---- native collectives: fingerprints out of band, compared once per phase and at the end of backward ----
NATIVE = {"SHARDWISE_GLOO_NATIVE_COLLECTIVES": "1", "SHARDWISE_STALL_S": "4"}


def _native_case(rank: int, world: int, scenario: str, out_dir: str) -> dict:
    """One scenario on a fresh model after one healthy step (SGD with momentum). Returns the error text (or
    None), whether the optimizer was reached after the divergent backward, and whether every parameter is
    still what the healthy step left."""
    from shardwise.engine.core.runtime import runtime_of

    torch.manual_seed(0)
    model = GPT(CFG)
    shardwise.shard(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(x, x).loss.backward()
    opt.step()
    opt.zero_grad()
    shards = [g.shard for g in runtime_of(model).flat_groups()]  # what the optimizer updates
    before = [t.clone() for t in shards]
    reached_optimizer = False
    start = time.monotonic()
    try:
        if scenario == "extra_forward":  # the last rank runs one forward more
            loss = model(x, x).loss
            if rank == world - 1:
                loss = loss + model(x, x).loss
            loss.backward()
        elif scenario == "skipped_backward":  # rank 0 skips one backward
            loss = model(x, x).loss
            if rank != 0:
                loss.backward()
            model(x, x).loss.backward()
        elif scenario == "different_order":  # rank 1 swaps two blocks: same sizes, different units
            order = [0, 1, 2] if rank != 1 else [0, 2, 1]
            h = torch.randn(2, 16, CFG.n_embd, generator=torch.Generator().manual_seed(0))
            for i in order:
                h = model.blocks[i](h)
            h.sum().backward()
        elif scenario == "different_sizes":  # rank 1 calls the head's unit (the root), the others a block
            h = torch.randn(2, 16, CFG.n_embd)
            (model.lm_head(h) if rank == 1 else model.blocks[0](h)).sum().backward()
        elif scenario == "mixed_gradients":
            # Rank 1's reduce-scatter of the root carries blocks.0's fingerprint: the data collective itself
            # completes (same sizes), so only the compare at the end of backward can see it.
            checker = runtime_of(model).checker
            original = checker.check
            checker.check = lambda op, unit, group, numel: original(
                op, 0 if (rank == 1 and op == "reduce_scatter" and unit == 3) else unit, group, numel)
            model(x, x).loss.backward()
        elif scenario == "one_rank_no_sync":  # rank 0 accumulates, the others reduce: met only by the watchdog
            if rank == 0:
                with shardwise.no_sync(model):
                    model(x, x).loss.backward()
            else:
                model(x, x).loss.backward()
        elif scenario == "never_arrives":  # the last rank stays away (user code) while the others step
            if rank == world - 1:
                done = os.path.join(out_dir, "done")
                while not os.path.exists(done) and time.monotonic() - start < 40:
                    time.sleep(0.1)
            else:
                try:
                    model(x, x).loss.backward()
                finally:
                    if rank == 0:
                        open(os.path.join(out_dir, "done"), "w").close()
        reached_optimizer = True
        opt.step()
        error = None
    except shardwise.ShardwiseError as e:
        error = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, shards))
    return {"error": error, "reached_optimizer": reached_optimizer, "unchanged": unchanged,
            "seconds": time.monotonic() - start}


def _native_world(rank: int, world: int, scenarios: list[str], out_dir: str) -> dict:
    """Scenarios caught by the compare leave the process group usable (no data collective was issued
    mismatched), so they share one world; the last one may leave it stuck."""
    return {s: _native_case(rank, world, s, out_dir) for s in scenarios}


def _assert_first_difference(error: str, at: dict[int, str]) -> None:
    assert error.startswith("ranks disagree about the next collective"), error
    for rank, what in at.items():
        assert re.search(rf"ranks \[[^\]]*\b{rank}\b[^\]]*\] are at {re.escape(what)}", error), (rank, what, error)


@pytest.mark.parametrize("world", [2, 3])
def test_native_collectives_divergences_are_named_before_any_gradient_reaches_the_optimizer(world, tmp_path):
    """gloo's own all-gather / reduce-scatter (fingerprints out of band, no per-collective exchange): every
    divergence the per-collective check caught is caught, by the per-phase compare or at the end of backward,
    before the optimizer runs, with the first differing collective and the ranks named on every rank. At
    world size 3 a rank that never arrives is named by the watchdog, with its last collectives."""
    compare = ["extra_forward", "skipped_backward", "different_order", "different_sizes", "mixed_gradients"]
    last = "one_rank_no_sync" if world == 2 else "never_arrives"
    scenarios = compare[:2] + (compare[2:] if world == 2 else []) + [last]
    results = run_distributed(_native_world, world, scenarios, str(tmp_path), timeout_s=60, env=NATIVE,
                              allow_errors=True)
    stuck = [r for r in results if isinstance(r, RankError)]
    assert not stuck, stuck
    for scenario in scenarios:
        for rank, res in enumerate(results):
            case = res[scenario]
            if scenario == "never_arrives" and rank == world - 1:
                continue  # it was away, in user code
            assert case["error"], (scenario, rank, case)
            assert not case["reached_optimizer"] and case["unchanged"], (scenario, rank, case)
            assert case["seconds"] < 30, (scenario, rank, case)  # the collective timeout is 60 s
    errors = {s: [res[s]["error"] for res in results] for s in scenarios}
    ahead = world - 1
    for e in errors["extra_forward"]:
        _assert_first_difference(e, {ahead: "all_gather of unit 'blocks.0'", 0: "all_gather of unit 'blocks.2'"})
        assert "forward" in e and "backward" in e
    for e in errors["skipped_backward"]:
        _assert_first_difference(e, {0: "all_gather of unit 'blocks.0'"})
        assert "all_gather of unit 'blocks.2'" in e
    if world == 2:
        for e in errors["different_order"]:
            _assert_first_difference(e, {0: "all_gather of unit 'blocks.1'", 1: "all_gather of unit 'blocks.2'"})
        for e in errors["different_sizes"]:  # named before gloo could abort on the sizes
            _assert_first_difference(e, {0: "all_gather of unit 'blocks.0'", 1: "all_gather of unit '<root>'"})
        for e in errors["mixed_gradients"]:
            _assert_first_difference(e, {0: "reduce_scatter of unit '<root>'", 1: "reduce_scatter of unit 'blocks.0'"})
        for e in errors["one_rank_no_sync"]:  # found by the watchdog's probe of every rank's recent collectives
            assert e.startswith("ranks disagree about the next collective"), e
            assert "Found by the stall watchdog" in e and "reduce_scatter of unit" in e, e
    else:
        for e in errors["never_arrives"][:2]:
            assert "stopped waiting in the consistency exchange before all_gather of unit '<root>'" in e, e
            assert "rank 2: outside shardwise since step" in e, e
            assert re.search(r"ranks \[2\] are behind: their last collective is call \d+", e), e
            assert "rank 2's last collectives: " in e and "reduce_scatter of unit '<root>'" in e, e
