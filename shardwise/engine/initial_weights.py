"""One model's initial weights on every rank, as ``DistributedDataParallel`` gives (``shard()`` time).

DDP broadcasts rank 0's parameters and buffers when it wraps a model, so scripts that seed each rank
differently (nanoGPT's ``1337 + rank``, meant for its data) or not at all still train one model. ``shard()``
keeps each rank's piece of its own parameters, so it compares first: one checksum per parameter and buffer
(``checksum``), every rank's in one small all-gather, agreed like every collective outside the unit schedule
(``collectives.run_agreed``). Where they differ it takes rank 0's values (one broadcast per flat group and
per buffer that differs) and says so in one warning on rank 0; with ``sync_module_states=False`` given
explicitly it refuses by name instead. ``sync_module_states=True`` broadcasts everything without comparing.

Ranks that build on the meta device initialise module by module (materialize.py) under rank 0's RNG state,
broadcast once, so every rank computes the single-process values whatever its own seed; ranks other than 0
then get their own RNG state back (data-order seeds stay per rank; rank 0's advances as eager construction
would advance it). The values are compared the same way afterwards, and an init that still differs (one that
reads the rank or its own generator) is refused by name: it cannot be rank 0's, whose full values are gone.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine import materialize
from shardwise.engine.base import collectives
from shardwise.engine.base.device import control_group
from shardwise.engine.core.flat_group import FlatGroup
from shardwise.errors import ShardwiseError

_CHUNK = 1 << 20  # elements summed at once: |word| < 2^31, weight < 2^8, so a chunk's sum stays below 2^59
_MOD = (1 << 61) - 1  # checksums are below 2^61: they fit the int64 exchange with room to spare
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # element size -> word read


def checksum(t: torch.Tensor) -> int:
    """A number that changes with any bit of ``t`` and with where it is: two sums of its words (plain, and
    weighted by position) in exact integer arithmetic, computed where ``t`` lives, a bounded chunk at a
    time. The same on every rank and device for the same bits."""
    flat = t.detach().contiguous().view(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    words = flat.view(_WORDS[flat.element_size()])
    h = words.numel() % _MOD
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=chunk.device) % 251 + 1
        h = (h * 1_000_003 + int((chunk * weights).sum()) * 31 + int(chunk.sum())) % _MOD
    return h


class Tensors:
    """The tensors compared, in one order on every rank: the parameters in plan order, then the buffers."""

    def __init__(self, model: nn.Module, groups: list[FlatGroup]):
        self.params = [(g, i, spec) for g in groups for i, spec in enumerate(g.plan.params)]
        self.buffers = [(f"{m_name}.{n}" if m_name else n, m, n) for m_name, m in model.named_modules()
                        for n, b in m._buffers.items() if b is not None]
        self.names = [spec.fqn for _, _, spec in self.params] + [name for name, _, _ in self.buffers]

    def buffer_values(self) -> list[torch.Tensor]:
        return [m._buffers[n] for _, m, n in self.buffers]

    def original_param(self, index: int) -> torch.Tensor:
        ref = self.params[index][2].refs[0]
        return ref.module._parameters[ref.name]


def fill(model: nn.Module, groups: list[FlatGroup], device: torch.device, sync_module_states: Optional[bool],
         param_init_fn: Optional[Callable[[nn.Module], None]], checker) -> None:
    """Fill every group's shard so that all ranks hold pieces of one model (see the module docstring), and
    move the buffers to ``device``. ``sync_module_states``: True broadcasts rank 0's, False refuses ranks
    that differ, None (not given) takes rank 0's where they differ and says so."""
    if sync_module_states:
        materialize.fill_from_rank0(model, groups, device, _world(groups))
        return
    is_meta = any(p.is_meta for p in model.parameters())
    tensors = Tensors(model, groups)
    if not _is_distributed():
        if is_meta:
            materialize.fill_from_meta(model, groups, device, param_init_fn)
        else:
            materialize.fill_from_full_params(groups)
        _buffers_to(model, device)
        return
    if not is_meta:
        _buffers_to(model, device)
    mine = [int(is_meta)] + ([0] * len(tensors.names) if is_meta else
                             [checksum(tensors.original_param(i)) for i in range(len(tensors.params))]
                             + [checksum(b) for b in tensors.buffer_values()])
    rows = _exchange(mine, checker, "the comparison of every rank's initial weights in shard()")
    metas = [r for r, row in enumerate(rows) if row[0]]
    if len(metas) == len(rows):
        _fill_from_meta_alike(model, groups, device, param_init_fn, tensors, checker)
    elif metas:
        _take_rank0_for_meta_ranks(model, groups, device, sync_module_states, metas)
    else:
        materialize.fill_from_full_params(groups)
        differing = _differing(rows)
        if differing:
            _take_rank0_where_differing(groups, device, sync_module_states, tensors, differing, rows)


def _fill_from_meta_alike(model, groups, device, param_init_fn, tensors: Tensors, checker) -> None:
    """Every rank on meta: initialise under rank 0's RNG state, then compare what each rank computed."""
    seen: dict[tuple[int, int], int] = {}
    with _rank0_rng(device, checker):
        materialize.fill_from_meta(model, groups, device, param_init_fn,
                                   seen=lambda g, i, value: seen.__setitem__((id(g), i), checksum(value)))
    _buffers_to(model, device)
    mine = [0] + [seen.get((id(g), i), 0) for g, i, _ in tensors.params] + [checksum(b) for b in tensors.buffer_values()]
    rows = _exchange(mine, checker, "the comparison of every rank's meta-device init in shard()")
    differing = _differing(rows)
    if differing:
        raise ShardwiseError(
            f"the meta-device init gives different values on different ranks in {_listing(differing, tensors.names, rows)}, "
            f"although every rank initialised from rank 0's RNG state: the init (param_init_fn, reset_parameters, "
            f"_init_weights) depends on the rank or on a generator of its own. Make it deterministic, or build the "
            f"model for real on rank 0 and pass shard(sync_module_states=True)")


