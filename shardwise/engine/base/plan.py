"""The sharding plan: which unit owns which parameter, and where each parameter lives in its flat buffer.

Pure bookkeeping: no process group, no allocation. It runs just as well on a model built on the meta device
with a made-up world size, which is how ``shardwise estimate-memory`` plans 70B models on a laptop.

Layout (one ``FlatGroupPlan`` per unit x dtype x requires_grad)::

    unsharded flat:  [ p0 .......... | p1 ...... | p2 ..... | pad ]     padded_numel = shard_numel * N
    rank r owns:     [ r * shard_numel, (r + 1) * shard_numel )

Parameters are laid out whole and back to back, so after an all-gather every parameter is a contiguous
view of the gathered buffer (no copy-out), and each rank's shard of a parameter is one contiguous 1-D piece
of it (possibly empty). Frozen parameters and other dtypes get their own groups so that no gradient memory
or traffic is ever spent on a frozen parameter, and no buffer mixes dtypes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable, Iterator, Optional, Union

import torch
import torch.nn as nn

from shardwise.errors import ShardwiseError

UnitsSpec = Union[str, Callable[[nn.Module], bool], nn.Module, Iterable[Union[type, nn.Module]]]

EMBEDDING, HEAD = "embedding", "head"  # UnitPlan.edge
AUTO, AUTO_WITH_HEAD = "auto", "auto+head"  # the units= strings (edge_unit_modules says what each adds)


@dataclass(eq=False)
class ParamRef:
    """One place a parameter is registered: ``module._parameters[name]``, reachable as ``fqn``."""

    module: nn.Module
    name: str
    fqn: str


@dataclass(eq=False)
class ParamSpec:
    """One unique parameter (tied parameters appear once, with several refs)."""

    refs: list[ParamRef]
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    offset: int = 0  # element offset in the unsharded flat buffer of its group

    @property
    def fqn(self) -> str:
        return self.refs[0].fqn

    @cached_property
    def numel(self) -> int:  # (read hundreds of times a step: a plan's shapes never change)
        return self.shape.numel()

    def local_range(self, shard_start: int, shard_end: int) -> tuple[int, int]:
        """Element range [lo, hi) of this parameter (flattened) that falls in a rank's shard (lo == hi: none)."""
        lo = min(max(shard_start - self.offset, 0), self.numel)
        hi = min(max(shard_end - self.offset, 0), self.numel)
        return lo, max(lo, hi)


