"""How a failed run reaches the user: one line per distinct problem, naming the option or file, and no
traceback unless asked for (``--debug`` or ``SHARDWISE_DEBUG=1``).

A worker that fails writes its one line into a directory the launcher gave it (``SHARDWISE_ERROR_DIR``)
and exits with status 1; the launcher then prints each distinct line once, with the ranks that hit it,
instead of torch's per-rank report with its tracebacks. Problems raised by shardwise's agreements are the
same text on every rank, so a full disk during a save reads as one line, not as one block per rank.
Under torchrun (no launcher of ours) each failing worker prints its own line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from shardwise.engine.base import flags
from shardwise.engine.checks.agree import describe_exception
from shardwise.errors import ShardwiseError
from shardwise.trainer.config import ConfigError
from shardwise.trainer.data import DataError
from shardwise.hf.model_spec import ModelError

ERROR_DIR_ENV = "SHARDWISE_ERROR_DIR"
# Problems with what the user gave us: their messages are complete as they are.
USER_ERRORS = (ShardwiseError, ConfigError, DataError, ModelError)


def debug_enabled() -> bool:
    return flags.debug()


def one_line(e: BaseException) -> str:
    """The message a user sees for ``e``: a user error as it is, an OSError with its file and reason,
    anything else marked as shardwise's own fault with the way to see more."""
    if isinstance(e, USER_ERRORS):
        text = str(e)
    elif isinstance(e, OSError):
        text = describe_exception(e)
    else:
        text = f"internal error: {describe_exception(e)} (rerun with --debug for the traceback)"
    return " ".join(text.split("\n")[0].split()) if not debug_enabled() else text


def report_worker_failure(e: BaseException) -> None:
    """From inside a failing worker: hand the launcher this rank's line (or print it, under torchrun)."""
    rank = os.environ.get("RANK", "0")
    line = one_line(e)
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory and os.path.isdir(directory):
        Path(directory, f"rank-{int(rank):06d}.txt").write_text(line + "\n")
    else:
        print(f"shardwise train: error (rank {rank}): {line}", file=sys.stderr, flush=True)


def collected_failures(directory: str) -> list[str]:
    """The distinct lines the workers left in ``directory``, each with the ranks that reported it."""
    by_text: dict[str, list[int]] = {}
    for path in sorted(Path(directory).glob("rank-*.txt")):
        by_text.setdefault(path.read_text().strip(), []).append(int(path.stem.split("-")[1]))
    out = []
    for text, ranks in by_text.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        out.append(f"{text} ({who})")
    return out
