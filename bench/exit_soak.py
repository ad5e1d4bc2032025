"""Soak test for a clean exit: many short jobs of a library script (shard, a few steps of training with
SGD), half ending with ``dist.destroy_process_group()`` and half never calling it; counts the runs that
abort ("terminate called ...", SIGABRT), hang (still running at ``--timeout``: every rank's Python stacks
are printed into the log first) or fail otherwise.

    python bench/exit_soak.py --runs 200 --world-size 3 --log soak.log   # 400 runs, one job at a time

Run it from a checkout; every job imports the ``shardwise`` of this checkout. The kinds alternate, so a
machine that gets busier during the soak loads both alike. Exit status 1 if any run failed.
See [Note: a gloo worker must never free a Python object] in shardwise's collectives for the mechanism
this watches for.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

JOB = r'''
import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the soak asks a hung rank for its stacks
import torch, torch.distributed as dist, torch.nn as nn
import shardwise


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


dist.init_process_group("gloo")
torch.manual_seed(0)
model = shardwise.shard(Blocks(), strategy=sys.argv[2])
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(3):
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
'''

STRATEGIES = ("full_shard", "shard_optim_grad", "no_shard")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(script: Path, kind: str, strategy: str, world_size: int, timeout_s: float,
            torchrun: bool) -> tuple[bool, str]:
    """One job: under torchrun, or (faster: no agent process) one process per rank with torchrun's
    environment variables, rank 0 hosting the store."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    port = free_port()
    if torchrun:
        cmds = [([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}",
                  f"--master-port={port}", str(script), kind, strategy], env)]
    else:
        cmds = [([sys.executable, str(script), kind, strategy],
                 dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(r), LOCAL_RANK=str(r))) for r in range(world_size)]
    logs = [tempfile.TemporaryFile("w+") for _ in cmds]  # files, not pipes: a full pipe would block a rank
    procs = [subprocess.Popen(c, env=e, stdout=log, stderr=subprocess.STDOUT, text=True) for (c, e), log in zip(cmds, logs)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        hung = [i for i, p in enumerate(procs) if p.poll() is None]
        for i in hung:
            procs[i].send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack, then killed
        time.sleep(3)
        for p in procs:
            p.kill()
        outs = _read(logs)
        stacks = "".join(f"--- rank {i} ---\n{outs[i][-4000:]}" for i in hung)
        return False, f"hang: processes {hung} still running after {timeout_s:.0f} s; their stacks:\n{stacks}"
    outs = _read(logs)
    codes = [p.returncode for p in procs]
    out = "".join(outs)
    bad = any(codes) or "terminate called" in out or "Aborted" in out
    kind = "abort" if (-signal.SIGABRT in codes or "terminate called" in out or "Aborted" in out) else "error"
    return not bad, (f"{kind}: exit codes {codes}: " + out[-2000:]) if bad else ""


def _read(logs) -> list[str]:
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    return outs


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200, help="runs of each kind (destroy, no destroy)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one job may take")
    ap.add_argument("--torchrun", action="store_true", help="launch every job with torchrun (slower)")
    ap.add_argument("--log", type=Path, default=None, help="append each failure's output here")
    args = ap.parse_args()
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"shardwise_exit_soak_{os.getpid()}.py"
    script.write_text(JOB)
    counts = {"destroy": [0, 0], "no_destroy": [0, 0]}  # kind -> [runs, failures]
    causes: collections.Counter = collections.Counter()  # abort / hang / error
    t0 = time.monotonic()
    # Stopped early (SIGTERM, Ctrl-C): the counts so far are still printed.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for i in range(args.runs):
            for kind in counts:
                ok, detail = one_run(script, kind, STRATEGIES[i % len(STRATEGIES)], args.world_size, args.timeout,
                                      args.torchrun)
                counts[kind][0] += 1
                if not ok:
                    counts[kind][1] += 1
                    causes[detail.split(":", 1)[0]] += 1
                    print(f"run {i} {kind}: FAILED {detail.splitlines()[0] if detail else ''}", flush=True)
                    if args.log:
                        with args.log.open("a") as f:
                            f.write(f"=== run {i} {kind}\n{detail}\n")
            if (i + 1) % 10 == 0:
                print(f"{i + 1} of each kind, {time.monotonic() - t0:.0f} s: " + ", ".join(
                    f"{k} {f} failed of {n}" for k, (n, f) in counts.items()), flush=True)
    except KeyboardInterrupt:
        print("stopped early", flush=True)
    finally:
        script.unlink(missing_ok=True)
    print("result: " + ", ".join(f"{k} {f} failed of {n}" for k, (n, f) in counts.items())
          + f" at world size {args.world_size}; failures by cause: {dict(causes) or 'none'} "
          f"({time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.1f})")
    return 1 if any(f for _, f in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
