"""CPU seconds per rank of the optimizer step and of the whole training step: shardwise against DDP (and FSDP2),
and shardwise of another checkout (``--before DIR``: a git worktree of an earlier commit), interleaved.

    python bench/step_cpu.py --model gpt-tiny --steps 20 --warmup 3 --repeats 3 --before /tmp/base
    python bench/step_cpu.py --model gpt-34m --steps 4 --warmup 2 --repeats 2 --impls shardwise,ddp,fsdp2

Every run: world size 2 on gloo, one CPU thread per rank, the same GPT (same seed), AdamW (torch's default
implementation for CPU tensors), one unit per ``Block``. Each rank measures, per step, ``time.process_time()``
(CPU seconds of the whole process: gloo's threads too) and wall time around ``opt.step()`` and around the
whole step (forward, backward, step, zero_grad); the table gives, per implementation, the median over the
measured steps of the mean over ranks, as min / median / max over the repeats. Runs alternate A, B, C, A,
B, C... in fresh processes. The 1-minute load average is printed before each run: on a shared machine wall
time follows the load; CPU seconds follow it less.

``--impls floor``: the plain model plus only the data collectives every FSDP must issue at these units (see
``_fsdp_floor``): the lowest CPU time any FSDP step can have here, what the issue's gpt-tiny target meets.

What it does not show: GPU steps (no collectives overlap here), other optimizers, memory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def worker(args) -> None:
    sys.path.insert(0, args.repo)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=2, init_method=f"tcp://127.0.0.1:{args.port}")
    from shardwise.models import GPT, PRESETS, Block

    torch.manual_seed(0)
    model = GPT.from_preset(args.model)
    seq, batch = {"gpt-34m": (256, 8), "gpt-170m": (128, 2)}.get(args.model, (PRESETS[args.model]["block_size"], 2))
    impl = args.impl
    if impl.startswith("shardwise"):
        import shardwise

        assert Path(shardwise.__file__).resolve().is_relative_to(Path(args.repo).resolve()), shardwise.__file__
        # "shardwise-one-unit": the whole model one unit (units=None), one gather and one reduction a step
        shardwise.shard(model, units=None if impl == "shardwise-one-unit" else {Block})
    elif impl == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif impl == "floor":
        floor_collectives = _fsdp_floor(model, Block)
    elif impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for m in model.modules():
            if isinstance(m, Block):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + args.rank)
    vocab = model.config.vocab_size if hasattr(model, "config") else model.module.config.vocab_size
    rows = []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, vocab, (batch, seq), generator=gen)
        y = torch.randint(0, vocab, (batch, seq), generator=gen)
        c0, w0 = time.process_time(), time.perf_counter()
        if impl == "floor":
            floor_collectives("forward")
        loss = model(x, y).loss
        loss.backward()
        if impl == "floor":
            floor_collectives("backward")
        c1, w1 = time.process_time(), time.perf_counter()
        opt.step()
        c2, w2 = time.process_time(), time.perf_counter()
        opt.zero_grad()
        c3, w3 = time.process_time(), time.perf_counter()
        if i >= args.warmup:
            rows.append(dict(opt_cpu=c2 - c1, opt_wall=w2 - w1, step_cpu=c3 - c0, step_wall=w3 - w0))
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _fsdp_floor(model, block_type):
    """The collectives no FSDP can do without, on a plain (unwrapped) model: per step an all-gather of every
    unit in forward (the blocks and the root, the rest of the model), the blocks' re-gathers in backward
    (resharded after forward) and one gradient reduction per unit (an all-reduce of the whole unit, as
    shardwise reduce-scatters on gloo), each at its unit's size, issued and waited on one by one. No
    agreement, no Python bookkeeping: the CPU time a step cannot go below with one unit per block."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    blocks = [sum(p.numel() for p in m.parameters()) for m in model.modules() if isinstance(m, block_type)]
    units = [sum(p.numel() for p in model.parameters()) - sum(blocks)] + blocks
    shards = {n: torch.zeros(-(-n // world)) for n in units}
    gathered = {n: torch.zeros(-(-n // world) * world) for n in units}
    grads = {n: torch.zeros(n) for n in units}

    def issue(phase: str) -> None:
        if phase == "forward":
            for n in units:
                dist.all_gather_into_tensor(gathered[n], shards[n])
            return
        for n in reversed(blocks):
            dist.all_gather_into_tensor(gathered[n], shards[n])
        for n in reversed(units):
            dist.all_reduce(grads[n])

    return issue


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(impl: str, repo: str, args) -> dict:
    port = _port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo}
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--impl", impl, "--repo", repo,
                                   "--rank", str(r), "--port", str(port), "--model", args.model,
                                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                                   "--out", f"{tmp}/{r}.json"], env=env) for r in range(2)]
        codes = [p.wait(timeout=args.timeout) for p in procs]
        if any(codes):
            return {"failed": codes}
        per_rank = [json.loads(Path(f"{tmp}/{r}.json").read_text()) for r in range(2)]
    return {k: statistics.mean(r[k] for r in per_rank) for k in per_rank[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--impl", default="shardwise")
    ap.add_argument("--impls", default="shardwise,shardwise-before,ddp")
    ap.add_argument("--repo", default=str(HERE))
    ap.add_argument("--before", default=None, help="a checkout of an earlier commit (the shardwise-before row)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    impls = [i for i in args.impls.split(",") if i != "shardwise-before" or args.before]
    results: dict[str, list[dict]] = {i: [] for i in impls}
    for rep in range(args.repeats):
        for impl in impls:
            repo = args.before if impl == "shardwise-before" else str(HERE)
            load = os.getloadavg()[0]
            r = run_once(impl, repo, args)
            r["load"] = load
            results[impl].append(r)
            print(f"repeat {rep} {impl}: {json.dumps(r)}", flush=True)
    print(f"\n{args.model}, world size 2, {args.steps} steps after {args.warmup}, {args.repeats} repeats")
    print("| impl | opt step CPU ms | opt step wall ms | whole step CPU ms | whole step wall ms | load (1 min) |")
    print("|---|---|---|---|---|---|")
    for impl, rs in results.items():
        ok = [r for r in rs if "failed" not in r]
        if not ok:
            print(f"| {impl} | failed | | | | |")
            continue

        def mmm(k):
            v = sorted(r[k] * 1e3 for r in ok)
            return f"{v[0]:.2f} / {statistics.median(v):.2f} / {v[-1]:.2f}"

        loads = sorted(r["load"] for r in ok)
        print(f"| {impl} | {mmm('opt_cpu')} | {mmm('opt_wall')} | {mmm('step_cpu')} | {mmm('step_wall')} | "
              f"{loads[0]:.1f}-{loads[-1]:.1f} |")


if __name__ == "__main__":
    main()
