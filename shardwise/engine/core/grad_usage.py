"""Which parameters got a gradient: the rule that makes ``p.grad is None`` mean what it means in one process.

A parameter that no rank's backward reached in a step (an unused ``Linear``, a layer upstream of a
``torch.no_grad()`` block, a layer dropped on every rank) gets no gradient in one process, and AdamW or
momentum leave it alone. Its flat group still reduces it (the packed gradient holds zeros there), so each
reduction records, per parameter, whether this rank packed a gradient for it (``UnshardParams`` hands over
``None`` for an output that got none; ``no_sync`` micro-batches fold theirs in). At the end of a synced
backward the ranks OR these marks: one word per 62 parameters of the model, carried by the end-of-backward
fingerprint exchange (``CollectiveChecker.agree``'s payload) or, with checks off, one small all-reduce. The
sink then drops the gradients it started for parameters no rank used (core/seams.py, ``end_backward``);
a parameter used on some rank only keeps the averaged gradient, zeros from the others, as DDP's
``find_unused_parameters`` gives.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from shardwise.engine.base import collectives
from shardwise.engine.base.device import communication_device
from shardwise.engine.base.strategy import ProcessGroups

BITS = 62  # per int64 word: stays positive, so the words survive any integer exchange unchanged


def either(a: Optional[Sequence[bool]], b: Optional[Sequence[bool]]) -> Optional[list[bool]]:
    """Element-wise OR of two usage marks (None: nothing recorded)."""
    if a is None or b is None:
        return None if a is None and b is None else list(a if b is None else b)
    return [x or y for x, y in zip(a, b)]


def pack(marks: Sequence[bool]) -> list[int]:
    words = [0] * -(-len(marks) // BITS)
    for i, used in enumerate(marks):
        if used:
            words[i // BITS] |= 1 << (i % BITS)
    return words


def unpack(words: Sequence[int], n: int) -> list[bool]:
    return [bool((int(words[i // BITS]) >> (i % BITS)) & 1) for i in range(n)]


def agree(marks: list[bool], checker, pgs: ProcessGroups) -> list[bool]:
    """Every rank's ``marks`` ORed: through ``checker``'s end-of-backward exchange (which compares the
    ranks' collectives in the same message), or, with checks off, one all-reduce per process group."""
    if not marks:
        if checker is not None:
            checker.agree()
        return marks
    if checker is not None and checker.group is not None:
        table = checker.agree(payload=torch.tensor(pack(marks), dtype=torch.int64))
        words = [0] * table.shape[1]
        for row in table.tolist():
            words = [w | r for w, r in zip(words, row)]
        return unpack(words, len(marks))
    return _summed(marks, None, pgs, "the agreement on which parameters got a gradient")


def agree_now(marks: Sequence[bool], checker, pgs: ProcessGroups, unit: int, what: str) -> list[bool]:
    """One reduction's marks ORed across ranks before its gradient is handed out, for a sink whose hand-out
    acts on it at once (a post-accumulate-grad hook, an optimizer stepping in backward): agreed first like any
    collective outside the unit schedule (``collectives.run_agreed``)."""
    return _summed(marks, checker, pgs, what, unit)


def _summed(marks: Sequence[bool], checker, pgs: ProcessGroups, what: str, unit: Optional[int] = None) -> list[bool]:
    counts = torch.tensor(list(marks), dtype=torch.int32)
    for group in (pgs.shard, pgs.replicate):
        if group is not None:
            counts = counts.to(communication_device(group))
            collectives.run_agreed(checker, "grad_usage", collectives.all_reduce_sum, counts, group=group,
                                   what=what, **({} if unit is None else {"unit": unit}))
    return [bool(c) for c in counts.tolist()]
