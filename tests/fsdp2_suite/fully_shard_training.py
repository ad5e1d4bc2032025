"""Scenarios ported from FSDP2's ``test_fully_shard_training.py`` (pytorch/pytorch,
``test/distributed/_composable/fsdp/``): parity of one-unit and many-unit models, CPU offload, a unit called alone
or twice in a forward, activation checkpointing in six flavours, a head called by itself per chunk, an exception
caught mid-step, two forwards per step, tied weights on an uneven shard, gradient accumulation, an entry method
other than forward, parameter registration, a cast after sharding. Registered in ``fsdp2_cases.CASES``; run and
asserted by ``test_fsdp2_suite.py``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from shardwise.engine.surface.pieces import is_piece
from fsdp2_cases import (Case, ChunkedHeadModel, CkptGPT, GB, MLP, Raiser, RESHARD, STRATEGIES, WORLD_SIZES, add_case,
                         assert_eq, bwd, case, count_reduce_scatters, cpu_offload_policy, fsdp2_shard, full_params, gpt,
                         gpt_step, grad_sync, mean_sq_step, mlp_stack, randn_batches, token_batches, unit, unit_of)
from models import Block, GPT


def _single_group(shapes):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1]))

    def build(ws):
        return Case(make, mean_sq_step, randn_batches(4, shapes[0][0]),
                    doc="TestFullyShard1DTrainingCore.test_train_parity_single_group_shard_dim0: everything in "
                        f"the root unit, shapes {shapes}")

    return build


for _shapes, _slow_at in (([(7, 15), (15, 3)], None), ([(16, 17), (17, 8)], WORLD_SIZES)):
    add_case(f"single_group_{_shapes[0][0]}_{_shapes[0][1]}_{_shapes[1][1]}", _single_group(_shapes), slow_at=_slow_at)


@case()
def case_multi_group_offload(ws):
    return Case(gpt, gpt_step, token_batches(3, 62), ours=dict(offload=shardwise.CPUOffload()),
                fsdp2=dict(offload_policy=cpu_offload_policy()),
                doc="test_train_parity_multi_group_cpu_offload_eager: Block units, CPU offload on both")


@case()
def case_non_root_forward_backward(ws):
    def make():
        torch.manual_seed(0)
        return mlp_stack(8)

    def step(ctx, model, x):
        out = model(ctx.take(x)) if ctx.i % 2 == 0 else model[0](ctx.take(x))  # odd steps: a unit alone
        loss = out.pow(2).mean()
        bwd(ctx, model, loss)
        return loss

    return Case(make, step, randn_batches(4, 8),
                doc="test_non_root_forward_backward: a step through the root, then one through model[0] alone")


class MultiForwardModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = unit(nn.Linear(4, 4))
        self.outer = nn.Linear(4, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


for _s in STRATEGIES:
    def _multi_forward(ws, _s=_s):
        def make():
            torch.manual_seed(0)
            return MultiForwardModule()

        return Case(make, mean_sq_step, randn_batches(4, 4), **unit_of(_s),
                    doc="test_multi_forward_module: a unit called twice in one forward")

    add_case(f"multi_forward_module_{_s}", _multi_forward, slow_at=WORLD_SIZES if _s == "shard_grad_op" else None)


def _composable_ckpt_fsdp2(ctx, model):
    """FSDP2's "composable" activation checkpointing on every Block (FSDP2 side only; ours uses its option)."""
    if ctx.side == "fsdp2":
        from torch.distributed._composable import checkpoint

        for m in model.modules():
            if isinstance(m, Block):
                checkpoint(m)


def _ckpt_gpt(reentrant: bool, tie: bool = False):
    def make():
        m = gpt(tie=tie, cls=CkptGPT)
        m.reentrant = reentrant
        return m

    return make


def _wrapped_gpt():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    m = gpt()
    apply_activation_checkpointing(m, check_fn=lambda mod: isinstance(mod, Block))
    return m


