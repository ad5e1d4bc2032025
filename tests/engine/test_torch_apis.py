"""torch's own APIs that look at parameters or gradients, used on a sharded model as a user would: each row
gives the single-process result or raises ``ShardwiseError`` on every rank, under every strategy.

A row is user code for a few training steps, written once: ``run(ctx)`` drives either the sharded model
(each rank on its slice of the global batch) or an unsharded reference (the whole batch, one process;
every rank computes it for itself). ``ctx.record(x)`` notes a value (a norm, a loss) to compare; the
final parameters are compared too. A row whose ``expect`` names an error must raise ``ShardwiseError``
containing that text on every rank (the reference may succeed or raise torch's own error: in-place writes
between forward and backward). The next API is one more row.

All rows x strategies run in one spawn per test function (as ``parity_utils.run_scenarios`` does); world
size 2 under three strategies runs by default, the other two and world size 3 (uneven pieces) under
``-m slow``.
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import pytest
import torch
import torch.nn.functional as F

import shardwise
from harness import run_distributed
from models import GPT, Block, tiny_gpt_config
from parity_utils import (local_slice, make_batches, rel_err, sharded_param_errors, spawn_once,
                          whole_model_rel_err, worst)
from shardwise import ShardwiseError

STEPS = 3
VOCAB = tiny_gpt_config().vocab_size
STRATEGIES = ("full_shard", "shard_grad_op", "shard_optim", "shard_optim_grad", "no_shard")
SHARDED = STRATEGIES[:-1]  # strategies whose parameters are pieces of more than one rank
RTOL = 2e-5  # norms summed per piece round differently from one norm of the whole (fp32)


@dataclass
class Ctx:
    model: torch.nn.Module
    rank: int
    ws: int
    sharded: bool
    strategy: str
    config: dict = field(default_factory=dict)  # the GPT's config overrides (Row.config)
    trace: list = field(default_factory=list)
    scratch: dict = field(default_factory=dict)  # what a row keeps between its two halves (saved states)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return local_slice(t, self.rank, self.ws) if self.sharded else t

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return self.model(self.take(x), self.take(y)).loss

    def record(self, value) -> None:
        self.trace.append(float(value))

    def params(self) -> list:
        return list(self.model.parameters())

    def grads(self) -> list:
        return [p.grad for p in self.model.parameters() if p.grad is not None]


Expect = Union[str, None, Callable[[str], Optional[str]]]  # None: exact; text: the ShardwiseError's text


@dataclass
class Row:
    name: str
    run: Callable[[Ctx, list], None]
    expect: Expect = None
    # Adaptive optimizers divide by a gradient's own size: on gradients that are zero in theory (attention's
    # key bias) rounding noise becomes a visible step, so those rows compare the whole model at once
    # (parity_utils.whole_model_rel_err), as the mixed-precision parity tests do.
    whole_model: bool = False
    # Sign-based optimizers (Rprop) step +-lr on gradients that are zero in theory (attention's key bias),
    # whatever their rounding noise: their rows use the GPT without biases.
    config: dict = field(default_factory=dict)

    def expected(self, strategy: str) -> Optional[str]:
        return self.expect(strategy) if callable(self.expect) else self.expect


def sharded_only(text: str) -> Callable[[str], Optional[str]]:
    """Refused where parameters are pieces of several ranks, exact under no_shard."""
    return lambda strategy: text if strategy in SHARDED else None


# ---- the user code of the rows --------------------------------------------------------------------------
def sgd(params, **kw):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9, **kw)


def train(make_opt=sgd, after_backward=None, before_forward=None, between=None, closure_opt=False):
    """A row body: STEPS steps of forward, backward, ``after_backward(ctx)``, step, zero_grad."""

    def run(ctx: Ctx, batches):
        opt = make_opt(ctx.params())
        for batch in batches:
            if before_forward:
                before_forward(ctx)
            if closure_opt:
                def closure():
                    opt.zero_grad()
                    loss = ctx.loss(batch)
                    loss.backward()
                    return loss
                ctx.record(opt.step(closure))
                continue
            loss = ctx.loss(batch)
            if between:
                between(ctx, opt)
            loss.backward()
            if after_backward:
                after_backward(ctx)
            opt.step()
            opt.zero_grad()
    return run


def clip_torch(**kw):
    return lambda ctx: ctx.record(torch.nn.utils.clip_grad_norm_(ctx.params(), 0.05, **kw))


def total_norm_then_clip(ctx):
    norm = torch.nn.utils.get_total_norm(ctx.grads())
    ctx.record(norm)
    torch.nn.utils.clip_grads_with_norm_(ctx.params(), 0.05, norm)


def per_param_norms(ctx):  # Lightning's grad_norm logging: one norm per parameter, then their norm
    norms = [p.grad.data.norm(2) for p in ctx.params() if p.grad is not None]
    ctx.record(torch.stack(norms).norm(2))
    ctx.record(max(float(g.abs().max()) for g in ctx.grads()))
    ctx.record(sum(float(g.pow(2).sum()) for g in ctx.grads()))


def other_reductions(ctx):
    gs = ctx.grads()
    ctx.record(sum(float(g.abs().mean()) for g in gs))
    ctx.record(sum(int(torch.count_nonzero(g)) for g in gs))  # (unused embedding rows: exact zeros)
    ctx.record(sum(float(torch.dot(g.flatten(), g.flatten())) for g in gs))
    ctx.record(sum(float(g.float().amin()) for g in gs))
    ctx.record(all(bool(torch.isfinite(g).all()) for g in gs))


def vector_norm_of_grads(ctx):
    ctx.record(torch.nn.utils.parameters_to_vector(ctx.grads()).norm())


def vector_round_trip(ctx):
    vec = torch.nn.utils.parameters_to_vector(ctx.params())
    torch.nn.utils.vector_to_parameters(vec * 0.5, ctx.params())


def optimizer_row(cls, **kw):
    return train(make_opt=lambda ps: cls(ps, **kw))


def _one_adamw_step(ctx: Ctx, batches) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(ctx.params(), lr=1e-2)
    ctx.loss(batches[0]).backward()
    opt.step()
    opt.zero_grad()
    return opt


def _train_on_loaded(ctx: Ctx, batches, state_dict: dict) -> None:
    """A fresh AdamW loads ``state_dict`` and trains the remaining batches."""
    fresh = torch.optim.AdamW(ctx.params(), lr=1e-2)
    fresh.load_state_dict(state_dict)
    for batch in batches[1:]:
        ctx.loss(batch).backward()
        fresh.step()
        fresh.zero_grad()


def save_load(rank0_only: bool, other_plan: bool = False, in_memory: bool = False):
    """Train a step, save the optimizer state as a DDP user would, load it into a fresh optimizer, train on."""

    def run(ctx: Ctx, batches):
        opt = _one_adamw_step(ctx, batches)
        if in_memory:
            _train_on_loaded(ctx, batches, opt.state_dict())
            return
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        blob = buf.getvalue()
        if rank0_only and ctx.sharded:
            blob = _broadcast_object(blob)  # rank 0 saved the file, every rank reads it
        if other_plan and ctx.sharded:  # the same model, now sharded over groups of one rank (same world)
            state = shardwise.full_state_dict(ctx.model)
            ctx.model = _gpt(**ctx.config)
            ctx.model.load_state_dict(_broadcast_object(state))
            shardwise.shard(ctx.model, units={Block}, strategy="hybrid_shard", mesh=_mesh(ctx.ws))
        _train_on_loaded(ctx, batches, torch.load(io.BytesIO(blob), weights_only=True))
    return run


def save_on_rank0_alone(ctx: Ctx, batches):
    """The DDP habit ``if rank == 0: torch.save(opt.state_dict(), f)``: the whole state is gathered as it is
    pickled, so every rank must save (refused by name on every rank, before the next step)."""
    opt = _one_adamw_step(ctx, batches)
    if ctx.rank == 0:
        torch.save(opt.state_dict(), io.BytesIO())
    ctx.loss(batches[1]).backward()
    opt.step()


def load_another_ranks_stamped_state(ctx: Ctx, batches):
    """A state of this rank's elements stamped with its piece (what an offloading optimizer's host state, or
    an earlier shardwise, saves), loaded on another rank: refused by name at the first step."""
    from shardwise.engine.surface.optimizer_guard import STAMP_KEY, stamp_of
    from shardwise.engine.surface.pieces import local_of

    sd = _one_adamw_step(ctx, batches).state_dict()
    params = ctx.params()
    sd["state"] = {k: {**{n: local_of(v).clone() for n, v in e.items()}, STAMP_KEY: stamp_of(params[k])}
                   for k, e in sd["state"].items()}
    blob = io.BytesIO()
    torch.save(sd, blob)
    theirs = _broadcast_object(blob.getvalue()) if ctx.sharded else blob.getvalue()  # rank 0's, loaded everywhere
    _train_on_loaded(ctx, batches, torch.load(io.BytesIO(theirs), weights_only=True))


def _broadcast_object(obj):
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _mesh(ws):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (ws, 1), mesh_dim_names=("replicate", "shard"))


def hooked(before_shard: bool, make_hook, no_sync: bool = False, penalty=None):
    """Tensor hooks on every parameter, ``make_hook(p)`` for each, registered before or after shard();
    ``penalty(params)`` added to the loss."""

    def run(ctx: Ctx, batches):
        if not before_shard:
            for p in ctx.params():
                p.register_hook(make_hook(p))
        opt = sgd(ctx.params())
        for batch in batches:
            if no_sync and ctx.sharded:
                x, y = batch
                with shardwise.no_sync(ctx.model):
                    ctx.loss((x[:6], y[:6])).backward()
                ctx.loss((x[6:], y[6:])).backward()
            else:
                (ctx.loss(batch) + (0.05 * penalty(ctx.params()) if penalty else 0.0)).backward()
            opt.step()
            opt.zero_grad()
    run.hook_before_shard = make_hook if before_shard else None
    return run


def clamp_hook(p):
    return lambda g: g.clamp(-1e-3, 1e-3)


def mask_hook(p):  # a fixed mask in the parameter's full shape (pruning, frozen rows)
    mask = (torch.arange(p.numel()) % 3 != 0).float().view(p.shape)
    return lambda g: g * mask


def post_accumulate_hooks(ctx: Ctx, batches, penalty=None):  # optimizer in backward, one SGD per parameter
    opts = {p: sgd([p]) for p in ctx.params()}
    def step_now(q):
        opts[q].step()
        opts[q].zero_grad()

    for p in ctx.params():
        p.register_post_accumulate_grad_hook(step_now)
    for batch in batches:
        (ctx.loss(batch) + (0.05 * penalty(ctx.params()) if penalty else 0.0)).backward()


def weight_norms(ctx: Ctx):  # weight-norm logging, grad mode on as in a plain training loop
    ps = ctx.params()
    ctx.record(torch.nn.utils.get_total_norm(ps))
    ctx.record(torch.nn.utils.parameters_to_vector(ps).norm())
    ctx.record(torch.stack([p.norm() for p in ps]).norm())
    ctx.record(max(float(p.abs().max()) for p in ps))
    ctx.record(sum(float(p.data.float().pow(2).sum()) for p in ps))


def penalised(penalty, no_sync: bool = False):
    """``loss + 0.05 * penalty(params)`` back-propagated (an L2 penalty written by hand), SGD steps."""

    def run(ctx: Ctx, batches):
        opt = sgd(ctx.params())
        for batch in batches:
            if no_sync:  # two micro-batches, the penalty in the first (unsynced where sharded)
                x, y = batch
                with shardwise.no_sync(ctx.model) if ctx.sharded else contextlib.nullcontext():
                    (ctx.loss((x[:6], y[:6])) + 0.05 * penalty(ctx.params())).backward()
                ctx.loss((x[6:], y[6:])).backward()
            else:
                value = penalty(ctx.params())
                ctx.record(value)
                (ctx.loss(batch) + 0.05 * value).backward()
            opt.step()
            opt.zero_grad()
    return run


def l2(ps):
    return sum(p.pow(2).sum() for p in ps)


def backward_with_inputs(pick, functional: bool = False):
    """SGD steps whose backward names its inputs: ``pick(params)``."""

    def run(ctx: Ctx, batches):
        opt = sgd(ctx.params())
        for batch in batches:
            loss = ctx.loss(batch)
            if functional:
                torch.autograd.backward(loss, inputs=pick(ctx.params()))
            else:
                loss.backward(inputs=pick(ctx.params()))
            opt.step()
            opt.zero_grad()
    return run


def autograd_grad(ctx: Ctx, batches):
    opt = sgd(ctx.params())
    for batch in batches:
        grads = torch.autograd.grad(ctx.loss(batch), ctx.params())
        for p, g in zip(ctx.params(), grads):
            p.grad = g
        opt.step()
        opt.zero_grad()


def scale_all(factor):
    def write(ctx, *_):
        with torch.no_grad():
            for p in ctx.params():
                p.mul_(factor)
    return write


def step_between_forward_and_backward(ctx: Ctx, batches):
    """A GAN's order: the discriminator steps (its gradients from the loss before) before the generator's
    loss, computed through it, is back-propagated."""
    opt = sgd(ctx.params())
    ctx.loss(batches[0]).backward()
    loss = ctx.loss(batches[1])
    opt.step()
    loss.backward()


def grad_scaler_inf(ctx: Ctx, batches):
    """torch.amp.GradScaler with an inf in one element of one parameter's gradient: every rank skips."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = sgd(ctx.params())
    for step, batch in enumerate(batches):
        scaler.scale(ctx.loss(batch)).backward()
        if step == 1:
            _poison_first_element(ctx, "blocks.1.mlp.c_fc.weight")
        scaler.unscale_(opt)
        ctx.record(torch.nn.utils.clip_grad_norm_(ctx.params(), 1e9) if step != 1 else 0.0)
        scaler.step(opt)
        scaler.update()
        ctx.record(scaler.get_scale())
        opt.zero_grad()


