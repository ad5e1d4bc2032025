"""The ``shardwise`` command (also ``python -m shardwise``): ``train``, ``estimate-memory``, ``export``,
``generate``.

Every failure a user can cause ends here as one line on stderr, ``shardwise <command>: error: ...``,
naming the option or file and what is valid, and no traceback. ``--debug`` anywhere on the command line
(or ``SHARDWISE_DEBUG=1``) lets tracebacks through instead, in the workers too. A bug in shardwise itself
still prints one line, marked ``internal error``, and says how to see the traceback.

Exit status, one rule for every command: 0 done; 2 refused before any work, for something given to it (an
option, a value, a model, data, a checkpoint, an output path: the line names it); 1 the work started and
failed (a rank failed, a write failed, a bug); 128 + the signal number when interrupted (130 for Ctrl-C,
143 for SIGTERM), with the way to resume.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
from typing import Iterator, Optional, Sequence

from shardwise.usage import UsageError

USAGE = """usage: shardwise <command> [options] [--debug]

commands:
  train             train a GPT preset or a Hugging Face config with fully sharded data parallel
                    (no options: 2 local ranks, a small GPT, the Python standard library as text)
  estimate-memory   per-rank memory plan of a configuration, from the real sharding plan (no processes)
  export            write a full model from a checkpoint (safetensors / Hugging Face layout)
  generate          sample text from a run directory, a checkpoint or an export (one process)

`shardwise <command> --help` lists each command's options; --debug shows tracebacks; --version."""

DEBUG_FLAG = "--debug"


class Interrupted(Exception):
    """Ctrl-C or a termination signal; the message says what to do next (exit status 128 + signal)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.status = 128 + signum


def train_main(argv: Sequence[str]) -> int:
    from shardwise.trainer.config import resolve
    from shardwise.trainer.help import help_text
    from shardwise.trainer.launch import under_torchrun
    from shardwise.trainer.preflight import check_before_launch

    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    cfg = resolve(argv)
    launching = not under_torchrun()
    world = cfg.nproc if launching else int(os.environ.get("WORLD_SIZE", "1"))
    local = cfg.nproc if launching else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    check_before_launch(cfg, world_size=world, local_ranks=local, launching=launching)
    finished = _finished_note(cfg)
    if finished:
        print(finished, flush=True)
        return 0

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from shardwise.trainer.failures import collected_failures, debug_enabled
    from shardwise.trainer.loop import run

    with _worker_error_dir() as error_dir, _quiet_launcher():
        try:
            run(cfg)
        except (KeyboardInterrupt, SignalException) as e:
            raise Interrupted(_interrupted_note(cfg, int(getattr(e, "sigval", signal.SIGINT))),
                              int(getattr(e, "sigval", signal.SIGINT))) from None
        except ChildFailedError as e:
            if debug_enabled():
                raise  # torch's report, with every failed rank's traceback
            lines = collected_failures(error_dir) if error_dir else []
            for rank, failure in sorted(e.failures.items()):
                if not lines and failure.exitcode is not None and failure.exitcode < 0:
                    lines.append(f"rank {rank} was killed by signal {-failure.exitcode}")
            for line in lines or [f"{len(e.failures)} rank(s) failed; rerun with --debug to see their tracebacks"]:
                print(f"shardwise train: error: {line}", file=sys.stderr)
            return 1
    return 0


def _finished_note(cfg) -> str | None:
    """Resuming a run whose checkpoint is already at --steps: nothing to train, and why (no worker starts)."""
    from shardwise.checkpoint import checkpoint_info
    from shardwise.trainer.state import resume_path

    path = resume_path(cfg.out, cfg.resume)
    step = checkpoint_info(path).step if path is not None else None
    if step is None or step < cfg.steps:
        return None
    return (f"{path} is at step {step} and --steps is {cfg.steps}: nothing left to train. --steps counts every "
            f"step of the run, those before the resume included: raise it (e.g. --steps {cfg.steps + step}) to "
            f"train further")


def _interrupted_note(cfg, signum: int) -> str:
    from shardwise.trainer.state import resume_path

    what = f"interrupted ({signal.Signals(signum).name})"
    if resume_path(cfg.out, "latest") is None:
        return (f"{what} before its first checkpoint in {cfg.out}: the same command starts it again (--save-every N "
                f"saves along the way)")
    return f"{what}; the run continues from its last checkpoint in {cfg.out} with the same command plus --resume latest"


@contextlib.contextmanager
def _worker_error_dir() -> Iterator[Optional[str]]:
    """Where self-launched workers leave their one-line errors (``failures``); none under torchrun."""
    from shardwise.trainer.failures import ERROR_DIR_ENV
    from shardwise.trainer.launch import under_torchrun

    if under_torchrun():
        yield None
        return
    previous = os.environ.get(ERROR_DIR_ENV)
    with tempfile.TemporaryDirectory(prefix="shardwise-errors-") as d:
        os.environ[ERROR_DIR_ENV] = d
        try:
            yield d
        finally:
            if previous is None:
                os.environ.pop(ERROR_DIR_ENV, None)
            else:
                os.environ[ERROR_DIR_ENV] = previous


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """torch's elastic agent logs every failed worker with its traceback, and the ranks it stops after the
    first failure; the workers' own lines say what matters."""
    from shardwise.trainer.failures import debug_enabled

    import torch.distributed.launcher.api  # noqa: F401  (creates the agent's loggers, each with its own level)

    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith(prefixes)]
    levels = [logger.level for logger in loggers]
    if not debug_enabled():
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def estimate_main(argv: Sequence[str]) -> int:
    from shardwise.planner.cli import main as run_estimate
    from shardwise.trainer.config import INT_RANGES, TrainConfig

    return run_estimate(argv, TrainConfig(), max_seq_len=INT_RANGES["seq_len"][1])


def _raise_usage(message: str):
    raise UsageError(message)


def export_main(argv: Sequence[str]) -> int:
    from shardwise.hf.export import export_main as run_export

    return int(run_export(list(argv)) or 0)


def generate_main(argv: Sequence[str]) -> int:
    from shardwise.trainer.generate import generate_main as run_generate, make_parser

    parser = make_parser()
    parser.error = _raise_usage  # type: ignore[method-assign]
    return run_generate(argv, parser)


COMMANDS = {"train": train_main, "estimate-memory": estimate_main, "export": export_main, "generate": generate_main}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from shardwise.trainer.failures import USER_ERRORS, debug_enabled, one_line

    argv = list(sys.argv[1:] if argv is None else argv)
    if DEBUG_FLAG in argv:
        argv = [a for a in argv if a != DEBUG_FLAG]
        from shardwise.engine.base import flags

        os.environ[flags.DEBUG] = "1"  # the workers inherit it
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from shardwise.version import __version__

        print(f"shardwise {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"shardwise: error: unknown command {command!r}; valid: {', '.join(COMMANDS)} "
              f"(shardwise --help)", file=sys.stderr)
        return 2
    if debug_enabled():
        return COMMANDS[command](rest)
    try:
        return COMMANDS[command](rest)
    except UsageError as e:
        print(f"shardwise {command}: error: {e}", file=sys.stderr)
        return 2
    except USER_ERRORS as e:  # refused: options, model, data, checkpoint
        print(f"shardwise {command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"shardwise {command}: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print(f"shardwise {command}: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    except SystemExit as e:  # argparse's --help (0), or a library calling sys.exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # a bug in shardwise: still one line, and the way to the traceback
        print(f"shardwise {command}: error: {one_line(e)}", file=sys.stderr)
        return 1

