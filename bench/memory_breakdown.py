"""Where each rank's peak memory goes: compare_cpu.py's training (same model, data, optimizer, units), with
the step split into phases and, in each, the peak RSS beside what glibc's malloc says is live.

    python bench/memory_breakdown.py --model gpt-170m --impls shardwise,fsdp1,fsdp2,ddp --repeats 2

Per rank and phase (build, wrap, then every step's forward, backward, optimizer step, zero_grad):

* ``rss``: the peak RSS (VmHWM, reset at every phase boundary through /proc/self/clear_refs), less the RSS
  right after ``init_process_group`` (the interpreter, torch, gloo: the runtime, not the training);
* ``live``: the most bytes malloc had handed out and not taken back during the phase (``mallinfo2``: heap
  in use + mmapped blocks), sampled every ~0.5 ms by a thread, less the same at the start: tensors and
  every other allocation (gloo's buffers, Python objects), no code pages or freed memory;
* ``slack``: at that sample, RSS beyond the live bytes, i.e. what malloc keeps of freed blocks plus code
  pages mapped since the start;
* ``trim``: after the step, how much RSS ``malloc_trim(0)`` gives back (freed memory malloc kept).

A rank's peak RSS is the runtime plus its largest phase peak. (Resetting VmHWM resets ``ru_maxrss`` too, so
compare_cpu.py's figure is not taken here; the two agree within a few MB when both are run.)

For shardwise the engine's own buffers are listed at the end of the first measured step's backward and at
its optimizer step (shards, gradient shards, optimizer state, gathered buffers, gradient flats in flight).
The sampler is a second Python thread: it perturbs step times, so read memory here and time in compare_cpu.py.
Set ``--malloc-env MALLOC_ARENA_MAX=1`` (or any ``NAME=VALUE,...``) to try glibc settings in the workers.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import compare_cpu  # noqa: E402  (the training every row of compare_cpu.py runs)
from proc_rss import current_rss, peak_rss, reset_peak_rss  # noqa: E402


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def live_bytes() -> int:
    """Bytes malloc has handed out and not taken back: ordinary heap blocks in use plus mmapped ones."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


class Phases:
    """Peak RSS and peak live malloc bytes per named phase (the largest over the steps measured)."""

    def __init__(self):
        self.base_rss, self.base_live = current_rss(), live_bytes()
        self.name, self.peaks = None, {}
        self._live_max = self._slack_at_max = 0
        self._stop = False
        self._lock = threading.Lock()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop:
            live, resident = live_bytes(), current_rss()
            with self._lock:
                if live > self._live_max:
                    self._live_max, self._slack_at_max = live, resident - live
            time.sleep(0.0005)

    def begin(self, name: str) -> None:
        with self._lock:
            self.name, self._live_max, self._slack_at_max = name, live_bytes(), current_rss() - live_bytes()
        reset_peak_rss()

    def end(self, record: bool = True) -> None:
        with self._lock:
            live, slack, name = self._live_max, self._slack_at_max, self.name
        peak = peak_rss()
        if record:
            old = self.peaks.get(name, {"rss": 0, "live": 0, "slack": 0})
            new = {"rss": peak - self.base_rss, "live": live - self.base_live,
                   "slack": slack - (self.base_rss - self.base_live)}
            if new["rss"] >= old["rss"]:
                self.peaks[name] = new

    def stop(self) -> None:
        self._stop = True


def engine_buffers(model, opt) -> dict:
    """shardwise's own buffers now, in bytes (sizes of storages actually allocated)."""
    import shardwise

    runtime = shardwise_runtime(model)
    out = {"param shards": 0, "grad shards": 0, "gathered": 0, "grad flats in flight": 0}
    for u in runtime.units:
        for g in u.flat_groups:
            out["param shards"] += g.shard.untyped_storage().nbytes()
            if not getattr(g, "aliases_shard", False):
                out["gathered"] += g.gathered.untyped_storage().nbytes()
    try:  # since #27 a gradient is a piece reading as the whole: its memory is its local elements'
        from shardwise.engine.surface.pieces import local_of
    except ImportError:
        def local_of(t):
            return t
    seen = set()
    for p in model.parameters():
        if p.grad is not None:
            s = local_of(p.grad).untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                out["grad shards"] += s.nbytes()
    for pending in getattr(runtime, "_pending", []):
        if getattr(pending, "flat", None) is not None:
            out["grad flats in flight"] += pending.flat.untyped_storage().nbytes()
    out["optimizer state"] = sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
                                 if isinstance(t, torch.Tensor))
    del shardwise
    return out


def shardwise_runtime(model):
    import importlib

    for name in ("shardwise.engine.core.runtime", "shardwise.engine.runtime"):  # after / before the engine split
        try:
            return importlib.import_module(name).runtime_of(model)
        except ModuleNotFoundError:
            continue
    raise RuntimeError("no shardwise runtime module")


