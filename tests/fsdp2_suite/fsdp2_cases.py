"""What every scenario file of the FSDP2 suite builds on: the ``Case`` a scenario describes, its registration
(with the world sizes at which it runs only under ``-m slow``), units marked the same way for both engines,
and the models, batches and steps shared by several FSDP2 test files (after
``torch.testing._internal.common_fsdp``, our own code). How a case is run and asserted:
``test_fsdp2_suite.py``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import parity_utils
import shardwise
from models import GPT, tiny_gpt_config
from parity_utils import CollectiveCounter

WORLD_SIZES = (3, 2)
GB = 12  # global batch: divisible by both world sizes
RTOL = 1e-6


# ---- units: the same modules become units on both engines -------------------------------------------------
_MARK = "_fsdp2_suite_unit"


def unit(m: nn.Module) -> nn.Module:
    """Mark ``m`` as a unit: ``shardwise.shard(units=is_unit)`` and ``fully_shard(m)`` on FSDP2."""
    setattr(m, _MARK, True)
    return m


def is_unit(m: nn.Module) -> bool:
    return getattr(m, _MARK, False)


def fsdp2_shard(model: nn.Module, mesh, **kwargs) -> None:
    from torch.distributed.fsdp import fully_shard

    for m in reversed(list(model.modules())):  # children before parents, as FSDP2 requires
        if m is not model and is_unit(m):
            fully_shard(m, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


RESHARD = {"full_shard": True, "shard_grad_op": False}


# ---- models (after torch.testing._internal.common_fsdp, our own code) ----------------------------------
class MLP(nn.Module):
    def __init__(self, dim: int, mult: int = 4, bias: bool = True, with_buffer: bool = False):
        super().__init__()
        self.in_proj = nn.Linear(dim, mult * dim, bias=bias)
        self.out_proj = nn.Linear(mult * dim, dim, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn(dim))
        else:
            self.buffer = None

    def forward(self, x):
        z = F.relu(self.out_proj(F.relu(self.in_proj(x))))
        return z if self.buffer is None else z + self.buffer

    def reset_parameters(self):
        if self.buffer is not None:
            nn.init.normal_(self.buffer)


def mlp_stack(dim: int, n: int = 3, **kw) -> nn.Sequential:
    return nn.Sequential(*[unit(MLP(dim, **kw)) for _ in range(n)])


class DoubleLinear(nn.Module):
    def __init__(self, dim: int, use_second_linear: bool = True):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.use_second_linear = use_second_linear

    def forward(self, x):
        if self.use_second_linear:
            return F.relu(self.lin1(x)), F.relu(self.lin2(x))
        return F.relu(self.lin1(x))


class ChunkedHeadModel(nn.Module):
    """embed -> body -> norm -> head; the head can be skipped and called by itself per chunk."""

    def __init__(self, dim: int, vocab: int, tie: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens, skip_head: bool = False):
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


class Raiser(nn.Module):
    """Wraps a module; raises in forward (or, for ``where="backward"``, in backward) while armed."""

    def __init__(self, wrapped: nn.Module):
        super().__init__()
        self.wrapped = wrapped
        self.armed = None

    def forward(self, x):
        if self.armed == "forward":
            raise RuntimeError("boom in forward")
        y = self.wrapped(x)
        if self.armed == "backward" and y.requires_grad:
            def explode(_grad):
                raise RuntimeError("boom in backward")
            y.register_hook(explode)
        return y


class CkptGPT(GPT):
    """GPT whose forward runs every block through ``torch.utils.checkpoint`` (the "utils" AC flavour)."""

    reentrant = False

    def forward(self, idx, targets=None):
        from torch.utils.checkpoint import checkpoint

        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def gpt(tie: bool = False, cls=GPT, **cfg) -> nn.Module:
    torch.manual_seed(0)
    model = cls(tiny_gpt_config(tie_weights=tie, **cfg))
    for b in model.blocks:
        unit(b)
    return model


def gpt_step(ctx, model, batch):
    x, y = (ctx.take(t) for t in batch)
    out = model(x, y)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    bwd(ctx, model, loss)
    return loss


# ---- running one case three ways ----------------------------------------------------------------------
@dataclass
class Case:
    make: Callable[[], nn.Module]
    step: Callable  # step(ctx, model, batch) -> local loss; runs forward and backward
    batches: list
    ours: dict = field(default_factory=dict)  # shard() kwargs
    fsdp2: dict = field(default_factory=dict)  # fully_shard() kwargs
    fsdp2_wrap: Optional[Callable] = None  # (model, mesh) in place of fsdp2_shard(model, mesh, **fsdp2)
    pre_wrap: Optional[Callable] = None  # (ctx, model) -> None or a replacement model, before sharding
    prepare: Optional[Callable] = None  # (ctx, model) after sharding, every side
    finish: Optional[Callable] = None  # (ctx, model) -> extra metrics, after training
    optimizer: Any = "sgd"  # name, or (ctx, model) -> optimizer or None
    ref_local: bool = False  # the reference is the per-rank DDP emulation (mixed precision)
    # expectations, read by the tests
    rtol: float = RTOL
    parity: str = "reference"  # what ours is held to: "reference", or "fsdp2" (no exact reference exists)
    fsdp2_parity: bool = True  # False: FSDP2's numbers cannot be compared (e.g. its own random init)
    fsdp2_error: Optional[str] = None  # FSDP2 raises this by design (regex); ours must not
    ours_error: Optional[str] = None  # where FSDP2 fails too: ours may raise this instead of training (regex)
    check: Optional[Callable] = None  # (extra, side, ws) -> None, asserts on the recorded extras
    compare_extra: tuple = ()  # recorded lists of numbers that must match the reference's to rtol
    doc: str = ""


def bwd(ctx, model, loss, **kwargs) -> None:
    """Backward; on our side check the engine's invariants right after it."""
    loss.backward(**kwargs)
    if ctx.side == "shardwise":
        parity_utils.assert_engine_clean(model)


