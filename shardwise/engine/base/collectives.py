"""Thin wrappers over torch.distributed collectives: one place that knows the API differences between
torch versions and backends, so the rest of the package speaks in ``all_gather_into`` / ``reduce_scatter_into``.

[Note: the wire on gloo] gloo's reduce-scatter is slower than its ring all-reduce of the same buffer at
every size that matters, and its all-gather too above a few million elements (bench/gloo_wire.py, its table
in bench/README.md: world sizes 2-4). So on gloo a reduce-scatter all-reduces the packed gradients in place
and keeps this rank's chunk, and an all-gather of more than ``GLOO_NATIVE_ALL_GATHER_MAX`` elements zero-fills
the output, writes this rank's chunk and all-reduces it (x + 0 is exact in every dtype); smaller all-gathers
are gloo's own, which moves half the bytes. No extra memory: both substitutes run in buffers we already
hold. NCCL keeps the native collectives. ``SHARDWISE_GLOO_NATIVE_COLLECTIVES=1`` makes every one native (a
network where bytes cost more than gloo's slower algorithms).

No collective is issued from a thread that runs beside the training thread (the offload worker): collectives
from two threads could reach the wire in a different order on different ranks. ``issue_here`` enforces it.

Every collective inherits the timeout of its process group (set at ``init_process_group(timeout=...)``),
and ``wait`` accepts a timeout as well, so no call here can block forever. ``wait`` is the one place shardwise
waits for a collective: it waits through ``watchdog.wait``, so a rank stuck there for much longer than a step
makes every rank report where it is and raises, instead of sitting out that timeout (watchdog.py). The
synchronous forms here (``async_op=False``) and ``run_and_wait`` (any torch.distributed collective) go
through it too.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import sys
import threading
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from shardwise.engine.base import device as devices, flags, watchdog
from shardwise.errors import ShardwiseError

# torch 2.13 deprecates the *_tensor names in favour of *_single; 2.11 (the GPU image) only has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_use_all_reduce_cache: dict = {}


# [Note: a gloo worker must never free a Python object] A gloo worker thread frees a work (and what it
# holds: the caller's thread-local state, the tensors it was given) when it is done with it; if the caller
# dropped its handles first, that free is the last reference, and it drops Python objects: a tensor whose
# Python object torch preserved while C++ held it, or the ``contextvars`` context ``backward()`` stashes in
# thread-local state. That needs the GIL; if the interpreter is finalizing by then (a script that ends right
# after its last step, with or without ``destroy_process_group()``), Python ends the thread with
# ``pthread_exit``, the forced unwind crosses a ``noexcept`` destructor and the process aborts: "terminate
# called without an active exception" (core dump: a ``ProcessGroupGloo::runLoop`` thread in
# ``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` -> ``SafePyObject`` decref -> ``take_gil`` ->
# ``pthread_exit`` -> ``std::terminate``). Two rules keep the last reference on the Python side:
# collectives are launched without the backward's stash (``_without_python_tls``), and the handles of the
# last ``RETAIN`` works stay referenced here, for ever once the interpreter exits (``_keep_at_exit``), so a
# worker that is still finishing one at exit never holds the last reference to anything.
RETAIN = 4  # a few: each keeps its tensors referenced (scratch buffers free their memory themselves)
_retained: "collections.deque" = collections.deque(maxlen=RETAIN)
_keep_registered = False


def _retain(work):
    """Keep ``work``'s handle referenced (see the Note above); returns it."""
    global _keep_registered
    if work is not None:
        _retained.append(work)
        if not _keep_registered:
            _keep_registered = True
            atexit.register(_keep_at_exit)
    return work


