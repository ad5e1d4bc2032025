"""What a Lightning checkpoint costs each rank in host memory: ``state_dict_type="full"`` against
``"sharded"`` (shardwise's Lightning strategy), and the bytes each writes.

    python bench/lightning_checkpoint_memory.py --model gpt-34m --world-size 2 --repeats 2

Each run: fresh processes (gloo, one thread per rank), the same GPT (same seed) as a LightningModule, one
AdamW step with the Trainer (so the optimizer holds its two moments), then ``trainer.save_checkpoint``. Per
rank it records the rise of the peak resident memory over the save (``VmHWM`` restarted just before it) and
the save's wall time; then the bytes of the checkpoint file and of its sidecar directory. Runs alternate full,
sharded, full, ...; the table gives min / median / max over the repeats.

What it does not show: GPU memory (a GPU run gathers the same bytes into rank 0's host memory), the time to
consolidate a sharded checkpoint (one process, offline), disks other than this machine's page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # benchmark this checkout
sys.path.insert(0, str(REPO_ROOT / "bench"))

from proc_rss import peak_rss, reset_peak_rss  # noqa: E402


def worker(rank: int, world: int, port: int, preset: str, kind: str, out_dir: str, result_file: str) -> None:
    import lightning as L

    from shardwise.integrations.lightning import ProcessGroupEnvironment, ShardwiseStrategy
    from shardwise.models import GPT, Block

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = GPT.from_preset(preset)

        def training_step(self, batch, _):
            return self.gpt(batch[0], batch[1])[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    module = Module()
    seq = min(64, module.gpt.config.block_size)
    data = torch.utils.data.TensorDataset(torch.randint(0, module.gpt.config.vocab_size, (world, seq)),
                                          torch.randint(0, module.gpt.config.vocab_size, (world, seq)))
    strategy = ShardwiseStrategy(cluster_environment=ProcessGroupEnvironment(), units={Block}, state_dict_type=kind)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
    path = Path(out_dir) / "run.ckpt"
    dist.barrier()
    reset_peak_rss()
    before = peak_rss()
    t0 = time.perf_counter()
    trainer.save_checkpoint(path)
    seconds = time.perf_counter() - t0
    rise = peak_rss() - before
    rows = [None] * world
    dist.all_gather_object(rows, {"rise": rise, "seconds": seconds})
    if rank == 0:
        sidecar = path.with_name(path.name + ".shardwise")
        side_bytes = sum(f.stat().st_size for f in sidecar.rglob("*") if f.is_file())
        params = sum(p.numel() for p in module.parameters())
        Path(result_file).write_text(json.dumps({"ranks": rows, "file_bytes": path.stat().st_size,
                                                 "sidecar_bytes": side_bytes, "params": params}))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-34m")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    results: dict[str, list] = {"full": [], "sharded": []}
    for _ in range(args.repeats):
        for kind in results:
            with tempfile.TemporaryDirectory() as d:
                result_file = os.path.join(d, "result.json")
                print(f"load {os.getloadavg()[0]:.1f}: {kind}", flush=True)
                mp.spawn(worker, args=(args.world_size, _port(), args.model, kind, d, result_file),
                         nprocs=args.world_size, join=True)
                results[kind].append(json.loads(Path(result_file).read_text()))
    mb = lambda x: x / 1e6  # noqa: E731
    print(f"\n{args.model}, {results['full'][0]['params']:,} parameters, world size {args.world_size}, "
          f"{args.repeats} repeats (min / median / max)\n")
    print("| state_dict_type | peak RSS rise over the save, rank 0, MB | other ranks, MB | save s (rank 0) | file MB | "
          "sidecar MB |")
    print("|---|---|---|---|---|---|")
    for kind, runs in results.items():
        def mmm(values):
            return " / ".join(f"{v:.1f}" for v in (min(values), statistics.median(values), max(values)))
        rank0 = [mb(r["ranks"][0]["rise"]) for r in runs]
        others = [mb(x["rise"]) for r in runs for x in r["ranks"][1:]]
        secs = [r["ranks"][0]["seconds"] for r in runs]
        print(f"| {kind} | {mmm(rank0)} | {mmm(others)} | {' / '.join(f'{s:.2f}' for s in (min(secs), statistics.median(secs), max(secs)))} "
              f"| {mb(runs[0]['file_bytes']):.1f} | {mb(runs[0]['sidecar_bytes']):.1f} |")


if __name__ == "__main__":
    main()
