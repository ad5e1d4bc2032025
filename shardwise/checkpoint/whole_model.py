"""A sharded model written out whole, streamed: the tensor half of the one whole-model save path
(``shardwise.save_whole_model``, hf/whole_model.py, adds what a Hugging Face model directory holds besides).

Order of events (every rank calls ``write_whole_model``)::

    all ranks   agree on the call itself (the model's collective check, as full_state_dict does): a call
                on one rank only is a ShardwiseError on every rank, naming it
    rank 0      check OUT can be written, create a temporary directory beside it
                ---- agree ----
    all ranks   flat group by flat group, in model order: join its all-gather (master dtype); rank 0 writes
                each of its parameters into the safetensors file being written (copied to the CPU, cast to
                ``dtype``, one tensor at a time), then every rank frees the gathered group
    rank 0      persistent buffers (every rank holds them whole; rank 0's are written), the caller's other
                files (``add_files``: config.json ...), then the directory is published (below)
                ---- agree ----

So no rank ever holds more than one flat group's whole parameters (one unit's parameters of one dtype),
plus, on rank 0, a CPU copy of the one tensor being written. Files are split as Hugging Face splits them: greedily, in that
order, at most ``max_shard_bytes`` each (a larger tensor alone), ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json`` when there are several, else one ``model.safetensors``.

Publishing is atomic where it can be: a new OUT appears by one rename of the finished temporary directory;
into an existing OUT (a Trainer's output directory, which holds other things) each finished file is renamed
into place, the loading entry points (index, single file) last, and weight files of an earlier save that
this one does not have (another split) are removed, as ``save_pretrained`` does. A failure while writing (a
full disk on rank 0) is one ShardwiseError on every rank naming the file; rank 0 still joins the remaining
gathers first, removes the temporary directory, and leaves OUT as it was.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar, Union

import torch
import torch.nn as nn

from shardwise.checkpoint.export import INDEX_FILE, SINGLE_FILE, write_weight_files, written_dtype
from shardwise.checkpoint.files import unwritable_dir_problem
from shardwise.checkpoint.format import fsync_dir
from shardwise.checkpoint.model_index import persistent_buffers
from shardwise.engine.checks import agree
from shardwise.errors import ShardwiseError

PathLike = Union[str, os.PathLike]
CALL = "save_whole_model"  # the name the ranks agree on, and that an error names
HF_MAX_SHARD_BYTES = 50 * 10**9  # save_pretrained's default in transformers 5
_WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")
Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]
T = TypeVar("T")


def write_whole_model(model: nn.Module, out: PathLike, *, dtype: Optional[torch.dtype] = None,
                      max_shard_bytes: int = HF_MAX_SHARD_BYTES,
                      add_files: Optional[Callable[[Path, Optional[torch.dtype]], None]] = None) -> Optional[list[Path]]:
    """Write the whole of sharded ``model`` into directory ``out`` as safetensors (see the module docstring).
    Collective. Rank 0 returns the weight files written, the other ranks None.

    Names are those of the unsharded model's ``state_dict()`` (recorded by ``shard()``); a tied parameter
    appears once, under its first name. ``dtype`` casts floating-point tensors (default: the master dtype).
    ``add_files(tmp, written_dtype)``: rank 0 writes the model's other files into the temporary directory."""
    from shardwise.engine.core.runtime import runtime_of

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ShardwiseError(f"{CALL}: max_shard_size={max_shard_bytes!r}: must be a positive number of bytes")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ShardwiseError(f"{CALL}: dtype={dtype!r}: must be a floating-point torch.dtype (or None: the masters')")
    rt = runtime_of(model)
    rt.settle()
    groups = list(rt.flat_groups())
    if rt.checker is not None:
        rt.checker.check_now(CALL, len(groups))  # a rank saving alone fails here by name, on every rank
    out = Path(out)
    layout = agree.agreed(lambda: _layout(model, rt, groups, dtype), f"{CALL} to {out}")
    writer = agree.rank() == 0
    stream = _stream(model, rt, groups, writer)

    def fill(tmp: Path) -> list[Path]:
        def produce(name: str) -> torch.Tensor:
            got, t = next(stream)
            if got != name:  # the layout and the stream walk the same lists: a bug, not a user error
                raise ShardwiseError(f"{CALL}: internal error, expected {name!r}, the stream gave {got!r}")
            # A copy on the CPU, one tensor at a time: the writer hands its memory to numpy, after which
            # the gathered group could no longer be freed (a storage exported to numpy cannot be resized).
            return t.to("cpu", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype, copy=True)

        names = write_weight_files(tmp, layout, produce, max_shard_bytes)
        if add_files is not None:
            add_files(tmp, written_dtype(layout))
        return [out / n for n in names]

    return rank0_writes(out, fill, also=stream)