def _keep_at_exit() -> None:
    """At exit, before finalization: the retained handles are never freed (one extra reference to their
    deque), so no gloo worker finishing one of them can be the last to release it."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_retained))


@contextlib.contextmanager
def _without_python_tls():
    """Launch a collective with no Python object in the thread-local state the work captures (during
    ``backward()``: the context torch's ``_engine_run_backward`` stashes under "context"; see [Note: a gloo
    worker must never free a Python object]). The stash is put back right after; a gloo collective does
    not read it.

    Private torch API, kept to this function: ``torch._C._is_key_in_tls`` / ``_get_obj_in_tls`` /
    ``_remove_obj_from_tls`` / ``_stash_obj_in_tls`` exist in torch 2.13 (checked) and 2.11; where they are
    missing nothing is stashed either."""
    c = torch._C
    if not (hasattr(c, "_is_key_in_tls") and c._is_key_in_tls(_BACKWARD_TLS_KEY)):
        yield
        return
    stashed = c._get_obj_in_tls(_BACKWARD_TLS_KEY)
    c._remove_obj_from_tls(_BACKWARD_TLS_KEY)
    try:
        yield
    finally:
        c._stash_obj_in_tls(_BACKWARD_TLS_KEY, stashed)


_BACKWARD_TLS_KEY = "context"


GLOO_NATIVE_ALL_GATHER_MAX = 2**22  # elements; above it gloo's all-gather runs as an all-reduce (see the Note)


def runs_as_all_reduce(op: str, group, device: torch.device, numel: int) -> bool:
    """Whether ``op`` ("all_gather" / "reduce_scatter") of ``numel`` elements (the whole, gathered size) on
    ``group`` runs as one all-reduce: see [Note: the wire on gloo]."""
    key = (id(group), torch.device(device).type)
    if key not in _use_all_reduce_cache:
        native = flags.enabled(flags.GLOO_NATIVE_COLLECTIVES)
        _use_all_reduce_cache[key] = devices.backend_for(group, device) == "gloo" and not native
    return _use_all_reduce_cache[key] and (op == "reduce_scatter" or numel > GLOO_NATIVE_ALL_GATHER_MAX)


_no_collectives = threading.local()  # .here: this thread runs beside the training thread (the offload worker)


def forbid_collectives_here() -> None:
    """The calling thread runs beside the training thread (the offload worker: its initializer calls this):
    a collective issued from it could reach the wire before or after the training thread's next one,
    differently on different ranks."""
    _no_collectives.here = True


def may_issue_here() -> bool:
    """Whether this thread may issue a collective (not a thread beside the training thread)."""
    return not getattr(_no_collectives, "here", False)


def issue_here(what: str) -> None:
    """Refuse a collective issued from a thread that runs beside the training thread (an internal error if it
    ever happens: such a thread hands its collectives back). Autograd's own threads are fine: the training
    thread waits in ``backward()`` while they run."""
    if getattr(_no_collectives, "here", False):
        raise ShardwiseError(f"internal error: {what} issued from thread {threading.current_thread().name!r}, "
                             f"which runs beside the training thread: collectives from two threads reach the "
                             f"wire in different orders on different ranks")
    stalled = watchdog.unusable()
    if stalled is not None:  # a collective may still be pending: the next one issued would pair with it
        raise ShardwiseError(f"rank {dist.get_rank()}: not issuing {what}: an earlier wait ({stalled}) ended in "
                             f"an error and shardwise's process groups are unusable from there on: exit")


class _ThenCopy:
    """A pending all-reduce whose result chunk still has to be copied out once it is done."""

    def __init__(self, work, dst: torch.Tensor, src: torch.Tensor):
        self.work, self.dst, self.src = work, dst, src

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if self.work is not None:
            self.work.wait() if timeout is None else self.work.wait(timeout)
            self.dst.copy_(self.src)
            self.work = self.src = None
        return True


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True,
                    what: Optional[str] = None):
    """Concatenate every rank's ``shard`` (same numel everywhere) into ``output``, rank-major.
    ``what`` names the call in errors and stall reports when ``async_op=False`` (default: op, size, caller)."""
    issue_here("an all-gather")
    if runs_as_all_reduce("all_gather", group, output.device, output.numel()):
        n = shard.numel()
        output.zero_()
        output.narrow(0, dist.get_rank(group) * n, n).copy_(shard)
        with _without_python_tls():
            work = _retain(dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group, async_op=True))
    else:
        with _without_python_tls():
            work = _retain(_all_gather_single(output, shard, group=group, async_op=True))
    if async_op:
        return work
    wait(work, what=what or _called("all_gather", output), group=group)
    return None


def reduce_scatter_into(output: torch.Tensor, flat: torch.Tensor, group, async_op: bool = True,
                        what: Optional[str] = None):
    """Sum ``flat`` over ranks and keep this rank's contiguous 1/N chunk in ``output``.
    On gloo ``flat`` is overwritten with the full sum (see [Note: the wire on gloo])."""
    issue_here("a reduce-scatter")
    if runs_as_all_reduce("reduce_scatter", group, flat.device, flat.numel()):
        n = output.numel()
        with _without_python_tls():
            work = _retain(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True))
        work = _ThenCopy(work, output, flat.narrow(0, dist.get_rank(group) * n, n))
    else:
        with _without_python_tls():
            work = _retain(_reduce_scatter_single(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=True))
    if async_op:
        return work
    wait(work, what=what or _called("reduce_scatter", flat), group=group)
    return None


def all_reduce_sum(tensor: torch.Tensor, group, async_op: bool = False, what: Optional[str] = None):
    """Sum ``tensor`` over ranks in place."""
    issue_here("an all-reduce")
    with _without_python_tls():
        work = _retain(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True))
    if async_op:
        return work
    wait(work, what=what or _called("all_reduce", tensor), group=group)
    return None


def run_and_wait(collective: Callable, *args, what: Optional[str] = None, group=None, **kwargs) -> None:
    """Run a torch.distributed collective synchronously, waiting through ``wait`` (named errors, stall
    reports): ``run_and_wait(dist.broadcast, t, src=0, what="...")`` in place of ``dist.broadcast(t, src=0)``.
    ``collective`` must accept ``group`` and ``async_op``."""
    issue_here(getattr(collective, "__name__", "a collective"))
    with _without_python_tls():
        work = _retain(collective(*args, group=group, async_op=True, **kwargs))
    wait(work, what=what or _called(getattr(collective, "__name__", "collective"), _first_tensor(args)),
         group=group)


def run_agreed(checker, op: str, collective: Callable, /, *args, what: str, group=None, numel: Optional[int] = None,
               unit: Optional[int] = None, **kwargs) -> None:
    """``run_and_wait`` for a collective that user code can start on some ranks only, outside the unit
    schedule (a tensor hook's gradient gather, a GradScaler's overflow vote, the comparison of
    summon_full_params edits, an optimizer-state verdict): the ranks first agree that each is about to issue
    ``op`` of this size (``checker.check_now``, fingerprint.py: one tiny exchange on the side group), so a
    rank that issues it alone is a ShardwiseError naming ``op`` on every rank, never a hang, a gloo abort on
    mismatched sizes or a sum paired with another rank's collective. ``checker``: the model's
    ``fingerprint.CollectiveChecker``, or None where checks are off (then a plain ``run_and_wait``).
    ``numel`` and ``unit``: the fingerprint's size (default: the first tensor's) and unit (default: the model).
    ``checker``, ``op`` and ``collective`` are positional only: ``op=`` is the collective's reduce op."""
    if checker is not None:
        size = numel if numel is not None else getattr(_first_tensor(args), "numel", lambda: 0)()
        checker.check_now(op, size, **({} if unit is None else {"unit": unit}))
    run_and_wait(collective, *args, what=what, group=group, **kwargs)


