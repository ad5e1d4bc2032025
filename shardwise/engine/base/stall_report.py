"""The text of a stall report (watchdog.py gathers it): one line per rank saying where it is, the ranks' last
collectives, and the verdict — raise (the ranks parted, or the user's threshold passed) or report only."""

from __future__ import annotations

from typing import Optional

from shardwise.engine.base.flags import STALL_S as ENV

GATHER_S = 5.0  # how long the reporting rank collects the others' lines


def _describe(line: Optional[dict]) -> str:
    if line is None:
        return (f"silent: no answer in {GATHER_S:.0f} s (its process died, hangs holding the GIL, or has not "
                f"reached shardwise yet)")
    if line.get("in") is not None:
        return f"in {line['in']} for {line['for']:.1f} s (step {line['step']})"
    last = f", {line['last']}," if line.get("last") else ""
    where = f"since step {line['step']}" if line["step"] else "before its first step"
    call = line.get("user_call")
    blocked = f", blocked in {call['call']} called at {call['at']}" if call else ""
    return f"outside shardwise {where}{blocked} (its last shardwise wait{last} ended {line['idle']:.1f} s ago)"


def render(report: dict, world: int) -> str:
    """The block every rank prints: who waited where, every rank's line, its last collectives, the verdict."""
    lines = report["lines"]
    by = lines.get(str(report["by"])) or {}
    if by.get("in") is not None:
        head = (f"rank {report['by']} waited {by['for']:.1f} s in {by['in']} (stall threshold "
                f"{report['thr']:.1f} s, {ENV}). Where every rank is:")
    elif report["by"] is None:
        head = "another rank started a stall report and never finished it (did it die?). This rank:"
    else:
        head = f"rank {report['by']} reported a stall. Where every rank is:"
    ranks = range(world) if report["by"] is not None else sorted(int(r) for r in lines)
    rows = [f"  rank {r}: {_describe(lines.get(str(r)))}" for r in ranks]
    rows += [f"  {line}" for line in report.get("collectives", [])]
    if report.get("note"):
        rows.append(f"  ({report['note']})")
    if report.get("diverged"):
        tail = (f"{report['diverged']}. The ranks waiting in shardwise raise ShardwiseError; the process group "
                f"is unusable from here on: exit.")
    elif report["raise"]:
        tail = ("Ranks must issue shardwise's collectives in the same order: a rank that ran fewer forwards "
                "(generate() stopped early, a skipped batch) or called clip_grad_norm_ / full_state_dict "
                "alone leaves the others waiting. The ranks waiting in shardwise raise ShardwiseError; their collective "
                "stays pending, so the process group is unusable from here on: exit. "
                f"{ENV}=<seconds> changes the threshold, {ENV}=0 turns the watchdog off.")
    else:
        tail = f"Report only, nothing raised: {report['why']}."
    return "\n".join([head, *rows, tail])
