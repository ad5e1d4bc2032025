"""A unit's state machine as tables (``shardwise/engine/core/unit.py``): what an entry is, what the unit's
state is, and whether an exit frees the gathered parameters. Pure functions of their inputs: no process
group, no model. The behaviour they drive is tested end to end in test_runtime_paths.py and
test_state_lifetime.py (every path leaves the engine clean, with parity)."""

from __future__ import annotations

import pytest

from shardwise.engine.core.unit import (PARAMS_BOUND, Frame, FrameKind, Unit, UnitState, entry_kind,
                                        reshard_after_exit)

F, P, R, S = FrameKind.FORWARD, FrameKind.PASS, FrameKind.RECOMPUTE, FrameKind.SUMMON

# kind, params bound (after the exit), failed, grad enabled, outputs hooked, owed backwards, strategy reshards
# after forward -> reshard, why
EXITS = [
    (P, False, False, True, True, 0, True, False, "a pass-through entry bound nothing"),
    (R, False, False, True, True, 0, True, False, "a recompute's backward follows at once"),
    (F, True, False, True, True, 0, True, False, "an outer entry (or the backward) still binds views"),
    (F, True, False, False, False, 0, True, False, "inference inside an outer entry"),
    (F, False, False, True, True, 1, True, True, "full_shard: the pre-backward hook gathers again"),
    (F, False, False, True, True, 1, False, False, "shard_grad_op, or the root: kept for the backward"),
    (F, False, False, True, True, 0, True, True, "hooked outputs, nothing owed (a frozen unit): freed"),
    (F, False, False, True, False, 0, True, True, "no gradient can reach it: nothing needs them this step"),
    (F, False, False, True, False, 0, False, True, "no gradient can reach it, whatever the strategy"),
    (F, False, False, True, False, 1, True, False, "a backward owed through an output we did not hook: kept"),
    (F, False, False, False, False, 0, True, True, "inference: nothing will need them again this step"),
    (F, False, False, False, False, 2, True, False, "inference between a forward and its owed backward"),
    (F, False, True, True, False, 0, True, True, "the forward raised, nothing owed: freed"),
    (F, False, True, True, True, 0, False, True, "the forward raised: its outputs' hooks count for nothing"),
    (F, False, True, True, False, 1, True, False, "the forward raised, an earlier forward's backward owed"),
    (S, False, False, False, False, 0, True, True, "a summon's exit behaves as a forward's"),
]


@pytest.mark.parametrize("kind, bound, failed, grad, hooked, owed, after_forward, expected, why", EXITS,
                         ids=[row[-1] for row in EXITS])
def test_reshard_after_exit(kind, bound, failed, grad, hooked, owed, after_forward, expected, why):
    assert reshard_after_exit(kind, failed, grad, hooked, owed, bound, after_forward) is expected, why


# submodule, in backward, params bound, entries open -> kind, why
ENTRIES = [
    (True, False, True, True, P, "a module of the unit called inside its forward: the forward's views serve"),
    (True, True, True, False, P, "a module called inside the backward, with the backward views bound"),
    (True, False, True, False, F, "views left bound outside backward and no entry open: a new forward"),
    (False, False, True, True, F, "the unit's own module always enters (a nested call of it)"),
    (True, False, False, True, F, "nothing bound yet: enters"),
    (False, False, False, False, F, "a forward"),
    (False, True, False, False, R, "code of the unit re-run inside backward"),
    (True, True, False, False, R, "a module of the unit re-run inside backward"),
]


@pytest.mark.parametrize("submodule, in_backward, bound, entries_open, expected, why", ENTRIES,
                         ids=[row[-1] for row in ENTRIES])
def test_entry_kind(submodule, in_backward, bound, entries_open, expected, why):
    assert entry_kind(submodule, in_backward, bound, entries_open) is expected, why


def _frame(kind: FrameKind, views) -> Frame:
    frame = Frame(kind, None)
    frame.views = views
    return frame


VIEWS, OTHER = [["forward views"]], [["other views"]]
# frames (innermost last), backward views, owed backwards -> state, views bound, why
STATES = [
    ([], None, 0, UnitState.IDLE, None, "between steps"),
    ([], None, 1, UnitState.OWES_BACKWARD, None, "a forward done, its backward owed"),
    ([], VIEWS, 1, UnitState.BACKWARD, VIEWS, "the pre-backward hook bound the backward views"),
    ([_frame(F, VIEWS)], None, 0, UnitState.FORWARD, VIEWS, "inside its forward"),
    ([_frame(F, VIEWS), _frame(P, None)], None, 0, UnitState.FORWARD, VIEWS, "a pass-through binds nothing"),
    ([_frame(F, None)], None, 0, UnitState.IDLE, None, "entering: not bound yet"),
    ([_frame(F, VIEWS)], OTHER, 1, UnitState.FORWARD, VIEWS, "a forward inside a backward's window"),
    ([_frame(R, OTHER)], OTHER, 1, UnitState.RECOMPUTE, OTHER, "a recompute runs on the backward views"),
    ([_frame(S, OTHER), _frame(F, VIEWS)], None, 0, UnitState.FORWARD, VIEWS, "a forward inside a summon"),
    ([_frame(S, OTHER)], None, 0, UnitState.SUMMONED, OTHER, "summon_full_params"),
]


@pytest.mark.parametrize("frames, backward_views, owed, expected, bound_views, why", STATES,
                         ids=[row[-1] for row in STATES])
def test_unit_state(frames, backward_views, owed, expected, bound_views, why):
    unit = Unit.__new__(Unit)  # the state reads only these three fields
    unit.frames, unit.backward_views, unit.owed_backwards = list(frames), backward_views, owed
    assert unit.state is expected, why
    assert unit.params_bound() is (expected in PARAMS_BOUND)
    assert unit._binding()[1] is bound_views
