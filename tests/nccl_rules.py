"""A CPU test mode that fails wherever a GPU run would break NCCL's rules.

On a GPU, shardwise's model data lives on the accelerator and some tensors stay on the host: offloaded shards,
pinned buffers, tensors made without a device, ``.cpu()`` results, the control traffic. NCCL moves device
tensors only, and an operation mixing device and host tensors raises. On a CPU machine both kinds are CPU
tensors, so nothing fails; this mode makes the difference visible:

* **Which kind a tensor is.** Every storage is tagged ``"device"`` or ``"host"`` (an attribute on the storage
  object, which torch keeps alive as long as the storage). ``DEVICE``, ``torch.device("cpu", 0)``, stands in for
  the accelerator: a factory call or ``.to()`` naming it makes device storage; naming plain ``"cpu"``, naming no
  device, ``pin_memory``, ``torch.tensor`` / ``frombuffer`` / ``from_numpy`` make host storage, and ``.cpu()`` /
  ``.to("cpu")`` of a device tensor returns a host *copy* (on a GPU it is a device-to-host copy, never the same
  tensor). Every other operation's new storage is device if any input is (a TorchDispatchMode sees every
  operation, autograd's backward included; a dtype cast keeps its input's kind). A device tensor's ``.device``
  is ``DEVICE``, so code that makes tensors ``device=t.device`` makes them where ``t`` is. Storages made before the mode
  was entered count as host.
* **Operations.** An operation whose tensor inputs mix device and host raises ``NcclRuleViolation``, except
  where CUDA allows it: copies, 0-dim host tensors (CUDA takes them as scalars) and host index tensors.
* **Host reads of device values.** Inside ``host_reads()``, every ``.item()``, ``.tolist()``, ``bool()``,
  ``int()``, ``float()``, ``torch.equal``, ``.numpy()`` and copy to the host of a device tensor made from
  shardwise's own code is recorded: each is a host-device sync on a GPU.
* **Collectives.** ``BACKEND`` is a process group registered with ``Backend.register_backend`` that wraps gloo
  and refuses a host tensor, as NCCL would; ``HOST_BACKEND`` wraps gloo and refuses a device tensor (shardwise
  keeps its control traffic on host groups: a device tensor there would be a host-device sync on a GPU).

Use: ``run_distributed(fn, world, ..., backend=nccl_rules.BACKEND)`` (the harness registers the backends before
``init_process_group``), and inside ``fn`` train under ``with nccl_rules.enforced():`` with inputs moved to
``nccl_rules.DEVICE``, as a GPU script moves them to ``cuda``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.engine.surface.pieces import Piece, local_of

DEVICE = torch.device("cpu", 0)  # the accelerator's stand-in: the index is what tells it from the host
BACKEND = "nccl_rules"  # device tensors only, like NCCL
HOST_BACKEND = "host_rules"  # host tensors only, like shardwise's control groups should carry
_ATTR = "_nccl_rules_kind"


class NcclRuleViolation(AssertionError):
    """What would fail on a GPU: a host tensor in an NCCL collective, a device tensor in a host collective, an
    operation mixing the two."""


def kind(t: torch.Tensor) -> str:
    """``"device"`` or ``"host"`` (storages made before the mode, or outside it, are host; a shardwise piece is
    the kind of the elements it holds: it has no storage of its own)."""
    return getattr(local_of(t).untyped_storage(), _ATTR, "host")


def _tag(t: torch.Tensor, which: str) -> None:
    storage = t.untyped_storage()
    if getattr(storage, _ATTR, None) is None:
        setattr(storage, _ATTR, which)


def _device_kind(device) -> Optional[str]:
    if device is None:
        return None
    device = torch.device(device)
    return "device" if device == DEVICE else "host"


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]


# Operations CUDA runs with host operands: copies between the two, and indexing with host index tensors.
_CROSS_DEVICE_OK = {"aten::copy_", "aten::_to_copy", "aten::copy", "aten::lift_fresh", "aten::set_",
                    "aten::_copy_from", "aten::_copy_from_and_resize"}
_INDEXING = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}


class _TagOperations(TorchDispatchMode):
    """Tags the storage every operation makes; refuses operations mixing device and non-scalar host tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, Piece) for t in types):
            # A piece's own __torch_dispatch__ computes it from plain tensors: returning NotImplemented lets it
            # run with this mode still on the stack, so the operations it makes (and the tensors they make, the
            # buffers of its collectives) are tagged and checked as a GPU would hold them.
            return NotImplemented
        kwargs = kwargs or {}
        name = func._schema.name
        inputs = _tensors(args, kwargs)
        if name not in _CROSS_DEVICE_OK:
            operands = inputs
            if name in _INDEXING:  # self (and values) must be on the device; indices may be on the host
                operands = [args[0]] + ([args[2]] if len(args) > 2 and isinstance(args[2], torch.Tensor) else [])
            kinds = {kind(t) for t in operands if t.dim() > 0 or kind(t) == "device"}
            if len(kinds) > 1:
                shapes = ", ".join(f"{kind(t)} {tuple(t.shape)}" for t in operands)
                raise NcclRuleViolation(f"{func} mixes device and host tensors ({shapes}): on a GPU this raises "
                                        f"'Expected all tensors to be on the same device'")
        out = func(*args, **kwargs)
        explicit = _device_kind(kwargs.get("device"))
        if name == "aten::_to_copy" and explicit == "host":
            # A plain-cpu device here comes from C++ that read a tensor's real device (autograd's backward of a
            # dtype cast): it keeps the input's kind. Python's own .cpu() / .to("cpu") are _HostCopies'.
            explicit = None
        if kwargs.get("pin_memory"):
            explicit = "host"
        made = explicit or ("device" if any(kind(t) == "device" for t in inputs) else "host")
        for t in _tensors(out, {}):
            _tag(t, made)
        return out


