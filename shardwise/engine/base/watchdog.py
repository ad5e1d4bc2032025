"""Stall watchdog: a rank that waits in a shardwise collective much longer than a step makes every rank
report, within seconds, where each rank is, and the waiting ranks raise ``ShardwiseError`` instead of
sitting out the process group's timeout (30 minutes by default).

The main thread only writes plain attributes (no store traffic, no lock, no thread wakeup):

* ``wait(work, what)`` (``collectives.wait`` is its one caller) records "in <what> since t" around every
  blocking wait shardwise does. Where ``work.wait()`` blocks the CPU (gloo) it waits in slices of
  ``SLICE_S`` seconds, so it can raise once the watchdog has reported a stall; a collective that finishes
  wakes the waiter at once, so a normal wait gets no polling latency. Under NCCL ``work.wait()`` only
  orders the current CUDA stream and returns: it is left as it is and only the state is recorded.
* ``note_step()`` (called at every root forward) counts and times steps.

The watchdog thread (one per process, a daemon, started by the first wait or ``note_step``) does one tiny
read-only operation a second on the default process group's c10d store, ``check([next report's key])``, to
learn whether a report was started:

1. A rank whose current blocking wait is older than the threshold starts one (the wait itself wakes the
   watchdog at that moment instead of leaving it to the next poll).
2. Every rank's watchdog sees it within a second and posts one line: where its main thread is (in which
   shardwise wait and for how long, or outside shardwise since which step and its last shardwise wait).
3. The starting rank collects the lines for up to ``GATHER_S`` seconds (a rank that does not answer is
   reported silent: dead, or not yet in shardwise), decides the verdict and posts the report.
4. Every rank prints the report to stderr as one block. If the verdict is to raise, each rank still in the
   wait it reported raises ``ShardwiseError`` carrying the report, within ``SLICE_S`` seconds. The stuck
   collective is still pending in the process group, which cannot be used any more: the process should exit.

Threshold, ``SHARDWISE_STALL_S``:

* a number > 0: a wait that long is a stall; reported, and raised (the user asked for it).
* ``0``: the watchdog is off (plain waits, no thread).
* unset: ``max(FLOOR_S, STEP_FACTOR x the longest step this rank has timed)``, a step being the time
  between two root forwards (``FIRST_STEP_S`` until a rank has timed one), and the verdict is *report
  only* unless the ranks' recent collectives prove they parted (below). A wait that long is not proof:
  rank-local work between steps (evaluation or ``torch.save`` on rank 0, loading weights the others
  receive by broadcast) makes the other ranks wait in the next collective for minutes in healthy runs, and
  the process group's own timeout (``init_process_group(timeout=...)``) is the user's word on how long
  is too long; that timeout still ends the wait, with a report printed before it.

Every rank's line also carries its last collectives (``fingerprint._rings``), read by the watchdog thread
only when a report is made, and, for a rank outside shardwise, the ``torch.distributed`` call its training
thread is blocked in, if any (blocked_call.py). The verdict is to raise, whatever the threshold, when they
prove the ranks parted: two ranks' last collectives differ at one call number, or ranks blocked in a
collective of their own hold ranks waiting in one of ours (a deadlock). Any wait longer than ``PROBE_S``
starts a *quiet probe* (at most one per ``PROBE_EVERY_S`` per rank): the same exchange, printed and raised
only if it proves that much, so ranks that parted are named within seconds, not at the threshold.

The verdict is also *report only* when every rank is waiting in the same collective: that one is slow,
not out of step. Without a store (``_default_store`` below) the report is this rank's own line only.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Union

import torch.distributed as dist

from shardwise.engine.base import flags
from shardwise.engine.base.blocked_call import blocked_call, deadlock
from shardwise.engine.base.stall_report import GATHER_S, render
from shardwise.errors import ShardwiseError

ENV = flags.STALL_S
FLOOR_S = 30.0
STEP_FACTOR = 5.0
FIRST_STEP_S = 300.0
POLL_S = 1.0
SLICE_S = 0.25
_SLICE = timedelta(seconds=SLICE_S)
_KEY = "shardwise/stall"
PROBE_S = 2.0  # a wait this long starts a quiet probe
PROBE_EVERY_S = 10.0  # at most one probe per rank this often

What = Union[str, Callable[[], str], None]  # a description, or a function making it when it is needed


def _default_store():
    """The c10d store of the default process group, or None.

    Private torch API, kept to this one function: ``torch.distributed.distributed_c10d._get_default_store``
    exists with the same name and body (``_world.pg_map[default_pg][1]``) in torch 2.13 (checked here) and in
    PyTorch's sources from 2.0 to the current main, which covers 2.11. If it is ever renamed, the fallback
    reads the same map; failing that the watchdog reports what this rank knows (its own line) only."""
    try:
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            return None
        getter = getattr(c10d, "_get_default_store", None)
        if getter is not None:
            return getter()
        return c10d._world.pg_map[c10d._get_default_group()][1]
    except Exception:
        return None


class _State:
    """What the main thread is doing. Written by the main thread (plain attributes: each store is atomic under
    the GIL), read by the watchdog thread; ``abort`` is the only field the watchdog writes."""

    def __init__(self) -> None:
        self.what: What = None  # the wait in progress, None outside shardwise's waits
        self.since = 0.0  # time.monotonic() at the start of the current wait
        self.wid = 0  # serial number of the current (or last) wait
        self.blocking = False  # whether the current wait blocks the CPU (can stall, can raise)
        self.last_what: What = None  # the last wait that finished
        self.left = time.monotonic()  # when it finished
        self.step = 0  # root forwards so far
        self.step_t: Optional[float] = None  # when the last one started
        self.longest = 0.0  # the longest time between two root forwards
        self.reported = 0.0  # when this rank last took part in a report
        self.abort: tuple[int, str, str | None] | None = None  # (wid, report, disagreement): that wait raises
        self.started = False
        self.off = False
        self.stalled: Optional[str] = None  # the wait that raised a stall: every later unfinished wait fails at once
        self.probed = 0.0  # when this rank last started a probe
        self.reporting = False  # this rank's watchdog is taking part in a report (its verdict may raise here)
        self.group = None  # the process group of the current wait (None: the default group)
        self.thread: Optional[int] = None  # the training thread: the last one that waited or started a step


_state = _State()
# Set by fingerprint.py (which imports this module, not the reverse): this rank's recent collectives, as
# JSON, and the function that reads every rank's of them: (disagreement text or None, lines to print).
Diagnosis = Callable[[dict], "tuple[str | None, list[str]]"]
_ring_source: Callable[[], dict] | None = None
_diagnose: Diagnosis | None = None


def set_ring_source(rings: Callable[[], dict], diagnose: Diagnosis) -> None:
    global _ring_source, _diagnose
    _ring_source, _diagnose = rings, diagnose
_start_lock = threading.Lock()
_wake = threading.Event()  # set by a wait that has just passed the threshold: the watchdog looks at once
_stop = threading.Event()  # set at interpreter exit: the watchdog thread leaves its loop
_thread: Optional[threading.Thread] = None
EXIT_JOIN_S = 2.0


def _text(what: What) -> str:
    if what is None:
        return "none"
    try:
        return what() if callable(what) else str(what)
    except Exception as e:  # a description must never be what fails
        return f"<description failed: {e!r}>"


def _env_threshold() -> Optional[float]:
    """SHARDWISE_STALL_S as a number, None if unset or unreadable."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        return None


