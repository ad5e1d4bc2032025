"""Plain torch model code the runtime's hooks must follow, with ``units="auto"`` (or a unit class): every
model trains exactly like a single-process reference.

``torch.utils.checkpoint`` around units in both modes (the units' forwards run again inside backward),
outputs the hooks cannot see (a ``@dataclass``, an object holding the loss), BatchNorm buffers (rank 0's
running statistics, as DDP broadcasts them), a registered entry method that uses root parameters without a
root forward, and MoE experts as units of their own (an expert without tokens is not called on one rank
while another rank calls it).

Parity as in ``test_parity``: fp32, SGD+momentum, losses and every parameter shard within 1e-6 relative of
the reference trained on the whole global batch. One spawn at world size 2 carries every scenario
(``run_scenarios``); the Hugging Face families are in ``tests/hf/test_hf_families.py``.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from harness import run_distributed
from parity_utils import (GLOBAL_BATCH, assert_engine_clean, assert_parity, gather_objects, global_mean,
                          local_slice, make_batches, make_optimizer, max_over_ranks, parity_check, rel_err,
                          routed_batches, run_scenarios, scalar_rel_err, scenario, sharded_param_errors, spawn_once,
                          train_pair, worst)
from shardwise import ShardwiseError

STEPS = 3
VOCAB = 101
RTOL = 1e-6


def _check_params_readable(model: nn.Module) -> None:
    """Fail (instead of crashing the process) if a module parameter is bound to storage too small for it."""
    from shardwise.engine.surface.pieces import local_of

    for name, p in model.named_parameters():
        p = local_of(p)  # (a piece has no memory of its own: its elements are what is bound)
        need = (p.storage_offset() + p.numel()) * p.element_size()
        if p.numel() and p.untyped_storage().nbytes() < need:
            raise AssertionError(f"{name}: bound to {p.untyped_storage().nbytes()} bytes of storage, needs {need} "
                                 f"(freed gathered buffer left bound after backward)")


# ---- plain torch models ----------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm residual MLP; odd sizes so no flat buffer divides evenly by the world size."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d + 1)
        self.out = nn.Linear(2 * d + 1, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(torch.tanh(self.fc(self.norm(h))))


class Net(nn.Module):
    def __init__(self, vocab: int = 29, d: int = 11, n_layer: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_layer)])
        self.head = nn.Linear(d, vocab)

    def logits(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)

    def forward(self, x, y):
        return F.cross_entropy(self.logits(x).flatten(0, 1), y.flatten())


class CheckpointedNet(Net):
    """torch.utils.checkpoint around every unit (the blocks), reentrant or not."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, x, y):
        h = self.embed(x)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.use_reentrant)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor
    aux: int = 0


@dataclasses.dataclass
class NetOut:
    loss: torch.Tensor
    logits: torch.Tensor


class CarryOut:
    """Not a dataclass, not a dict, not a tuple: an object holding tensors in attributes."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class WrappedBlock(Block):
    def __init__(self, d: int, wrap):
        super().__init__(d)
        self.wrap = wrap

    def forward(self, carried):
        h = carried.hidden if self.wrap is BlockOut else carried.h
        h = super().forward(h)
        return BlockOut(h) if self.wrap is BlockOut else CarryOut(h=h, extras=[h.detach()])


class OpaqueOutputNet(nn.Module):
    """Units return a @dataclass or a plain object; so does the root (the loss inside it)."""

    def __init__(self, wrap, vocab: int = 29, d: int = 11, n_layer: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.wrap = wrap
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([WrappedBlock(d, wrap) for _ in range(n_layer)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x, y):
        h = self.embed(x)
        carried = BlockOut(h) if self.wrap is BlockOut else CarryOut(h=h)
        for b in self.blocks:
            carried = b(carried)
        h = carried.hidden if self.wrap is BlockOut else carried.h
        logits = self.head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        return NetOut(loss, logits) if self.wrap is BlockOut else CarryOut(result={"loss": loss}, logits=logits)


def _opaque_step(model, batch, step, take):
    x, y = batch
    out = model(take(x), take(y))
    loss = out.loss if isinstance(out, NetOut) else out.result["loss"]
    loss.backward()
    return loss.detach()


class EncodeNet(Net):
    """``encode`` uses root parameters directly (F.embedding, a matmul), not through submodule calls."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(7, 11) * 0.3)

    def encode(self, x):
        h = F.embedding(x, self.embed.weight)
        for b in self.blocks:
            h = b(h)
        return h.mean(1) @ self.proj.t()


