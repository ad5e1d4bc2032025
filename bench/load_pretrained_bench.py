"""Loading a pretrained ~1B Llama into a model sharded over 2 ranks: time and peak memory per rank, three ways.

- ``shardwise``: build on meta, ``shard(param_init_fn=skip_weight_init)``, ``load_pretrained``: each rank reads
  only its shards' bytes;
- ``hf-every-rank``: ``AutoModelForCausalLM.from_pretrained`` on every rank, then ``shard`` (each rank keeps
  its slice);
- ``hf-rank0-sync``: ``from_pretrained`` on rank 0 only, the others build on meta, then
  ``shard(sync_module_states=True)`` broadcasts rank 0's values group by group.

The model (random weights, stored in bf16, index-sharded like a Hub download) is written to a temporary
directory and deleted afterwards. Masters are fp32 in every method. Each method runs in fresh processes
(gloo, CPU); "peak +RSS" is the kernel's peak RSS (VmHWM, reset after imports through /proc/self/clear_refs)
minus the RSS at that point. The file
is in the page cache after the first method (written just before): timings are warm-cache reads, not disk.

    python bench/load_pretrained_bench.py [--layers 16] [--hidden 2048] [--keep-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta

import torch

METHODS = ("shardwise", "hf-every-rank", "hf-rank0-sync")


def status_bytes(field: str) -> int:
    """VmRSS, or VmHWM (the peak RSS since the last reset), from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def make_model_dir(directory: str, layers: int, hidden: int) -> int:
    """Config + bf16 random weights in two safetensors files with an index, written one tensor at a time."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardwise.checkpoint.format import write_safetensors_streamed

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                      tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    layout = [(n, torch.bfloat16, tuple(p.shape)) for n, p in meta.named_parameters()]
    half = len(layout) // 2
    files = {"model-00001-of-00002.safetensors": layout[:half], "model-00002-of-00002.safetensors": layout[half:]}
    gen = torch.Generator().manual_seed(0)

    def produce(name):
        shape = {n: s for n, _, s in layout}[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    total = 0
    for fname, part in files.items():
        size, _ = write_safetensors_streamed(Path(directory) / fname, part, produce, metadata={"format": "pt"})
        total += size
    weight_map = {n: f for f, part in files.items() for n, _, _ in part}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg.save_pretrained(directory)
    return total


def worker(rank: int, world: int, init_file: str, method: str, directory: str, out_file: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import shardwise
    from shardwise.engine.core.runtime import runtime_of

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    with torch.device("meta"):  # imports of the model's code, outside the timed region for every method
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    base = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: VmHWM restarts from the current RSS
    dist.barrier()
    t0 = time.perf_counter()
    if method == "shardwise":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
        shardwise.shard(model, param_init_fn=shardwise.skip_weight_init(model))
        shardwise.load_pretrained(model, directory)
    elif method == "hf-every-rank":
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        shardwise.shard(model)
    else:
        if rank == 0:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
        shardwise.shard(model, sync_module_states=True)
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM")
    shard_bytes = sum(g.shard.numel() * g.shard.element_size() for g in runtime_of(model).flat_groups())
    checksum = sum(float(g.shard.double().sum()) for g in runtime_of(model).flat_groups())
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump({"rank": rank, "seconds": seconds, "peak_increase": peak - base, "peak": peak,
                   "shard_bytes": shard_bytes, "checksum": checksum}, f)
    dist.barrier()
    dist.destroy_process_group()


def run_method(method: str, directory: str, world: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(worker, args=(world, os.path.join(tmp, "rdzv"), method, directory, out), nprocs=world,
                           start_method="spawn")
        return [json.load(open(f"{out}.{r}")) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    directory = tempfile.mkdtemp(prefix="shardwise-load-bench-")
    try:
        size = make_model_dir(directory, args.layers, args.hidden)
        print(f"model: {directory}, {size / 1e9:.2f} GB of bf16 safetensors, world size {args.world}", flush=True)
        print("| method | rank | seconds | peak +RSS (GB) | shard bytes (GB) | checksum |")
        print("|---|---|---|---|---|---|")
        for method in args.methods.split(","):
            for r in run_method(method, directory, args.world):
                print(f"| {method} | {r['rank']} | {r['seconds']:.1f} | {r['peak_increase'] / 1e9:.2f} | "
                      f"{r['shard_bytes'] / 1e9:.2f} | {r['checksum']:.6e} |", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