def _poison_first_element(ctx: Ctx, name: str):
    p = ctx.model.get_parameter(name)
    with torch.no_grad():  # (every rank, as in one process: the rank holding element 0 writes it)
        p.grad.view(-1)[0] = float("inf")


class CustomStepAdam(torch.optim.Adam):
    """A user's Adam with its own step: shardwise cannot tell what the step does."""

    def step(self, closure=None):
        return super().step(closure)


@shardwise.allow_optimizer
class DeclaredAdam(CustomStepAdam):
    """The same, declared elementwise by its author."""


class DefaultsAdamW(torch.optim.AdamW):
    """A subclass that only changes the defaults keeps AdamW's step: accepted as AdamW."""

    def __init__(self, params):
        super().__init__(params, lr=1e-2, weight_decay=0.05)


# ---- the closed table: a parameter and its gradient are the whole tensor ------------------------------------
def whole_metadata(ctx: Ctx):  # what nanoGPT's and timm's loops read: shapes, counts, dimensions
    ps = ctx.params()
    ctx.record(sum(p.numel() for p in ps))
    ctx.record(sum(p.dim() + p.ndim + len(p.shape) for p in ps))
    ctx.record(sum(len(p) * p.size(-1) for p in ps))
    ctx.record(sum(math.prod(p.size()) for p in ps if p.dim() >= 2))
    ctx.record(sum(g.numel() for g in ctx.grads()))
    ctx.record(all(g.shape == p.shape for p in ps for g in [p.grad] if g is not None))


