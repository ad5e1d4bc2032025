"""gloo's own all-gather and reduce-scatter against the all-reduce that can stand in for each, per size.

    python bench/gloo_wire.py --world-sizes 2,3,4 --sizes 64k,1m,4m,16m --repeats 5

An all-gather of P elements (every rank contributes P/N) can run as gloo's ``all_gather_into_tensor`` or as an
all-reduce of a P-element buffer that each rank zero-fills and writes its chunk into (x + 0 is exact); a
reduce-scatter as ``reduce_scatter_tensor`` or as an all-reduce of the whole P-element input, keeping one's
chunk. This times the four, each from the same state (buffers allocated, the previous collective finished on
every rank), in fp32, at each world size, interleaved per repeat. A figure is the slowest rank's time for one
collective *including* the substitute's zero-fill and copies; the table keeps the median over the repeats
(min and max beside it). ``wire`` is what a rank sends for it under a ring algorithm: (N-1)/N x P for a native
all-gather or reduce-scatter, 2 (N-1)/N x P for an all-reduce. Every rank is one process with one thread on
this machine, like the training benchmarks. See bench/README.md for the results and what they decided.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torch 2.13 deprecates the *_tensor names in favour of *_single; 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
OPS = ("all_gather native", "all_gather as all_reduce", "reduce_scatter native", "reduce_scatter as all_reduce")


def parse_size(text: str) -> int:
    mult = {"k": 2**10, "m": 2**20}.get(text[-1].lower(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def _time(fn, group) -> float:
    """One collective's wall time on the slowest rank (every rank starts together)."""
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return took.item()


def _worker(rank: int, world: int, init_file: str, sizes: list[int], repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    results = {}
    for padded in sizes:
        padded -= padded % world
        n = padded // world
        shard = torch.randn(n)
        gathered = torch.empty(padded)
        grads = torch.randn(padded)
        out_shard = torch.empty(n)

        def ag_native():
            _all_gather_single(gathered, shard)

        def ag_all_reduce():
            gathered.zero_()
            gathered.narrow(0, rank * n, n).copy_(shard)
            dist.all_reduce(gathered)

        def rs_native():
            _reduce_scatter_single(out_shard, grads)

        def rs_all_reduce():
            dist.all_reduce(grads)
            out_shard.copy_(grads.narrow(0, rank * n, n))

        fns = dict(zip(OPS, (ag_native, ag_all_reduce, rs_native, rs_all_reduce)))
        for fn in fns.values():  # warm the connections and the allocator at this size
            _time(fn, None)
        times = {op: [] for op in OPS}
        for _ in range(repeats):
            for op, fn in fns.items():
                times[op].append(_time(fn, None))
        results[padded] = times
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "times": results}, f)
    dist.destroy_process_group()


def measure(world: int, sizes: list[int], repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "rdzv"), sizes, repeats, out), nprocs=world,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


def table(runs: list[dict]) -> str:
    rows = ["| world | elements P | op | ms min / median / max | wire elements per rank | vs native |",
            "|---|---|---|---|---|---|"]
    for run in runs:
        world = run["world"]
        for padded, times in run["times"].items():
            padded = int(padded)
            med = {op: statistics.median(ts) for op, ts in times.items()}
            for op in OPS:
                ts = sorted(times[op])
                wire = (2 if "as all_reduce" in op else 1) * (world - 1) * padded // world
                native = med[op.split()[0] + " native"]
                rows.append(f"| {world} | {padded:,} | {op} | {ts[0] * 1e3:.2f} / {med[op] * 1e3:.2f} / "
                            f"{ts[-1] * 1e3:.2f} | {wire:,} | {med[op] / native:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", default="2,3,4")
    ap.add_argument("--sizes", default="16k,256k,1m,4m,16m", help="gathered sizes P (k = 1024, m = 1024^2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write every timing here")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    runs = [measure(int(w), sizes, args.repeats) for w in args.world_sizes.split(",")]
    print(f"torch {torch.__version__}, gloo, fp32, {args.repeats} repeats, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    sys.exit(main())
