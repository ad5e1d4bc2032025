"""Crashes lose nothing: ``shardwise train --save-every K --resume auto`` under ``torchrun --max-restarts``,
with ranks killed by SIGKILL at random moments (one of them while a checkpoint is being written), ends
with parameters and optimizer state bitwise identical to a run that was never interrupted."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckpt_workers import assert_same_contents, contents

REPO = Path(__file__).resolve().parents[2]
STEPS_PER_KILL, SAVE_EVERY = 12, 2  # six saves per kill of a ~1M-parameter model: each takes long enough to be hit


def _train_cmd(out: Path, max_restarts: int, steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
            "-m", "shardwise", "train", "--model", "gpt-small", "--steps", str(steps),
            "--save-every", str(SAVE_EVERY), "--resume", "auto", "--out", str(out),
            "--batch-size", "4", "--seq-len", "32", "--eval-every", "0", "--progress", "false", "--timeout-s", "60"]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        # No TORCH_DISABLE_SHARE_RDZV_TCP_STORE here on purpose: the trainer must rejoin after a restart
        # on torchrun's shared store by itself (shardwise.trainer.launch._join_process_group).
    }


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


class Killer(threading.Thread):
    """SIGKILLs one worker of the torchrun job per plan entry: 'save' waits until a checkpoint is being
    written (its .tmp- directory exists), 'random' waits until the (re)started job has committed a new
    checkpoint, then a random fraction of a second, so it lands mid-step whatever the machine's speed."""

    def __init__(self, agent: subprocess.Popen, run_dir: Path, plan: list[str], seed: int):
        super().__init__(daemon=True)
        self.agent, self.run_dir, self.plan, self.rng = agent, run_dir, plan, random.Random(seed)
        self.log: list[str] = []
        self.killed: set[int] = set()

    def _fresh_workers(self, timeout: float = 120.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.agent.poll() is None:
            workers = [p for p in _children(self.agent.pid) if p not in self.killed]
            if len(workers) == 2:
                return workers
            time.sleep(0.05)
        return []

    def _tmp_dirs(self) -> set[tuple[str, int]]:
        """In-progress (or crashed) saves: their .tmp- directories, by name and inode, so that a stale one
        left by a killed save is not mistaken for a new save (rank 0 re-creates it, with a new inode)."""
        try:
            return {(e.name, e.inode()) for e in os.scandir(self.run_dir) if e.name.startswith(".tmp-")}
        except FileNotFoundError:
            return set()

    def _has_checkpoint(self) -> bool:
        return bool(self._checkpoints())

    def _checkpoints(self) -> set[str]:
        try:
            return {n for n in os.listdir(self.run_dir) if n.startswith("step-")}
        except FileNotFoundError:
            return set()

    def run(self) -> None:
        for kind in self.plan:
            workers = self._fresh_workers()
            if not workers:
                return
            stale = self._tmp_dirs()
            if kind == "save":
                # Wait for a save that is not the first, so the restart resumes from a checkpoint.
                deadline = time.monotonic() + 120
                while self.agent.poll() is None and time.monotonic() < deadline:
                    if self._has_checkpoint() and self._tmp_dirs() - stale:
                        break
                    time.sleep(0.0005)  # a tiny model saves in milliseconds
            else:
                before = self._checkpoints()
                deadline = time.monotonic() + 120
                while self.agent.poll() is None and time.monotonic() < deadline:
                    if self._checkpoints() - before:
                        break
                    time.sleep(0.005)
                time.sleep(self.rng.uniform(0.0, 0.3))
            during_save = bool(self._tmp_dirs() - stale)
            victim = self.rng.choice(workers)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.killed.update(workers)  # the agent tears down the survivor and restarts both
            self.log.append(f"{kind}: killed pid {victim}{' during a save' if during_save else ''}")


@pytest.mark.parametrize("plan", [["random", "save"], pytest.param(["random", "save", "random", "save"],
                                                                    marks=pytest.mark.slow)], ids=["2-kills", "4-kills"])
def test_kill_9_at_random_points_resumes_bitwise(tmp_path, plan):
    steps = STEPS_PER_KILL * len(plan)
    reference = tmp_path / "reference"
    subprocess.run(_train_cmd(reference, 0, steps), cwd=REPO, env=_env(), check=True, timeout=400,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    crashed = tmp_path / "crashed"
    agent = subprocess.Popen(_train_cmd(crashed, len(plan) + 1, steps), cwd=REPO, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = Killer(agent, crashed, plan, seed=int(os.environ.get("SHARDWISE_CRASH_SEED", "0")))
    killer.start()
    try:
        output, _ = agent.communicate(timeout=600)
    finally:
        if agent.poll() is None:
            agent.kill()
    killer.join(timeout=5)
    print("\n".join(killer.log))
    assert agent.returncode == 0, output[-4000:]
    assert len(killer.log) >= 2, f"the killer only got to {killer.log}"
    assert any("during a save" in entry for entry in killer.log), killer.log

    final = f"step-{steps:08d}"
    assert_same_contents(contents(reference / final), contents(crashed / final))