def threshold() -> tuple[Optional[float], bool]:
    """(seconds a wait may last before it is a stall, whether a stall is raised or only reported); None: off."""
    env = _env_threshold()
    if env is not None:
        return (env, True) if env > 0 else (None, False)
    s = _state
    if s.step >= 2:
        return max(FLOOR_S, STEP_FACTOR * s.longest), False
    return FIRST_STEP_S, False


def note_step() -> None:
    """Called at every root forward: counts steps and keeps the longest time between two of them."""
    s = _state
    now = time.monotonic()
    if s.step_t is not None and now - s.step_t > s.longest:
        s.longest = now - s.step_t
    s.step += 1
    s.step_t = now
    s.thread = threading.get_ident()
    if not s.started:
        _start()


def wait(work, what: What, timeout: Optional[timedelta] = None, blocking: bool = True, group=None) -> None:
    """``work.wait()``, recording where this rank is. ``blocking``: whether ``work.wait()`` blocks the CPU
    until the collective is done (gloo); only then is the wait sliced so that a reported stall can raise.
    ``group``: the collective's process group (a report says which ranks it waits for)."""
    s = _state
    if not s.started:
        _start()
    s.since = time.monotonic()
    s.wid += 1
    wid = s.wid
    s.blocking = blocking
    s.group, s.thread = group, threading.get_ident()
    s.what = what
    try:
        if s.stalled is not None and blocking and not work.is_completed():
            # After a stall the process group is unusable: waiting again would only stall (and report) again.
            raise ShardwiseError(f"rank {_rank()}: not waiting in {_text(what)}: an earlier wait ({s.stalled}) "
                                 f"stalled and the process group is unusable from there on")
        if not blocking or s.off:
            work.wait() if timeout is None else work.wait(timeout)
            return
        end = None if timeout is None else s.since + timeout.total_seconds()
        piece = _SLICE
        while True:
            if end is not None:
                piece = timedelta(seconds=max(0.001, min(SLICE_S, end - time.monotonic())))
            try:
                work.wait(piece)
                return
            except RuntimeError:
                if work.is_completed():
                    try:
                        work.wait()  # it failed (or finished just now): its own error, or nothing
                    except RuntimeError:
                        # A peer that gave up on this stall and exited closes the connection: the report of
                        # where every rank was says more than "connection closed", if one is coming.
                        _raise_stall(s, wid, what, linger_s=2.0)
                        raise
                    return
                _raise_stall(s, wid, what, linger_s=0.0)
                if not _wake.is_set():
                    thr = threshold()[0]
                    if thr is not None and time.monotonic() - max(s.since, s.reported) > thr:
                        _wake.set()  # saves the watchdog up to a poll interval
                if end is not None and time.monotonic() >= end:
                    raise  # the caller's own timeout
    finally:
        s.what = None
        s.last_what = what
        s.left = time.monotonic()