_CKPT_PREFIX = "_checkpoint_wrapped_module."


def full_params(side: str, model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Full parameters by name (rank 0 for ours). Names drop the checkpoint wrapper's prefix, as state
    dicts do (CheckpointWrapper strips it; FSDP2's tests ignore it the same way)."""
    names = [n.replace(_CKPT_PREFIX, "") for n in names]
    if side == "shardwise":
        sd = shardwise.full_state_dict(model)
        return {n: sd[n] for n in names if n in sd}
    out = {}
    for n, p in model.named_parameters():
        out[n.replace(_CKPT_PREFIX, "")] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
    return out


# ---- registration: one entry per scenario, with its speed class -------------------------------------------
class Registered(NamedTuple):
    build: Callable[[int], Case]  # world size -> Case
    world_sizes: tuple[int, ...]
    slow_at: tuple[int, ...]  # the world sizes at which it runs only under -m slow


CASES: dict[str, Registered] = {}


def add_case(name: str, build: Callable[[int], Case], world_sizes: tuple[int, ...] = WORLD_SIZES,
             slow_at: Optional[tuple[int, ...]] = None) -> None:
    """Register scenario ``name`` at ``world_sizes``. ``slow_at``: the world sizes at which it runs only under
    ``-m slow``; by default every one but the first, so the default run covers each scenario once, at world
    size 3 (no buffer divides evenly) where it runs there. A variant whose code path another default scenario
    already takes (mostly the shard_grad_op twin of a full_shard scenario) is slow at every world size."""
    slow_at = tuple(world_sizes[1:]) if slow_at is None else tuple(slow_at)
    assert name not in CASES, f"scenario {name!r} registered twice"
    assert set(slow_at) <= set(world_sizes), f"{name}: slow_at {slow_at} outside its world sizes {world_sizes}"
    CASES[name] = Registered(build, tuple(world_sizes), slow_at)


def case(*world_sizes: int, slow_at: Optional[tuple[int, ...]] = None):
    """Decorator form of ``add_case`` for ``case_<name>(ws) -> Case``."""

    def register(fn):
        add_case(fn.__name__.removeprefix("case_"), fn, world_sizes or WORLD_SIZES, slow_at)
        return fn

    return register


def is_slow(name: str, ws: int) -> bool:
    return ws in CASES[name].slow_at


# ---- batches, steps and checks shared by several scenario files ------------------------------------------
def randn_batches(steps: int, *shape: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(GB, *shape, generator=g) for _ in range(steps)]


def token_batches(steps: int, vocab: int, seq: int = 8, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (GB, seq), generator=g), torch.randint(0, vocab, (GB, seq), generator=g))
            for _ in range(steps)]


def mean_sq_step(ctx, model, x):
    loss = model(ctx.take(x)).pow(2).mean()
    bwd(ctx, model, loss)
    return loss


@contextlib.contextmanager
def grad_sync(ctx, model, sync: bool):
    """Gradient accumulation without communication: shardwise.no_sync / set_requires_gradient_sync."""
    if sync or ctx.side == "reference":
        yield
    elif ctx.side == "shardwise":
        with shardwise.no_sync(model):
            yield
    else:
        with parity_utils.gradient_sync_off(model):
            yield


@contextlib.contextmanager
def count_reduce_scatters(ctx):
    """Gradient reduce-scatters while active: ``.calls`` and ``.numel`` (elements sent, padding included).
    Ours are counted at shardwise.engine.base.collectives (parity_utils.CollectiveCounter), FSDP2's at
    dist.reduce_scatter_single, which its default ReduceScatter calls."""
    if ctx.side == "shardwise":
        with CollectiveCounter() as c:
            box = SimpleNamespace(calls=0, numel=0)
            yield box
        box.calls, box.numel = c.calls["reduce_scatter_into"], c.numel["reduce_scatter_into"]
        return
    box = SimpleNamespace(calls=0, numel=0)
    if ctx.side == "reference":
        yield box
        return
    orig = dist.reduce_scatter_single

    def counted(output, input, *a, **k):
        box.calls += 1
        box.numel += input.numel()
        return orig(output, input, *a, **k)

    dist.reduce_scatter_single = counted
    try:
        yield box
    finally:
        dist.reduce_scatter_single = orig


def unit_of(strategy: str) -> dict:
    return dict(ours=dict(strategy=strategy), fsdp2=dict(reshard_after_forward=RESHARD[strategy]))


STRATEGIES = ("full_shard", "shard_grad_op")


def assert_eq(got, want):
    assert got == want, f"got {got}, want {want}"


def cpu_offload_policy():
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=False)
