"""Users' idioms, as public training scripts and everyday loops write them (issue #27's table).

Each row is the user's code, written once, run twice on the same global batches from the same per-rank
model: around ``DistributedDataParallel(model)`` (DDP's semantics: rank 0's weights at construction,
gradients averaged) and around ``shardwise.shard(model)``. The sharded run must report what the DDP run
reports (losses, the whole weights after training, a file loaded back in one process, ...), or raise a
``ShardwiseError`` naming what is refused, on every rank.

The rows are patterns, not copies, of nanoGPT's ``train.py`` (seeds ``1337 + rank``, accumulation through
``require_backward_grad_sync``, ``raw_model = model.module``), pytorch/examples' ImageNet and MNIST DDP
scripts (no seed at all, SGD with momentum, a small CNN), transformers' no-trainer examples (accumulation
under ``no_sync``), and the loops people write around them (an unused layer, layer drop, legacy
``weight_norm``, sparse and renormalised embeddings, ``resize_token_embeddings`` after wrapping).

Default: world size 2 under ``full_shard``, ``shard_optim_grad`` and ``no_shard``; world size 3 under every
strategy is marked slow.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import tempfile
import warnings
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import shardwise
from harness import run_distributed
from models import GPT, Block, tiny_gpt_config
from parity_utils import gradient_sync_off, local_slice, rel_err, scalar_rel_err

VOCAB = tiny_gpt_config().vocab_size
STEPS = 3
GLOBAL_BATCH = 12
RTOL = 1e-5  # DDP and shardwise sum gradients in different orders
# The attention key bias: its gradient is zero in theory and summation-order noise in practice, which AdamW
# turns into full-size steps in both runs (test_parity.py's docstring; measured here up to 8e-5 at world size 3).
KEY_BIAS, KEY_BIAS_RTOL = "attn.c_attn.bias", 1e-3


# ---- the two sides ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Side:
    """What differs between the DDP run and the sharded run of a row: how the model is wrapped, and how the
    whole weights are read back (DDP's own wrapper, ``shardwise.full_state_dict``) to compare them."""

    name: str  # "ddp" or "shardwise"
    rank: int
    ws: int
    strategy: str
    tmp: str

    @property
    def sharded(self) -> bool:
        return self.name == "shardwise"

    def wrap(self, model: nn.Module, units=None, **ddp_kwargs) -> nn.Module:
        if self.sharded:
            return shardwise.shard(model, units=units, strategy=self.strategy)
        return DistributedDataParallel(model, **ddp_kwargs)

    def whole(self, model: nn.Module) -> dict:
        """The whole weights, on rank 0 ({} elsewhere): what the comparison reads, not what the row tests."""
        if self.sharded:
            return shardwise.full_state_dict(model)
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()} if self.rank == 0 else {}

    def batches(self, steps: int = STEPS, vocab: int = VOCAB, seq: int = 8):
        """This rank's slice of each global batch of token ids (the same global batches on every rank)."""
        g = torch.Generator().manual_seed(1234)
        for _ in range(steps):
            x = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g)
            y = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g)
            yield local_slice(x, self.rank, self.ws), local_slice(y, self.rank, self.ws)


def mean_over_ranks(value: torch.Tensor) -> float:
    t = value.detach().to(torch.float64).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@dataclasses.dataclass
class Row:
    build: Callable[[int], nn.Module]  # (rank) -> the model as the script builds it (its seeding included)
    run: Callable[[nn.Module, Side], dict]  # the user's code: wraps the model, trains, reports
    refused: Optional[str] = None  # the sharded run raises a ShardwiseError containing this, on every rank
    copyable: bool = True  # False: build twice from the same RNG state (a weight_norm module cannot be copied)
    # True: a collective on one rank only, after which the process group is unusable: the row runs in its own
    # processes, under the first strategy only (the refusal is the same agreement under every strategy)
    alone: bool = False
    sharded_only: bool = False  # True: ``refused`` only where parameters are pieces (not under no_shard)


# ---- models ----------------------------------------------------------------------------------------------
def gpt(rank: int) -> nn.Module:
    torch.manual_seed(0)
    return GPT(tiny_gpt_config())


