"""The offload worker thread runs beside the training thread (an ``offload_optimizer`` steps each unit as its
gradient lands, during backward); what it does must never decide a collective, so that no interleaving of
the two threads can make the ranks issue different collectives. Two races closed by construction, each
forced here both ways (one rank's worker fast, the other's slow) and held to one process's results:

* ZeRO-2 with CPU offload: an inner optimizer step marks the kept gathered copies as written, from the worker,
  in the middle of a backward. It is only a signal: whether a unit re-gathers is decided by the ranks
  together at the next forward's start (core/runtime.py), never by when the worker ran.
* A tensor hook (``p.register_hook``) on a unit's parameter: the hook needs the whole gradient, gathered over
  the shard group. The gather is issued by the training thread when the reduced gradient is delivered; the
  worker only hands it out. A collective from the worker thread is refused outright (base/collectives.py).
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import shardwise
from harness import run_distributed
from models import GPT, Block, gpt_loss, tiny_gpt_config
from parity_utils import SGD, local_slice, make_batches, run_scenarios, scenario, sharded_param_errors, spawn_once, worst

STEPS, VOCAB = 3, 62


def _hook(grad: torch.Tensor) -> torch.Tensor:
    return grad / (grad.norm() + 1.0)  # needs the whole gradient: not a function of a piece


def _race(rank: int, world: int, case: str, slow_rank: int) -> dict:
    torch.manual_seed(0)
    initial = GPT(tiny_gpt_config(n_layer=6))  # deep enough that steps land before later units re-gather
    ref = copy.deepcopy(initial)
    strategy = "shard_optim_grad" if case == "zero2" else "full_shard"
    model = shardwise.shard(copy.deepcopy(initial), units={Block}, strategy=strategy,
                            offload=shardwise.CPUOffload(worker_thread=True))
    if case == "tensor_hook":
        model.blocks[5].mlp.c_fc.weight.register_hook(_hook)  # reduced early in backward: lands while the training
        # thread still issues the other units' reductions
        ref.blocks[5].mlp.c_fc.weight.register_hook(_hook)
    opt = shardwise.offload_optimizer(model, torch.optim.SGD, **SGD)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    take_landing = opt.take_landing
    on_worker = []

    def slow_landing(landing):  # forced order: on ``slow_rank`` the worker hands out and steps well after the
        on_worker.append(threading.current_thread() is not threading.main_thread())  # training thread went on
        if rank == slow_rank:
            time.sleep(0.2)
        take_landing(landing)

    # The optimizer in the consumer's place but for the slowed landing (the sinks also read whether it steps in
    # backward: then each reduction's grad usage is agreed before its hand-out, on the training thread).
    opt._transfers.consumer = type("Slow", (), {"take_landing": staticmethod(slow_landing),
                                                "steps_in_backward": opt.steps_in_backward})()
    for x, y in make_batches(STEPS, VOCAB):
        gpt_loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        gpt_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"worst": worst(sharded_param_errors(model, ref))[1], "stepped_on_the_worker": any(on_worker)}


CASES = [(case, slow_rank) for case in ("zero2", "tensor_hook") for slow_rank in (0, 1)]


def _races(rank: int, world: int) -> dict:
    return run_scenarios({f"{case}/{slow}": (lambda r, w, c=case, s=slow: _race(r, w, c, s)) for case, slow in CASES},
                         rank, world)


@spawn_once
def report() -> list:
    return run_distributed(_races, 2, timeout_s=60)


@pytest.mark.parametrize("case,slow_rank", CASES)
def test_whatever_the_worker_threads_do_first_the_ranks_issue_the_same_collectives(case, slow_rank):
    for r in report():
        result = scenario(r, f"{case}/{slow_rank}")
        assert result["stepped_on_the_worker"], result  # the interleaving really was the worker's
        assert result["worst"] <= 1e-6, result
