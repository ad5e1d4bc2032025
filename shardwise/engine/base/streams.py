"""Copy streams and events for moving shards between host and compute device, with one set of methods
whatever the device, so the offload pipeline (offload_transfers.py) runs one code path everywhere.

On CUDA they are CUDA's own (``torch.cuda.Stream``, ``torch.cuda.Event``, ``Tensor.record_stream``; public
on torch 2.11 and 2.13): copies run on side streams and overlap compute. On the CPU (and any other compute
device) copies are synchronous ``copy_`` calls: ``torch.Event('cpu')`` exists but refuses to record
("cpu backend doesn't support events", torch 2.13), so the host stand-ins below play the part. A host event
is complete once recorded, and it counts its waits, which is what the CPU tests read to check the
pipeline's bookkeeping (every copy has an event, every event is waited before its data is read).
"""

from __future__ import annotations

import contextlib

import torch

from shardwise.errors import ShardwiseError


class HostEvent:
    """Stands in for ``torch.cuda.Event`` where copies are synchronous: complete when recorded."""

    __slots__ = ("recorded", "waits")

    def __init__(self) -> None:
        self.recorded = False
        self.waits = 0

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        self._waited()

    def wait(self, stream=None) -> None:
        self._waited()

    def _waited(self) -> None:
        if not self.recorded:  # a CUDA event never recorded is "complete": that would hide an ordering bug
            raise ShardwiseError("offload pipeline: an event was waited on before its copy recorded it")
        self.waits += 1


class HostStream:
    """Stands in for ``torch.cuda.Stream``: work issued "on" it has already happened."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        event.wait(self)


class HostCopyStreams:
    """Synchronous copies: the compute device is the host (or has no stream API shardwise uses)."""

    asynchronous = False  # nothing to overlap: copies and CPU optimizer steps share the same cores

    def __init__(self) -> None:
        self._current = HostStream()

    def new_stream(self) -> HostStream:
        return HostStream()

    def new_event(self) -> HostEvent:
        return HostEvent()

    def current_stream(self) -> HostStream:
        return self._current

    def using(self, stream):
        return contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        pass


class CudaCopyStreams:
    """CUDA side streams: a copy issued on one overlaps the compute stream until an event joins them."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> "torch.cuda.Stream":
        return torch.cuda.Stream(self.device)

    def new_event(self) -> "torch.cuda.Event":
        # blocking: a host thread waiting on it sleeps instead of spinning on a core the CPU optimizer needs
        return torch.cuda.Event(blocking=True)

    def current_stream(self) -> "torch.cuda.Stream":
        return torch.cuda.current_stream(self.device)

    def using(self, stream):
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        # The caching allocator must not hand this memory out again until ``stream``'s copy is done.
        tensor.record_stream(stream)