def grad_algebra(ctx: Ctx):
    """Products, comparisons and reductions along a dimension of gradients: each exact."""
    gs = ctx.grads()
    flat = [g.flatten() for g in gs]
    ctx.record(sum(float(f @ f) for f in flat))
    ctx.record(sum(float(torch.inner(f, f)) for f in flat))
    ctx.record(sum(float(torch.vdot(f, f)) for f in flat))
    ctx.record(sum(float(F.normalize(f, dim=0).sum()) for f in flat))
    ctx.record(sum(float(F.normalize(g, dim=-1).pow(2).sum()) for g in gs if g.dim() == 2))
    ctx.record(sum(float(F.cosine_similarity(g, g + 1.0, dim=-1).sum()) for g in gs if g.dim() == 2))
    ctx.record(all(torch.allclose(g, g * 1.0) for g in gs) and not any(torch.allclose(g, g + 1.0) for g in gs))
    ctx.record(all(torch.equal(g, g.clone()) for g in gs) and not any(torch.equal(g, g + 1.0) for g in gs))
    ctx.record(sum(float(g.sum(0).abs().sum() + g.amax(0).sum()) for g in gs))
    ctx.record(sum(float(g.norm(dim=-1).sum() + g.mean(-1, keepdim=True).sum()) for g in gs if g.dim() == 2))
    ctx.record(sum(float(g.std() + g.var(0).sum()) for g in gs if g.dim() == 2))
    ctx.record(sum(float(g[0].norm() + g.view(-1)[3:9].sum()) for g in gs if g.numel() > 9))