def gpt_seeded_per_rank(rank: int) -> nn.Module:
    torch.manual_seed(1337 + rank)  # nanoGPT: the seed is meant for the data, and it seeds the model too
    return GPT(tiny_gpt_config())


def gpt_unseeded(rank: int) -> nn.Module:
    torch.seed()  # no seed in the script: whatever each process drew (a framework seeding from the OS)
    return GPT(tiny_gpt_config())


class SmallCNN(nn.Module):
    """pytorch/examples' MNIST net, smaller: no repeated blocks, so units='auto' is the whole model."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 6, 3)
        self.fc = nn.Linear(6 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)


def cnn(rank: int) -> nn.Module:
    torch.manual_seed(1)
    return SmallCNN()


class Tower(nn.Module):
    """A block with a layer it never calls and one it drops at some steps (on every rank)."""

    def __init__(self, d: int = 7):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.unused = nn.Linear(d, d)
        self.dropped = nn.Linear(d, d)

    def forward(self, x, drop: bool):
        x = x + torch.tanh(self.fc(x))
        return x if drop else x + self.dropped(x)


class TowerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 7)
        self.blocks = nn.ModuleList(Tower() for _ in range(2))
        self.head = nn.Linear(7, VOCAB)

    def forward(self, idx, targets, step: int):
        x = self.embed(idx)
        for i, b in enumerate(self.blocks):
            x = b(x, drop=(step + i) % 2 == 0)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


def tower(rank: int) -> nn.Module:
    torch.manual_seed(2)
    return TowerNet()


class NormedNet(nn.Module):
    """Legacy torch.nn.utils.weight_norm (its pre-forward hook computes the weight), a sparse embedding."""

    def __init__(self, sparse: bool = False, max_norm: Optional[float] = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 9, sparse=sparse, max_norm=max_norm)
        self.hidden = torch.nn.utils.weight_norm(nn.Linear(9, 11))
        self.head = nn.Linear(11, VOCAB)

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.hidden(self.embed(idx))))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def normed(**kwargs) -> Callable[[int], nn.Module]:
    def build(rank: int) -> nn.Module:
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # legacy weight_norm is deprecated
            return NormedNet(**kwargs)

    return build


def hf_gpt2(rank: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(4)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=2, n_head=2))


# ---- the users' code -------------------------------------------------------------------------------------
def train_adamw(model: nn.Module, side: Side, units=None, lr: float = 1e-2, **ddp_kwargs) -> dict:
    """The plain loop: wrap, AdamW with weight decay, forward, backward, step, zero_grad."""
    model = side.wrap(model, units=units, **ddp_kwargs)
    return train_loop(model, side, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1))


def train_loop(model: nn.Module, side: Side, opt: torch.optim.Optimizer, clip: bool = False) -> dict:
    """Forward, backward (``clip``: clip_grad_norm_ to 1), step, zero_grad over the row's batches; the
    losses and the whole weights."""
    losses = []
    for x, y in side.batches():
        _, loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))
    return dict(losses=losses, weights=side.whole(model))


def gpt_loop(model, side):
    return train_adamw(model, side, units={Block})


def tower_loop(model, side):
    model = side.wrap(model, units={Tower}, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, no_grad = [], []
    for step, (x, y) in enumerate(side.batches()):
        loss = model(x, y, step)
        loss.backward()
        no_grad.append(sorted(n.removeprefix("module.") for n, p in model.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    return dict(losses=losses, no_grad=no_grad, weights=side.whole(model))


def accumulation(model, side, sync_switch, clip):
    """Two micro-batches per step, each under ``sync_switch(model, last)``, then ``clip`` and the step."""
    model = side.wrap(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro, losses = 2, []
    for x, y in side.batches():
        n = x.shape[0] // micro
        for m in range(micro):
            with sync_switch(model, m == micro - 1):
                _, loss = model(x[m * n:(m + 1) * n], y[m * n:(m + 1) * n])
                (loss / micro).backward()
        clip(model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))
    return dict(losses=losses, weights=side.whole(model))


@contextlib.contextmanager
def nanogpt_switch(model, last: bool):
    model.require_backward_grad_sync = last
    yield


def nanogpt_accumulation(model, side):
    """nanoGPT: ``model.require_backward_grad_sync = (micro_step == last)`` before each micro-batch's
    forward, then gradient clipping. (SGD with momentum: AdamW would amplify the rounding noise of gradients
    that are zero in exact arithmetic, the attention keys' bias, which two summation orders round apart.)"""
    return accumulation(model, side, nanogpt_switch, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0))


