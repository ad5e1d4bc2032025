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
not trust ``latest`` (it is for people and tools that want one file to read, and can lag by one
checkpoint after a crash): ``find_latest`` takes the ``step-*`` entry with the highest step.

Since a ``step-*`` name only ever appears by an atomic rename of a complete directory, and disappears by
a rename to ``.trash-*``, the newest ``step-*`` entry that is not a complete checkpoint was damaged or
put there by hand. ``find_latest`` then raises, naming it, instead of quietly falling back to an older
checkpoint (a resume that silently went back in time would restore other values than the user expects).
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

from shardwise.engine.checks import agree
from shardwise.checkpoint.format import TMP_PREFIX, TRASH_PREFIX, fsync_dir
from shardwise.checkpoint.load import load_checkpoint
from shardwise.checkpoint.save import save_checkpoint
from shardwise.checkpoint.verify import is_complete, listed_files_problem, read_manifest
from shardwise.errors import ShardwiseError

PathLike = Union[str, os.PathLike]
LATEST_NAME = "latest"
_STEP_DIR = re.compile(r"^step-(\d{1,18})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _step_entries(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every entry named like a checkpoint, oldest first (whatever it is)."""
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m:
            found.append((int(m.group(1)), child))
    return sorted(found)


def list_checkpoints(run_dir: PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in ``run_dir``, oldest first."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    return [(step, p) for step, p in _step_entries(root) if not p.is_symlink() and p.is_dir() and is_complete(p)]


def find_latest(run_dir: PathLike) -> Optional[Path]:
    """The newest checkpoint in ``run_dir``: the ``step-*`` entry with the highest step, None if there is
    none. Raises ShardwiseError, naming it, if that entry is not a complete checkpoint whose manifest
    records that step. Single-process, no collectives; checks no rank file's checksum (loading does)."""
    root = Path(run_dir)
    if not root.is_dir():
        return None
    entries = _step_entries(root)
    if not entries:
        return None
    step, path = entries[-1]
    if path.is_symlink() or not path.is_dir():
        kind = "a symbolic link" if path.is_symlink() else "not a directory"
        raise ShardwiseError(f"{path}: {kind}; the newest step-* entry of a run directory must be a checkpoint "
                             f"directory (a link could point a resume anywhere): move it away to resume from an "
                             f"older checkpoint")
    try:
        manifest = read_manifest(path)  # the commit record and the schema
    except ShardwiseError as e:
        raise ShardwiseError(f"{e}; it is the newest step-* entry in {root}: move it away to resume from an "
                             f"older checkpoint") from None
    problem = listed_files_problem(path, manifest)
    if problem:
        raise ShardwiseError(f"{problem}; the newest checkpoint in {root} is damaged: move it away to resume "
                             f"from an older one")
    if manifest["step"] is not None and manifest["step"] != step:
        raise ShardwiseError(f"{path}: its manifest records step {manifest['step']}, its name step {step}; "
                             f"a renamed checkpoint would resume at the wrong step")
    return path


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
             extra: Any = None, frozen_base: Optional[dict] = None) -> Path:
        path = save_checkpoint(self.path_for(step), model, optimizer, step=step, extra=extra, frozen_base=frozen_base)

        def after_commit() -> None:
            if agree.rank() != 0:
                return
            write_latest_pointer(self.run_dir, path.name)  # only now: the checkpoint it names is complete
            self._prune(keep=path)

        agree.agreed(after_commit, f"updating {self.run_dir / LATEST_NAME}")
        return path

    def latest(self) -> Optional[Path]:
        return find_latest(self.run_dir)

    def resume(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
               frozen_base: Optional[dict] = None) -> Optional[tuple[int, Any]]:
        """Load the newest checkpoint; return ``(step, extra)``, or None when there is none yet. Raises
        ShardwiseError on every rank if the newest is damaged (see ``find_latest``) or does not fit.

        Rank 0 chooses and tells the others, so all ranks load the same checkpoint even if a save
        completes while they look."""
        path = self.choose_latest()
        if path is None:
            return None
        extra = load_checkpoint(path, model, optimizer, frozen_base=frozen_base)
        step = int(_STEP_DIR.match(path.name).group(1))
        return step, extra

    def choose_latest(self) -> Optional[Path]:
        """``latest()`` as chosen by rank 0 and broadcast, so every rank gets the same answer. Collective."""
        choice = agree.agreed(lambda: str(self.latest() or "") if agree.rank() == 0 else None,
                              f"finding a checkpoint in {self.run_dir}")
        choice = agree.broadcast_json(choice)
        return Path(choice) if choice else None

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