@dataclass(eq=False)
class FlatGroupPlan:
    unit_fqn: str
    dtype: torch.dtype
    requires_grad: bool
    params: list[ParamSpec]
    shard_size: int

    # (Cached: read hundreds of times a step; a plan is made whole, and its parameters and shapes never change.)
    @cached_property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @cached_property
    def shard_numel(self) -> int:
        return -(-self.numel // self.shard_size)  # ceil: the last rank's shard ends in padding

    @cached_property
    def padded_numel(self) -> int:
        return self.shard_numel * self.shard_size

    def shard_range(self, shard_rank: int) -> tuple[int, int]:
        return shard_rank * self.shard_numel, (shard_rank + 1) * self.shard_numel

    @property
    def nbytes(self) -> int:
        return self.padded_numel * self.dtype.itemsize


@dataclass(eq=False)
class UnitPlan:
    fqn: str  # "" for the root unit
    module: nn.Module
    groups: list[FlatGroupPlan] = field(default_factory=list)
    # EMBEDDING / HEAD: the model's input embedding or output head, made a unit of its own by units="auto" /
    # "auto+head" (``edge_unit_modules``); None: a block, or the root.
    edge: Optional[str] = None

    @property
    def is_root(self) -> bool:
        return self.fqn == ""

    @property
    def checkpointed(self) -> bool:
        """Whether ``activation_checkpointing`` recomputes it: the blocks, as torchtitan checkpoints its
        layers; not the root, nor the embedding (a lookup) or the head (its matmul recomputed for nothing)."""
        return not self.is_root and self.edge is None

    @property
    def kept_after_forward(self) -> bool:
        """Whether it stays gathered from its forward into its backward under full_shard: the root, and the
        head, whose backward is the first to run (torchtitan: ``reshard_after_forward=False`` for the
        output; resharding would only gather it again at once)."""
        return self.is_root or self.edge == HEAD

    @property
    def label(self) -> str:
        return self.fqn or "<root>"

    def params(self) -> Iterator[ParamSpec]:
        for g in self.groups:
            yield from g.params


@dataclass(eq=False)
class ShardingPlan:
    units: list[UnitPlan]  # non-root units in module order, then the root unit last
    shard_size: int

    @property
    def root(self) -> UnitPlan:
        return self.units[-1]

    def groups(self) -> Iterator[FlatGroupPlan]:
        for u in self.units:
            yield from u.groups

    def params(self) -> Iterator[ParamSpec]:
        for u in self.units:
            yield from u.params()


def resolve_unit_modules(model: nn.Module, units: Optional[UnitsSpec]) -> list[tuple[str, nn.Module]]:
    """The (fqn, module) pairs that become units, in module order (none: the root is the one unit). The root
    is never among them."""
    return [(fqn, m) for fqn, m, _ in _unit_modules(model, units)]


def _unit_modules(model: nn.Module, units: Optional[UnitsSpec]) -> list[tuple[str, nn.Module, Optional[str]]]:
    """``resolve_unit_modules`` with each unit's ``UnitPlan.edge``."""
    if units is None:
        return []
    edges: dict[int, str] = {}
    if isinstance(units, str):
        if units not in (AUTO, AUTO_WITH_HEAD):
            raise ShardwiseError(f"units={units!r}: give a set of module classes, a callable, {AUTO!r} or "
                                 f"{AUTO_WITH_HEAD!r}")
        blocks = _auto_unit_predicate(model)
        edges = edge_unit_modules(model, blocks, with_head=units == AUTO_WITH_HEAD)
        predicate = lambda m: blocks(m) or id(m) in edges  # noqa: E731
    elif isinstance(units, nn.Module):  # (before callable: a module is one)
        predicate = _instance_predicate(model, [units])
    elif callable(units) and not isinstance(units, type):
        predicate = units
    else:
        given = list(units) if not isinstance(units, type) else [units]
        instances = [u for u in given if isinstance(u, nn.Module)]
        classes = {c for c in given if not isinstance(c, nn.Module)}
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise ShardwiseError(f"units contains {bad!r}, which are neither nn.Module classes nor modules of the "
                                 f"model")
        present = {type(m) for m in model.modules()}
        missing = sorted(c.__name__ for c in classes if c not in present)
        if missing:
            raise ShardwiseError(
                f"unit class(es) {', '.join(missing)} do not occur in {type(model).__name__}; "
                f"module classes present: {', '.join(sorted({c.__name__ for c in present}))}"
            )
        is_instance = _instance_predicate(model, instances)
        predicate = lambda m: type(m) in classes or is_instance(m)  # noqa: E731
    # (units="auto" on a model without repeated blocks, a CNN or an MLP, finds none: one unit, as units=None;
    # shard() says so.)
    return [(n, m, edges.get(id(m))) for n, m in model.named_modules() if m is not model and predicate(m)]


def _instance_predicate(model: nn.Module, instances: list) -> Callable[[nn.Module], bool]:
    """Modules given themselves (FSDP2's habit: ``fully_shard(layer)`` for each ``layer in model.layers``):
    each must be a submodule of ``model``; ``model`` itself is allowed and means nothing more (the root is
    always a unit)."""
    inside = {id(m) for m in model.modules()}
    outside = [type(m).__name__ for m in instances if id(m) not in inside]
    if outside:
        raise ShardwiseError(f"units contains {len(outside)} module(s) that are not part of this "
                             f"{type(model).__name__} (first a {outside[0]}); give its own submodules, or classes")
    ids = {id(m) for m in instances}
    return lambda m: id(m) in ids


def no_split_classes(model: nn.Module) -> set[type]:
    """The block classes a Hugging Face model names in ``_no_split_modules`` (empty for other models): the
    one reading of that attribute, for ``units="auto"`` and ``"auto+head"`` (the trainer's default)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return {type(m) for m in model.modules() if type(m).__name__ in names} if names else set()


def _auto_unit_predicate(model: nn.Module) -> Callable[[nn.Module], bool]:
    """Hugging Face models name their blocks in ``_no_split_modules``; otherwise take the children of the
    largest ``nn.ModuleList`` (by parameter count), which is where transformer blocks live."""
    classes = no_split_classes(model)
    if classes:
        return lambda m: type(m) in classes
    best, best_count = None, -1
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            count = sum(p.numel() for p in m.parameters())
            if count > best_count:
                best, best_count = m, count
    if best is None:
        return lambda m: False
    children = {id(c) for c in best}
    return lambda m: id(m) in children


def edge_unit_modules(model: nn.Module, in_block: Callable[[nn.Module], bool], with_head: bool) -> dict[int, str]:
    """id(module) -> EMBEDDING or HEAD: a Hugging Face model's input embedding (``get_input_embeddings``) as a
    unit of its own under units="auto", and its output head (``get_output_embeddings``) too under
    "auto+head", as torchtitan shards ``tok_embeddings`` and ``output`` apart from the layers. In the root they
    would stay gathered from the model's first entry to the head's backward; as units the embedding is
    resharded right after its lookup and the head gathered from its matmul (prefetched by the last block) to
    its backward. (torchtitan groups the final norm with the output; here a unit is one module, and the norm,
    a vector, stays in the root.)

    The head only when asked: fused losses read ``lm_head.weight`` inside the model's forward without calling
    the head (TRL's SFTTrainer by default, Liger's fused linear cross-entropy); in the root it is gathered
    there, as a unit of its own it would be a shard. ``shardwise train`` computes its loss from the logits, so
    its default is "auto+head".

    Only a module registered in one place, outside every block (``in_block``), whose parameters nothing else
    holds: tied embeddings (GPT-2's ``wte`` is its ``lm_head``) stay in the root, one unit used at both ends
    of the forward, as before."""
    getters = ((EMBEDDING, "get_input_embeddings"), (HEAD, "get_output_embeddings"))
    found = {}
    for kind, getter in getters if with_head else getters[:1]:
        get = getattr(model, getter, None)
        try:
            module = get() if callable(get) else None
        except (NotImplementedError, AttributeError):  # transformers' base class, for models without one
            module = None
        if isinstance(module, nn.Module) and module is not model:
            found[kind] = module
    if not found or (len(found) == 2 and found[EMBEDDING] is found[HEAD]):
        return {}
    places = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    names = {id(m): n for n, m in model.named_modules()}
    blocks = [f"{n}." for n, m in model.named_modules() if m is not model and in_block(m)]
    out = {}
    for kind, module in found.items():
        own = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
        alone = own and all(holders[k] == n for k, n in own.items())
        inside = any(names.get(id(module), "").startswith(b) for b in blocks)
        if alone and places[id(module)] == 1 and not inside and not in_block(module):
            out[id(module)] = kind
    return out


def build_plan(model: nn.Module, units: Optional[UnitsSpec], shard_size: int) -> ShardingPlan:
    """Assign every parameter to a unit and lay the units' flat buffers out for ``shard_size`` ranks.

    A parameter registered in several places (tied weights) belongs to the innermost unit that encloses all
    of its uses: that unit is gathered for as long as any user runs, so every use sees full weights.
    """
    if shard_size < 1:
        raise ShardwiseError(f"shard_size must be >= 1, got {shard_size}")
    unit_pairs = _unit_modules(model, units)
    unit_ids = {id(m): fqn for fqn, m, _ in unit_pairs}

    specs: dict[int, ParamSpec] = {}
    chains: dict[int, tuple[int, ...]] = {}  # param id -> common prefix of the unit chains of its uses
    visiting: set[int] = set()

    def visit(module: nn.Module, prefix: str, chain: tuple[int, ...]) -> None:
        if id(module) in visiting:
            raise ShardwiseError(f"module {prefix or '<root>'} contains itself")
        visiting.add(id(module))
        if id(module) in unit_ids and module is not model:
            chain = chain + (id(module),)
        for name, p in module._parameters.items():
            if p is None:
                continue
            ref = ParamRef(module, name, f"{prefix}{name}")
            if id(p) in specs:
                specs[id(p)].refs.append(ref)
                old = chains[id(p)]
                k = 0
                while k < min(len(old), len(chain)) and old[k] == chain[k]:
                    k += 1
                chains[id(p)] = old[:k]
            else:
                specs[id(p)] = ParamSpec([ref], p.shape, p.dtype, p.requires_grad)
                chains[id(p)] = chain
        for cname, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{cname}.", chain)
        visiting.discard(id(module))

    visit(model, "", ())

    by_unit: dict[int, list[ParamSpec]] = {id(m): [] for _, m, _ in unit_pairs}
    by_unit[id(model)] = []
    for pid, spec in specs.items():
        chain = chains[pid]
        by_unit[chain[-1] if chain else id(model)].append(spec)

    plans = [UnitPlan(fqn, m, edge=edge) for fqn, m, edge in unit_pairs] + [UnitPlan("", model)]
    for up in plans:
        keys: dict[tuple[torch.dtype, bool], list[ParamSpec]] = {}
        for spec in by_unit[id(up.module)]:
            keys.setdefault((spec.dtype, spec.requires_grad), []).append(spec)
        for (dtype, rg), params in keys.items():
            offset = 0
            for p in params:
                p.offset = offset
                offset += p.numel
            up.groups.append(FlatGroupPlan(up.fqn, dtype, rg, params, shard_size))
    return ShardingPlan(plans, shard_size)


def entry_modules(plan: ShardingPlan) -> list[tuple[nn.Module, int]]:
    """(module, unit index) for every module below a unit's own module that holds, itself or further down,
    a parameter the unit owns: calling such a module on its own must gather the unit first. The walk goes
    down each registration's name from the owning unit's module (tied weights: every place they appear)."""
    out, seen = [], set()
    for ui, unit in enumerate(plan.units):
        prefix = f"{unit.fqn}." if unit.fqn else ""
        for spec in unit.params():
            for ref in spec.refs:
                if not ref.fqn.startswith(prefix):
                    continue  # the unit's module is shared and reached by another path: covered by that one
                path = ref.fqn[len(prefix):].split(".")[:-1]  # module names below the unit, then the param
                module = unit.module
                for name in path:
                    module = module._modules[name]
                    if (id(module), ui) not in seen:
                        seen.add((id(module), ui))
                        out.append((module, ui))
    return out
