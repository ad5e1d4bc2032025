"""How many agreements (small all-gathers over every rank, on the gloo control group) a training step makes,
against the data collectives it issues, and how long a step spends inside them: shardwise's design (one
agreement per phase, the phase's collectives compared locally with the agreed sequence) against agreeing on
every collective before it is issued (``--mode collective``, what torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does
with its own fingerprint). The counts are deterministic; the times are as noisy as the machine. The most
includes waiting for the last rank to arrive; the fewest, on the rank that arrives last, is close to the
agreements' own latency.

    python bench/check_barriers.py                      # per phase (shardwise)
    python bench/check_barriers.py --mode collective    # every collective agreed on its own
    python bench/check_barriers.py --mode off           # SHARDWISE_CHECK_COLLECTIVES=0: no agreement

See bench/README.md ("The check before every collective: what it costs").
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harness: spawn, gloo

import torch
from harness import run_distributed

STEPS = 4


def worker(rank, world, n_layer, mode):
    import shardwise
    from shardwise.engine.base import collectives
    from shardwise.engine.base.device import control_group
    from shardwise.engine.checks.fingerprint import CollectiveChecker
    from shardwise.models import GPT, Block, GPTConfig

    if mode == "off":
        os.environ["SHARDWISE_CHECK_COLLECTIVES"] = "0"
    if mode == "collective":  # no agreed sequence: every collective is exchanged before it is issued
        original_before = CollectiveChecker.before_issue

        def before_issue(self, *a):
            self._on_track = False
            return original_before(self, *a)

        CollectiveChecker.before_issue = before_issue
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=n_layer, n_head=2, n_embd=16))
    shardwise.shard(model, units={Block})
    opt = torch.optim.AdamW(model.parameters())
    control = control_group()
    counts = {"agreements": 0, "data": 0}
    agreement_s = 0.0  # wall time inside the agreements (they are synchronous: the call returns when done)
    orig_ag, orig_rs = collectives.all_gather_into, collectives.reduce_scatter_into

    def ag(out, shard, group, *a, **k):
        nonlocal agreement_s
        if group is not control:
            counts["data"] += 1
            return orig_ag(out, shard, group, *a, **k)
        counts["agreements"] += 1
        start = time.perf_counter()
        try:
            return orig_ag(out, shard, group, *a, **k)
        finally:
            agreement_s += time.perf_counter() - start

    def rs(*a, **k):
        counts["data"] += 1
        return orig_rs(*a, **k)

    x = torch.randint(0, 61, (2, 16))
    model(x, x).loss.backward()  # the first step has no agreed sequence yet: not counted
    opt.step()
    opt.zero_grad()
    collectives.all_gather_into, collectives.reduce_scatter_into = ag, rs  # every call site reads the module
    start = time.perf_counter()
    for _ in range(STEPS):
        model(x, x).loss.backward()
        shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    step_s = (time.perf_counter() - start) / STEPS
    return {**{k: v / STEPS for k, v in counts.items()}, "agreement_ms": 1e3 * agreement_s / STEPS,
            "step_ms": 1e3 * step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("phase", "collective", "off"), default="phase")
    ap.add_argument("--layers", default="4,80")
    ap.add_argument("--world-sizes", default="2,4")
    args = ap.parse_args()
    for n_layer in map(int, args.layers.split(",")):
        for ws in map(int, args.world_sizes.split(",")):
            r = run_distributed(worker, ws, n_layer, args.mode)
            agreement_ms = sorted(rank["agreement_ms"] for rank in r)
            step_ms = max(rank["step_ms"] for rank in r)
            print(f"{args.mode}: n_layer={n_layer} ws={ws}: per step {r[0]['agreements']:g} agreements, "
                  f"{r[0]['data']:g} data collectives, {agreement_ms[0]:.1f}..{agreement_ms[-1]:.1f} ms inside the "
                  f"agreements (over ranks), step {step_ms:.1f} ms, load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