def _encode_step(model, batch, step, take):
    x, y = batch
    loss = F.cross_entropy(model.encode(take(x)), take(y)[:, 0] % 7)
    loss.backward()
    return loss.detach()


class BNBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, h):
        return h + torch.tanh(self.bn(self.fc(h)))


class BNNet(nn.Module):
    def __init__(self, d_in: int = 10, d: int = 13, n_out: int = 5):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(d_in, d)
        self.bn = nn.BatchNorm1d(d)  # a buffer owner in the root unit too
        self.blocks = nn.ModuleList([BNBlock(d) for _ in range(2)])
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        h = self.bn(self.inp(x))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _bn_scenario(rank, ws):
    """BatchNorm in train mode normalises with each rank's own batch statistics, so the exact reference is:
    every rank's slice forwarded with rank 0's running stats, gradients averaged, and the running stats of
    rank 0's forward kept (DDP's broadcast_buffers: rank 0's buffers are broadcast before each forward).
    After training, an eval forward must give the reference's output on every rank and leave every rank's
    buffers equal to the reference's."""
    initial = BNNet()
    ref = copy.deepcopy(initial)
    model = shardwise.shard(copy.deepcopy(initial), units="auto")
    opt, ref_opt = make_optimizer("sgd", model.parameters()), make_optimizer("sgd", ref.parameters())
    g = torch.Generator().manual_seed(3)
    loss_err, param_err = 0.0, 0.0
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 10, generator=g) * (1 + torch.arange(GLOBAL_BATCH)[:, None] / 4)
        y = torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)
        start = {n: b.clone() for n, b in ref.named_buffers()}
        kept, ref_losses = None, []
        for r in range(ws):
            with torch.no_grad():
                for n, b in ref.named_buffers():
                    b.copy_(start[n])
            loss_r = F.cross_entropy(ref(local_slice(x, r, ws)), local_slice(y, r, ws))
            (loss_r / ws).backward()
            ref_losses.append(loss_r.item())
            if r == 0:
                kept = {n: b.clone() for n, b in ref.named_buffers()}
        with torch.no_grad():
            for n, b in ref.named_buffers():
                b.copy_(kept[n])
        loss = F.cross_entropy(model(local_slice(x, rank, ws)), local_slice(y, rank, ws))
        loss.backward()
        assert_engine_clean(model)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(set_to_none=True), opt.zero_grad(set_to_none=True)
        loss_err = max(loss_err, scalar_rel_err(global_mean(loss), sum(ref_losses) / ws))
        param_err = max(param_err, worst(sharded_param_errors(model, ref))[1])
    model.eval()
    ref.eval()
    x_eval = torch.randn(4, 10, generator=g)
    with torch.no_grad():
        eval_err = max_over_ranks(rel_err(model(x_eval), ref(x_eval)))
    ref_bufs = dict(ref.named_buffers())
    buf_err = {n: max_over_ranks(rel_err(b, ref_bufs[n])) for n, b in model.named_buffers()}
    return dict(loss_err=loss_err, param_err=param_err, eval_err=eval_err, buf_err=buf_err)


def _checkpoint_scenario(use_reentrant: bool):
    def run(rank, ws):
        metrics, model, ref = parity_check(CheckpointedNet(use_reentrant), _plain_step, make_batches(STEPS, 29),
                                           rank, ws, shard_kwargs=dict(units="auto"))
        # After backward every module parameter must be its (readable) shard: read them all, as a user would.
        _check_params_readable(model)
        total = sum(float(p.detach().sum()) for p in model.parameters())
        keys = len(model.state_dict())
        # an optimizer built now sees the same shards
        late = make_optimizer("sgd", model.parameters())
        return dict(metrics=metrics, total_finite=bool(torch.isfinite(torch.tensor(total))), keys=keys,
                    late_params=sum(len(g["params"]) for g in late.param_groups),
                    n_params=len(list(ref.parameters())))

    return run


def _plain_step(model, batch, step, take):
    x, y = batch
    loss = model(take(x), take(y))
    loss.backward()
    return loss.detach()


def _opaque_scenario(wrap):
    def run(rank, ws):
        metrics, _, _ = parity_check(OpaqueOutputNet(wrap), _opaque_step, make_batches(STEPS, 29), rank, ws,
                                     shard_kwargs=dict(units="auto"))
        return dict(metrics=metrics)

    return run