def anchored(loss_of, plain: bool):
    """SGD steps of ``loss + 0.05 * sum(loss_of(p, anchor))``: each parameter tied to its value at the start
    (``p.detach().clone()``: a piece) or to a plain whole tensor (``plain``: another model's weights). The
    anchors sit 0.1 off the parameters' zeros: at ``p == a`` the L1 penalty's gradient is sign(rounding
    noise), which no two summation orders share (the attention key bias, zero-initialised with a zero-in-
    theory gradient, moved 0.17 apart at world size 3)."""

    def run(ctx: Ctx, batches):
        if plain:
            anchors = [q.detach() * 0.5 - 0.1 for q in _gpt(**ctx.config).parameters()]
        else:
            anchors = [p.detach().clone() * 0.5 - 0.1 for p in ctx.params()]
        penalised(lambda ps: sum(loss_of(p, a) for p, a in zip(ps, anchors)))(ctx, batches)
    return run


def cosine_penalty(p, a):  # (shifted: the cosine of a zero vector is ill-conditioned in one process too;
    return F.cosine_similarity(p.flatten() + 1.0, a.flatten() + 2.0, dim=0)  # 1 - cos would cancel in fp32)


def hand_accumulation(plain: bool, k: int = 2):
    """Gradients of k micro-batches summed by hand into ``acc`` (zeros_like, or plain tensors of the whole
    shape), ``p.grad = acc / k``, torch's clip_grad_norm_, step."""

    def run(ctx: Ctx, batches):
        opt = sgd(ctx.params())
        for x, y in batches:
            acc = [torch.zeros(p.shape) if plain else torch.zeros_like(p) for p in ctx.params()]
            for i in range(k):
                opt.zero_grad()
                n = len(x) // k
                ctx.loss((x[i * n:(i + 1) * n], y[i * n:(i + 1) * n])).backward()
                for a, p in zip(acc, ctx.params()):
                    a += p.grad
            for a, p in zip(acc, ctx.params()):
                p.grad = a / k
            ctx.record(torch.nn.utils.clip_grad_norm_(ctx.params(), 0.05))
            opt.step()
    return run


def decay_groups(ctx: Ctx, batches):  # nanoGPT's configure_optimizers: weight decay for p.dim() >= 2 only
    ps = ctx.params()
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.5},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)
    ctx.record(sum(p.numel() for p in opt.param_groups[0]["params"]))
    for batch in batches:
        ctx.loss(batch).backward()
        opt.step()
        opt.zero_grad()


