"""Scenarios ported from FSDP2's ``test_fully_shard_autograd.py`` (pytorch/pytorch,
``test/distributed/_composable/fsdp/``): an unused forward output or unit, activations passed between units inside
containers, post-accumulate-grad hooks, the optimizer stepped in backward. Registered in ``fsdp2_cases.CASES``; run
and asserted by ``test_fsdp2_suite.py``."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp2_cases import (Case, DoubleLinear, MLP, STRATEGIES, WORLD_SIZES, add_case, assert_eq, bwd, case, gpt,
                         gpt_step, mean_sq_step, randn_batches, token_batches, unit, unit_of)
from parity_utils import make_optimizer


for _s in STRATEGIES:
    def _unused_output(ws, _s=_s):
        def make():
            torch.manual_seed(0)
            m = DoubleLinear(8)
            unit(m.lin1)
            return m

        def step(ctx, model, x):
            out1, out2 = model(ctx.take(x))
            loss = (out1 * out2).mean() if ctx.i < 2 else out1.mean()  # later: the root's output unused
            bwd(ctx, model, loss)
            return loss

        return Case(make, step, randn_batches(4, 8), **unit_of(_s),
                    doc="test_unused_forward_output: a forward output left out of the loss")

    def _unused_module(ws, _s=_s):
        def make():
            torch.manual_seed(0)
            m = DoubleLinear(8, use_second_linear=False)
            unit(m.lin1), unit(m.lin2)
            return m

        return Case(make, lambda ctx, model, x: _mean_step(ctx, model, x), randn_batches(4, 8), **unit_of(_s),
                    doc="test_unused_forward_module: a unit that never runs")

    add_case(f"unused_forward_output_{_s}", _unused_output, slow_at=WORLD_SIZES if _s == "shard_grad_op" else None)
    add_case(f"unused_forward_module_{_s}", _unused_module, slow_at=WORLD_SIZES if _s == "shard_grad_op" else None)


def _mean_step(ctx, model, x):
    loss = model(ctx.take(x)).mean()
    bwd(ctx, model, loss)
    return loss


NT = collections.namedtuple("NT", "x y")


class TensorPair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class DC:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Inner:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Outer:
    inner: Inner
    z: torch.Tensor


class ToContainer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        k = self.kind
        if k == "list":
            return [x]
        if k == "tuple":
            return (x,)
        if k == "dict":
            return {"x": x}
        if k == "namedtuple":
            return NT(x, torch.ones_like(x))
        if k == "typed_namedtuple":
            return TensorPair(x, x.clone())
        if k == "dataclass":
            return DC(x, x.clone())
        return Outer(Inner(x, x.clone()), x.clone())  # nested_dataclass


class ContainerModule(nn.Module):
    """Runs its layers on the tensors inside a container and returns the same kind of container."""

    def __init__(self, kind: str, dim: int):
        super().__init__()
        self.kind = kind
        self.lin1, self.lin2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def f(self, x):
        return F.relu(self.lin2(F.relu(self.lin1(x))))

    def forward(self, inp):
        k = self.kind
        if k == "list":
            return [self.f(inp[0])]
        if k == "tuple":
            return (self.f(inp[0]),)
        if k == "dict":
            return {"x": self.f(inp["x"])}
        if k == "namedtuple":
            return NT(self.f(inp.x), inp.y)
        if k == "typed_namedtuple":
            return TensorPair(self.f(inp.x), self.lin1(inp.y))
        if k == "dataclass":
            return DC(self.f(inp.x), self.lin1(inp.y))
        return Outer(Inner(self.f(inp.inner.x), self.lin1(inp.inner.y)), self.lin2(inp.z))


class FromContainer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, inp):
        k = self.kind
        if k in ("list", "tuple"):
            return inp[0]
        if k == "dict":
            return inp["x"]
        if k == "namedtuple":
            return inp.x
        if k == "nested_dataclass":
            return inp.inner.x + inp.inner.y + inp.z
        return inp.x + inp.y


def container_model(kind: str, dim: int = 8) -> Callable[[], nn.Module]:
    def make():
        torch.manual_seed(0)
        return nn.Sequential(ToContainer(kind), *[unit(ContainerModule(kind, dim)) for _ in range(3)],
                             FromContainer(kind))

    return make


for _kind in ("list", "tuple", "dict", "namedtuple", "typed_namedtuple", "dataclass", "nested_dataclass"):
    def _containers(ws, _kind=_kind):
        return Case(container_model(_kind), mean_sq_step, randn_batches(3, 8),
                    doc="test_nontensor_activations / test_structured_input_output: activations passed between "
                        f"units inside a {_kind}")

    # one container kind by default: the hooks find tensors in all of them the same way
    add_case(f"activations_in_{_kind}", _containers, slow_at=None if _kind == "dataclass" else WORLD_SIZES)


@case()
def case_post_accumulate_grad_hooks_run_once(ws):
    def make():
        torch.manual_seed(0)
        m = MLP(8)
        unit(m.in_proj), unit(m.out_proj)
        return m

    def prepare(ctx, model):
        counts = ctx.rec["_counts"] = collections.Counter()
        for n, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, n=n: counts.update([n]))

    def step(ctx, model, x):
        loss = mean_sq_step(ctx, model, x)
        ctx.rec.setdefault("counts", []).append(dict(ctx.rec["_counts"]))
        ctx.rec["_counts"].clear()
        return loss

    names = ["in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias"]
    return Case(make, step, randn_batches(3, 8), prepare=prepare,
                check=lambda extra, side, ws: assert_eq(extra["counts"], [dict.fromkeys(names, 1)] * 3),
                doc="TestFullyShardPostAccGradHook.test_post_acc_grad_hook_runs: each parameter's hook runs "
                    "once per backward")


@case()
def case_optimizer_in_backward(ws):
    def prepare(ctx, model):
        if ctx.side == "reference":
            return
        optims = {p: make_optimizer("sgd", [p]) for p in model.parameters()}

        def hook(p):
            optims[p].step()
            optims[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

    return Case(gpt, gpt_step, token_batches(3, 62), prepare=prepare,
                optimizer=lambda ctx, model: make_optimizer("sgd", model.parameters()) if ctx.side == "reference"
                else None,
                doc="test_post_acc_grad_hook_optim_parity: one optimizer per parameter, stepped from its "
                    "post-accumulate-grad hook, against a normal optimizer step")
