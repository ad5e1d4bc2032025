"""How many consistency exchanges (CPU barriers over all ranks, on the gloo side group) a training step
makes in native-collective mode, against the data collectives it issues. The counts are deterministic.
Also printed: the wall time per step inside those exchanges, fewest and most over ranks (a time, so as noisy
as the machine). The most includes waiting for the last rank to arrive; the fewest, on the rank that
arrives last, is close to the exchanges' own latency.

    REPO=. LABEL=new python bench/check_barriers.py             # this checkout
    REPO=/path/to/old/checkout LABEL=old python bench/check_barriers.py

See bench/README.md ("The consistency check's cost in native mode").
"""
import os
import sys
import time
from pathlib import Path

REPO = os.path.abspath(os.environ.get("REPO", Path(__file__).resolve().parent.parent))
sys.path.insert(0, REPO)
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harness: spawn, gloo

import torch
from harness import run_distributed


def worker(rank, world, n_layer):
    import shardwise
    from shardwise.engine.base import collectives
    from shardwise.engine.checks import fingerprint
    from shardwise.models import GPT, Block, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=n_layer, n_head=2, n_embd=16))
    shardwise.shard(model, units={Block})
    opt = torch.optim.AdamW(model.parameters())
    side = fingerprint.side_group()
    counts = {"side": 0, "data": 0}  # side: consistency exchanges; data: all-gathers and reduce-scatters
    side_s = 0.0  # wall time inside the side exchanges (they are synchronous: the call returns when done)
    orig = collectives.all_gather_into
    orig_rs = collectives.reduce_scatter_into

    def ag(out, shard, group, *a, **k):
        nonlocal side_s
        if group is not side:
            counts["data"] += 1
            return orig(out, shard, group, *a, **k)
        counts["side"] += 1
        start = time.perf_counter()
        try:
            return orig(out, shard, group, *a, **k)
        finally:
            side_s += time.perf_counter() - start

    def rs(*a, **k):
        counts["data"] += 1
        return orig_rs(*a, **k)

    collectives.all_gather_into = ag  # every call site reads it through the module: counted
    collectives.reduce_scatter_into = rs
    x = torch.randint(0, 61, (2, 16))
    steps = 4
    for _ in range(steps):
        model(x, x).loss.backward()
        shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    return {**{k: v / steps for k, v in counts.items()}, "side_ms": 1e3 * side_s / steps}


if __name__ == "__main__":
    for n_layer in (4, 80):
        for ws in (2, 4):
            r = run_distributed(worker, ws, n_layer, env={"SHARDWISE_GLOO_NATIVE_COLLECTIVES": "1", "PYTHONPATH": REPO})
            side_ms = sorted(rank["side_ms"] for rank in r)
            print(f"{os.environ.get('LABEL', REPO)} n_layer={n_layer} ws={ws}: per step side={r[0]['side']:g} "
                  f"data={r[0]['data']:g} side_ms={side_ms[0]:.1f}..{side_ms[-1]:.1f} (over ranks)", flush=True)