def plain_ema(ctx: Ctx, batches):
    """An EMA kept in plain whole tensors, updated from the parameters: every rank gathers them."""
    ema = [torch.zeros(p.shape) for p in ctx.params()]
    opt = sgd(ctx.params())
    for batch in batches:
        ctx.loss(batch).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema, ctx.params()):
                e.mul_(0.5).add_(p, alpha=0.5)
        ctx.record(sum(float(e.norm()) for e in ema))


def closure_steps(ctx: Ctx, batches):
    """``opt.step(closure)`` whose closure zeroes, computes the loss and backpropagates (the parameters are
    compared; the returned loss is this rank's)."""
    opt = sgd(ctx.params())
    for batch in batches:
        def closure():
            opt.zero_grad()
            loss = ctx.loss(batch)
            loss.backward()
            return loss
        opt.step(closure)


def assign_data(ctx: Ctx):
    for p in ctx.params():
        p.data = p.data * 0.99


def assign_piece_sized_grad(ctx: Ctx):
    for p in ctx.params():
        p.grad = torch.zeros(math.ceil(p.numel() / ctx.ws))


def changed_after_shard(change):
    """``change(first block's MLP input layer)`` after shard() (in the reference, on the one-process model),
    then SGD steps: refused by name under every strategy (the layer's weight is no longer the view shard()
    made it)."""

    def run(ctx: Ctx, batches):
        change(ctx.model.blocks[0].mlp.c_fc)
        train()(ctx, batches)
    return run


def functional_call_perturbed(ctx: Ctx, batches):
    """MAML's inner step: the model called through ``torch.func.functional_call`` with perturbed parameters."""
    from torch.func import functional_call

    opt = sgd(ctx.params())
    for x, y in batches:
        params = {n: p - 0.01 for n, p in ctx.model.named_parameters()}
        functional_call(ctx.model, params, (ctx.take(x), ctx.take(y))).loss.backward()
        opt.step()
        opt.zero_grad()


def optimizer_state_reads(ctx: Ctx, batches):
    """``optimizer.state[p]`` read between steps, as logging code and momentum resets do: each momentum
    buffer's norm and shape, then the first block's buffers zeroed in place."""
    opt = sgd(ctx.params())
    for step, batch in enumerate(batches):
        ctx.loss(batch).backward()
        opt.step()
        opt.zero_grad()
        buffers = [opt.state[p]["momentum_buffer"] for p in ctx.params()]
        ctx.record(sum(float(b.norm()) for b in buffers))
        ctx.record(all(b.shape == p.shape for b, p in zip(buffers, ctx.params())))
        if step == 0:
            for p in ctx.model.blocks[0].parameters():
                opt.state[p]["momentum_buffer"].zero_()


def reregister_weight(layer):  # a weight re-wrapped as a parameter of its own (a hand-written re-tie)
    layer.weight = torch.nn.Parameter(layer.weight)


PIECE_OPTIMIZER = "is not a known elementwise optimizer"
TORCH = "torch: "  # prefix: torch's own error, raised at construction on every rank (as in one process)
NOT_ITS_STATE = "load a state that optimizer.state_dict() returned"
WRITTEN = "was modified in place after the forward"