# Tensors built from data before any operation runs (pin_memory: a host copy, whatever it is given).
_MADE_FROM_DATA = (torch.tensor, torch.as_tensor, torch.Tensor.pin_memory)


_REAL_DEVICE = torch._C.TensorBase.device  # the C property; ``enforced()`` shadows it on torch.Tensor


def _device(t: torch.Tensor) -> torch.device:
    """``t.device`` inside ``enforced()``: ``DEVICE`` for a device tensor, so that code making tensors
    ``device=t.device`` makes them where ``t`` is, as on a GPU; a property on the class, not a mode, so that
    it holds inside backward too (a mode's handler runs ``backward`` with the mode popped)."""
    return DEVICE if kind(t) == "device" else _REAL_DEVICE.__get__(t)


# What reads a device tensor's values on the host (a host-device sync on a GPU), and where shardwise is.
_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
               torch.Tensor.__float__, torch.equal, torch.Tensor.numpy, torch.Tensor.cpu}
_SHARDWISE = os.sep + "shardwise" + os.sep
_reads: Optional[list] = None  # host_reads()'s record while it is active


def _note_host_read(func, args, kwargs) -> None:
    if _reads is None or not any(kind(t) == "device" for t in _tensors(args, kwargs)):
        return
    if func is torch.Tensor.to and _to_target(func, args[1:], kwargs) != "host":
        return
    frame = sys._getframe(2)
    while frame is not None and (os.sep + "torch" + os.sep in frame.f_code.co_filename
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is not None and _SHARDWISE in frame.f_code.co_filename:
        where = f"{frame.f_code.co_filename.split(_SHARDWISE)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        _reads.append(f"{getattr(func, '__name__', func)} in {where}")


@contextlib.contextmanager
def host_reads() -> Iterator[list]:
    """The host reads of device values shardwise's code makes in this block (inside ``enforced()``): one
    ``"item in engine/core/flat_group.py:160 kept_copy_stale"`` per read."""
    global _reads
    saved, _reads = _reads, []
    try:
        yield _reads
    finally:
        _reads = saved


class _HostCopies(TorchFunctionMode):
    """What the dispatch mode cannot see: ``.cpu()`` and ``.to("cpu")`` of a CPU tensor (torch returns the
    tensor itself), and ``torch.tensor`` (its data is built before any operation)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS or func is torch.Tensor.to:
            _note_host_read(func, args, kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.to) and args and isinstance(args[0], torch.Tensor):
            target = _to_target(func, args[1:], kwargs)
            if target == "host" and kind(args[0]) == "device":
                out = func(*args, **kwargs)
                out = out.clone() if out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr() else out
                setattr(out.untyped_storage(), _ATTR, "host")
                return out
            if target == "device" and kind(args[0]) == "device":  # as on a GPU: no copy to where it already is
                return args[0].to(**_without_device(args[1:], kwargs))
        out = func(*args, **kwargs)
        if func in _MADE_FROM_DATA and isinstance(out, torch.Tensor):
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            which = _device_kind(kwargs.get("device")) or (kind(source) if source is not None else "host")
            setattr(out.untyped_storage(), _ATTR, "host" if func is torch.Tensor.pin_memory else which)
        if func is torch.Tensor.numpy and kind(args[0]) == "device":
            raise NcclRuleViolation(".numpy() of a device tensor: on a GPU this raises")
        return out


def _without_device(args, kwargs) -> dict:
    """``.to(...)``'s arguments other than the device, as keywords."""
    dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
    rest = {k: v for k, v in kwargs.items() if k in ("non_blocking", "copy", "memory_format")}
    return {**({"dtype": dtype} if dtype is not None else {}), **rest}


def _to_target(func, args, kwargs) -> Optional[str]:
    """"host", "device" or None (a dtype-only ``.to``) for ``.cpu()`` / ``.to(...)``."""
    if func is torch.Tensor.cpu:
        return "host"
    candidates = [kwargs.get("device")] + list(args)
    for c in candidates:
        if isinstance(c, (str, torch.device)):
            return _device_kind(c)
        if isinstance(c, torch.Tensor):  # .to(other): other's kind
            return kind(c)
    return None


@contextlib.contextmanager
def enforced() -> Iterator[None]:
    """Tag and check every operation in this block (the modes are this thread's: the offload worker thread,
    where it runs, makes host tensors, which it should)."""
    torch.Tensor.device = property(_device)
    try:
        with _HostCopies(), _TagOperations():
            yield
    finally:
        del torch.Tensor.device  # torch.Tensor inherits TensorBase's again


# ---- the process groups -------------------------------------------------------------------------------------

class _RuleGroup(dist.ProcessGroup):
    """gloo, refusing tensors of the kind its backend must never carry."""

    refused = ""  # "host" (NCCL's stand-in) or "device" (a host-only control group)

    def __init__(self, inner, rank: int, size: int, name: str):
        super().__init__(rank, size)
        self.inner, self._name = inner, name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self._name

    def name(self) -> str:
        return self._name

    def _check(self, op: str, *tensors) -> None:
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor) and kind(t) == self.refused:
                raise NcclRuleViolation(
                    f"{op} on a {self._name} group got a {self.refused} tensor {tuple(t.shape)} {t.dtype}: "
                    + ("NCCL moves device tensors only ('No backend type associated with device type cpu')"
                       if self.refused == "host" else "control traffic must stay on the host (a device tensor "
                       "here is a host-device sync on a GPU)"))

    def allreduce(self, tensors, opts=None):
        self._check("all_reduce", tensors)
        return self.inner.allreduce(tensors, opts) if opts is not None else self.inner.allreduce(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        self._check("all_reduce_coalesced", tensors)
        return self.inner.allreduce_coalesced(tensors, opts)

    def allgather(self, outputs, inputs, opts=None):
        self._check("all_gather", outputs, inputs)
        return self.inner.allgather(outputs, inputs, opts)

    def all_gather_single(self, output, input, opts=None):
        self._check("all_gather_into_tensor", output, input)
        return self.inner._allgather_base(output, input, opts)

    _allgather_base = all_gather_single  # torch 2.11's name

    def reduce_scatter(self, outputs, inputs, opts=None):
        self._check("reduce_scatter", outputs, inputs)
        return self.inner.reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        self._check("reduce_scatter_tensor", output, input)
        return self.inner._reduce_scatter_base(output, input, opts)

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        self._check("all_to_all_single", output, input)
        return self.inner.alltoall_base(output, input, output_splits, input_splits, opts)

    alltoall_base = all_to_all_single

    def broadcast(self, tensors, opts=None):
        self._check("broadcast", tensors)
        return self.inner.broadcast(tensors, opts)

    def reduce(self, tensors, opts=None):
        self._check("reduce", tensors)
        return self.inner.reduce(tensors, opts)

    def gather(self, outputs, inputs, opts=None):
        self._check("gather", outputs, inputs)
        return self.inner.gather(outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts=None):
        self._check("scatter", outputs, inputs)
        return self.inner.scatter(outputs, inputs, opts)

    def barrier(self, opts=None):
        return self.inner.barrier(opts) if opts is not None else self.inner.barrier()


class _DeviceOnlyGroup(_RuleGroup):
    refused = "host"


class _HostOnlyGroup(_RuleGroup):
    refused = "device"


def _creator(cls, name: str):
    def create(store, rank: int, size: int, timeout):
        from torch._C._distributed_c10d import ProcessGroupGloo

        return cls(ProcessGroupGloo(store, rank, size, timeout), rank, size, name)

    return create


def register() -> None:
    """Make ``BACKEND`` and ``HOST_BACKEND`` known to torch.distributed (in every process, before
    ``init_process_group``), and tell shardwise's one rule (engine/base/device.py) that ``BACKEND`` moves device
    tensors only, on ``DEVICE``, and that its control groups are ``HOST_BACKEND``'s; a second call does nothing."""
    from shardwise.engine.base import device

    device.DEVICE_ONLY_BACKENDS[BACKEND] = lambda: DEVICE
    device.CONTROL_BACKEND = HOST_BACKEND
    known = getattr(dist.Backend, "_plugins", {})
    if BACKEND.upper() not in known:
        dist.Backend.register_backend(BACKEND, _creator(_DeviceOnlyGroup, BACKEND), devices=["cpu"])
    if HOST_BACKEND.upper() not in known:
        dist.Backend.register_backend(HOST_BACKEND, _creator(_HostOnlyGroup, HOST_BACKEND), devices=["cpu"])
