"""Optimizer step time on CPU (gloo): shardwise.optim.Muon vs the naive exact way vs AdamW.

    python bench/muon_bench.py --model gpt-34m --n-layer 1 --world-sizes 2,4 --repeats 3 --ns-dtype float32

- ours:  shardwise.optim.Muon (each matrix orthogonalised once on an owner rank balanced by cost, one
         all-to-all there and one back, same-shaped matrices in one batched Newton–Schulz call)
- naive: the same momentum and AdamW, but every rank all-gathers every full matrix (one collective per
         matrix) and orthogonalises all of them itself, then keeps its slice: what an FSDP user can write
         today to be exact
- adamw: torch.optim.AdamW on the shards (no communication at all), the floor

One process per rank, one CPU thread each (OMP_NUM_THREADS=1). Gradients come from one real backward and
stay fixed; each timed step is preceded by a barrier and its time is the slowest rank's. Prints a markdown
table of min / median / max seconds per step over ``--repeats`` steps (after one warm-up step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _naive_muon_class():
    from shardwise.engine.logical_shapes import param_info
    from shardwise.optim.muon import Muon, _matrix_shape, adjusted_lr
    from shardwise.optim.newton_schulz import orthogonalize

    class NaiveMuon(Muon):
        """Every rank gathers every whole matrix (one all-reduce of a zero-padded copy per matrix, the
        gather gloo does fastest) and orthogonalises all of them."""

        def _orthogonalize_and_update(self, matrices):
            for p, group, piece in matrices:
                info = param_info(p)
                dtype = getattr(torch, group["ns_dtype"])
                full = torch.zeros(info.numel, dtype=dtype)
                full[info.offset:info.offset + info.local_numel] = piece.to(dtype)
                if self._groups.shard is not None:
                    dist.all_reduce(full, group=self._groups.shard)
                shape = _matrix_shape(info)
                ortho = orthogonalize([full.view(shape)], group["ns_coefficients"], group["ns_steps"], group["eps"],
                                      dtype)[0].reshape(-1)[info.offset:info.offset + info.local_numel]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(ortho, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], shape))

    return NaiveMuon


def _worker(rank: int, ws: int, init_file: str, args, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    import shardwise
    from shardwise.models import GPT, Block
    from shardwise.optim import Muon
    torch.manual_seed(0)
    overrides = {"n_layer": args.n_layer} if args.n_layer else {}
    model = shardwise.shard(GPT.from_preset(args.model, **overrides), units={Block})
    x = torch.randint(0, 256, (2, 32))  # token ids every preset's vocabulary holds
    model(x, x).loss.backward()
    ns_dtype = getattr(torch, args.ns_dtype)
    makers = {
        "ours": lambda: Muon(model.parameters(), ns_dtype=ns_dtype),
        "naive": lambda: _naive_muon_class()(model.parameters(), ns_dtype=ns_dtype),
        "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-4),
    }
    results = {}
    for name in args.impls.split(","):
        opt = makers[name]()
        opt.step()  # warm-up: state allocation, exchange plan
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.item())
        results[name] = times
        del opt
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-34m")
    ap.add_argument("--n-layer", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ns-dtype", default="bfloat16", help="Newton–Schulz dtype (torch's default: bfloat16)")
    ap.add_argument("--impls", default="ours,naive,adamw")
    args = ap.parse_args()
    print(f"model {args.model} n_layer {args.n_layer or 'preset'} | ns_dtype {args.ns_dtype} | "
          f"{args.repeats} timed steps after 1 warm-up | 1 thread per rank\n")
    print("| world size | optimizer | step s (min / median / max) |\n|---|---|---|")
    ctx = mp.get_context("spawn")
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            queue = ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(r, ws, os.path.join(tmp, "rdv"), args, queue))
                     for r in range(ws)]
            for p in procs:
                p.start()
            results = queue.get()
            for p in procs:
                p.join()
        for name, times in results.items():
            print(f"| {ws} | {name} | {min(times):.3f} / {statistics.median(times):.3f} / {max(times):.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