ROWS = [
    Row("clip_grad_norm_", train(after_backward=clip_torch())),
    Row("clip_grad_norm_ foreach=False", train(after_backward=clip_torch(foreach=False))),
    Row("clip_grad_norm_ inf", train(after_backward=clip_torch(norm_type=float("inf")))),
    Row("clip_grad_norm_ norm_type=1", train(after_backward=clip_torch(norm_type=1.0))),
    Row("get_total_norm + clip_grads_with_norm_", train(after_backward=total_norm_then_clip)),
    Row("clip_grad_value_", train(after_backward=lambda ctx: torch.nn.utils.clip_grad_value_(ctx.params(), 1e-3))),
    Row("p.grad.norm() per parameter", train(after_backward=per_param_norms)),
    Row("parameters_to_vector(grads).norm()", train(after_backward=vector_norm_of_grads)),
    Row("p.grad mean, count_nonzero, dot, amin, isfinite().all()", train(after_backward=other_reductions)),
    Row("torch.cat(pieces + a whole tensor).norm()",  # (the whole tensor is held by the group's first rank)
        train(after_backward=lambda ctx: ctx.record(torch.cat([g.view(-1) for g in ctx.grads()] + [torch.ones(3)]).norm()))),
    Row("p.grad.sort() (positions in the whole)", train(after_backward=lambda ctx: ctx.grads()[0].sort()),
        sharded_only("depends on positions in the whole tensor")),
    Row("vector_to_parameters", train(after_backward=vector_round_trip)),  # (p.data = piece: values copied in)
    *[Row(f"optim.{cls.__name__}", optimizer_row(cls, **kw), whole_model=cls is not torch.optim.SGD,
          config=dict(bias=False) if cls is torch.optim.Rprop else {}) for cls, kw in [
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
        (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)), (torch.optim.AdamW, dict(lr=1e-2)),
        (torch.optim.Adagrad, dict(lr=1e-2, initial_accumulator_value=0.1)), (torch.optim.RMSprop, dict(lr=1e-3, centered=True, momentum=0.5)),
        (torch.optim.Adamax, dict(lr=1e-2)), (torch.optim.NAdam, dict(lr=1e-2)), (torch.optim.RAdam, dict(lr=1e-2)),
        (torch.optim.ASGD, dict(lr=1e-2, t0=1)), (torch.optim.Adadelta, dict(lr=1.0)),
        (torch.optim.Rprop, dict(lr=1e-2))]],
    Row("optim.LBFGS", train(make_opt=lambda ps: torch.optim.LBFGS(ps, lr=0.1, max_iter=3), closure_opt=True),
        PIECE_OPTIMIZER),  # (refused under no_shard too: the optimizer steps the flat local parameter there as well)
    Row("optim.Adafactor", optimizer_row(torch.optim.Adafactor, lr=1e-2), PIECE_OPTIMIZER),
    Row("optim.Muon (torch's)", optimizer_row(torch.optim.Muon, lr=1e-2), TORCH + "Muon only supports 2D parameters"),
    Row("optim.SparseAdam", optimizer_row(torch.optim.SparseAdam, lr=1e-2), PIECE_OPTIMIZER),
    Row("an Adam subclass with its own step", optimizer_row(CustomStepAdam, lr=1e-2), PIECE_OPTIMIZER),
    Row("the same, declared with shardwise.allow_optimizer", optimizer_row(DeclaredAdam, lr=1e-2), whole_model=True),
    Row("an AdamW subclass that keeps AdamW's step", optimizer_row(DefaultsAdamW), whole_model=True),
    # optimizer.state_dict() holds the whole state, as DDP's: whichever rank's file is loaded, at any plan.
    Row("state_dict saved on every rank, load_state_dict", save_load(rank0_only=False), whole_model=True),
    Row("state_dict of rank 0's file, loaded everywhere", save_load(rank0_only=True), whole_model=True),
    Row("state_dict loaded at another shard size", save_load(rank0_only=False, other_plan=True), whole_model=True),
    Row("state_dict kept in memory, load_state_dict", save_load(rank0_only=False, in_memory=True), whole_model=True),
    Row("torch.save(opt.state_dict()) on rank 0 alone", save_on_rank0_alone,
        sharded_only("ranks [0] are at torch.save of a sharded model's state_dict() pieces"), whole_model=True),
    Row("a per-rank state of another piece (stamped)", load_another_ranks_stamped_state, sharded_only(NOT_ITS_STATE),
        whole_model=True),
    Row("register_hook after shard: clamp", hooked(False, clamp_hook)),
    Row("register_hook before shard: clamp", hooked(True, clamp_hook)),
    Row("register_hook before shard: full-shape mask", hooked(True, mask_hook)),
    Row("register_hook: normalise by its norm", hooked(False, lambda p: lambda g: g / (g.norm() + 1.0))),
    Row("register_hook under no_sync", hooked(False, lambda p: lambda g: g * 0.5, no_sync=True), "has a tensor hook"),
    Row("register_post_accumulate_grad_hook", post_accumulate_hooks),
    # Parameters themselves: reductions exact (and differentiable where additive), autograd calls by name.
    Row("get_total_norm(parameters), parameters_to_vector(parameters).norm(), p.norm(), p.abs().max()",
        train(after_backward=weight_norms)),
    Row("p.sort() (positions in the whole)", train(after_backward=lambda ctx: ctx.params()[0].sort()),
        sharded_only("depends on positions in the whole tensor")),
    Row("L2 penalty by hand: loss + wd * sum(p.pow(2).sum())", penalised(l2)),
    Row("penalty from get_total_norm(parameters) ** 2",
        penalised(lambda ps: torch.nn.utils.get_total_norm(ps) ** 2)),
    Row("L2 penalty by hand under no_sync", penalised(l2, no_sync=True)),
    Row("penalty from p.abs().max() (a maximum across ranks)", penalised(lambda ps: sum(p.abs().max() for p in ps))),
    Row("L2 penalty by hand with a tensor hook", hooked(False, clamp_hook, penalty=l2), "has a tensor hook or a post"),
    Row("L2 penalty by hand with post-accumulate-grad hooks", lambda ctx, b: post_accumulate_hooks(ctx, b, penalty=l2),
        "has a tensor hook or a post"),
    Row("loss.backward(inputs=all parameters)", backward_with_inputs(list)),
    Row("torch.autograd.backward(loss, inputs=all parameters)", backward_with_inputs(list, functional=True)),
    Row("loss.backward(inputs=some parameters)", backward_with_inputs(lambda ps: ps[:3]),
        "names some parameters of a sharded flat group"),
    # Refused in every strategy: a shard's gradient exists only as the reduction into p.grad.
    Row("autograd.grad(loss, parameters)", autograd_grad, "torch.autograd.grad(..., inputs=<parameters"),
    Row("in-place write before forward", train(before_forward=scale_all(0.99))),
    Row("in-place write between forward and backward", train(between=scale_all(0.99)), WRITTEN),
    Row("optimizer.step() between forward and backward (GAN)", step_between_forward_and_backward, WRITTEN),
    Row("in-place write between backward and step", train(after_backward=scale_all(0.99))),
    Row("GradScaler with an inf in one rank's piece", grad_scaler_inf),
    # torch utilities that re-make a parameter after shard() (tu28): nn.Parameter(p) of a whole piece (no_shard)
    # is a piece too, so these reach the same refusal under every strategy
    Row("parametrizations.weight_norm after shard", changed_after_shard(torch.nn.utils.parametrizations.weight_norm),
        "was removed from its module after shardwise.shard()"),
    Row("nn.Parameter(p) re-registered after shard", changed_after_shard(reregister_weight),
        "was replaced after shardwise.shard()"),
    Row("torch.func.functional_call with perturbed parameters (MAML)", functional_call_perturbed,
        "torch.func.functional_call given tensors other than the model's own parameters"),
    Row("optimizer.state[p] read and zeroed between steps", optimizer_state_reads),
]

