"""Which parameters got a gradient: the rule that makes ``p.grad is None`` mean what it means in one process.

A parameter that no rank's backward reached in a step (an unused ``Linear``, a layer upstream of a
``torch.no_grad()`` block, a layer dropped on every rank) gets no gradient in one process, and AdamW or
momentum leave it alone. Its flat group still reduces it (the packed gradient holds zeros there), so each
reduction records, per parameter, whether this rank packed a gradient for it (``UnshardParams`` hands over
``None`` for an output that got none; ``no_sync`` micro-batches fold theirs in). At the end of a synced
backward the ranks OR these marks on the control group (base/device.py): inside the agreement's own exchange
up to 992 parameters, else one small all-gather of host words agreed before it is issued like every control
collective (checks/fingerprint.py). The sink then drops the gradients it started for parameters no rank used
(core/seams.py, ``end_backward``); a parameter used on some rank only keeps the averaged gradient, zeros from
the others, as DDP's ``find_unused_parameters`` gives.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shardwise.engine.base import collectives
from shardwise.engine.base.device import control_group
from shardwise.engine.checks.fingerprint import FLAG_WORDS

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


def agree(marks: list[bool], checker) -> list[bool]:
    """Every rank's ``marks`` ORed at the end of a synced backward (see ``_ored``)."""
    if not marks:
        return marks
    return _ored(marks, checker, "the agreement on which parameters got a gradient")


def agree_now(marks: Sequence[bool], checker, unit: int, what: str) -> list[bool]:
    """One reduction's marks ORed across ranks before its gradient is handed out, for a sink whose hand-out
    acts on it at once (a post-accumulate-grad hook, an optimizer stepping in backward). Called from
    ``reduction.finish`` on the training thread, never from the offload worker (collectives.py)."""
    return _ored(marks, checker, what, unit)


def _ored(marks: Sequence[bool], checker, what: str, unit: Optional[int] = None) -> list[bool]:
    """Control traffic on the control group over every rank. Up to ``FLAG_WORDS`` words (62 parameters each)
    the OR rides in the check's own exchange (``or_words``: one collective, the same size as every other
    exchange, so a rank here and a rank in a tensor hook's ``check_now`` meet in a named disagreement);
    more words travel in an all-gather of their own, agreed first like any collective outside the unit
    schedule (``collectives.run_agreed``). Every rank sends every trainable group's marks, so what travels
    has the same size everywhere whatever ran."""
    group = control_group()
    if group is None:
        return list(marks)
    words = pack(marks)
    where = {} if unit is None else {"unit": unit}
    if checker is not None and len(words) <= FLAG_WORDS:
        return unpack(checker.or_words("grad_usage", len(marks), words, **where), len(marks))
    mine = torch.tensor(words, dtype=torch.int64)
    world = dist.get_world_size()
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
    collectives.run_agreed(checker, "grad_usage", collectives.all_gather_into, everyone, mine, group=group,
                           what=what, **where)
    words = [0] * mine.numel()
    for row in everyone.view(world, -1).tolist():
        words = [w | r for w, r in zip(words, row)]
    return unpack(words, len(marks))
