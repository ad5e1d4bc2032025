"""The one multi-process harness every distributed test uses.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` fresh processes, joins them in a gloo
process group through a ``file://`` rendezvous (no ports to collide on), runs ``fn(rank, world_size, *args)``
in each, and returns the list of per-rank return values. Every collective inherits a short timeout, a rank
that raises fails the test with its traceback, and the whole run has a wall-clock limit, so a test can fail
but never hang. Workers run with one thread each (``OMP_NUM_THREADS=1``), like the benchmarks.
"""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_COLLECTIVE_TIMEOUT_S = 60


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, timeout_s: float, fn, args, env,
            backend: str) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend != "gloo":  # the NCCL-rules test mode's process groups (tests/nccl_rules.py)
        import nccl_rules

        nccl_rules.register()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    result: Any = None
    error = None
    try:
        result = fn(rank, world_size, *args)
    except BaseException as e:  # reported to the parent with this rank's traceback
        error = f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump((result, error), f)
        gc.collect()  # FSDP-style modules hold process-group references; free them before teardown
        if error is None:
            dist.destroy_process_group()
    if error is not None:
        os._exit(1)  # skip teardown collectives that would wait for the ranks still healthy


def run_distributed(fn: Callable, world_size: int, *args, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
                    env: dict | None = None, allow_errors: bool = False, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results.

    With ``allow_errors=True`` a rank that raised yields a ``RankError`` in its slot instead of failing.
    ``backend``: the default group's; ``nccl_rules.BACKEND`` runs the NCCL-rules test mode's."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _worker,
            args=(world_size, init_file, tmp, timeout_s, fn, args, env or {}, backend),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline_s = timeout_s * 3 + 60
        import time

        start = time.monotonic()
        while not _join_quietly(ctx):
            if time.monotonic() - start > deadline_s:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test did not finish in {deadline_s:.0f}s")
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: exited (code {ctx.processes[r].exitcode}) without reporting")
                results.append(RankError(errors[-1]))
                continue
            with open(path, "rb") as f:
                res, err = pickle.load(f)
            if err is not None:
                errors.append(err)
                res = RankError(err)
            results.append(res)
        if errors and not allow_errors:
            raise AssertionError("distributed test failed:\n" + "\n".join(errors))
        return results


class RankError(str):
    """The error text of a rank that raised (returned in place of its result when allow_errors=True)."""


def _join_quietly(ctx) -> bool:
    """Wait a little for all processes; True once every one has exited (whatever its code)."""
    for p in ctx.processes:
        p.join(timeout=0.2)
    return all(p.exitcode is not None for p in ctx.processes)


def error_of(fn) -> str:
    """``"Type: message"`` of what ``fn()`` raises, or ``"no error"``: for tests that compare every rank's
    error text (a rank's exception cannot cross the process boundary, its text can)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"