def _encode_scenario(rank, ws):
    """Training through a registered entry method: the root forward never runs."""
    initial = EncodeNet()
    ref = copy.deepcopy(initial)
    model = shardwise.shard(copy.deepcopy(initial), units="auto")
    shardwise.register_forward_method(model, "encode")
    x = local_slice(make_batches(1, 29)[0][0], rank, ws)
    with torch.no_grad():
        err = max_over_ranks(rel_err(model.encode(x), ref.encode(x)))
    metrics = train_pair(model, ref, _encode_step, make_batches(STEPS, 29), rank, ws)
    return dict(err=err, metrics=metrics)


# ---- MoE whose experts are units of their own ------------------------------------------------------------
class Expert(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d + 1)
        self.out = nn.Linear(2 * d + 1, d)

    def forward(self, h):
        return self.out(F.gelu(self.fc(h)))


class MoELayer(nn.Module):
    """Top-1 router; an expert that gets no tokens is not called (the usual MoE code)."""

    def __init__(self, d: int, n_experts: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(d) for _ in range(n_experts)])
        self.hits: list = []

    def forward(self, h):
        flat = self.norm(h).reshape(-1, h.shape[-1])
        probs = self.router(flat).softmax(-1)
        weight, choice = probs.max(-1)
        self.hits.append(torch.bincount(choice, minlength=len(self.experts)))
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_add(0, idx, expert(flat[idx]) * weight[idx, None])
        return h + out.view_as(h)


