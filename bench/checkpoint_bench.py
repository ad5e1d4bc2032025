"""Checkpoint save and load time and size: shardwise against torch.distributed.checkpoint (DCP) on FSDP2.

    python bench/checkpoint_bench.py --model gpt-170m --world-size 2 --repeats 3

Both sides train the same GPT (same seed) for one AdamW step, so the optimizer holds its two moment
tensors per parameter, then save model + optimizer state ``--repeats`` times and load it back as many
times into a freshly built, sharded model and optimizer:

- shardwise: ``shardwise.checkpoint.save_checkpoint`` / ``load_checkpoint`` (safetensors + JSON, SHA-256
  computed while writing and verified on load, fsync and atomic rename);
- FSDP2: ``fully_shard`` per Block and the root, ``get_state_dict`` -> ``dcp.save``, and
  ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict`` (DCP fsyncs its files by default, as shardwise
  does; it computes no checksums).

Each side runs in fresh processes (gloo, one thread per rank). Times are the median over repeats, taken
on rank 0 between barriers, so they cover the slowest rank. Loads read from the page cache (the files
were just written); this measures the libraries, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # benchmark this checkout

from shardwise.models import GPT, Block  # noqa: E402


def _one_step(model, opt, rank: int, seq: int, batch: int) -> None:
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=g)
    model(x[:, :-1].contiguous(), x[:, 1:].contiguous()).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _build_shardwise(preset: str):
    import shardwise

    torch.manual_seed(0)
    model = shardwise.shard(GPT.from_preset(preset), units={Block})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _build_fsdp2(preset: str):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT.from_preset(preset)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _bench_shardwise(preset, root: Path, repeats: int, seq: int, batch: int) -> dict:
    from shardwise.checkpoint import load_checkpoint, save_checkpoint
    model, opt = _build_shardwise(preset)
    _one_step(model, opt, dist.get_rank(), seq, batch)
    path = root / "shardwise-ckpt"
    saves = [_timed(lambda: save_checkpoint(path, model, opt, step=1)) for _ in range(repeats)]
    size = _dir_bytes(path)
    del model, opt
    model, opt = _build_shardwise(preset)
    loads = [_timed(lambda: load_checkpoint(path, model, opt)) for _ in range(repeats)]
    unverified = [_timed(lambda: load_checkpoint(path, model, opt, verify_checksums=False)) for _ in range(repeats)]
    return {"save_s": saves, "load_s": loads, "load_unverified_s": unverified, "bytes": size,
            "files": len(list(path.iterdir()))}


def _bench_fsdp2(preset, root: Path, repeats: int, seq: int, batch: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _build_fsdp2(preset)
    _one_step(model, opt, dist.get_rank(), seq, batch)
    path = root / "dcp-ckpt"

    def save():
        if dist.get_rank() == 0 and path.exists():
            shutil.rmtree(path)  # DCP writes into the directory; start each repeat clean like shardwise does
        dist.barrier()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

    saves = [_timed(save) for _ in range(repeats)]
    size = _dir_bytes(path)
    del model, opt
    model, opt = _build_fsdp2(preset)
    # DCP loads into existing tensors: the optimizer needs its state allocated first (a zero-lr step is
    # the usual way); that is part of the cost of a DCP load, so it is inside the timed region.

    def load():
        if not opt.state:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            lr = opt.param_groups[0]["lr"]
            opt.param_groups[0]["lr"] = 0.0
            opt.step()
            opt.param_groups[0]["lr"] = lr
            opt.zero_grad(set_to_none=True)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    loads = [_timed(load) for _ in range(repeats)]
    return {"save_s": saves, "load_s": loads, "bytes": size, "files": len(list(path.iterdir()))}


def _worker(rank, world, init_file, impl, preset, root, repeats, seq, batch, out_file):
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        fn = _bench_shardwise if impl == "shardwise" else _bench_fsdp2
        result = fn(preset, Path(root), repeats, seq, batch)
        if rank == 0:
            Path(out_file).write_text(json.dumps(result))
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-170m")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq", type=int, default=32, help="sequence length of the one training step")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    rows = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for impl in ("shardwise", "fsdp2"):
            out_file = os.path.join(tmp, f"{impl}.json")
            init_file = os.path.join(tmp, f"{impl}.rdzv")
            mp.start_processes(_worker, nprocs=args.world_size, start_method="spawn",
                               args=(args.world_size, init_file, impl, args.model, tmp, args.repeats, args.seq,
                                     args.batch, out_file))
            rows[impl] = json.loads(Path(out_file).read_text())
            for name in ("shardwise-ckpt", "dcp-ckpt"):
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)

    print(f"\n{args.model}, world size {args.world_size}, AdamW state after one step, median (min) of {args.repeats}\n")
    def cell(xs):
        return f"{statistics.median(xs):.2f} (min {min(xs):.2f})"

    print("| | save (s) | load (s) | size on disk | files |")
    print("|---|---|---|---|---|")
    names = {"shardwise": "shardwise (safetensors + JSON, SHA-256, fsync)", "fsdp2": "FSDP2 + torch.distributed.checkpoint"}
    for impl, r in rows.items():
        print(f"| {names[impl]} | {cell(r['save_s'])} | {cell(r['load_s'])} | {r['bytes'] / 1e9:.3f} GB | {r['files']} |")
    if "load_unverified_s" in rows.get("shardwise", {}):
        print(f"| shardwise, load with verify_checksums=False | | {cell(rows['shardwise']['load_unverified_s'])} | | |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
