"""Collective agreement on errors and small JSON messages, without pickle.

A checkpoint problem is often seen by one rank only (its file is the truncated one). Raising there alone
would leave the other ranks blocked in their next collective until the timeout; instead every step of
save and load ends in ``raise_if_any``, which all ranks call, so either all go on or all raise the same
``ShardwiseError``. Text travels as UTF-8 bytes in uint8 tensors (torch's object collectives pickle). All of
it is control traffic: host tensors on the control group (device.py), each call agreed first.
"""

from __future__ import annotations

import errno
import json
import traceback
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from shardwise.engine.base import flags
from shardwise.engine.base.collectives import all_gather_into, broadcast_text, run_and_wait
from shardwise.engine.base.device import control_group
from shardwise.engine.checks.fingerprint import check_collective
from shardwise.errors import ShardwiseError

T = TypeVar("T")
# Which agreement collective comes next, in the fingerprint's size field (fingerprint.check_collective): a
# rank raising while another gathers JSON fails by name instead of pairing two different collectives.
_RAISE_IF_ANY, _GATHER_JSON, _BROADCAST_JSON, _HOST_ALL_REDUCE, _HOST_ALL_GATHER = 1, 2, 3, 4, 5


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def raise_if_any(problem: Optional[str]) -> None:
    """Every rank calls this; if any rank has a problem, every rank raises the lowest such rank's text."""
    if not is_distributed():
        if problem:
            raise ShardwiseError(problem)
        return
    check_collective("checkpoint", _RAISE_IF_ANY)  # a rank here alone fails by name, not in a mismatched collective
    me, n = dist.get_rank(), dist.get_world_size()
    flag = torch.tensor([me if problem else n], dtype=torch.int64)
    run_and_wait(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=control_group(),
                 what="the agreement on which rank failed")
    first = int(flag.item())
    if first == n:
        return
    raise ShardwiseError(broadcast_text(problem if me == first else None, src=first))


def attempt(fn: Callable[[], T], what: str) -> tuple[Optional[T], Optional[str]]:
    """Run ``fn``; return (result, None) or (None, error text) instead of raising, for ``raise_if_any``.

    The text is one line (a full disk must not hide behind a traceback): the step, the rank and, for an
    OSError, the file and the system's reason. ``SHARDWISE_DEBUG=1`` appends the traceback."""
    try:
        return fn(), None
    except ShardwiseError as e:
        return None, str(e)
    except Exception as e:  # an OSError on one rank must still reach the others as text
        text = f"{what} failed on rank {rank()}: {describe_exception(e)}"
        if flags.debug():
            text += "\n" + traceback.format_exc(limit=3)
        return None, text


def describe_exception(e: BaseException) -> str:
    """``OSError: [ENOSPC] No space left on device: '/x/rank-0.safetensors'`` rather than a traceback."""
    if isinstance(e, OSError) and e.strerror:
        code = errno.errorcode.get(e.errno, str(e.errno))
        return f"{type(e).__name__}: [{code}] {e.strerror}" + (f": {e.filename!r}" if e.filename else "")
    return f"{type(e).__name__}: {e}"


def agreed(fn: Callable[[], T], what: str) -> T:
    """``fn()`` on every rank, raising everywhere together if it fails anywhere."""
    result, problem = attempt(fn, what)
    raise_if_any(problem)
    return result  # type: ignore[return-value]


def gather_json(obj: Any, dst: int = 0) -> Optional[list[Any]]:
    """Every rank's JSON-able ``obj``, in rank order, on ``dst`` (None elsewhere)."""
    data = json.dumps(obj, allow_nan=True).encode("utf-8")
    if not is_distributed():
        return [json.loads(data)]
    check_collective("checkpoint", _GATHER_JSON)
    n, group = dist.get_world_size(), control_group()
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    run_and_wait(dist.all_gather, lengths, length, group=group, what="the exchange of every rank's JSON length")
    sizes = [int(t.item()) for t in lengths]
    longest = max(sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
    run_and_wait(dist.all_gather, bufs, buf, group=group, what="the exchange of every rank's JSON")
    if dist.get_rank() != dst:
        return None
    return [json.loads(b[:size].numpy().tobytes().decode("utf-8")) for b, size in zip(bufs, sizes)]


def broadcast_json(obj: Any, src: int = 0) -> Any:
    if not is_distributed():
        return obj
    check_collective("checkpoint", _BROADCAST_JSON)
    return json.loads(broadcast_text(json.dumps(obj, allow_nan=True) if dist.get_rank() == src else None, src=src))


def all_gather_host(output: torch.Tensor, mine: torch.Tensor, what: str) -> None:
    """Every rank's host tensor ``mine`` (same size everywhere) into ``output``, rank-major, as control traffic,
    agreed first (collective)."""
    check_collective("host_reduction", _HOST_ALL_GATHER * 1000 + mine.numel())
    all_gather_into(output, mine, control_group(), async_op=False, what=what)


def all_reduce_host(values: list[float], op=dist.ReduceOp.SUM, what: str = "a reduction over ranks") -> list[float]:
    """``values`` (numbers on the host: metrics, counts) reduced over every rank, as control traffic: no
    device tensor, no host-device sync, agreed first like every collective of ours (collective)."""
    if not is_distributed():
        return list(values)
    check_collective("host_reduction", _HOST_ALL_REDUCE * 1000 + len(values))
    t = torch.tensor(values, dtype=torch.float64)
    run_and_wait(dist.all_reduce, t, op=op, group=control_group(), what=what)
    return t.tolist()


def barrier() -> None:
    if is_distributed():
        raise_if_any(None)
