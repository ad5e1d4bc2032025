"""Scenarios ported from FSDP2's ``test_fully_shard_init.py`` (pytorch/pytorch,
``test/distributed/_composable/fsdp/``): meta-device and rank-0-broadcast initialisation, param_init_fn, a scalar
and a non-contiguous parameter, a parameter replaced after sharding. Registered in ``fsdp2_cases.CASES``; run and
asserted by ``test_fsdp2_suite.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from fsdp2_cases import (Case, MLP, WORLD_SIZES, add_case, assert_eq, case, gpt, gpt_step, mean_sq_step, mlp_stack,
                         randn_batches, token_batches, unit)
from fully_shard_state_dict import fsdp2_load_full_sd
from models import GPT, tiny_gpt_config


class Rope(nn.Module):
    """Parameter-less, with a non-persistent buffer (like RoPE's inv_freq) that reset_parameters fills."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self.compute(dim), persistent=False)

    @staticmethod
    def compute(dim: int) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def reset_parameters(self):
        with torch.no_grad():
            self.inv_freq.copy_(self.compute(self.dim))

    def forward(self, x):
        return x * (1 + self.inv_freq.mean())


def _meta_net(dim: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(unit(MLP(dim, mult=1, bias=False, with_buffer=True)), unit(MLP(dim, mult=1, bias=False)),
                             Rope(dim))


def _meta_init(dim: int):
    def build(ws):
        def pre_wrap(ctx, model):
            if ctx.side == "reference":  # the reference starts from the values our engine materialised
                model.to_empty(device="cpu")
                model.load_state_dict(ctx.shared["init_sd"])
                model[2].reset_parameters()

        def prepare(ctx, model):
            if ctx.side == "fsdp2":  # FSDP2's flow: to_empty, then every module's reset_parameters
                model.to_empty(device="cpu")
                for m in model.modules():
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
            if ctx.side == "shardwise":
                ctx.shared["init_sd"] = shardwise.full_state_dict(model)
            if ctx.side != "reference":
                bufs = [b.detach().clone() for b in model.buffers()]
                same = True
                for b in bufs:
                    everyone = [torch.empty_like(b) for _ in range(ctx.ws)]
                    dist.all_gather(everyone, b)
                    same = same and all(torch.equal(e, b) for e in everyone)
                ctx.rec["buffers_same_on_all_ranks"] = same
                ctx.rec["rope_inv_freq_ok"] = torch.equal(model[2].inv_freq, Rope.compute(dim))
                ctx.rec["not_on_meta"] = not any(t.is_meta for t in list(model.parameters()) + bufs)

        def check(extra, side, ws):
            assert_eq({k: extra.get(k) for k in ("buffers_same_on_all_ranks", "rope_inv_freq_ok", "not_on_meta")},
                       dict(buffers_same_on_all_ranks=True, rope_inv_freq_ok=True, not_on_meta=True))

        return Case(lambda: _meta_net(dim), mean_sq_step, randn_batches(3, dim), pre_wrap=pre_wrap, prepare=prepare,
                    fsdp2_parity=False, check=check,
                    doc=f"test_meta_device_1d_init: MLP units (dim {dim}, one with a buffer) and a parameter-less "
                        "RoPE-style module on the meta device; materialised, buffers identical on every rank, then "
                        "trained (the reference starts from our materialised values; FSDP2 draws its own)")

    return build


for _dim in (8, 3, 1):
    add_case(f"meta_init_dim{_dim}", _meta_init(_dim), slow_at=None if _dim == 1 else WORLD_SIZES)


@case()
def case_rank0_broadcast_meta_init(ws):
    def meta_gpt():
        with torch.device("meta"):
            m = GPT(tiny_gpt_config())
        for b in m.blocks:
            unit(b)
        return m

    def pre_wrap(ctx, model):
        if ctx.side == "fsdp2" or (ctx.side == "shardwise" and ctx.rank != 0):
            return meta_gpt()  # only rank 0 holds real weights (ours); FSDP2 starts on meta everywhere

    def prepare(ctx, model):
        if ctx.side == "fsdp2":
            model.to_empty(device="cpu")
            fsdp2_load_full_sd(model, ctx.initial.state_dict() if ctx.rank == 0 else {})

    return Case(gpt, gpt_step, token_batches(3, 62), pre_wrap=pre_wrap, prepare=prepare,
                ours=dict(sync_module_states=True),
                doc="test_rank0_broadcast_meta_device_init: rank 0 has the weights, the others a meta model; "
                    "ours: sync_module_states=True, FSDP2: to_empty + broadcast_from_rank0")


def det_init(m: nn.Module) -> None:
    """A deterministic, rank-independent init of a module's own parameters (DTensors included)."""
    for n, p in m.named_parameters(recurse=False):
        v = (torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.37 + len(n)) * 0.3).view(p.shape)
        with torch.no_grad():
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                v = distribute_tensor(v, p.device_mesh, p.placements)
            p.copy_(v)


@case()
def case_param_init_fn(ws):
    def make():
        with torch.device("meta"):
            return mlp_stack(6)

    def pre_wrap(ctx, model):
        if ctx.side == "reference":
            model.to_empty(device="cpu")
            model.apply(det_init)

    def prepare(ctx, model):
        if ctx.side == "fsdp2":
            model.to_empty(device="cpu")
            model.apply(det_init)

    return Case(make, mean_sq_step, randn_batches(3, 6), pre_wrap=pre_wrap, prepare=prepare,
                ours=dict(param_init_fn=det_init),
                doc="test_meta_device_1d_init with a user init: ours param_init_fn, FSDP2 to_empty + the same "
                    "function on its DTensors; both equal an eager model initialised the same way")


class ScaledStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp_stack(4)
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d

    def forward(self, x):
        return self.body(x) * self.scale


@case()
def case_scalar_parameter(ws):
    def make():
        torch.manual_seed(0)
        return ScaledStack()

    return Case(make, mean_sq_step, randn_batches(3, 4),
                fsdp2_error=r"Change scale to a 1D tensor with numel equal to 1",
                doc="test_raise_scalar_parameter: a 0-d parameter (FSDP2 refuses it; ours trains it)")


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = unit(nn.Conv2d(3, 4, 3))
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)).flatten(1))


@case()
def case_noncontiguous_parameter(ws):
    def make():
        torch.manual_seed(0)
        m = ConvNet()
        m.conv.to(memory_format=torch.channels_last)
        return m

    return Case(make, mean_sq_step, randn_batches(3, 3, 8, 8),
                fsdp2_error=r"FSDP does not support non-contiguous parameters",
                doc="test_raise_noncontiguous_parameter: a channels_last conv weight (FSDP2 refuses it)")


class WeightNormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = unit(nn.Linear(3, 3, bias=False))
        self.layer2 = unit(nn.Linear(3, 3, bias=False))
        self.weight_norm = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.layer2(self.layer1(x)) * self.weight_norm


@case()
def case_parameter_replaced_after_shard(ws):
    def make():
        torch.manual_seed(0)
        return WeightNormModel()

    def prepare(ctx, model):
        model.weight_norm = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    return Case(make, mean_sq_step, randn_batches(3, 3), prepare=prepare,
                ours_error=r"ShardwiseError: parameter 'weight_norm' of unit '<root>' was replaced after "
                           r"shardwise\.shard\(\)",
                doc="test_reset_sharded_param_in_lazy_init: a root parameter replaced by a new nn.Parameter after "
                    "sharding, before the first forward (FSDP2 fails on it: ours may train it or refuse it)")
