"""Two "nodes" on one machine: two torchrun agents meeting through the c10d rendezvous, as on a cluster
(`torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT` on each node, a shared run directory).
``hybrid_shard`` then shards inside each node and replicates across the two, and must train the same model
as one node of four ranks with ``full_shard``: same global batch, same losses step by step."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
TRAIN = ["-m", "shardwise", "train", "--model", "gpt-tiny", "--steps", str(STEPS), "--batch-size", "2",
         "--seq-len", "32", "--eval-every", "0", "--log-every", "1", "--warmup-steps", "1",
         "--progress", "false", "--timeout-s", "60"]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["loss"] for r in records if "loss" in r]


def test_two_nodes_over_c10d_rendezvous_train_like_one_node(tmp_path):
    port = _free_port()
    multi = tmp_path / "two-nodes"
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "shardwise-multinode-test", *TRAIN, "--sharding-strategy", "hybrid_shard",
             "--out", str(multi)],
            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)
    ]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    for node, (agent, out) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"node {node} failed:\n{out[-3000:]}"

    single = tmp_path / "one-node"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           *TRAIN, "--sharding-strategy", "full_shard", "--out", str(single)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    manifest = json.loads((multi / f"step-{STEPS:08d}" / "manifest.json").read_text())
    assert (manifest["strategy"], manifest["shard_size"], manifest["replicate_size"]) == ("hybrid_shard", 2, 2)
    multi_losses, single_losses = _losses(multi), _losses(single)
    assert len(multi_losses) == STEPS
    for step, (a, b) in enumerate(zip(multi_losses, single_losses), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: two nodes {a}, one node {b}"