def _take_rank0_for_meta_ranks(model, groups, device, sync_module_states, metas: list[int]) -> None:
    ranks = _ranks(metas)
    if 0 in metas:
        raise ShardwiseError(
            f"{ranks} built the model on the meta device, rank 0 included, while other ranks built it "
            f"for real: there are no rank 0 values to take. Build on the meta device on every rank, or build "
            f"for real on rank 0 and pass shard(sync_module_states=True)")
    if sync_module_states is False:
        raise ShardwiseError(
            f"shard(sync_module_states=False): {ranks} built the model on the meta device while rank 0 "
            f"built it for real, so their parameters would be uninitialised; leave sync_module_states unset or "
            f"pass True to take rank 0's values")
    materialize.fill_from_rank0(model, groups, device, _world(groups))
    _say(f"{ranks} built the model on the meta device: took rank 0's parameters and buffers "
         f"(shard(sync_module_states=True) says this is intended)")


def _take_rank0_where_differing(groups, device, sync_module_states, tensors: Tensors, differing: list[int],
                                rows) -> None:
    listing = _listing(differing, tensors.names, rows)
    if sync_module_states is False:
        raise ShardwiseError(
            f"shard(sync_module_states=False): the ranks' initial weights differ in {listing}: every rank would "
            f"train its own model. Seed every rank alike before building the model, or leave sync_module_states "
            f"unset (or pass True) to take rank 0's values, as DistributedDataParallel does")
    n_params = len(tensors.params)
    by_group = {id(tensors.params[i][0]) for i in differing if i < n_params}
    for g in groups:
        if id(g) in by_group:
            materialize.fill_group_from_rank0(
                g, device, lambda spec: spec.refs[0].module._parameters[spec.refs[0].name])
    for i in differing:
        if i >= n_params:
            name, module, key = tensors.buffers[i - n_params]
            collectives.run_and_wait(dist.broadcast, module._buffers[key], src=0, group=_world(groups),
                                     what=f"rank 0's buffer {name!r}")
    _say(f"the ranks' initial weights differ in {listing}: took rank 0's, as DistributedDataParallel does (seed "
         f"every rank alike before building the model, or pass shard(sync_module_states=True))")


def _differing(rows: list[list[int]]) -> list[int]:
    """Indices (into the compared tensors) where some rank's checksum is not rank 0's."""
    return [i - 1 for i in range(1, len(rows[0])) if any(row[i] != rows[0][i] for row in rows[1:])]


def _listing(differing: list[int], names: list[str], rows: list[list[int]]) -> str:
    first = differing[0]
    ranks = [r for r, row in enumerate(rows) if row[first + 1] != rows[0][first + 1]]
    verb = "differs" if len(ranks) == 1 else "differ"
    return f"{len(differing)} of {len(names)} tensors (first {names[first]!r}, where {_ranks(ranks)} {verb} from rank 0)"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _exchange(values: list[int], checker, what: str) -> list[list[int]]:
    """Every rank's ``values`` (the same length everywhere: the plans agree), in rank order: control traffic,
    host tensors on the control group (base/device.py)."""
    world = dist.get_world_size()
    mine = torch.tensor(values, dtype=torch.int64)
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
    collectives.run_agreed(checker, "initial_weights", collectives.all_gather_into, everyone, mine,
                           group=control_group(), what=what)
    return everyone.view(world, -1).tolist()


@contextlib.contextmanager
def _rank0_rng(device: torch.device, checker) -> Iterator[None]:
    """Every rank draws from rank 0's RNG state (CPU, and ``device``'s generator) inside the block; ranks
    other than 0 get their own state back after it."""
    cuda = device.type == "cuda"
    own = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if cuda else [])
    sizes = [s.numel() for s in own]
    states = torch.cat([s.cpu() for s in own])  # (host tensors on the control group: base/device.py)
    collectives.run_agreed(checker, "rng_state", dist.broadcast, states, src=0, group=control_group(),
                           what="rank 0's RNG state for the meta-device init in shard()")
    if dist.get_rank() == 0:
        yield
        return
    theirs = states.cpu().split(sizes)
    torch.set_rng_state(theirs[0])
    if cuda:
        torch.cuda.set_rng_state(theirs[1], device)
    try:
        yield
    finally:
        torch.set_rng_state(own[0])
        if cuda:
            torch.cuda.set_rng_state(own[1], device)


def _world(groups: list[FlatGroup]):
    """The model's world data group (shardwise's own: base/device.py), which carries rank 0's values."""
    return groups[0].pgs.world if groups else None


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for mod in model.modules():
        for n, b in list(mod._buffers.items()):
            if b is not None and b.device != device and not b.is_meta:
                mod._buffers[n] = b.to(device)


def _say(text: str) -> None:
    if dist.get_rank() == 0:
        warnings.warn(f"shardwise.shard(): {text}", UserWarning, stacklevel=4)


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