def unusable() -> Optional[str]:
    """The wait that raised a stall or a disagreement, if one did: a collective may still be pending on some
    rank, so nothing more may be issued (collectives.issue_here), or the next one would pair with it."""
    return _state.stalled


def _raise_stall(s: _State, wid: int, what: What, linger_s: float) -> None:
    """Raise the stall report for wait ``wid`` if the watchdog has one; wait up to ``linger_s`` for it when
    this wait is past the threshold (the report is being gathered)."""
    thr = threshold()[0]
    # Past the threshold, or while a report (a probe) is being made: a peer that read the verdict first may
    # have raised and exited already, closing this wait's connection before this rank's verdict is posted.
    due = s.reporting or (thr is not None and time.monotonic() - s.since > thr)
    deadline = time.monotonic() + (linger_s if due else 0.0)
    while True:
        abort = s.abort
        if abort is not None and abort[0] == wid:
            s.stalled = _text(what)
            stopped = f"rank {_rank()}: stopped waiting in {_text(what)} after {time.monotonic() - s.since:.1f} s"
            if abort[2]:  # the ranks' recent collectives show where they parted: that comes first
                raise ShardwiseError(f"{abort[2]}. Found by the stall watchdog; {stopped}. {abort[1]}") from None
            raise ShardwiseError(f"{stopped}. {abort[1]}") from None
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _rank() -> int:
    try:
        return dist.get_rank() if dist.is_initialized() else 0
    except Exception:
        return 0