def no_sync_accumulation(model, side):
    """DDP's documented accumulation (as Accelerate's accumulate() does it): ``with model.no_sync():``
    around all micro-batches but the last."""
    model = side.wrap(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro, losses = 3, []
    for x, y in side.batches(seq=6):
        n = x.shape[0] // micro if x.shape[0] % micro == 0 else 1
        chunks = [(x[i:i + n], y[i:i + n]) for i in range(0, x.shape[0], n)]
        for i, (xm, ym) in enumerate(chunks):
            if i < len(chunks) - 1:
                with model.no_sync():
                    (model(xm, ym).loss / len(chunks)).backward()
            else:
                (model(xm, ym).loss / len(chunks)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            losses.append(mean_over_ranks(model(x, y).loss))
    return dict(losses=losses, weights=side.whole(model))


def raw_model_module(model, side):
    """nanoGPT: ``raw_model = model.module if ddp else model``, then ``raw_model.state_dict()``."""
    model = side.wrap(model, units={Block})
    raw_model = model.module
    return dict(keys=sorted(raw_model.state_dict().keys()))


def unwrap_helper(model, side):
    """The recursive unwrap many scripts carry (``while hasattr(m, "module")``), then training through the
    unwrapped model's own methods."""
    model = side.wrap(model, units={Block})
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    return dict(is_gpt=isinstance(inner, GPT), config=inner.config.n_embd)


def cnn_sgd(model, side):
    """pytorch/examples ImageNet/MNIST: SGD with momentum and weight decay, NLL loss, units='auto' on a
    model without repeated blocks (one unit, as DDP holds it)."""
    if side.sharded:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = shardwise.shard(model, units="auto", strategy=side.strategy)
    else:
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        x = local_slice(torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=g), side.rank, side.ws)
        y = local_slice(torch.randint(0, 10, (GLOBAL_BATCH,), generator=g), side.rank, side.ws)
        loss = F.nll_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(mean_over_ranks(loss))
    return dict(losses=losses, weights=side.whole(model))


def normed_loop(optimizer: str):
    def run(model, side):
        model = side.wrap(model, units={nn.Linear})
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for x, y in side.batches():
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
        return dict(losses=losses, weights=side.whole(model))

    return run


def resize_after_wrapping(model, side):
    """A tokenizer gained tokens after the model was wrapped: ``resize_token_embeddings`` on the inner model."""
    model = side.wrap(model, units=None)
    inner = model.module if not side.sharded else model
    inner.resize_token_embeddings(VOCAB + 3)
    return dict(rows=inner.get_input_embeddings().num_embeddings)


def counts_and_shapes(model, side):
    """nanoGPT's get_num_params and the shape printouts people write after wrapping."""
    model = side.wrap(model, units={Block})
    params = list(model.parameters())
    return dict(numel=sum(p.numel() for p in params), shapes=[tuple(p.shape) for p in params],
                dims=[p.dim() for p in params], ndims=[p.ndim for p in params], lens=[len(p) for p in params],
                sizes=[tuple(p.size()) for p in params])


def decay_groups(select_decay: Callable[[str, torch.Tensor], bool]):
    """Weight-decay groups chosen from each parameter's shape, then AdamW."""

    def run(model, side):
        model = side.wrap(model, units={Block})
        named = {n.removeprefix("module."): p for n, p in model.named_parameters() if p.requires_grad}
        decay = [p for n, p in named.items() if select_decay(n, p)]
        no_decay = [p for n, p in named.items() if not select_decay(n, p)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-2)
        losses = []
        for x, y in side.batches():
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
        return dict(groups=[len(decay), len(no_decay)], decayed=sum(p.numel() for p in decay), losses=losses,
                    weights=side.whole(model))

    return run


def optimizer_built_before_wrapping(model, side):
    """nanoGPT's order: ``configure_optimizers`` (decay groups by ``p.dim() >= 2``, from the whole parameters)
    first, then the wrapper, then AdamW steps, with clipping on the wrapped model's parameters."""
    opt = torch.optim.AdamW(nanogpt_groups(model.parameters()), lr=1e-2)
    return train_loop(side.wrap(model, units={Block}), side, opt, clip=True)


def clipping_the_optimizer_groups(model, side):
    """An optimizer built before the wrapper, whose own parameter lists are read from the first step on:
    their element count logged, their gradients clipped (mmengine's ``OptimWrapper`` and fairseq clip what
    the optimizer holds). Before the first ``step()`` these are the model's parameters, as under DDP."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = side.wrap(model, units={Block})
    held = lambda: [p for g in opt.param_groups for p in g["params"]]  # noqa: E731
    counts, norms, losses = [sum(p.numel() for p in held())], [], []
    for x, y in side.batches():
        _, loss = model(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(held(), 0.5)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))
    return dict(losses=losses, counts=counts, norms=norms, weights=side.whole(model))


def nanogpt_groups(params) -> list[dict]:
    """nanoGPT's ``configure_optimizers``: weight decay for the matrices (``p.dim() >= 2``) only."""
    params = [p for p in params if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def optimizer_state_loaded_before_wrapping(model, side):
    """nanoGPT's resume: ``configure_optimizers``, then ``optimizer.load_state_dict(checkpoint["optimizer"])``
    (whole tensors, saved by a one-process run), then the wrapper, then training."""
    earlier = copy.deepcopy(model)  # the run that wrote the checkpoint: one step on a batch of its own
    first = torch.optim.AdamW(nanogpt_groups(earlier.parameters()), lr=1e-2)
    x = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(7))
    earlier(x, x)[1].backward()
    first.step()
    opt = torch.optim.AdamW(nanogpt_groups(model.parameters()), lr=1e-2)
    opt.load_state_dict(first.state_dict())
    return train_loop(side.wrap(model, units={Block}), side, opt)


def _file_loaded(path: str) -> dict:
    """A saved state dict, loaded in one process, under the model's own names (DDP's carry ``module.``)."""
    sd = torch.load(path, map_location="cpu", weights_only=True)
    sd = sd.get("model", sd)
    return {k.removeprefix("module."): v for k, v in sd.items()}


def save_state_dict(where: str):
    """``torch.save(model.state_dict(), path)`` after training: on rank 0 only (pytorch/examples' ImageNet
    saves on the first rank of each node), or on every rank into one path (a per-epoch save nobody guarded),
    or a nanoGPT-style checkpoint dict on every rank."""

    def run(model, side):
        model = side.wrap(model, units={Block})
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in side.batches(steps=2):
            model(x, y).loss.backward()
            opt.step()
            opt.zero_grad()
        path = f"{side.tmp}/{side.name}-{side.strategy}-{where}.pt"
        if where == "rank 0":
            if side.rank == 0:
                torch.save(model.state_dict(), path)
        elif where == "every rank":
            torch.save(model.state_dict(), path)
        else:  # a checkpoint dict
            torch.save({"model": model.state_dict(), "iter_num": 2, "config": {"n_embd": 25}}, path)
        x, y = next(side.batches(steps=1))
        model(x, y).loss.backward()  # the run goes on (a collective every rank reaches)
        dist.barrier()
        return dict(loaded=_file_loaded(path) if side.rank == 0 else {})

    return run


def safetensors_save(model, side):
    from safetensors.torch import save_file

    model = side.wrap(model, units={Block})
    path = f"{side.tmp}/{side.name}-{side.strategy}.safetensors"
    sd = {k.removeprefix("module."): v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, path)
    dist.barrier()
    from safetensors.torch import load_file
    return dict(loaded=load_file(path) if side.rank == 0 else {})


def save_pretrained(everywhere: bool, extra: Callable[[nn.Module], dict] = lambda inner: {}):
    """transformers' no-trainer examples: ``unwrapped.save_pretrained(dir, is_main_process=...)`` on every
    rank (with ``extra(unwrapped)``'s keywords); or guarded by ``if rank == 0`` around the whole call."""

    def run(model, side):
        from transformers import GPT2LMHeadModel

        model = side.wrap(model, units=None)
        inner = model.module if not side.sharded else model
        out = f"{side.tmp}/{side.name}-{side.strategy}-{everywhere}-{'-'.join(sorted(extra(inner)))}"
        if everywhere:
            inner.save_pretrained(out, is_main_process=side.rank == 0, **extra(inner))
        elif side.rank == 0:
            inner.save_pretrained(out)
        x, y = next(side.batches(steps=1, seq=6))
        inner(x, labels=y).loss.backward()
        dist.barrier()
        if side.rank != 0:
            return dict(loaded={})
        return dict(loaded=GPT2LMHeadModel.from_pretrained(out).state_dict())

    return run


def penalty(term: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """A regulariser written from the parameters themselves (towards the initial weights)."""

    def run(model, side):
        model = side.wrap(model, units={Block})
        start = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, y in side.batches():
            _, loss = model(x, y)
            reg = sum(term(p, p0) for p, p0 in zip(model.parameters(), start))
            (loss + 1e-2 * reg).backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
            losses.append(float(reg))
        return dict(losses=losses, weights=side.whole(model))

    return run


def hand_accumulation(model, side):
    """Accumulation by hand: ``acc += p.grad`` after every micro-batch, ``p.grad = acc / k`` at the end,
    torch's clip_grad_norm_ and a step."""
    model = side.wrap(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    losses, norms, k = [], [], 2
    for x, y in side.batches():
        acc = [torch.zeros_like(p) for p in params]
        n = x.shape[0] // k
        for m in range(k):
            model(x[m * n:(m + 1) * n], y[m * n:(m + 1) * n]).loss.backward()
            for a, p in zip(acc, params):
                a += p.grad
                p.grad = None
        for a, p in zip(acc, params):
            p.grad = a / k
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.5)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            losses.append(mean_over_ranks(model(x, y).loss))
    return dict(losses=losses, norms=norms, weights=side.whole(model))


class ReadsBlockWeight(nn.Module):
    """A root forward that uses a unit's weight directly (a head tied by hand to the first block's layer)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 7)
        self.blocks = nn.ModuleList(nn.Linear(7, 7) for _ in range(2))

    def forward(self, idx, targets):
        x = self.embed(idx)
        for b in self.blocks:
            x = torch.tanh(b(x))
        logits = x @ self.embed.weight.T + self.blocks[0].weight.sum()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reads_block_weight(rank: int) -> nn.Module:
    torch.manual_seed(5)
    return ReadsBlockWeight()


def root_reads_unit_weight(model, side):
    model = side.wrap(model, units={nn.Linear})
    losses = []
    for x, y in side.batches(steps=1):
        loss = model(x, y)
        loss.backward()
        losses.append(mean_over_ranks(loss))
    return dict(losses=losses)


def averaged_model(model, side):
    """``AveragedModel(model)`` built before wrapping (an EMA of the weights), updated after every step."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    model = side.wrap(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in side.batches():
        model(x, y).loss.backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
    return dict(ema={k: v.detach().clone() for k, v in ema.module.state_dict().items()} if side.rank == 0 else {})



# ---- users arriving from FSDP2 / FSDP1 and torchtitan / torchtune-style loops ----------------------------
# Scripts written for FSDP, with DDP's own calls where the model is a DistributedDataParallel (the DDP side).
@contextlib.contextmanager
def fsdp2_switch(model, last: bool):
    """FSDP2's switch off around a micro-batch whose gradients are only accumulated (DDP's ``no_sync``)."""
    if last:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        with gradient_sync_off(model):
            yield


def fsdp2_accumulation(model, side):
    """Accumulation over micro-batches through FSDP2's ``set_requires_gradient_sync``, ``loss / accum``, then
    torch's ``clip_grad_norm_(..., foreach=True)``."""
    return accumulation(model, side, fsdp2_switch, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True))


def fsdp1_clip_method(model, side):
    """FSDP1's ``model.clip_grad_norm_(max_norm)`` (as Accelerate calls it under FSDP1; torch's for DDP): the
    global norm, returned and applied."""
    model = side.wrap(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for x, y in side.batches():
        _, loss = model(x, y)
        loss.backward()
        if isinstance(model, DistributedDataParallel):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            norm = model.clip_grad_norm_(0.5)
        norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    return dict(losses=losses, norms=norms, weights=side.whole(model))


# ---- peft adapters after wrapping (moe29: model families and peft variants) -----------------------------------
def _lora(targets=("c_attn",)):
    from peft import LoraConfig

    return LoraConfig(r=2, lora_alpha=4, target_modules=list(targets), lora_dropout=0.0, init_lora_weights=False)


def peft_gpt2(rank: int) -> nn.Module:
    from peft import get_peft_model

    return get_peft_model(hf_gpt2(rank), _lora(), adapter_name="sft")


def adapter_added_after_wrapping(how: str):
    """Adapter parameters created inside the wrapped model, then trained: a second adapter (a DPO or multi-task
    script's second stage: ``PeftModel.add_adapter`` + ``set_adapter``), or ``get_peft_model`` called on the
    wrapped model. They belong to no flat group (DDP does not sync them either, but trains on)."""

    def run(model, side):
        from peft import get_peft_model

        model = side.wrap(model, units=None)
        inner = model.module if not side.sharded else model
        torch.manual_seed(5)  # the same new adapter on every rank
        if how == "add_adapter":
            inner.add_adapter("dpo", _lora(("c_proj",)))
            inner.set_adapter("dpo")
        else:
            model = get_peft_model(inner, _lora(("c_proj",)))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for x, y in side.batches():
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(mean_over_ranks(loss))
        return dict(losses=losses)

    return run

ROWS: dict[str, Row] = {
    # seeds (nanoGPT seeds 1337 + rank before building the model; ImageNet's script seeds only if asked)
    "seed 1337 + rank": Row(gpt_seeded_per_rank, gpt_loop),
    "no seed": Row(gpt_unseeded, gpt_loop),
    # parameters without a gradient, AdamW
    "unused layer and layer drop, AdamW": Row(tower, tower_loop),
    # DDP's idioms
    "require_backward_grad_sync accumulation": Row(gpt, nanogpt_accumulation),
    "model.no_sync() accumulation": Row(gpt, no_sync_accumulation),
    "raw_model = model.module": Row(gpt, raw_model_module, refused="no wrapper and no .module"),
    "while hasattr(model, 'module') unwrap": Row(gpt, unwrap_helper),
    "units='auto' on a CNN, SGD with momentum": Row(cnn, cnn_sgd),
    # what crashed
    "legacy weight_norm, SGD": Row(normed(), normed_loop("sgd"), copyable=False),
    "legacy weight_norm, AdamW": Row(normed(), normed_loop("adamw"), copyable=False),
    "nn.Embedding(sparse=True), SGD": Row(normed(sparse=True), normed_loop("sgd"), copyable=False),
    "nn.Embedding(max_norm=1.0)": Row(normed(max_norm=1.0), normed_loop("sgd"), copyable=False,
                                      refused="renormalises the rows it looks up in place"),
    "resize_token_embeddings after wrapping": Row(hf_gpt2, resize_after_wrapping,
                                                  refused="resize_token_embeddings() after shardwise.shard()"),
    # (the weight outside its unit's forward is the whole parameter: its sum is a reduction, exact)
    "root forward reads a unit's weight": Row(reads_block_weight, root_reads_unit_weight),
    "AveragedModel built before wrapping": Row(gpt, averaged_model),
    # what a parameter is: shapes and counts, decay groups by shape
    "parameter count and shapes": Row(gpt, counts_and_shapes),
    "decay groups by p.dim() >= 2 (nanoGPT)": Row(gpt, decay_groups(lambda n, p: p.dim() >= 2)),
    "optimizer built before wrapping (nanoGPT's order)": Row(gpt, optimizer_built_before_wrapping),
    "optimizer built before wrapping, its own parameters clipped": Row(gpt, clipping_the_optimizer_groups),
    "optimizer state loaded before wrapping (nanoGPT's resume)": Row(gpt, optimizer_state_loaded_before_wrapping),
    "no decay for p.ndim <= 1 or biases (timm)": Row(gpt, decay_groups(lambda n, p: not (p.ndim <= 1 or n.endswith(".bias")))),
    # saves, loaded back in one process
    "torch.save(model.state_dict()) on rank 0": Row(gpt, save_state_dict("rank 0"), alone=True,
                                                    refused="ranks [0] are at torch.save of a sharded model's state_dict()"),
    "torch.save(model.state_dict()) on every rank": Row(gpt, save_state_dict("every rank")),
    "checkpoint dict on every rank": Row(gpt, save_state_dict("checkpoint dict")),
    # (under no_shard parameters are whole: the file is the whole model, as DDP's)
    "safetensors save_file(model.state_dict())": Row(gpt, safetensors_save, sharded_only=True,
                                                     refused="on a piece of a sharded parameter or gradient"),
    "save_pretrained on every rank": Row(hf_gpt2, save_pretrained(True)),
    "save_pretrained on rank 0 only": Row(hf_gpt2, save_pretrained(False), alone=True,
                                          refused="ranks [0] are at save_whole_model"),
    # trainers and loops of others (Accelerate): run_clm_no_trainer passes save_function=accelerator.save, which
    # transformers 5 ignores; Accelerate's FSDP guide passes state_dict=accelerator.get_state_dict(model), the
    # model's own state dict (a copy of it is another state dict, which the streamed writer does not write)
    "save_pretrained(save_function=accelerator.save)": Row(hf_gpt2, save_pretrained(
        True, lambda inner: {"save_function": lambda obj, f: torch.save(obj, f)})),
    "save_pretrained(state_dict=the model's own)": Row(hf_gpt2, save_pretrained(
        True, lambda inner: {"state_dict": inner.state_dict()})),
    "save_pretrained(state_dict=a copy)": Row(hf_gpt2, save_pretrained(
        True, lambda inner: {"state_dict": {k: v.clone() for k, v in inner.state_dict().items()}}),
        refused="this state dict is not the model's own"),
    # penalties written from the parameters
    "F.mse_loss penalty": Row(gpt, penalty(lambda p, p0: F.mse_loss(p, p0))),
    "F.l1_loss penalty": Row(gpt, penalty(lambda p, p0: F.l1_loss(p, p0))),
    "F.smooth_l1_loss penalty": Row(gpt, penalty(lambda p, p0: F.smooth_l1_loss(p, p0))),
    # (shifted off zero: the cosine of an all-zero bias divides by its clamped norm, a 1e8 gradient that makes
    # any two reduction orders differ; and -cos, not 1 - cos, whose logged value cancels in fp32)
    "cosine_similarity penalty": Row(gpt, penalty(lambda p, p0: -F.cosine_similarity(p.flatten() + 1, p0.flatten() + 2, dim=0))),
    "torch.dist penalty": Row(gpt, penalty(lambda p, p0: torch.dist(p, p0 + 1))),
    "sigmoid().mean() penalty": Row(gpt, penalty(lambda p, p0: p.sigmoid().mean())),
    "norm penalty with all-zero parameters": Row(gpt, penalty(lambda p, p0: p.norm())),
    "linalg.vector_norm penalty": Row(gpt, penalty(lambda p, p0: torch.linalg.vector_norm(p))),
    "hand-written accumulation and torch's clip_grad_norm_": Row(gpt, hand_accumulation),
    # users arriving from FSDP2 / FSDP1 (torchtitan / torchtune-style loops)
    "FSDP2 set_requires_gradient_sync accumulation": Row(gpt, fsdp2_accumulation),
    "FSDP1 model.clip_grad_norm_": Row(gpt, fsdp1_clip_method),
    # peft adapters after wrapping (moe29: model families and peft variants)
    "peft add_adapter after wrapping": Row(peft_gpt2, adapter_added_after_wrapping("add_adapter"),
                                           refused="PeftModel.add_adapter() after shardwise.shard()"),
    "get_peft_model after wrapping": Row(hf_gpt2, adapter_added_after_wrapping("get_peft_model"),
                                         refused="after shardwise.shard() holds parameters no flat group holds"),
}


# ---- running the table -----------------------------------------------------------------------------------
def _models(row: Row, rank: int) -> tuple[nn.Module, nn.Module]:
    """The model each side starts from: one build, copied (or two builds from the same RNG state)."""
    if row.copyable:
        model = row.build(rank)
        return copy.deepcopy(model), model
    state = torch.get_rng_state()
    first = row.build(rank)
    torch.set_rng_state(state)
    return first, row.build(rank)


def _outcome(run, model, side) -> dict:
    try:
        return dict(result=run(model, side))
    except shardwise.ShardwiseError as e:
        return dict(shardwise_error=str(e))
    except Exception as e:  # noqa: BLE001 - a row's other failures are reported by the test that reads it
        return dict(other_error=f"{type(e).__name__}: {e}")


def _worker(rank, ws, names, strategies):
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = ROWS[name]
            ddp_model, sharded_model = _models(row, rank)
            out[name] = {"ddp": _outcome(row.run, ddp_model, Side("ddp", rank, ws, "", tmp))}
            for strategy in strategies:
                model = copy.deepcopy(sharded_model) if row.copyable else _models(row, rank)[1]
                out[name][strategy] = _outcome(row.run, model, Side("shardwise", rank, ws, strategy, tmp))
    return out


def _compare(ddp, sharded, where: str) -> list[str]:
    """What differs between the two reports (tensors and floats within RTOL, anything else equal)."""
    if isinstance(ddp, dict):
        if set(ddp) != set(sharded):
            return [f"{where}: keys differ: {sorted(set(ddp) ^ set(sharded))}"]
        return [d for k in ddp for d in _compare(ddp[k], sharded[k], f"{where}.{k}")]
    if isinstance(ddp, (list, tuple)) and ddp and isinstance(ddp[0], (float, torch.Tensor)):
        return [d for i, (a, b) in enumerate(zip(ddp, sharded)) for d in _compare(a, b, f"{where}[{i}]")]
    if isinstance(ddp, torch.Tensor):
        if ddp.shape != sharded.shape:
            return [f"{where}: shape {tuple(sharded.shape)}, DDP {tuple(ddp.shape)}"]
        err = rel_err(sharded, ddp)
        return [f"{where}: off by {err:.2e}"] if err > (KEY_BIAS_RTOL if where.endswith(KEY_BIAS) else RTOL) else []
    if isinstance(ddp, float):
        err = scalar_rel_err(sharded, ddp)
        return [f"{where}: {sharded} vs DDP {ddp}"] if err > RTOL or math.isnan(sharded) else []
    return [] if ddp == sharded else [f"{where}: {sharded!r} vs DDP {ddp!r}"]


def check_rows(report: list, names, strategies) -> None:
    problems = []
    for name in names:
        row = ROWS[name]
        for rank, per_rank in enumerate(report):
            ddp = per_rank[name]["ddp"]
            assert "result" in ddp, f"{name!r}: the DDP side itself failed on rank {rank}: {ddp}"
            for strategy in strategies:
                got = per_rank[name][strategy]
                where = f"{name!r} {strategy} rank {rank}"
                refused = None if row.sharded_only and strategy == "no_shard" else row.refused
                if refused is not None:
                    if refused not in got.get("shardwise_error", ""):
                        problems.append(f"{where}: expected a ShardwiseError containing {refused!r}, got {got}")
                elif "result" not in got:
                    problems.append(f"{where}: raised {got}")
                else:
                    problems += _compare(ddp["result"], got["result"], where)
    assert not problems, "\n".join(problems)


DEFAULT_STRATEGIES = ("full_shard", "shard_optim_grad", "no_shard")
ALL_STRATEGIES = ("full_shard", "shard_grad_op", "shard_optim_grad", "shard_optim", "no_shard")
_REPORTS: dict = {}


def report(ws: int, strategies: tuple) -> list:
    key = (ws, strategies)
    if key not in _REPORTS:
        shared = [name for name, row in ROWS.items() if not row.alone]
        _REPORTS[key] = run_distributed(_worker, ws, shared, strategies, timeout_s=120)
    return _REPORTS[key]


def check(name: str, ws: int, strategies: tuple) -> None:
    if ROWS[name].alone:
        strategies = strategies[:1]
        check_rows(run_distributed(_worker, ws, [name], strategies, timeout_s=120), [name], strategies)
    else:
        check_rows(report(ws, strategies), [name], strategies)


@pytest.mark.parametrize("name", list(ROWS))
def test_idiom_at_world_size_2(name):
    check(name, 2, DEFAULT_STRATEGIES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ROWS))
def test_idiom_at_world_size_3_every_strategy(name):
    check(name, 3, ALL_STRATEGIES)