AC_FLAVOURS = {
    # name: (make, ours extra kwargs, pre_wrap)
    "ours_vs_composable": (gpt, dict(activation_checkpointing=True), _composable_ckpt_fsdp2),
    "utils_nonreentrant": (_ckpt_gpt(False), {}, None),
    "utils_reentrant": (_ckpt_gpt(True), {}, None),
    "wrapper": (_wrapped_gpt, {}, None),
    "tied_ours_vs_composable": (lambda: gpt(tie=True), dict(activation_checkpointing=True), _composable_ckpt_fsdp2),
    "tied_utils_nonreentrant": (_ckpt_gpt(False, tie=True), {}, None),
}

for _flavour, (_make, _ours_kw, _pre) in AC_FLAVOURS.items():
    for _s in STRATEGIES:
        def _ac(ws, _make=_make, _ours_kw=_ours_kw, _pre=_pre, _s=_s, _flavour=_flavour):
            kw = unit_of(_s)
            kw["ours"].update(_ours_kw)
            return Case(_make, gpt_step, token_batches(3, 62), pre_wrap=_pre, **kw,
                        doc=f"test_train_parity_with_activation_checkpointing / test_train_parity_with_shared_"
                            f"params: activation checkpointing ({_flavour}) around Block units")

        # the tied non-reentrant flavour combines two that run by default
        add_case(f"ac_{_flavour}_{_s}", _ac,
                 slow_at=WORLD_SIZES if _s == "shard_grad_op" or _flavour == "tied_utils_nonreentrant" else None)


# -- chunked loss: the head called by itself, per chunk, after a forward that skipped it ------------------
CHUNK_VOCAB, CHUNK_DIM, N_CHUNKS = 29, 16, 4


def _chunked_model(tie: bool):
    def make():
        torch.manual_seed(0)
        m = ChunkedHeadModel(CHUNK_DIM, CHUNK_VOCAB, tie)
        unit(m.body)
        if not tie:
            unit(m.embed), unit(m.norm), unit(m.head)
        return m

    return make


def _chunked_fsdp2_wrap(tie: bool, **kw):
    def wrap(model, mesh):
        from torch.distributed.fsdp import fully_shard

        if tie:  # FSDP2 needs the tied embed/head in one group: its test groups [embed, norm, head]
            fully_shard(model.body, mesh=mesh, **kw)
            fully_shard([model.embed, model.norm, model.head], mesh=mesh, **kw)
            fully_shard(model, mesh=mesh, **kw)
        else:
            fsdp2_shard(model, mesh, **kw)

    return wrap


