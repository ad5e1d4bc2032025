"""How many consistency exchanges (CPU barriers over all ranks, on the gloo side group) a training step
makes in native-collective mode, against the data collectives it issues. Deterministic: a count, not a time.

    REPO=. LABEL=new python bench/check_barriers.py             # this checkout
    REPO=/path/to/old/checkout LABEL=old python bench/check_barriers.py

See bench/README.md ("The consistency check's cost in native mode").
"""
import os
import sys
from pathlib import Path

REPO = os.path.abspath(os.environ.get("REPO", Path(__file__).resolve().parent.parent))
sys.path.insert(0, REPO)
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harness: spawn, gloo

import torch
from harness import run_distributed


def worker(rank, world, n_layer):
    import shardwise
    from shardwise import collectives, consistency
    from shardwise.models import GPT, Block, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=n_layer, n_head=2, n_embd=16))
    shardwise.shard(model, units={Block})
    opt = torch.optim.AdamW(model.parameters())
    side = consistency.side_group()
    counts = {"side": 0, "data": 0}  # side: consistency exchanges; data: all-gathers and reduce-scatters
    orig = collectives.all_gather_into
    orig_rs = collectives.reduce_scatter_into

    def ag(out, shard, group, *a, **k):
        counts["side" if group is side else "data"] += 1
        return orig(out, shard, group, *a, **k)

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
    return {k: v / steps for k, v in counts.items()}


if __name__ == "__main__":
    for n_layer in (4, 80):
        for ws in (2, 4):
            r = run_distributed(worker, ws, n_layer, env={"SHARDWISE_GLOO_NATIVE_COLLECTIVES": "1", "PYTHONPATH": REPO})
            print(f"{os.environ.get('LABEL', REPO)} n_layer={n_layer} ws={ws}: per step {r[0]}", flush=True)
