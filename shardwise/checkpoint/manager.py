"""``CheckpointManager``: a run directory of numbered checkpoints, a ``latest`` pointer, and pruning.

Layout::

    RUN_DIR/
        step-00000100/     complete checkpoints (a directory only ever gets this name by an atomic rename)
        step-00000200/
        latest             text: "step-00000200", replaced atomically after each commit
        .tmp-step-00000300/    a save in progress, or one that crashed: ignored, removed by the next save

Crash safety follows from the order of events in ``save``: the new checkpoint is committed (renamed into
place, parent fsynced) before ``latest`` moves to it, and older checkpoints are pruned only after that.
A crash at any moment therefore leaves at least the previous complete checkpoint in place. Readers do
not trust ``latest`` blindly: ``find_latest`` scans for the newest *complete* checkpoint (``latest`` is for
people and tools that want one file to read; it can lag by one checkpoint after a crash).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from shardwise.checkpoint import agree
from shardwise.checkpoint.format import TMP_PREFIX, TRASH_PREFIX, fsync_dir, is_complete
from shardwise.checkpoint.load import load_checkpoint
from shardwise.checkpoint.save import save_checkpoint

PathLike = Union[str, os.PathLike]
LATEST_NAME = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(run_dir: PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in ``run_dir``, oldest first."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def find_latest(run_dir: PathLike) -> Optional[Path]:
    """The newest complete checkpoint in ``run_dir`` (None if there is none). Single-process, no collectives."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def write_latest_pointer(run_dir: Path, name: str) -> None:
    """Replace ``run_dir/latest`` atomically: readers see the old name or the new one, never a torn file."""
    tmp = run_dir / f"{LATEST_NAME}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / LATEST_NAME)
    fsync_dir(run_dir)


class CheckpointManager:
    """Numbered checkpoints in one run directory. Every rank constructs one and calls ``save``/``resume``.

    Args:
        run_dir: where checkpoints go (shared by all ranks).
        keep_last: keep this many newest checkpoints, pruning older ones after each successful save
            (None keeps all).
    """

    def __init__(self, run_dir: PathLike, keep_last: Optional[int] = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.run_dir / step_dir_name(step)

    def save(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, step: int,
             extra: Any = None) -> Path:
        path = save_checkpoint(self.path_for(step), model, optimizer, step=step, extra=extra)

        def after_commit() -> None:
            if agree.rank() != 0:
                return
            write_latest_pointer(self.run_dir, path.name)  # only now: the checkpoint it names is complete
            self._prune(keep=path)

        agree.agreed(after_commit, f"updating {self.run_dir / LATEST_NAME}")
        return path

    def latest(self) -> Optional[Path]:
        return find_latest(self.run_dir)

    def resume(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[tuple[int, Any]]:
        """Load the newest complete checkpoint; return ``(step, extra)``, or None when there is none yet.

        Rank 0 chooses and tells the others, so all ranks load the same checkpoint even if a save
        completes while they look."""
        choice = agree.agreed(lambda: str(self.latest() or "") if agree.rank() == 0 else None, "finding a checkpoint")
        choice = agree.broadcast_json(choice)
        if not choice:
            return None
        path = Path(choice)
        extra = load_checkpoint(path, model, optimizer)
        step = int(_STEP_DIR.match(path.name).group(1))
        return step, extra

    def _prune(self, keep: Path) -> None:
        # Leftovers of crashed saves and interrupted deletions: no save is in flight now (save is collective).
        for child in self.run_dir.iterdir():
            if child.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
        if self.keep_last is None:
            return
        complete = [p for _, p in list_checkpoints(self.run_dir)]
        doomed = [p for p in complete[: max(0, len(complete) - self.keep_last)] if p != keep]
        for old in doomed:
            # Rename first, so a checkpoint is never seen half-deleted under its real name.
            trash = self.run_dir / f"{TRASH_PREFIX}{old.name}-{time.time_ns()}"
            os.rename(old, trash)
            shutil.rmtree(trash, ignore_errors=True)
        if doomed:
            fsync_dir(self.run_dir)
