"""Starting the ranks: under ``torchrun`` we are already one worker; otherwise we start ``nproc`` local
workers through torch's elastic launcher (the machinery torchrun itself uses), with a c10d rendezvous on a
free local port. Either way each worker ends up in ``run_worker`` with the usual env (RANK, WORLD_SIZE...).
"""

from __future__ import annotations

import gc
import os
import uuid
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardwise.engine.base.device import pick_backend

# torchrun (and the elastic agent) export these to every worker; a bare `python -m shardwise` has neither.
_TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"


def under_torchrun() -> bool:
    """True inside a worker started by torchrun / the elastic launcher (or any launcher that sets RANK and
    WORLD_SIZE the torch way, e.g. SLURM wrappers)."""
    return _TORCHRUN_ENV in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_worker(backend: str, timeout_s: float, threads_per_rank: int) -> torch.device:
    """Join the process group (env:// rendezvous from the launcher) and pick this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # Ranks on one machine share its cores: oversubscribing threads makes every rank slower.
    torch.set_num_threads(threads_per_rank or max(1, (os.cpu_count() or 1) // local_world))
    backend = pick_backend(backend)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        _join_process_group(backend, timedelta(seconds=timeout_s))
    return device


def _join_process_group(backend: str, timeout: timedelta) -> None:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch 2.13: torchrun's agent store outlives a restart, and gloo's connectFullMesh would read the
        # dead workers' addresses from it ("Connection refused"). Each attempt gets its own key prefix.
        store = dist.PrefixStore(
            f"shardwise/attempt_{restart}",
            dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout),
        )
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def shutdown_worker() -> None:
    gc.collect()  # sharded modules hold process-group references; free them before teardown
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(worker: Callable[[Any], Any], arg: Any, nproc: int) -> dict[int, Any]:
    """Run ``worker(arg)`` once per rank: in this process under torchrun, else in ``nproc`` fresh local
    processes via ``torch.distributed.launcher.api.elastic_launch``. Returns {rank: result} (this
    process's rank only under torchrun). A failing worker raises ``ChildFailedError`` with its traceback."""
    if under_torchrun():
        return {int(os.environ.get("RANK", "0")): worker(arg)}
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does; workers then set their own count
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # port 0: a free port, so concurrent runs never collide
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    return elastic_launch(config, worker)(arg)
