"""No host-device sync in a steady training step: shardwise's own code never reads a device tensor's values on
the host (``.item()``, ``.tolist()``, ``bool()``, ``torch.equal``, a copy to the host) once a step follows the
last one, whatever the strategy; the only sync left is the one the user asks for (``loss.item()`` here).

Counted under the NCCL-rules test mode (tests/nccl_rules.py), which knows which tensors a GPU run would hold on
the device: its ``host_reads()`` records every read of a device value made from shardwise's files. A planted
value comparison shows the count is real.
"""

from __future__ import annotations

import pytest
import torch

import nccl_rules
import shardwise
from harness import run_distributed
from parity_utils import local_slice, make_batches, run_scenarios, scenario, spawn_once
from shardwise.models import GPT, Block, GPTConfig

CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=18)
CASES = {"full_shard": {}, "shard_grad_op": {}, "shard_optim_grad": {}, "shard_optim": {}, "no_shard": {},
         "full_shard_bf16": {"mixed_precision": shardwise.MixedPrecision(param_dtype=torch.bfloat16)}}


def _steady_step_reads(strategy: str, options: dict, plant: bool = False):
    def run(rank: int, world: int) -> list[list[str]]:
        torch.manual_seed(0)
        model = shardwise.shard(GPT(CFG), units={Block}, strategy=strategy.removesuffix("_bf16"), **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if plant:  # the kept copies' verdict read from the values, as it was: planted in flat_group.py's name
            from shardwise.engine.core import flat_group

            namespace = {"torch": torch, "original": flat_group.FlatGroup.kept_copy_stale}
            exec(compile("def stale(g):\n    return (g.keep_gathered and not torch.equal(g.shard, g.shard)) or "
                         "original(g)\n", flat_group.__file__, "exec"), namespace)
            flat_group.FlatGroup.kept_copy_stale = namespace["stale"]
        reads = []
        for x, y in make_batches(3, CFG.vocab_size, global_batch=2 * world, seq_len=16):
            x, y = (local_slice(t, rank, world).to(nccl_rules.DEVICE) for t in (x, y))
            with nccl_rules.host_reads() as step_reads:
                loss = model(x, y).loss
                loss.backward()
                shardwise.clip_grad_norm_(model, 1.0)
                opt.step()
                opt.zero_grad()
            reads.append(list(step_reads))
            loss.item()  # the user's own sync
        return reads

    return run


def _worker(rank: int, world: int) -> dict:
    with nccl_rules.enforced():
        scenarios = {name: _steady_step_reads(name, options) for name, options in CASES.items()}
        scenarios["planted"] = _steady_step_reads("shard_optim_grad", {}, plant=True)
        return run_scenarios(scenarios, rank, world)


@spawn_once
def report() -> list:
    return run_distributed(_worker, 2, backend=nccl_rules.BACKEND)


@pytest.mark.parametrize("case", list(CASES))
def test_a_steady_step_reads_no_device_value_on_the_host(case):
    for rank, r in enumerate(report()):
        reads = scenario(r, case)
        assert reads[1:] == [[], []], (rank, reads)  # steps 2 and 3


def test_the_count_sees_a_planted_value_comparison():
    for r in report():
        reads = scenario(r, "planted")
        assert reads[2] and all(read.startswith("equal in ") for read in reads[2]), reads