def rank0_writes(out: PathLike, fill: Callable[[Path], T], *, also: Iterator = iter(())) -> Optional[T]:
    """Rank 0 runs ``fill(tmp)`` on a fresh temporary directory beside ``out`` and publishes it at ``out``;
    every rank then exhausts ``also`` (its share of the collectives ``fill`` drives on rank 0, which rank 0
    finishes too when ``fill`` failed) and agrees on the outcome. Collective. Rank 0 returns what ``fill``
    returned, the other ranks None."""
    out = Path(out)
    writer = agree.rank() == 0
    tmp = out.parent / f".{out.name}.save-tmp-{os.getpid()}-{time.time_ns()}"
    agree.agreed(lambda: _prepare(out, tmp) if writer else None, f"{CALL}: preparing {out}")
    result, problem = None, None
    if writer:
        result, problem = agree.attempt(lambda: _fill_and_publish(tmp, out, fill), f"{CALL} to {out}")
    for _ in also:
        pass
    if problem and writer:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        agree.raise_if_any(problem)
    except ShardwiseError as e:
        raise ShardwiseError(f"{e}; {out} was not written (it is as it was)") from None
    return result


def _layout(model: nn.Module, rt, groups: list, dtype: Optional[torch.dtype]) -> Layout:
    """(name, dtype written, shape) in the order the stream produces them."""
    keys = set(rt.state_dict_keys)
    out = []
    for g in groups:
        for spec in g.plan.params:
            if spec.fqn not in keys:  # a state-dict hook renamed it: its saved name is unknown here
                raise ShardwiseError(f"{CALL}: parameter {spec.fqn!r} is not among the model's state_dict() names "
                                     f"(a state-dict hook renames it); unwrap the model before shardwise.shard()")
            out.append((spec.fqn, _cast(g.plan.dtype, dtype), tuple(spec.shape)))
    out += [(name, _cast(b.dtype, dtype), tuple(b.shape)) for name, b in persistent_buffers(model, rt)]
    return out


def _cast(dt: torch.dtype, dtype: Optional[torch.dtype]) -> torch.dtype:
    return dtype if dtype is not None and dt.is_floating_point else dt


def _stream(model: nn.Module, rt, groups: list, writer: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every rank: the gathers, one flat group at a time. Rank 0: yields each whole parameter (a view of its
    gathered group, valid until the next group is asked for), then the persistent buffers."""
    for g in groups:
        if g.pgs.shard is None:  # no_shard: the shard is the whole group
            if writer:
                yield from _params_of(g, g.shard)
            continue
        full = g.gather_full()
        if writer:
            yield from _params_of(g, full)
        # Free it now: the engine keeps the handles of its last few collectives, and with them their
        # tensors (base/collectives.py: RETAIN), so dropping our reference alone would not return the memory.
        full.untyped_storage().resize_(0)
    if writer:
        yield from persistent_buffers(model, rt)


def _params_of(g, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for spec in g.plan.params:
        yield spec.fqn, full.narrow(0, spec.offset, spec.numel).view(spec.shape)


def _prepare(out: Path, tmp: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ShardwiseError(f"{out}: exists and is not a directory; a model is saved as a directory of files")
    problem = unwritable_dir_problem(out.parent)
    if problem:
        raise ShardwiseError(f"{out}: {problem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()


def _fill_and_publish(tmp: Path, out: Path, fill: Callable[[Path], T]) -> T:
    try:
        result = fill(tmp)
        publish(tmp, out)
    except OSError as e:  # a full disk, say: one line naming the file
        raise ShardwiseError(f"{CALL}: {e.filename or tmp}: {e.strerror or e}") from None
    return result


def publish(tmp: Path, out: Path) -> None:
    """Put the files of the finished directory ``tmp`` at ``out``: one rename when ``out`` is new, else file by
    file (``out`` may hold other things), removing the weight files of an earlier save that ``tmp`` lacks."""
    fsync_dir(tmp)
    if not out.exists():
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return
    new = set(os.listdir(tmp))
    for name in sorted(new, key=lambda n: n == INDEX_FILE or n == SINGLE_FILE):  # the loading entry points last
        os.replace(tmp / name, out / name)
    for stale in out.iterdir():
        if _WEIGHT_FILE.match(stale.name) and stale.name not in new and stale.is_file():
            stale.unlink()
    fsync_dir(out)
    tmp.rmdir()
