"""Collectives that user code starts outside the unit schedule, as a table: one row per call.

Each row: what every rank does first, then what rank 0 alone does, and the name the error gives. Called on
every rank the result equals one process's; called on rank 0 alone, every rank raises the disagreement
naming it (``collectives.run_agreed`` / ``CollectiveChecker.check_now``), never a hang, a gloo abort or a
collective paired with another rank's: rank 0's agreement meets the others' next one (the start of their
next forward), so every rank fails at once and the process group stays usable; the rows share one spawn.
"""

import re
import time

import pytest
import torch
import torch.distributed as dist

import shardwise
from harness import RankError, run_distributed
from shardwise.models import GPT, GPTConfig, Block

CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=18)


def _hooked_step(model, opt, mine, hook_on_root):
    handle = model.wpe.weight.register_hook(lambda g: g / g.norm()) if hook_on_root else None  # sees the whole
    model(mine, mine).loss.backward()
    if handle is not None:
        handle.remove()
    opt.step()


def _scaler_step(model, opt, mine, alone: bool = False):
    """A ShardedGradScaler step; ``alone``: every rank runs the scaled backward, rank 0 alone steps."""
    scaler = shardwise.ShardedGradScaler()
    scaler.scale(model(mine, mine).loss).backward()
    if not alone or dist.get_rank() == 0:
        scaler.step(opt)
        scaler.update()


def _summoned(model):
    with shardwise.summon_full_params(model):
        return model.blocks[1].attn.c_attn.weight.detach().clone()


def _user_call_row(rank: int, world: int, row: str) -> dict:
    """One row on a fresh model (SGD with momentum): ``exact`` (the every-rank call against one process's
    result), then rank 0 alone makes the call and every rank goes on training: ``error`` per rank."""
    from parity_utils import local_slice, sharded_param_errors, worst

    x = torch.randint(0, 61, (2 * world, 16), generator=torch.Generator().manual_seed(1))
    mine = local_slice(x, rank, world)
    torch.manual_seed(0)
    ref = GPT(CFG)
    torch.manual_seed(0)
    model = shardwise.shard(GPT(CFG), units={Block}, strategy="no_shard" if "no_shard" in row else "full_shard")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    if row == "tensor_hook":
        _hooked_step(model, opt, mine, True)
        _hooked_step(ref, ref_opt, x, True)
    elif row.startswith("scaler"):
        _scaler_step(model, opt, mine)
        ref(x, x).loss.backward()
        ref_opt.step()
    if row in ("summon", "full_state_dict", "load_full_state_dict"):
        if row == "summon":
            exact = torch.equal(_summoned(model), ref.blocks[1].attn.c_attn.weight)
        elif row == "full_state_dict":
            sd = shardwise.full_state_dict(model)
            exact = rank != 0 or all(torch.equal(v, ref.state_dict()[k]) for k, v in sd.items())
        else:
            ref = GPT(CFG)  # another initialisation, loaded into the sharded model
            shardwise.load_full_state_dict(model, ref.state_dict() if rank == 0 else {})
            exact = worst(sharded_param_errors(model, ref))[1] == 0.0
    else:
        exact = worst(sharded_param_errors(model, ref))[1] <= 1e-6
    opt.zero_grad()
    try:
        if row.startswith("scaler"):
            _scaler_step(model, opt, mine, alone=True)
        elif row == "tensor_hook":
            _hooked_step(model, opt, mine, hook_on_root=rank == 0)
        elif rank == 0:
            {"summon": lambda: _summoned(model), "full_state_dict": lambda: shardwise.full_state_dict(model),
             "save_while_load": lambda: shardwise.full_state_dict(model),
             "load_full_state_dict": lambda: shardwise.load_full_state_dict(model, ref.state_dict())}[row]()
        elif row == "save_while_load":  # not alone: another rank loads meanwhile (same model, same counts)
            shardwise.load_full_state_dict(model, {})
        model(mine, mine).loss.backward()  # everyone goes on training
        error = None
    except shardwise.ShardwiseError as e:
        error = str(e)
    return {"exact": exact, "error": error}


def _user_call_rows(rank: int, world: int, rows: list[str]) -> dict:
    return {row: _user_call_row(rank, world, row) for row in rows}


USER_CALLS = {  # row -> the call the error names, and of what
    "tensor_hook": ("tensor_hook_gather", "unit '<root>'"), "scaler": ("grad_reduction", "the model"),
    "summon": ("summon_full_params", "the model"), "full_state_dict": ("state_dict", "the model"),
    "load_full_state_dict": ("load_state_dict", "the model"), "save_while_load": ("state_dict", "the model"),
    "scaler_no_shard": ("overflow_vote", "the model")}


def _assert_user_call_rows(results: list, rows: list[str]) -> None:
    assert not [r for r in results if isinstance(r, RankError)], results
    for row in rows:
        for rank, res in enumerate(results):
            case = res[row]
            if row != "save_while_load":
                assert case["exact"], (row, rank, case)
            e = case["error"] or ""
            assert e.startswith("ranks disagree about the next collective"), (row, rank, case)
            op, of = USER_CALLS[row]
            assert re.search(rf"ranks \[0\] are at {op} \(.*?\) of {re.escape(of)}", e), (row, rank, e)
            assert "are behind" not in e, (row, rank, e)  # the disagreement is proven: nobody is "behind"
        if row == "save_while_load":
            assert re.search(r"ranks \[1[^\]]*\] are at load_state_dict \(", results[0][row]["error"]), results[0][row]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_collectives_user_code_starts_are_exact_on_every_rank_and_named_when_one_rank_calls_alone(world):
    """The table: a tensor hook's gradient gather, a GradScaler step, entering summon_full_params,
    full_state_dict, load_full_state_dict (and a save on one rank while another loads), a ShardedGradScaler's
    own overflow vote (no_shard: its gradients are whole, the vote is the only collective)."""
    rows = list(USER_CALLS)
    start = time.monotonic()
    results = run_distributed(_user_call_rows, world, rows, timeout_s=60, allow_errors=True)
    assert time.monotonic() - start < 50, results  # never the 60 s collective timeout
    _assert_user_call_rows(results, rows)
