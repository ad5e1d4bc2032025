"""The ``shardwise`` command (also ``python -m shardwise``): ``train``, ``estimate-memory``, ``export``."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """usage: shardwise <command> [options]

commands:
  train             train a GPT preset or a Hugging Face config with fully sharded data parallel
                    (no options: 2 local ranks, a small GPT, the Python standard library as text)
  estimate-memory   per-rank memory plan of a configuration, from the real sharding plan (no processes)
  export            write a full model from a checkpoint (safetensors / Hugging Face layout)

`shardwise <command> --help` lists each command's options."""


def train_main(argv: Sequence[str]) -> int:
    from shardwise.trainer.config import ConfigError, help_text, resolve
    from shardwise.trainer.model_factory import ModelError, resolve_model

    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    try:
        cfg = resolve(argv)
        resolve_model(cfg.model)  # reject a bad --model before starting any process
    except (ConfigError, ModelError) as e:
        print(f"shardwise train: error: {e}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from shardwise.trainer.loop import run

    try:
        run(cfg)
    except ChildFailedError as e:
        print(f"shardwise train: a rank failed:\n{e.format_msg()}", file=sys.stderr)
        return 1
    return 0


def estimate_main(argv: Sequence[str]) -> int:
    from shardwise.estimate import main

    return main(argv)


def export_main(argv: Sequence[str]) -> int:
    try:
        from shardwise.checkpoint import export_main as run_export  # type: ignore[attr-defined]
    except ImportError:
        try:
            from shardwise.checkpoint.export import export_main as run_export
        except ImportError:
            print("shardwise export: error: this installation has no checkpoint export (shardwise.checkpoint)",
                  file=sys.stderr)
            return 2
    return int(run_export(list(argv)) or 0)


COMMANDS = {"train": train_main, "estimate-memory": estimate_main, "export": export_main}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"shardwise: unknown command {command!r}; valid: {', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[command](rest)