def _chunked_fwd_bwd(ctx, model, tokens):
    h = model(ctx.take(tokens), skip_head=True)
    total, h_grads = 0.0, []
    for chunk in torch.chunk(h.detach(), N_CHUNKS, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        loss = model.head(chunk).pow(2).mean() / N_CHUNKS
        loss.backward()  # h's graph is still pending: the engine is not between steps yet
        h_grads.append(chunk.grad)
        total = total + loss.detach()
    bwd(ctx, model, h, gradient=torch.cat(h_grads, dim=1))
    return total


for _tie in (False, True):
    for _s in STRATEGIES:
        def _chunked(ws, _tie=_tie, _s=_s):
            return Case(_chunked_model(_tie), _chunked_fwd_bwd, [b for b, _ in token_batches(3, CHUNK_VOCAB)],
                        ours=dict(strategy=_s), fsdp2_wrap=_chunked_fsdp2_wrap(_tie, reshard_after_forward=RESHARD[_s]),
                        doc="test_partial_group_forward_then_standalone: forward without the head, then the head "
                            f"alone per chunk, backward through h ({'tied' if _tie else 'untied'} head)")

        # the tied head is the harder layout (FSDP2 needs it in one group): the untied one runs under -m slow
        add_case(f"chunked_head_{'tied' if _tie else 'untied'}_{_s}", _chunked,
                 slow_at=WORLD_SIZES if not _tie or _s == "shard_grad_op" else None)


@case()
def case_chunked_head_grad_acc(ws):
    def step(ctx, model, micro):
        total = 0.0
        for k, tokens in enumerate(micro):
            with grad_sync(ctx, model, k == len(micro) - 1):
                total = total + _chunked_fwd_bwd(ctx, model, tokens)
        return total

    batches = [[b for b, _ in token_batches(3, CHUNK_VOCAB, seed=10 + s)] for s in range(2)]
    return Case(_chunked_model(False), step, batches, fsdp2_wrap=_chunked_fsdp2_wrap(False),
                doc="test_partial_group_forward_grad_accum_chunked: chunked head with 3 micro-batches, the first "
                    "two without gradient sync")


# -- an exception in the middle of a step, caught by the training loop ----------------------------------
def _raiser_model():
    torch.manual_seed(0)
    m = ChunkedHeadModel(CHUNK_DIM, CHUNK_VOCAB, tie=False)
    m.body = unit(Raiser(m.body))
    unit(m.head)
    return m


def _exception_step(where: str):
    def step(ctx, model, tokens):
        x = ctx.take(tokens)
        if ctx.i == 1:  # the "skip this batch" pattern: the failure is caught, gradients dropped
            model.body.armed = where
            try:
                loss = model(x).pow(2).mean()
                loss.backward()
            except RuntimeError as e:
                ctx.rec.setdefault("caught", []).append(str(e))
            model.body.armed = None
            model.zero_grad(set_to_none=True)
            if ctx.side == "fsdp2":
                model.reset_iter_state()  # FSDP2's documented recovery after a failed step
        loss = model(x).pow(2).mean()
        bwd(ctx, model, loss)
        return loss

    return step


for _where in ("forward", "backward"):
    def _exception(ws, _where=_where):
        return Case(_raiser_model, _exception_step(_where), [b for b, _ in token_batches(4, CHUNK_VOCAB)],
                    doc=f"test_reset_iter_state_after_exception: an exception in {_where} of a unit at step 1, "
                        "caught; the model keeps training",
                    check=lambda extra, side, ws, _w=_where: _check_caught(extra, _w))

    add_case(f"exception_in_{_where}", _exception)


def _check_caught(extra, where):
    assert extra.get("caught") == [f"boom in {where}"], extra.get("caught")


# -- DPO: two forwards, one loss, nested units, activation checkpointing ------------------------------------
def _nested_gpt(cls=GPT, reentrant=False):
    def make():
        m = gpt(cls=cls)
        m.reentrant = reentrant
        for b in m.blocks:
            unit(b.attn), unit(b.mlp)
        return m

    return make


def _dpo_step(ctx, model, batch):
    (x1, y1), (x2, y2) = batch
    l1, l2 = model(ctx.take(x1), ctx.take(y1)), model(ctx.take(x2), ctx.take(y2))
    l1 = l1 if isinstance(l1, torch.Tensor) else l1.loss
    l2 = l2 if isinstance(l2, torch.Tensor) else l2.loss
    loss = l1 - 0.5 * l2  # linear in the two losses, so the global-batch reference is exact
    bwd(ctx, model, loss)
    return loss


for _flavour in ("utils", "ours_vs_composable"):
    for _s in STRATEGIES:
        def _dpo(ws, _flavour=_flavour, _s=_s):
            kw = unit_of(_s)
            if _flavour == "ours_vs_composable":
                kw["ours"]["activation_checkpointing"] = True
                make, pre = _nested_gpt(), _composable_ckpt_fsdp2
            else:
                make, pre = _nested_gpt(CkptGPT), None
            batches = list(zip(token_batches(3, 62, seed=1), token_batches(3, 62, seed=2)))
            return Case(make, _dpo_step, batches, pre_wrap=pre, **kw,
                        doc="test_double_forward_with_nested_fsdp_and_checkpoint: two forwards (DPO), one "
                            f"backward; units Block > attn, mlp nested; checkpointing {_flavour}")

        add_case(f"dpo_nested_{_flavour}_{_s}", _dpo, slow_at=WORLD_SIZES if _s == "shard_grad_op" else None)


@case()
def case_double_partial_forward(ws):
    def step(ctx, model, batch):
        t1, t2 = batch
        h1, h2 = model(ctx.take(t1), skip_head=True), model(ctx.take(t2), skip_head=True)
        loss = h1.pow(2).mean() + h2.pow(2).mean()
        bwd(ctx, model, loss)
        ctx.rec.setdefault("head_grad_none", []).append(model.head.weight.grad is None)
        return loss

    batches = [(a, b) for (a, _), (b, _) in zip(token_batches(3, CHUNK_VOCAB, seed=1),
                                                token_batches(3, CHUNK_VOCAB, seed=2))]
    return Case(_chunked_model(False), step, batches, fsdp2_wrap=_chunked_fsdp2_wrap(False),
                doc="test_double_partial_forward_then_backward: two forwards skipping the head unit, one backward",
                check=lambda extra, side, ws: assert_eq(extra["head_grad_none"], [True] * 3))


class TiedModel(nn.Module):
    def __init__(self, vocab: int, hidden: int = 16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        return self.output(self.tok_embeddings(ids))


@case()
def case_tied_uneven(ws):
    vocab = ws * 4 + 1

    def make():
        torch.manual_seed(0)
        return TiedModel(vocab)

    def step(ctx, model, ids):
        ids = ctx.take(ids)
        loss = F.cross_entropy(model(ids).view(-1, vocab).float(), ids.view(-1))
        bwd(ctx, model, loss)
        return loss

    def finish(ctx, model):
        w = full_params(ctx.side, model, ["tok_embeddings.weight"]).get("tok_embeddings.weight")
        if w is None:
            return {}
        init = ctx.initial.tok_embeddings.weight
        return {"rows_not_updated": [r for r in range(vocab) if torch.equal(w[r], init[r])]}

    g = torch.Generator().manual_seed(0)
    return Case(make, step, [torch.randint(0, vocab, (GB, 8), generator=g) for _ in range(5)], optimizer="adamw",
                finish=finish, check=lambda extra, side, ws: assert_eq(extra.get("rows_not_updated"), []),
                doc="test_train_shared_params_uneven_shard: tied embedding/output, vocab 4 * ws + 1 rows; every "
                    "row is updated, the padded last shard included")


# -- gradient accumulation -----------------------------------------------------------------------------------
def _grad_acc(strategy: str, offload: bool):
    def build(ws):
        def make():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(16, 16), *[unit(MLP(16)) for _ in range(3)])  # root: the Linear

        def step(ctx, model, micro):
            total = 0.0
            with count_reduce_scatters(ctx) as c:
                for k, x in enumerate(micro):
                    with grad_sync(ctx, model, k == len(micro) - 1):
                        loss = model(ctx.take(x)).pow(2).mean()
                        bwd(ctx, model, loss)
                    total = total + loss.detach()
            ctx.rec.setdefault("reduce_scatters", []).append(c.calls)
            return total

        kw = unit_of(strategy)
        if offload:
            kw["ours"]["offload"] = shardwise.CPUOffload()
            kw["fsdp2"]["offload_policy"] = cpu_offload_policy()
        batches = [randn_batches(3, 16, seed=s) for s in range(4)]
        return Case(make, step, batches, **kw,
                    check=lambda extra, side, ws: assert_eq(extra["reduce_scatters"], [4] * 4),
                    doc="test_gradient_accumulation (mode 'all') / test_requires_gradient_sync / "
                        "test_1f1b_microbatching: 3 micro-batches, only the last one synchronised (one "
                        "reduce-scatter per unit per step), zero_grad alternating set_to_none")

    return build


for _s, _off in (("full_shard", False), ("shard_grad_op", False), ("full_shard", True)):
    add_case(f"grad_acc_{_s}{'_offload' if _off else ''}", _grad_acc(_s, _off),
             slow_at=WORLD_SIZES if _s == "shard_grad_op" else None)


# -- a forward method other than forward ----------------------------------------------------------------
class PatchEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_proj = nn.Conv2d(3, 8, kernel_size=4, stride=4)

    def forward_features(self, imgs):
        return self.patch_proj(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs):
        return self.forward_features(imgs).sum(dim=1)


class ViTModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.vit, self.projector = unit(PatchEmbed()), unit(nn.Linear(8, 5))

    def forward(self, imgs):
        return self.projector(self.vit.forward_features(imgs))  # not vit.forward


@case()
def case_register_forward_method(ws):
    def make():
        torch.manual_seed(0)
        return ViTModel()

    def prepare(ctx, model):
        if ctx.side == "shardwise":
            shardwise.register_forward_method(model.vit, "forward_features")
        elif ctx.side == "fsdp2":
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(model.vit, "forward_features")

    return Case(make, mean_sq_step, randn_batches(3, 3, 8, 8), prepare=prepare,
                doc="TestFullyShardCustomForwardMethod.test_register_fsdp_forward_method: the root calls "
                    "vit.forward_features, registered as a forward method of the vit unit")


class ParamOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 5) * 0.5)

    def forward(self):
        return self.weight @ self.weight