def _start() -> None:
    with _start_lock:
        s = _state
        if s.started:
            return
        env = _env_threshold()
        if env is not None and env <= 0:
            s.off = s.started = True
            return
        if not (dist.is_available() and dist.is_initialized()):
            return  # no process group yet: looked at again at the next wait or step
        s.started = True
        if dist.get_world_size() < 2:
            return  # a world of one: nobody to wait for
        global _thread
        _thread = threading.Thread(target=_Watchdog().run, name="shardwise-watchdog", daemon=True)
        _thread.start()
        atexit.register(_stop_at_exit)


def _stop_at_exit() -> None:
    """Stop the watchdog thread before the interpreter finalizes. A daemon thread that comes back from a
    store call (C++, GIL released) after finalization began is ended with ``pthread_exit``, whose unwind
    through pybind11's GIL guard aborts the process (see [Note: a gloo worker must never free a Python
    object] in collectives.py for the same mechanism). atexit handlers run while the interpreter is whole."""
    _stop.set()
    _wake.set()
    if _thread is not None and _thread is not threading.current_thread():
        _thread.join(EXIT_JOIN_S)


def _where(s: _State, now: float) -> dict:
    """This rank's line of the report."""
    what, since, wid, group = s.what, s.since, s.wid, s.group
    if what is not None and s.blocking:
        line = {"in": _text(what), "for": round(now - since, 1), "step": s.step, "wid": wid,
                "ranks": _ranks(group)}
    else:
        line = {"in": None, "step": s.step, "idle": round(now - s.left, 1), "last": _text(s.last_what)
                if s.last_what is not None else None,
                "user_call": blocked_call(s.thread if s.thread is not None else threading.main_thread().ident)}
    if _ring_source is not None:
        try:
            line["rings"] = _ring_source()
        except (RuntimeError, KeyError, IndexError, TypeError, ValueError) as e:
            line["rings_failed"] = repr(e)  # the report must not fail for want of the collectives
    return line


def _ranks(group) -> list[int]:
    try:
        return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return []