def worker(rank: int, world: int, init: str, impl: str, args, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    phases = Phases()
    spec = compare_cpu.RunSpec(impl=impl, model=args.model, seq_len=args.seq_len, batch=args.batch, steps=args.steps,
                               warmup=args.warmup, seed=0, lr=3e-4)
    torch.manual_seed(spec.seed)
    phases.begin("build")
    model = compare_cpu.GPT.from_preset(spec.model)
    batches = compare_cpu.make_batches(spec, rank, model.config.vocab_size)
    phases.end()
    phases.begin("wrap")
    wrapped = {}
    plain_step = compare_cpu.plain_step

    def keep(module, opt):  # every setup but DeepSpeed's ends here: keep what it wrapped, to step it by phases
        wrapped.update(model=module, opt=opt)
        return plain_step(module, opt)

    compare_cpu.plain_step = keep
    compare_cpu.SETUPS[impl](model, spec)
    compare_cpu.plain_step = plain_step
    model, opt = wrapped["model"], wrapped["opt"]
    phases.end()
    buffers, trimmed, losses = {}, [], []
    measuring = [False]
    if args.per_block:  # backward split at every block's start: "backward: head" until the last block's
        blocks = [m for m in model.modules() if isinstance(m, compare_cpu.Block)]
        for b, block in enumerate(blocks):
            def enter(_module, _grad, b=b):
                phases.end(measuring[0])
                phases.begin(f"backward: block {b}")
            block.register_full_backward_pre_hook(enter)
    for i, (x, y) in enumerate(batches):
        measured = measuring[0] = i >= args.warmup
        phases.begin("forward")
        loss = model(x, y).loss
        phases.end(measured)
        phases.begin("backward: head" if args.per_block else "backward")
        loss.backward()
        phases.end(measured)
        if impl.startswith("shardwise") and i == args.warmup:
            buffers["end of backward"] = engine_buffers(model, opt)
        phases.begin("optimizer step")
        opt.step()
        phases.end(measured)
        if impl.startswith("shardwise") and i == args.warmup:
            buffers["after the optimizer step"] = engine_buffers(model, opt)
        phases.begin("zero_grad")
        opt.zero_grad()
        phases.end(measured)
        losses.append(loss.item())
        if measured and args.trim:
            before = current_rss()
            _libc.malloc_trim(0)
            trimmed.append(before - current_rss())
    phases.stop()
    report = {"impl": impl, "rank": rank, "peaks": phases.peaks, "buffers": buffers, "trimmed": trimmed,
              "runtime_rss": phases.base_rss, "peak_rss": phases.base_rss + max(p["rss"] for p in phases.peaks.values()),
              "losses": losses}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def run(impl: str, args) -> list[dict]:
    import torch.multiprocessing as mp

    env = dict(kv.split("=", 1) for kv in args.malloc_env.split(",")) if args.malloc_env else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the spawned workers (glibc reads them at start)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "report")
            mp.start_processes(worker, args=(args.world_size, os.path.join(tmp, "rdv"), impl, args, out),
                               nprocs=args.world_size, start_method="spawn", join=True)
            return [json.load(open(f"{out}.rank{r}.json")) for r in range(args.world_size)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-170m")
    ap.add_argument("--impls", default="shardwise,fsdp1,fsdp2,ddp")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after every measured step (and report it)")
    ap.add_argument("--malloc-env", default="", help="NAME=VALUE,... for the workers' glibc (MALLOC_ARENA_MAX=1, ...)")
    ap.add_argument("--per-block", action="store_true", help="split backward at every block (module hooks)")
    ap.add_argument("--json")
    args = ap.parse_args()
    seq, batch = compare_cpu.DEFAULT_SHAPES.get(args.model, (None, compare_cpu.FALLBACK_BATCH))
    args.seq_len = args.seq_len or seq or compare_cpu.PRESETS[args.model]["block_size"]
    args.batch = args.batch or batch
    runs = []
    for repeat in range(args.repeats):
        for impl in args.impls.split(","):
            load = os.getloadavg()[0]
            reports = run(impl, args)
            runs.append({"impl": impl, "repeat": repeat, "load": load, "ranks": reports})
            worst = max(reports, key=lambda r: r["peak_rss"])
            print(f"{impl} (repeat {repeat}, load {load:.1f}): peak RSS {worst['peak_rss'] / 1e9:.3f} GB, runtime "
                  f"{worst['runtime_rss'] / 1e9:.3f} GB; losses {worst['losses'][0]:.4f} -> {worst['losses'][-1]:.4f}",
                  flush=True)
            for name, p in worst["peaks"].items():
                print(f"    {name:<16} rss {p['rss'] / 1e9:6.3f}  live {p['live'] / 1e9:6.3f}  slack {p['slack'] / 1e9:6.3f} GB")
            if worst["trimmed"]:
                print(f"    malloc_trim after a step returned {statistics.median(worst['trimmed']) / 1e9:.3f} GB (median)")
            for when, b in worst["buffers"].items():
                print(f"    engine buffers, {when}: " + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in b.items()) + " GB")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    print("\n| impl | peak RSS per rank GB min / median / max | of which runtime | phase of the peak | "
          "live at that phase GB | slack GB |")
    print("|---|---|---|---|---|---|")
    for impl in args.impls.split(","):
        mine = [max(r["ranks"], key=lambda x: x["peak_rss"]) for r in runs if r["impl"] == impl]
        peaks = sorted(x["peak_rss"] / 1e9 for x in mine)
        top = max(mine, key=lambda x: x["peak_rss"])
        phase, p = max(top["peaks"].items(), key=lambda kv: kv[1]["rss"])
        print(f"| {impl} | {peaks[0]:.3f} / {statistics.median(peaks):.3f} / {peaks[-1]:.3f} | "
              f"{top['runtime_rss'] / 1e9:.3f} | {phase} | {p['live'] / 1e9:.3f} | {p['slack'] / 1e9:.3f} |")


if __name__ == "__main__":
    main()