class MoENet(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 11):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([MoELayer(d) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x, y):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _moe_expert_units_scenario(rank, ws):
    """units={Expert}: an expert with no tokens on one rank is not called there, but is on another. Either
    parity (the engine still takes part in that unit's collectives) or a ShardwiseError on every rank
    naming the expert unit."""
    initial = MoENet()
    try:
        metrics, model, _ = parity_check(initial, _plain_step, routed_batches(STEPS, VOCAB, ws), rank, ws,
                                         shard_kwargs=dict(units={Expert}))
        outcome = dict(metrics=metrics)
        layers = model.layers
    except ShardwiseError as e:
        outcome = dict(shardwise_error=str(e))
        layers = None
    # routing of step 0 on this rank, from the reference-independent copy (same weights, this rank's slice)
    probe = MoENet()
    with torch.no_grad():
        x, y = routed_batches(STEPS, VOCAB, ws)[0]
        probe(local_slice(x, rank, ws), local_slice(y, rank, ws))
    counts = torch.stack([layer.hits[0] for layer in probe.layers])
    per_rank = torch.stack(gather_objects(counts))
    outcome["idle_here_busy_there"] = ((per_rank == 0).any(0) & (per_rank > 0).any(0)).sum().item()
    outcome["errors_on_ranks"] = gather_objects("shardwise_error" in outcome)
    del layers
    return outcome


# ---- what a module does to its parameters around its own forward ------------------------------------------
class WeightNormNet(nn.Module):
    """Legacy ``torch.nn.utils.weight_norm``: a pre-forward hook computes ``weight`` from ``weight_g`` and
    ``weight_v``, so it must run after the unit's entry has gathered them (shardwise's entry hooks go first)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(29, 9)
        self.hidden = torch.nn.utils.weight_norm(nn.Linear(9, 13))
        self.head = torch.nn.utils.weight_norm(nn.Linear(13, 29), dim=None)

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.hidden(self.embed(idx))))
        return F.cross_entropy(logits.reshape(-1, 29), targets.reshape(-1))


class SparseEmbeddingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(29, 9, sparse=True)  # gradients arrive as sparse tensors: reduced dense
        self.head = nn.Linear(9, 29)

    def forward(self, idx, targets):
        return F.cross_entropy(self.head(self.embed(idx)).reshape(-1, 29), targets.reshape(-1))


def _built_twice_scenario(build, units, optimizers=("sgd", "adamw")):
    """Parity for a model that cannot be deep-copied (a weight_norm module's ``weight`` is not a leaf): the
    reference and the sharded model are built from the same seed."""

    def run(rank, ws):
        out = {}
        for optimizer in optimizers:
            torch.manual_seed(0)
            ref = build()
            torch.manual_seed(0)
            model = shardwise.shard(build(), units=units)
            out[optimizer] = train_pair(model, ref, _plain_step, make_batches(STEPS, 29), rank, ws, optimizer=optimizer)
        return out

    return run


def _torch_worker(rank, ws):
    return run_scenarios({
        "dataclass_output": _opaque_scenario(BlockOut),
        "object_output": _opaque_scenario(CarryOut),
        "batchnorm": _bn_scenario,
        "encode_method": _encode_scenario,
        "torch_checkpoint_non_reentrant": _checkpoint_scenario(False),
        "torch_checkpoint_reentrant": _checkpoint_scenario(True),
        "weight_norm_units": _built_twice_scenario(WeightNormNet, {nn.Linear}),  # the hooked module is the unit
        "weight_norm_root": _built_twice_scenario(WeightNormNet, None),
        # (torch's AdamW refuses the reference's sparse gradient; SGD with momentum takes it)
        "sparse_embedding": _built_twice_scenario(SparseEmbeddingNet, {nn.Embedding}, ("sgd",)),
        "moe_expert_units": _moe_expert_units_scenario,  # last: ranks calling different units
    }, rank, ws)


@spawn_once
def torch_report() -> dict:
    return run_distributed(_torch_worker, 2)[0]


# ---- tests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["torch_checkpoint_non_reentrant", "torch_checkpoint_reentrant"])
def test_torch_checkpoint_around_units(name):
    """torch.utils.checkpoint(block, use_reentrant=...) around every unit: parity, and afterwards every
    parameter is a readable shard (sum, state_dict, a new optimizer) instead of freed storage."""
    r = scenario(torch_report(), name)
    assert_parity(r["metrics"], label=name)
    assert r["total_finite"] and r["keys"] == r["n_params"] and r["late_params"] == r["n_params"], r


@pytest.mark.parametrize("name", ["dataclass_output", "object_output"])
def test_outputs_the_hooks_cannot_see(name):
    """Units and the root return a @dataclass / a plain object holding the tensors (the loss in a dict
    inside it): backward is still detected at once, gradients are this step's."""
    assert_parity(scenario(torch_report(), name)["metrics"], label=name)


def test_batchnorm_buffers_follow_rank0_like_ddp():
    """Training matches the per-rank-statistics reference; after it an eval forward gives the reference's
    output on every rank and every rank's running stats equal the reference's (rank 0's)."""
    r = scenario(torch_report(), "batchnorm")
    assert r["loss_err"] <= RTOL and r["param_err"] <= RTOL, r
    assert r["eval_err"] <= RTOL, r
    assert all(e <= RTOL for e in r["buf_err"].values()), r["buf_err"]


def test_registered_encode_method_trains_without_root_forward():
    """register_forward_method(model, 'encode'): encode() uses root weights directly; its output equals the
    unsharded one and training through it alone is exact."""
    r = scenario(torch_report(), "encode_method")
    assert r["err"] <= RTOL, r["err"]
    assert_parity(r["metrics"], label="encode")


def test_moe_with_experts_as_units_idle_on_some_ranks():
    """units={Expert}: an expert without tokens on one rank is not called there while another rank calls
    it. Parity, or a ShardwiseError on every rank naming an expert unit."""
    r = torch_report()["moe_expert_units"]
    if isinstance(r, dict) and "error" in r:
        raise AssertionError(r["error"])
    assert r["idle_here_busy_there"] > 0
    if "shardwise_error" in r:
        assert all(r["errors_on_ranks"]), f"only some ranks raised: {r['errors_on_ranks']}"
        assert "experts." in r["shardwise_error"], r["shardwise_error"]
        return
    assert_parity(r["metrics"], label="moe expert units")


@pytest.mark.parametrize("name", ["weight_norm_units", "weight_norm_root"])
def test_legacy_weight_norm_trains_exactly(name):
    """torch.nn.utils.weight_norm's pre-forward hook computes the weight after the unit's entry gathered
    weight_g and weight_v (it read freed memory and crashed the process before shardwise's entry hooks went
    first), whether the normalised Linear is a unit of its own or inside the root."""
    for optimizer, metrics in scenario(torch_report(), name).items():
        assert_parity(metrics, label=f"{name}/{optimizer}")


def test_sparse_embedding_gradients_are_reduced_dense():
    """nn.Embedding(sparse=True): its sparse gradient is reduced (and handed out) dense: exact with SGD and
    momentum (so dense optimizers such as AdamW work too; SparseAdam, which needs sparse gradients, is refused
    with the other non-elementwise optimizers)."""
    for optimizer, metrics in scenario(torch_report(), "sparse_embedding").items():
        assert_parity(metrics, label=f"sparse embedding/{optimizer}")