class _Watchdog:
    """Store keys, per report n = 1, 2, ...: ``{_KEY}/n/claim`` (counter: the first to add 1 starts it),
    ``/start`` (set by that rank), ``/<rank>`` (each rank's line, JSON), ``/report`` (the verdict, JSON)."""

    def __init__(self) -> None:
        self.store_id: Optional[int] = None
        self.handled = 0  # the last report this rank took part in, or that existed when it first looked

    @staticmethod
    def latest(store) -> int:
        n = 0
        while store.check([f"{_KEY}/{n + 1}/start"]) or store.check([f"{_KEY}/{n + 1}/claim"]):
            n += 1
        return n

    def run(self) -> None:
        while not _stop.is_set():
            _wake.wait(POLL_S)
            _wake.clear()
            if _stop.is_set():
                return
            try:
                self.tick()
            except Exception:
                _stop.wait(4 * POLL_S)  # the store is gone (a rank exited, the group was destroyed): back off

    def tick(self) -> None:
        s = _state
        if not dist.is_initialized():
            return
        now = time.monotonic()
        thr, may_raise = threshold()
        stalled = (thr is not None and s.what is not None and s.blocking
                   and now - max(s.since, s.reported) > thr)
        # A quiet probe: a wait past PROBE_S makes every rank post where it is and its last collectives; if
        # they prove the ranks parted, every waiting rank raises at once.
        probe = (not stalled and thr is not None and s.what is not None and s.blocking
                 and now - s.since > min(PROBE_S, thr) and now - s.probed > PROBE_EVERY_S)
        store = _default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        if store is None:
            if stalled:
                s.reported = now
                self.finish({"by": rank, "thr": thr, "raise": may_raise, "lines": {str(rank): _where(s, now)},
                             "why": f"{ENV} unset: report only" if not may_raise else "",
                             "note": "other ranks unknown: the process group has no c10d store to ask"}, rank,
                            world)
            return
        if id(store) != self.store_id:  # first look, or a new process group: earlier reports are not ours
            self.store_id, self.handled = id(store), self.latest(store)
        cur = self.handled + 1
        # One read-only operation per poll: FileStore appends a record for every write, even add(key, 0).
        started = store.check([f"{_KEY}/{cur}/start"])
        mine = False
        if (stalled or probe) and not started:
            if int(store.add(f"{_KEY}/{cur}/claim", 1)) == 1:
                store.set(f"{_KEY}/{cur}/start", str(rank))
                mine = True
                if probe:
                    s.probed = now
            else:
                started = True  # another rank claimed it a moment ago: join that one
        if not (started or mine):
            return
        line = json.dumps(_where(s, now))
        store.set(f"{_KEY}/{cur}/{rank}", line)
        self.handled = cur
        reported, s.reported = s.reported, now
        s.reporting = True
        try:
            if mine:
                report = self.collect(store, cur, rank, world, thr, may_raise, quiet=probe)
                store.set(f"{_KEY}/{cur}/report", json.dumps(report))
                if report["raise"]:
                    time.sleep(0.5)  # before this rank raises (and exits, maybe with the store): others read it
            else:
                report = self.receive(store, cur, rank, line)
            if report.get("quiet"):
                s.reported = reported  # a probe that found nothing does not postpone the stall report
            self.finish(report, rank, world)
        finally:
            s.reporting = False

    def collect(self, store, ep: int, rank: int, world: int, thr: float, may_raise: bool,
                quiet: bool = False) -> dict:
        keys = [f"{_KEY}/{ep}/{r}" for r in range(world)]
        deadline = time.monotonic() + GATHER_S
        while not store.check(keys) and time.monotonic() < deadline and not _stop.is_set():
            time.sleep(0.1)
        lines = {str(r): json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
        waiting = {line["in"] for line in lines.values()}
        why = ""
        if not may_raise:
            why = (f"{ENV} is unset, so only a proven disagreement raises before the process group's own "
                   f"timeout; {ENV}=<seconds> makes a wait that long raise")
        elif len(lines) == world and len(waiting) == 1 and None not in waiting:
            may_raise, why = False, "every rank is in this same collective (slow, not out of step)"
        report = {"by": rank, "thr": thr, "raise": may_raise, "lines": lines, "why": why}
        diverged = None
        if _diagnose is not None:
            diverged, report["collectives"] = _diagnose({int(r): line.get("rings") for r, line in lines.items()})
        diverged = diverged or deadlock(lines, world, min(PROBE_S, thr))
        if diverged:
            report.update(diverged=diverged, quiet=False)
            report["raise"] = True  # proven, not suspected: raise whatever the threshold
            return report
        report["quiet"] = quiet  # a probe that proved nothing prints nothing
        return report

    def receive(self, store, ep: int, rank: int, line: str) -> dict:
        key = f"{_KEY}/{ep}/report"
        deadline = time.monotonic() + GATHER_S + 5 * POLL_S
        while not store.check([key]):
            if time.monotonic() > deadline or _stop.is_set():
                return {"by": None, "thr": 0.0, "raise": False, "lines": {str(rank): json.loads(line)},
                        "why": "the report is incomplete"}
            time.sleep(0.1)
        return json.loads(store.get(key))

    def finish(self, report: dict, rank: int, world: int) -> None:
        if report.get("quiet"):
            return
        text = render(report, world)
        mine = report["lines"].get(str(rank))
        s = _state
        if report["raise"] and mine is not None and mine.get("in") is not None and s.what is not None \
                and s.wid == mine["wid"]:
            s.abort = (mine["wid"], text, report.get("diverged"))  # that wait raises it (if still in progress)
        block = "\n".join(f"[shardwise rank {rank}] {row}" for row in ["stall report:", *text.split("\n")])
        try:
            sys.stderr.write(block + "\n")
            sys.stderr.flush()
        except Exception:
            pass