# The closed table (issue #27): a parameter and its gradient are the whole tensor to user code. Whole-shape
# metadata, exact products, comparisons and reductions along a dimension, functional penalties, indexing by
# contiguous runs exact; other indexing, products and random fills refused by name.
WHOLE_ROWS = [
    Row("shape, size(), dim(), ndim, numel(), len() of parameters and gradients", train(after_backward=whole_metadata)),
    Row("g @ g (1-D), inner, vdot, F.normalize, cosine_similarity, allclose, equal, sum(0), norm(dim), std, g[0]",
        train(after_backward=grad_algebra)),
    Row("g @ g.T of a 2-D gradient (a transposed view)", train(after_backward=lambda ctx: [g @ g.T for g in ctx.grads() if g.dim() == 2]),
        sharded_only("reorders or selects positions")),
    Row("torch.mm of a 2-D gradient", train(after_backward=lambda ctx: [torch.mm(g, torch.ones(g.shape[1], 2))
                                                                        for g in ctx.grads() if g.dim() == 2]),
        sharded_only("torch.mm (aten.mm.default)")),
    Row("torch.einsum of gradients", train(after_backward=lambda ctx: [torch.einsum("ij,ij->", g, g)
                                                                       for g in ctx.grads() if g.dim() == 2]),
        sharded_only("torch.einsum")),
    Row("p.grad[:, 0] (a strided selection)", train(after_backward=lambda ctx: [g[:, 0] for g in ctx.grads() if g.dim() == 2]),
        sharded_only("reorders or selects positions")),
    Row("p.grad[index tensor]", train(after_backward=lambda ctx: [g[torch.tensor([0, 2])] for g in ctx.grads()]),
        sharded_only("depends on positions in the whole tensor")),
    Row("torch.randn_like(p)", train(after_backward=lambda ctx: torch.randn_like(ctx.params()[0])),
        sharded_only("a random fill")),
    *[Row(f"penalty {name}, anchor {'plain' if plain else 'p.detach().clone()'}", anchored(fn, plain))
      for name, fn in [("F.mse_loss(p, a)", F.mse_loss), ("F.l1_loss(p, a)", F.l1_loss),
                       ("F.smooth_l1_loss(p, a)", lambda p, a: F.smooth_l1_loss(p, a, beta=0.01)),
                       ("torch.dist(p, a)", torch.dist), ("F.cosine_similarity(p, a)", cosine_penalty),
                       ("(p - a).norm()", lambda p, a: (p - a).norm())]
      for plain in (False, True)],
    Row("penalty p.sigmoid().mean()", penalised(lambda ps: sum(p.sigmoid().mean() for p in ps))),
    # Zero-initialised biases: the norm's subgradient at zero is 0, as in one process (not NaN).
    Row("norm penalty with all-zero parameters: sum(p.norm())", penalised(lambda ps: sum(p.norm() for p in ps))),
    Row("norm penalty: sum(torch.linalg.vector_norm(p))",
        penalised(lambda ps: sum(torch.linalg.vector_norm(p) for p in ps))),
    Row("hand-written accumulation into zeros_like, p.grad = acc / k, clip_grad_norm_", hand_accumulation(plain=False)),
    Row("hand-written accumulation into plain tensors, p.grad = acc / k, clip_grad_norm_", hand_accumulation(plain=True)),
    Row("p.grad = a 1-D tensor of this rank's piece size", train(after_backward=assign_piece_sized_grad),
        "p.grad = tensor for parameter"),
    Row("weight decay groups by p.dim() >= 2 (nanoGPT)", decay_groups, whole_model=True),
    Row("EMA in plain tensors: e.mul_(d).add_(p)", plain_ema),
    Row("p.data = p.data * 0.99 before forward", train(before_forward=assign_data)),
    # The closure runs inside step(): it must see the pieces (its zero_grad, its backward), the step the locals.
    Row("SGD step(closure) (Lightning's automatic optimisation)", closure_steps),
]
TABLES = {"ROWS": ROWS, "WHOLE_ROWS": WHOLE_ROWS}