def wait(work, timeout: Optional[timedelta] = None, what: watchdog.What = "collective", group=None) -> None:
    """Wait for an async collective; a failure (peer died, timeout) becomes an error naming ``what`` (a string,
    or a function returning one, called only if it is needed). ``group``: the collective's process group
    (None: the default one), which tells whether the wait blocks the CPU (see ``_waits_on_cpu``). A wait
    that stalls raises ``ShardwiseError`` with a report of where every rank is (watchdog.py)."""
    if work is None:
        return
    try:
        watchdog.wait(work, what, timeout, _waits_on_cpu(group), group)
    except ShardwiseError:
        raise
    except RuntimeError as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ShardwiseError(f"rank {rank}: {watchdog._text(what)} failed: a peer rank died, left or timed out "
                             f"({e})") from e


_cpu_wait_cache: dict = {}


def _waits_on_cpu(group) -> bool:
    """Whether ``work.wait()`` on ``group`` blocks the CPU until the collective is done (gloo: then the wait can
    stall, and is sliced so it can raise). Under NCCL it only orders the current CUDA stream; slicing it would
    take a CPU-blocking timed wait, so it is left alone (mixed backends such as "cpu:gloo,cuda:nccl" too)."""
    key = id(group)
    cached = _cpu_wait_cache.get(key)
    if cached is None:
        cached = not devices.moves_cuda_over_nccl(group)
        _cpu_wait_cache[key] = cached
    return cached


def _first_tensor(args) -> Optional[torch.Tensor]:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _called(op: str, tensor: Optional[torch.Tensor]) -> str:
    """A default name for a synchronous collective: the operation, its size and shardwise's caller."""
    frame = sys._getframe(2)
    size = f" of {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} elements" if tensor is not None else ""
    return f"{op}{size} in {frame.f_code.co_name}()"


def broadcast_text(text: Optional[str], src: int = 0) -> str:
    """Send a string from global rank ``src`` to every rank without pickle (length, then UTF-8 bytes): control
    traffic, host tensors on the control group (device.py). The caller agrees on the call first."""
    is_src = dist.get_rank() == src
    data = (text or "").encode("utf-8") if is_src else b""
    what = f"broadcast_text from rank {src} in {sys._getframe(1).f_code.co_name}()"
    group = devices.control_group()
    length = torch.tensor([len(data)], dtype=torch.int64)
    run_and_wait(dist.broadcast, length, src=src, group=group, what=what)
    buf = torch.empty(int(length.item()), dtype=torch.uint8)
    if is_src and len(data):
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if buf.numel():
        run_and_wait(dist.broadcast, buf, src=src, group=group, what=what)
    return bytes(buf.tolist()).decode("utf-8") if not is_src else (text or "")