@case()
def case_root_no_forward_inputs(ws):
    def make():
        torch.manual_seed(0)
        return ParamOnly()

    def step(ctx, model, _):
        loss = model().pow(2).mean()
        bwd(ctx, model, loss)
        return loss

    return Case(make, step, [None] * 3,
                doc="TestFullyShardForwardInputs.test_root_no_forward_inputs: a root forward with no inputs")


@case()
def case_param_registration(ws):
    """After forward and after backward every parameter is its shard (FSDP2: a DTensor; ours: a piece, whole
    shape over this rank's elements); gathering the full parameters on demand (ours: summon_full_params;
    FSDP2: unshard()/reshard()) shows full shapes."""

    def shapes_ok(ctx, model):
        if ctx.side == "shardwise":
            return all(is_piece(p) for p in model.parameters())
        if ctx.side == "fsdp2":
            return all(hasattr(p, "full_tensor") for p in model.parameters())
        return True

    def step(ctx, model, x):
        out = model(ctx.take(x))
        after_forward = shapes_ok(ctx, model)
        loss = out.pow(2).mean()
        bwd(ctx, model, loss)
        ctx.rec.setdefault("sharded", []).append((after_forward, shapes_ok(ctx, model)))
        return loss

    def finish(ctx, model):
        want = {n: tuple(p.shape) for n, p in ctx.initial.named_parameters()}
        if ctx.side == "shardwise":
            with shardwise.summon_full_params(model):
                got = {n: tuple(p.shape) for n, p in model.named_parameters()}
            back = shapes_ok(ctx, model)
        elif ctx.side == "fsdp2":
            for m in model.modules():
                if hasattr(m, "unshard"):
                    m.unshard()
            got = {n: tuple(p.shape) for n, p in model.named_parameters()}  # DTensor shapes are global anyway
            for m in model.modules():
                if hasattr(m, "reshard"):
                    m.reshard()
            back = shapes_ok(ctx, model)
        else:
            got, back = want, True
        return {"summoned_shapes_ok": got == want, "sharded_again": back}

    def check(extra, side, ws):
        assert_eq(extra["sharded"], [(True, True)] * 3)
        assert extra["summoned_shapes_ok"] and extra["sharded_again"], extra

    def make():
        torch.manual_seed(0)
        return mlp_stack(5)

    return Case(make, step, randn_batches(3, 5), finish=finish, check=check,
                doc="test_param_registration_after_forward / _after_backward")


@case()
def case_to_float64_after_shard(ws):
    def make():
        torch.manual_seed(0)
        m = MLP(4)
        unit(m.in_proj), unit(m.out_proj)
        return m

    def step(ctx, model, x):
        loss = model(ctx.take(x).double()).pow(2).mean()
        bwd(ctx, model, loss)
        ctx.rec.setdefault("dtypes", set()).update(
            str(t.dtype) for p in model.parameters() for t in (p, p.grad) if t is not None)
        return loss

    return Case(make, step, randn_batches(4, 4), prepare=lambda ctx, model: model.to(torch.float64),
                check=lambda extra, side, ws: assert_eq(extra["dtypes"], {"torch.float64"}),
                doc="TestFullyShardCastAfterInit.test_to_float64_after_init: model.to(float64) after sharding")