# ---- running the table ------------------------------------------------------------------------------------
def _gpt(**config):
    torch.manual_seed(0)
    return GPT(tiny_gpt_config(**config))


def _attempt(fn) -> dict:
    try:
        fn()
        return {}
    except ShardwiseError as e:
        return {"shardwise_error": str(e)}
    except Exception as e:  # noqa: BLE001 - torch's own errors are results here, compared by the test
        return {"other_error": f"{type(e).__name__}: {e}"}


def _run_row(row: Row, strategy: str, rank: int, ws: int) -> dict:
    batches = make_batches(STEPS, VOCAB)
    hook = getattr(row.run, "hook_before_shard", None)
    ref_model = _gpt(**row.config)
    model = _gpt(**row.config)
    if hook is not None:
        for p in model.parameters():
            p.register_hook(hook(p))
        for p in ref_model.parameters():
            p.register_hook(hook(p))
    ref = Ctx(ref_model, 0, 1, sharded=False, strategy=strategy, config=row.config)
    ref_out = _attempt(lambda: row.run(ref, batches))
    ctx = Ctx(shardwise.shard(model, units={Block}, strategy=strategy), rank, ws, sharded=True, strategy=strategy,
              config=row.config)
    out = _attempt(lambda: row.run(ctx, batches))
    out["reference"] = ref_out
    if not out.get("shardwise_error") and not out.get("other_error") and not ref_out:
        out["trace_err"] = max([rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(ctx.trace, ref.trace)],
                               default=0.0)
        out["trace_len"] = (len(ctx.trace), len(ref.trace))
        out["param_err"] = (("<whole model>", whole_model_rel_err(ctx.model, ref.model)) if row.whole_model
                            else worst(sharded_param_errors(ctx.model, ref.model)))
    return out


def _table(rank: int, ws: int, strategies: tuple, table: str) -> dict:
    return {(row.name, s): _run_row(row, s, rank, ws) for s in strategies for row in TABLES[table]}


@spawn_once
def _report(ws: int, strategies: tuple, table: str) -> list:
    # (the whole ws3 table under five strategies takes ~2 minutes on 2 idle cores: a generous hang guard)
    return run_distributed(_table, ws, strategies, table, timeout_s=30 if ws == 2 else 90)


def _check(results: list, row: Row, strategy: str) -> None:
    outs = [r[(row.name, strategy)] for r in results]
    expected = row.expected(strategy)
    if expected is not None and expected.startswith(TORCH):
        for rank, out in enumerate(outs):
            assert expected[len(TORCH):] in out.get("other_error", ""), f"rank {rank}: {out}"
        return
    if expected is not None:
        for rank, out in enumerate(outs):
            text = out.get("shardwise_error")
            assert text is not None and expected in text, (
                f"rank {rank}: expected ShardwiseError containing {expected!r}, got {out}")
        return
    for rank, out in enumerate(outs):
        assert "shardwise_error" not in out and "other_error" not in out, f"rank {rank}: {out}"
        assert not out["reference"], f"the reference raised: {out['reference']}"
        assert out["trace_len"][0] == out["trace_len"][1], f"rank {rank} recorded {out['trace_len']}"
        assert out["trace_err"] <= RTOL, f"rank {rank}: recorded values off by {out['trace_err']:.2e}"
        name, err = out["param_err"]
        assert err <= RTOL, f"rank {rank}: parameter {name!r} off by {err:.2e}"


# The default run: world size 2 under the three strategies whose gradients and parameters live most
# differently (ZeRO-3's re-gather, ZeRO-1's whole gradients, DDP's aliasing); the rest under -m slow.
DEFAULT = ("full_shard", "shard_optim", "no_shard")
REST = tuple(s for s in STRATEGIES if s not in DEFAULT)


@pytest.mark.parametrize("strategy", DEFAULT)
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_ws2(row, strategy):
    _check(_report(2, DEFAULT, "ROWS"), row, strategy)


@pytest.mark.parametrize("strategy", DEFAULT)
@pytest.mark.parametrize("row", WHOLE_ROWS, ids=lambda r: r.name)
def test_whole_ws2(row, strategy):
    _check(_report(2, DEFAULT, "WHOLE_ROWS"), row, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", REST)
@pytest.mark.parametrize("row", ROWS + WHOLE_ROWS, ids=lambda r: r.name)
def test_ws2_other_strategies(row, strategy):
    _check(_report(2, REST, "ROWS" if row in ROWS else "WHOLE_ROWS"), row, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("row", ROWS + WHOLE_ROWS, ids=lambda r: r.name)
def test_ws3(row, strategy):
    _check(_report(3, STRATEGIES, "ROWS" if row in ROWS else "WHOLE_ROWS"), row, strategy)
