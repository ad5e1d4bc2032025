"""The CPU-offload pipeline's copies and the host work that follows them.

Per sharded model (one per ``shard(..., offload=CPUOffload())``):

* **device -> host.** When a unit's reduce-scatter finishes (``reduction.finish``), its gradient shard
  is copied into a pinned host buffer of the flat group (allocated once, reused every step) on the D2H
  side stream, and an event is recorded after the copy. Nothing on the host reads that buffer before the
  event is waited on: the *hand-out* (``.grad`` of each shard parameter becomes a view of it, or has it
  added when a gradient is already there) waits first. Who hands it out: an attached consumer
  (``optim.offload.OffloadOptimizer``: hand-out, then that unit's optimizer step, as soon as the unit's
  last gradient of the backward lands) or, with a plain torch optimizer, ``end_backward``, in order.
* **host work.** On CUDA the consumer's work runs on one worker thread (FIFO), so the CPU optimizer step
  of unit k overlaps the GPU backward of the units before it; on the CPU it runs inline (there is nothing
  to overlap with: the same cores compute backward). ``end_backward`` waits for all of it, so when
  ``backward()`` returns every gradient is on the host and every eager step is done.
* **host -> device.** ``begin_unshard`` asks for the shard on the device: the copy is issued on the H2D
  side stream and the compute stream waits on its event before the all-gather reads it. The order in
  which groups asked during the last step is recorded; each request issues the copies of the next
  ``h2d_ahead`` groups of that order, and the optimizer issues the first ``h2d_ahead`` right after their
  step, so a copy is in flight before its unshard asks. A copy whose shard changed since it was issued
  (version counters) is dropped and copied again; unused copies are dropped at the end of backward.

Buffers (G = the group's shard elements, master dtype): ``host grad`` (G, pinned on CUDA: the home of
the group's ``.grad`` views), ``host incoming`` (G, pinned, only once a gradient arrives while ``.grad``
is set: it is added from there), device copies of the shard (G each, at most ``h2d_ahead`` issued ahead).
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from shardwise.engine.base import collectives
from shardwise.engine.base.device import copy_streams
from shardwise.engine.base.cpu_offload import CPUOffload


class Landing:
    """A gradient shard on its way to a pinned host buffer."""

    __slots__ = ("group", "buffer", "event", "final", "used")

    def __init__(self, group, buffer: torch.Tensor, event, final: bool, used=None):
        self.group, self.buffer, self.event, self.final = group, buffer, event, final
        self.used = used  # which parameters get it (None: every trainable one; core/grad_usage.py)


class DeviceCopy:
    """A shard on its way to the compute device, and the shard version it was copied from."""

    __slots__ = ("tensor", "event", "version")

    def __init__(self, tensor: torch.Tensor, event, version: tuple):
        self.tensor, self.event, self.version = tensor, event, version


class OffloadTransfers:
    def __init__(self, device: torch.device, offload: CPUOffload, streams=None):
        self.device = device
        self.offload = offload
        self.streams = streams if streams is not None else copy_streams(device)
        self.d2h = self.streams.new_stream()
        self.h2d = self.streams.new_stream()
        threaded = offload.worker_thread if offload.worker_thread is not None else self.streams.asynchronous
        self._executor: Optional[ThreadPoolExecutor] = None
        if threaded:
            # It runs beside the training thread: no collective may be issued from it (collectives.py).
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="shardwise-offload",
                                                initializer=collectives.forbid_collectives_here)
            weakref.finalize(self, self._executor.shutdown, wait=False)
        self.window = offload.h2d_ahead
        self.consumer = None  # takes every landing (optim.offload.OffloadOptimizer); None: end_backward does
        self.host_buffers: dict[tuple, torch.Tensor] = {}  # (group, "grad" | "incoming") -> pinned buffer
        self.allocations = 0  # host buffers allocated so far: one or two per group for the model's lifetime
        self._queued: list[Landing] = []  # landings to hand out at end of backward (no consumer)
        self._work: list[Future] = []  # consumer work submitted since the last drain, in order
        self._last_work: dict = {}  # group -> its latest submitted work
        self._ahead: dict = {}  # group -> DeviceCopy issued before its request
        self._sequence: list = []  # groups in the order they asked for their shard on the device, this step
        self._last_sequence: list = []
        self.trace: Optional[list] = None  # set to [] to record (event, (unit, group)) tuples: tests read it

    # ---- device -> host -----------------------------------------------------------------------------
    def grad_to_host(self, group, grad_shard: torch.Tensor, final: bool, used=None) -> None:
        """Start copying a reduced gradient shard to the host. ``final``: the group receives no other
        gradient in this backward (its optimizer step may start once this one lands); ``used``: the sink's."""
        self._settle(group)  # an earlier gradient of this group is handed out first: it decides where this goes
        buffer = self._host_buffer(group, "incoming" if group.sink.has_grad(group) else "grad")
        self.d2h.wait_stream(self.streams.current_stream())  # the reduced shard is complete on the compute stream
        with self.streams.using(self.d2h):
            src = grad_shard if grad_shard.dtype == buffer.dtype else grad_shard.to(buffer.dtype)
            buffer.copy_(src, non_blocking=True)
            event = self.streams.new_event()
            event.record(self.d2h)
        self.streams.record_stream(grad_shard, self.d2h)
        self.note("d2h", group)
        landing = Landing(group, buffer, event, final, used)
        if self.consumer is None:
            self._queued.append(landing)
        else:
            self._submit(group, self.consumer.take_landing, landing)

    def hand_out(self, landing: Landing) -> None:
        """Wait for the copy, then give the group's shard parameters their gradient (views of the buffer,
        or added to the ``.grad`` they hold)."""
        landing.event.synchronize()
        self.note("landed", landing.group)
        landing.group.sink.accumulate(landing.group, landing.buffer, landing.used)

    def _host_buffer(self, group, kind: str) -> torch.Tensor:
        key = (group, kind)
        buf = self.host_buffers.get(key)
        # A view of last step's gradient buffer that the user still holds (``g = p.grad`` before
        # ``zero_grad()``) keeps its values, as in plain torch: the next gradient lands in a new buffer.
        if buf is None or buf.dtype != group.plan.dtype or (kind == "grad" and _viewed_elsewhere(buf)):
            buf = self.offload.allocate(group.plan.shard_numel, group.plan.dtype, self.device)
            self.host_buffers[key] = buf
            self.allocations += 1
        return buf

    # ---- host work ----------------------------------------------------------------------------------
    def _submit(self, group, fn: Callable, arg) -> None:
        if self._executor is None:
            fn(arg)
            return
        work = self._executor.submit(fn, arg)
        self._work.append(work)
        self._last_work[group] = work

    def _settle(self, group) -> None:
        """Everything submitted for ``group`` is done, and its queued gradients are handed out."""
        work = self._last_work.pop(group, None)
        if work is not None:
            work.result()
        mine = [landing for landing in self._queued if landing.group is group]
        if mine:
            self._queued = [landing for landing in self._queued if landing.group is not group]
            for landing in mine:
                self.hand_out(landing)

    def drain(self) -> None:
        """Wait for all submitted host work; re-raise the first error it raised."""
        work, self._work, self._last_work = self._work, [], {}
        first = None
        for w in work:
            try:
                w.result()
            except BaseException as e:  # noqa: BLE001 - the first one is re-raised once all have finished
                first = first or e
        if first is not None:
            raise first

    def end_backward(self) -> None:
        """Every gradient of this backward handed out, every eager step done; copies made ahead for this
        backward and not used are dropped (the step that follows makes them stale)."""
        queued, self._queued = self._queued, []
        for landing in queued:
            self.hand_out(landing)
        self._ahead.clear()
        self.drain()

    def recover(self) -> None:
        """After a failed backward: drop what is in flight (the step's gradients are lost, as in torch)."""
        self._queued = []
        self._ahead.clear()
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - the failed step's error is the one the user saw
            pass

    # ---- host -> device -----------------------------------------------------------------------------
    def shard_on_device(self, group) -> torch.Tensor:
        """The group's shard on the compute device, for its all-gather; the compute stream waits for it."""
        self._sequence.append(group)
        copy = self._ahead.pop(group, None)
        if copy is None or copy.version != group.shard_version():
            copy = self._to_device(group)
        self.streams.current_stream().wait_event(copy.event)
        self.note("h2d_wait", group)
        self._copy_ahead(self._last_sequence[len(self._sequence):])
        return copy.tensor

    def host_updated(self, group) -> None:
        """``group``'s host shard holds its next values (its optimizer step is done): copy it ahead now if
        the next forward asks for it among the first ``h2d_ahead``."""
        if group in self._last_sequence[:self.window] and group not in self._ahead:
            self._copy_ahead([group])

    def copy_first_ahead(self) -> None:
        """The first ``h2d_ahead`` shards the next forward asks for, copied now (after the optimizer step)."""
        self._copy_ahead(self._last_sequence)

    def rotate(self) -> None:
        """A step is over (optimizer step, or the next forward begins): its request order is the one
        to copy ahead by from now on."""
        if self._sequence:
            self._last_sequence, self._sequence = self._sequence, []

    def _copy_ahead(self, upcoming: list) -> None:
        for group in upcoming[:self.window]:
            if len(self._ahead) >= self.window:
                return
            if group not in self._ahead:
                self._ahead[group] = self._to_device(group)

    def _to_device(self, group) -> DeviceCopy:
        self._settle(group)  # its optimizer step (worker thread) must not be writing the host shard
        current = self.streams.current_stream()
        tensor = torch.empty(group.shard.numel(), dtype=group.shard.dtype, device=self.device)
        self.h2d.wait_stream(current)  # the new tensor's memory may still be read by queued compute
        with self.streams.using(self.h2d):
            tensor.copy_(group.shard, non_blocking=True)
            event = self.streams.new_event()
            event.record(self.h2d)
        self.streams.record_stream(tensor, self.h2d)  # dropped unused: not reused before the copy is done
        self.note("h2d", group)
        return DeviceCopy(tensor, event, group.shard_version())

    # ---- bookkeeping --------------------------------------------------------------------------------
    def note(self, what: str, group) -> None:
        if self.trace is not None:
            self.trace.append((what, group.ids))

    def violations(self) -> list[str]:
        """What must not be left between a backward and the next forward (the test harness asserts none)."""
        problems = []
        if self._queued:
            problems.append(f"{len(self._queued)} offloaded gradients never handed out")
        if any(not w.done() for w in self._work):
            problems.append("offload host work still running")
        if len(self._ahead) > self.window:
            problems.append(f"{len(self._ahead)} shard copies made ahead (at most {self.window})")
        return problems


def _viewed_elsewhere(buffer: torch.Tensor) -> bool:
    """Whether any tensor other than ``buffer`` itself still views its storage. Private API, kept to this
    function: ``torch._C._storage_Use_Count`` (checked on torch 2.13 and 2.11) counts the tensors sharing a
    storage, plus one for the ``untyped_storage()`` object made to ask."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) > 2
