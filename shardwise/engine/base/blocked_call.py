"""Which ``torch.distributed`` call a thread is blocked in, read from its Python stack: what a stall report
says of a rank that waits outside shardwise, and what proves a deadlock with a rank that waits inside it
(watchdog.py). Read by the watchdog thread, only when a report is made.

A rank blocked in a collective of its own (``dist.barrier()``, ``dist.all_reduce(metric)``) on a group that
holds a rank waiting in one of ours, while that rank's collective holds it, can never be released: each
waits for the other. That is proof, not suspicion, so the ranks waiting in ours raise within seconds; the
rank in its own call cannot be interrupted (its wait is in C++) and prints the report; its call fails when
the raising ranks exit and close their connections (gloo), or at the process group's timeout (NCCL).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch.distributed as dist

_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def blocked_call(thread_id: Optional[int]) -> Optional[dict]:
    """``{"call": "torch.distributed.barrier()", "at": "train.py:57", "ranks": [...]}`` for the outermost
    ``torch.distributed`` collective the thread is inside (the one user code called), or None."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    outermost = None
    while frame is not None:
        if frame.f_code.co_filename.endswith(_C10D):
            outermost = frame
        frame = frame.f_back
    if outermost is None:
        return None
    caller = outermost.f_back
    while caller is not None and os.sep + "torch" + os.sep in caller.f_code.co_filename:
        caller = caller.f_back  # past torch's own wrappers (c10d_logger's exception logger)
    group = outermost.f_locals.get("group")
    try:
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, AttributeError):
        ranks = []
    at = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}" if caller is not None else "?"
    return {"call": f"torch.distributed.{outermost.f_code.co_name}()", "at": at, "ranks": ranks}


def deadlock(lines: dict[str, dict], world: int, waited_s: float) -> Optional[str]:
    """From a report's lines (rank -> line): the ranks blocked in a collective of their own on a group that
    holds a rank that has waited at least ``waited_s`` in one of ours on a group that holds them, or None."""
    inside = {int(r): line for r, line in lines.items()
              if line.get("in") is not None and line.get("for", 0) >= waited_s}
    outside = {int(r): line["user_call"] for r, line in lines.items()
               if line.get("in") is None and line.get("user_call")}
    stuck = sorted(a for a, call in outside.items() if any(
        b in call["ranks"] and a in (line.get("ranks") or range(world)) for b, line in inside.items()))
    if not stuck:
        return None
    waiting = sorted(inside)
    calls = "; ".join(sorted({f"{outside[a]['call']} called at {outside[a]['at']}" for a in stuck}))
    return (f"ranks {stuck} are blocked in a collective of their own ({calls}) while ranks {waiting} wait in "
            f"shardwise's {inside[waiting[0]]['in']}: each waits for the other. The ranks took different paths "
            f"(a forward or evaluation on some ranks only, uneven batches, an exception caught on one rank, a "
            f"barrier some ranks reach first?)")
