"""Paths around the main one that real training code takes: each gives the single-process numbers or a
``ShardwiseError`` on every rank, and leaves the engine clean after every backward.

Recompute outside our hooks (``torch.utils.checkpoint`` in both modes around units, and the way Hugging Face
checkpoints ``forward`` so that module hooks stay outside), outputs the hooks cannot look into by type
(dataclasses, plain objects), an exception caught in forward or backward, ``no_sync`` with a unit unused in
the last micro-batch, freezing and unfreezing after ``shard()``, conversions after ``shard()``,
optimizer-in-backward hooks, double backward, a module called outside the root forward. All scenarios run
in one spawn at world size 3 (uneven shards), fp32, SGD with momentum, 1e-6 relative (``parity_utils``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import shardwise
from harness import run_distributed
from models import GPT, Block, SkippableGPT, gpt_loss, tiny_gpt_config
from parity_utils import (assert_engine_clean, assert_parity, is_sharded, local_slice, make_batches, parity_check,
                          rel_err, run_scenarios, scenario, simple_step, spawn_once)
from shardwise import ShardwiseError
from shardwise.engine.surface.pieces import is_piece, local_of
WORLD_SIZE = 3
VOCAB = tiny_gpt_config().vocab_size
STEPS = 3


def _gpt(cls=GPT, **overrides):
    torch.manual_seed(0)
    return cls(tiny_gpt_config(**overrides))


# ---- recompute outside our hooks ------------------------------------------------------------------------
class CheckpointedCallGPT(GPT):
    """Wraps every block *call* in ``torch.utils.checkpoint``: the recompute goes through module hooks."""

    reentrant = False

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant) if torch.is_grad_enabled() else block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class ForwardCheckpointedBlock(Block):
    """Checkpoints its own ``forward`` (as transformers' GradientCheckpointingLayer does): the recompute
    calls forward directly, inside backward, with no module hook around it."""

    reentrant = False

    def forward(self, x):
        if torch.is_grad_enabled():
            return checkpoint(super().forward, x, use_reentrant=self.reentrant)
        return super().forward(x)


def _with_forward_checkpointing(reentrant: bool) -> GPT:
    model = _gpt()
    for b in model.blocks:
        b.__class__ = ForwardCheckpointedBlock
        b.reentrant = reentrant
    return model


def _loss_only(model, x, y):
    return model(x, y)


def _recompute(rank, ws):
    out = {}
    for reentrant in (False, True):
        for strategy in ("full_shard", "shard_grad_op"):
            CheckpointedCallGPT.reentrant = reentrant
            metrics, model, _ = parity_check(_gpt(CheckpointedCallGPT), simple_step(_loss_only),
                                             make_batches(STEPS, VOCAB), rank, ws,
                                             shard_kwargs=dict(units={Block}, strategy=strategy))
            # every parameter readable afterwards (it used to be bound to freed storage: SIGSEGV)
            total = sum(float(p.detach().sum()) for p in model.parameters()) + len(model.state_dict())
            out[f"call reentrant={reentrant} {strategy}"] = dict(metrics=metrics, readable=total == total)
            metrics, _, _ = parity_check(_with_forward_checkpointing(reentrant), simple_step(gpt_loss),
                                         make_batches(STEPS, VOCAB), rank, ws,
                                         shard_kwargs=dict(units={ForwardCheckpointedBlock}, strategy=strategy))
            out[f"forward reentrant={reentrant} {strategy}"] = dict(metrics=metrics, readable=True)
    return out


# ---- outputs the hooks cannot tell by type --------------------------------------------------------------
@dataclasses.dataclass
class LossAndLogits:
    loss: torch.Tensor
    logits: torch.Tensor


class Carrier:
    """A plain object holding the loss in an attribute."""

    def __init__(self, loss):
        self.payload = {"loss": loss}


class DataclassGPT(GPT):
    def forward(self, idx, targets=None):
        out = super().forward(idx, targets)
        return LossAndLogits(out.loss, out.logits)


class ObjectGPT(GPT):
    def forward(self, idx, targets=None):
        return Carrier(super().forward(idx, targets).loss)


def _opaque_outputs(rank, ws):
    out = {}
    for name, cls, loss_of in (("dataclass", DataclassGPT, lambda m, x, y: m(x, y).loss),
                               ("object", ObjectGPT, lambda m, x, y: m(x, y).payload["loss"])):
        for strategy in ("full_shard", "shard_grad_op"):
            out[f"{name} {strategy}"] = parity_check(_gpt(cls), simple_step(loss_of), make_batches(STEPS, VOCAB),
                                                     rank, ws, shard_kwargs=dict(units={Block}, strategy=strategy))[0]
    return out


# ---- exceptions caught mid-step ---------------------------------------------------------------------------
class Failing(RuntimeError):
    pass


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Failing("simulated out of memory in backward")


def _skip_on_failure(where: str, fail_step: int = 1):
    """Forward+backward; at ``fail_step`` the step raises (in a block's forward, or in backward after the
    head's gradients are computed) and is skipped the usual way: catch, zero_grad, go on."""

    def step(model, batch, step, take):
        x, y = batch
        block = model.blocks[1]
        handle = None
        if step == fail_step and where == "forward":
            def boom(module, args):
                raise Failing("simulated out of memory in forward")
            handle = block.register_forward_pre_hook(boom)
        try:
            out = model(take(x), take(y))
            loss = out.loss
            if step == fail_step and where == "backward":
                loss = FailInBackward.apply(loss)
            loss.backward()
            return out.loss.detach()
        except Failing:
            for p in model.parameters():
                p.grad = None
            return torch.zeros(())
        finally:
            if handle is not None:
                handle.remove()

    return step


def _caught_exceptions(rank, ws):
    out = {}
    for where in ("forward", "backward"):
        for strategy in ("full_shard", "shard_grad_op", "no_shard"):
            # A backward that raised runs none of our code after the failure: the engine settles at the next
            # forward (step 2), where the invariants are checked again.
            out[f"{where} {strategy}"] = parity_check(
                _gpt(), _skip_on_failure(where), make_batches(4, VOCAB), rank, ws,
                shard_kwargs=dict(units={Block}, strategy=strategy),
                unsettled_steps=(1,) if where == "backward" else ())[0]
    return out


# ---- no_sync with a unit unused in the last micro-batch ---------------------------------------------------
MICRO_SKIPS = [(), (0,), (1,)]  # block 1 runs in the first two micro-batches, not in the last


def _accumulate_with_unused(model, micro_batches, step, take):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        loss = model(take(x), take(y), skip=MICRO_SKIPS[i])
        if is_sharded(model) and not last:
            with shardwise.no_sync(model):
                loss.backward()
        else:
            loss.backward()
        total = total + loss.detach()
    return total


def _no_sync_unused(rank, ws):
    batches = [make_batches(len(MICRO_SKIPS), VOCAB, seed=50 + s) for s in range(STEPS)]
    return {s: parity_check(_gpt(SkippableGPT), _accumulate_with_unused, batches, rank, ws,
                            shard_kwargs=dict(units={Block}, strategy=s))[0]
            for s in ("full_shard", "shard_grad_op", "no_shard")}


# ---- changes after shard() --------------------------------------------------------------------------------
def _toggle_at_step_one(change):
    def step(model, batch, step, take):
        if step == 1:
            change(model)
        x, y = batch
        loss = gpt_loss(model, take(x), take(y))
        loss.backward()
        return loss.detach()

    return step


def _freeze_unfreeze(rank, ws):
    out = {}
    freeze = _toggle_at_step_one(lambda m: m.blocks[0].requires_grad_(False))
    unfreeze = _toggle_at_step_one(lambda m: m.blocks[2].requires_grad_(True))
    for strategy in ("full_shard", "no_shard"):
        out[f"freeze {strategy}"] = parity_check(_gpt(), freeze, make_batches(STEPS, VOCAB), rank, ws,
                                                 shard_kwargs=dict(units={Block}, strategy=strategy))[0]
        initial = _gpt()
        initial.blocks[2].requires_grad_(False)
        out[f"unfreeze {strategy}"] = parity_check(initial, unfreeze, make_batches(STEPS, VOCAB), rank, ws,
                                                   shard_kwargs=dict(units={Block}, strategy=strategy))[0]
    return out


def _forward_error(model, x) -> str:
    try:
        gpt_loss(model, x, x).backward()
    except ShardwiseError as e:
        return str(e)
    return "no error"


CONVERSIONS = {"half": lambda m: m.half(), "double": lambda m: m.double(),
               "to(bfloat16)": lambda m: m.to(torch.bfloat16)}
REFUSED_CHANGES = {
    "one parameter's dtype": lambda m: setattr(m.blocks[1].mlp.c_fc.weight, "data",
                                               m.blocks[1].mlp.c_fc.weight.data.double()),
    "to(meta)": lambda m: m.to("meta"),
}


def _conversions(rank, ws):
    """``model.to(dtype)`` after shard(), then training: the engine follows the conversion (as FSDP2 does)
    and trains like a reference converted the same way. Other changes of parameters are refused by name."""
    out = {}
    for name, convert in CONVERSIONS.items():
        dtypes = set()

        def step(model, batch, step, take, convert=convert, dtypes=dtypes):
            if step == 0:
                convert(model)
            x, y = batch
            loss = gpt_loss(model, take(x), take(y))
            loss.backward()
            dtypes.update(str(t.dtype) for p in model.parameters() for t in (p, p.grad) if t is not None)
            return loss.float()

        metrics, _, _ = parity_check(_gpt(), step, make_batches(STEPS, VOCAB), rank, ws,
                                     shard_kwargs=dict(units={Block}))
        out[name] = dict(metrics=metrics, dtypes=sorted(dtypes))
    x = torch.randint(0, VOCAB, (2, 8))
    for name, change in REFUSED_CHANGES.items():
        model = shardwise.shard(_gpt(), units={Block})
        change(model)
        out[name] = _forward_error(model, x)
    # p.data = a tensor of the whole's dtype, device and shape copies its values in (a piece's or a plain
    # whole tensor's): the forward is the reference's with the same weight.
    ref, model = _gpt(), shardwise.shard(_gpt(), units={Block})
    new = torch.randn(ref.blocks[1].mlp.c_fc.weight.shape, generator=torch.Generator().manual_seed(3))
    ref.blocks[1].mlp.c_fc.weight.data = new.clone()
    model.blocks[1].mlp.c_fc.weight.data = new.clone()
    model.blocks[0].mlp.c_fc.weight.data = model.blocks[0].mlp.c_fc.weight.data * 0.5
    ref.blocks[0].mlp.c_fc.weight.data = ref.blocks[0].mlp.c_fc.weight.data * 0.5
    with torch.no_grad():
        out["p.data = whole"] = rel_err(gpt_loss(model, x, x), gpt_loss(ref, x, x))
    return out


def _optimizer_in_backward(rank, ws):
    """SGD applied per parameter from ``register_post_accumulate_grad_hook`` (no optimizer.step())."""
    initial, batches = _gpt(), make_batches(STEPS, VOCAB)
    ref = GPT(tiny_gpt_config())
    ref.load_state_dict(initial.state_dict())
    model = shardwise.shard(initial, units={Block})
    calls = {"n": 0}

    def install(m, count):
        for p in m.parameters():
            opt = torch.optim.SGD([p], lr=0.2, momentum=0.9)

            def hook(param, opt=opt):
                if count:
                    calls["n"] += 1
                opt.step()
                opt.zero_grad(set_to_none=True)

            p.register_post_accumulate_grad_hook(hook)

    install(ref, False)
    install(model, True)
    for x, y in batches:
        gpt_loss(ref, x, y).backward()
        gpt_loss(model, local_slice(x, rank, ws), local_slice(y, rank, ws)).backward()
        assert_engine_clean(model)
    from parity_utils import sharded_param_errors, worst
    return dict(err=worst(sharded_param_errors(model, ref)), calls=calls["n"], params=len(list(model.parameters())))


def _double_backward(rank, ws):
    model = shardwise.shard(_gpt(), units={Block})
    x = torch.randint(0, VOCAB, (2, 8))
    loss = gpt_loss(model, x, x)
    try:
        loss.backward(create_graph=True)  # the first half of a gradient penalty
        text = "no error"
    except ShardwiseError as e:
        text = str(e)
    gpt_loss(model, x, x).backward()  # and the engine is usable afterwards
    assert_engine_clean(model)
    return text


# ---- calls outside the root forward -----------------------------------------------------------------------
class Probed(GPT):
    def weight_norm(self):
        return self.wte.weight.norm()  # reads a weight directly: needs register_forward_method


def _outside_forward(rank, ws):
    initial = _gpt(Probed, tie_weights=True)
    ref = _gpt(Probed, tie_weights=True)
    model = shardwise.shard(initial, units={Block})
    shardwise.register_forward_method(model, "weight_norm")
    h = torch.randn(2, 5, tiny_gpt_config().n_embd)
    out = {}
    with torch.no_grad():
        out["head"] = rel_err(model.lm_head(h), ref.lm_head(h))  # the tied weight lives in the root unit
        out["block"] = rel_err(model.blocks[1](h), ref.blocks[1](h))
        out["method"] = rel_err(model.weight_norm(), ref.weight_norm())
    with shardwise.summon_full_params(model):
        out["summoned"] = max(rel_err(p, ref.get_parameter(n)) for n, p in model.named_parameters())
        out["shapes"] = all(p.shape == ref.get_parameter(n).shape for n, p in model.named_parameters())
        with torch.no_grad():
            model.blocks[0].mlp.c_fc.weight.mul_(2.0)  # written back on exit
    with torch.no_grad():
        ref.blocks[0].mlp.c_fc.weight.mul_(2.0)
    with shardwise.summon_full_params(model.blocks[2], writeback=False):
        with torch.no_grad():
            model.blocks[2].mlp.c_fc.weight.zero_()  # dropped on exit
    x, y = make_batches(1, VOCAB)[0]
    out["after"] = rel_err(gpt_loss(model, local_slice(x, rank, ws), local_slice(y, rank, ws)),
                           gpt_loss(ref, local_slice(x, rank, ws), local_slice(y, rank, ws)))
    # Back to pieces: the whole's shape, this rank's elements only.
    params = list(model.parameters())
    out["shards_after"] = (all(is_piece(p) for p in params)
                           and sum(local_of(p).numel() for p in params) < sum(p.numel() for p in params))
    return out


class Gan(torch.nn.Module):
    """A generator and a discriminator with their heads in the root unit, and a ``train_step`` that steps both
    optimizers inside it, each between a toggle of ``requires_grad`` (Lightning's manual optimisation)."""

    def __init__(self, width: int = 10):
        super().__init__()
        self.generator = torch.nn.Sequential(Tanh(width), Tanh(width), torch.nn.Linear(width, width))
        self.discriminator = torch.nn.Sequential(Tanh(width), Tanh(width), torch.nn.Linear(width, 1))

    def train_step(self, x, g_opt, d_opt):
        def toggle(opt):  # as LightningModule.toggle_optimizer: through the optimizers' parameters
            chosen = {id(p) for g in opt.param_groups for p in g["params"]}
            for o in (g_opt, d_opt):
                for p in (p for g in o.param_groups for p in g["params"]):
                    p.requires_grad_(id(p) in chosen)

        z = x.flip(1)
        toggle(d_opt)
        fake = self.generator(z).detach()
        d_loss = F.softplus(-self.discriminator(x)).mean() + F.softplus(self.discriminator(fake)).mean()
        d_loss.backward()
        d_opt.step()
        d_opt.zero_grad()
        toggle(g_opt)
        g_loss = F.softplus(-self.discriminator(self.generator(z))).mean()
        g_loss.backward()
        g_opt.step()
        g_opt.zero_grad()
        for p in (p for o in (g_opt, d_opt) for g in o.param_groups for p in g["params"]):
            p.requires_grad_(True)  # untoggled
        return torch.stack([d_loss.detach(), g_loss.detach()])


class Tanh(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def _steps_inside_a_method(rank, ws):
    """Two optimizers stepped inside a method registered with register_forward_method (the root gathered around
    it), plain ``opt.step()`` calls as in one process: the pass after the first step reads its new weights
    (the engine's step hook gathers the bound root again), and a parameter frozen at that step and unfrozen
    after it gets its gradient. Losses and parameters as one process running the same method."""
    out = {}
    for strategy in ("full_shard", "no_shard"):
        torch.manual_seed(0)
        ref, model = Gan(), Gan()
        model.load_state_dict(ref.state_dict())
        shardwise.shard(model, units={Tanh}, strategy=strategy)
        shardwise.register_forward_method(model, "train_step")
        opts = {id(m): (torch.optim.Adam(m.generator.parameters(), lr=0.05),
                        torch.optim.Adam(m.discriminator.parameters(), lr=0.05)) for m in (ref, model)}
        losses = []
        for i in range(STEPS):
            x = torch.randn(6, 10, generator=torch.Generator().manual_seed(i))
            mine = model.train_step(local_slice(x, rank, ws), *opts[id(model)])
            theirs = ref.train_step(x, *opts[id(ref)])
            torch.distributed.all_reduce(mine)  # the mean of equal slices' means: the batch's
            losses.append(rel_err(mine / ws, theirs))
        whole = shardwise.full_state_dict(model)
        out[strategy] = {"losses": losses, "params": max(rel_err(whole[k], v) for k, v in ref.state_dict().items())
                         if rank == 0 else 0.0}
    return out


class MaskedLinear(torch.nn.Module):
    """A linear layer with a bool mask and an int8 scale stored as (frozen) parameters."""

    def __init__(self, width: int = 12):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.mask = torch.nn.Parameter(torch.rand(width, width) > 0.3, requires_grad=False)
        self.scale = torch.nn.Parameter(torch.randint(-3, 4, (width,), dtype=torch.int8), requires_grad=False)

    def forward(self, x):
        return torch.tanh(F.linear(x, self.fc.weight * self.mask, self.fc.bias) * self.scale.float())


def _integer_params(rank, ws):
    """bool and int8 parameters in units and the root: gathered as their own dtype; numbers as the
    reference."""
    torch.manual_seed(0)
    initial = torch.nn.Sequential(MaskedLinear(), MaskedLinear(), MaskedLinear())
    batches = [torch.randn(6, 12, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]

    def step(model, x, _step, take):
        loss = model(take(x)).pow(2).mean()
        loss.backward()
        return loss

    out = {}
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        metrics, model, _ = parity_check(initial, step, batches, rank, ws,
                                         shard_kwargs=dict(units={MaskedLinear}, strategy=strategy))
        sd = shardwise.full_state_dict(model)
        out[strategy] = dict(metrics=metrics, dtypes=sorted({str(v.dtype) for v in sd.values()}) if sd else None)
    return out


def _worker(rank, ws):
    return run_scenarios({"recompute": _recompute, "opaque": _opaque_outputs, "exceptions": _caught_exceptions,
                          "no_sync_unused": _no_sync_unused, "freeze": _freeze_unfreeze, "conversions": _conversions,
                          "optimizer_in_backward": _optimizer_in_backward, "double_backward": _double_backward,
                          "outside_forward": _outside_forward, "integer_params": _integer_params,
                          "steps_inside_a_method": _steps_inside_a_method}, rank, ws)


@spawn_once
def report() -> dict:
    return run_distributed(_worker, WORLD_SIZE)[0]


@pytest.mark.parametrize("variant", [f"{how} reentrant={r} {s}" for how in ("call", "forward") for r in (False, True)
                                     for s in ("full_shard", "shard_grad_op")])
def test_torch_checkpoint_around_units_or_their_forward_trains_in_parity_and_leaves_params_readable(variant):
    """torch.utils.checkpoint around a unit's call, or inside its forward (Hugging Face's way, hooks outside),
    in both modes: parity, every parameter readable afterwards, no entry or ticket left over."""
    r = scenario(report(), "recompute")[variant]
    assert_parity(r["metrics"], label=variant)
    assert r["readable"]


@pytest.mark.parametrize("variant", ["dataclass full_shard", "dataclass shard_grad_op", "object full_shard",
                                     "object shard_grad_op"])
def test_outputs_of_any_type_train_in_parity(variant):
    """A @dataclass output or a plain object holding the loss: backward is found, gradients arrive on time."""
    assert_parity(scenario(report(), "opaque")[variant], label=variant)


@pytest.mark.parametrize("variant", [f"{w} {s}" for w in ("forward", "backward")
                                     for s in ("full_shard", "shard_grad_op", "no_shard")])
def test_an_exception_caught_in_forward_or_backward_skips_one_step_and_training_goes_on_in_parity(variant):
    """The "skip this batch on OOM" pattern: the failed step costs its gradients only; every later step
    matches a reference that skipped the same batch, and the engine is clean after every step."""
    assert_parity(scenario(report(), "exceptions")[variant], label=variant)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_no_sync_reduces_a_unit_that_the_last_micro_batch_did_not_use(strategy):
    """Block 1 runs in earlier no_sync micro-batches but not in the last (synced) one: its accumulated
    gradient is still reduced, so it trains exactly like the reference."""
    assert_parity(scenario(report(), "no_sync_unused")[strategy], label=strategy)


@pytest.mark.parametrize("variant", ["freeze full_shard", "unfreeze full_shard", "freeze no_shard",
                                     "unfreeze no_shard"])
def test_freezing_or_unfreezing_after_shard_trains_like_the_reference(variant):
    """requires_grad changed after shard(): frozen weights stop moving, unfrozen ones start training."""
    assert_parity(scenario(report(), "freeze")[variant], label=variant)


@pytest.mark.parametrize("conversion,rtol", [("double", 1e-6), ("half", 5e-3), ("to(bfloat16)", 3e-2)])
def test_converting_the_model_dtype_after_shard_trains_like_a_converted_reference(conversion, rtol):
    """model.double() / .half() / .to(bfloat16) after shard(): parameters and gradients take the new dtype
    and training matches a reference converted the same way (low precision: within its rounding)."""
    r = scenario(report(), "conversions")[conversion]
    assert_parity(r["metrics"], rtol=rtol, label=conversion)
    assert len(r["dtypes"]) == 1 and r["dtypes"][0] != "torch.float32", r["dtypes"]


def test_p_data_assigned_a_whole_tensor_after_shard_copies_its_values_in():
    err = scenario(report(), "conversions")["p.data = whole"]
    assert err <= 1e-6, f"off by {err:.2e}"


@pytest.mark.parametrize("change", list(REFUSED_CHANGES))
def test_other_changes_of_parameters_after_shard_are_a_named_error(change):
    text = scenario(report(), "conversions")[change]
    assert "after shardwise.shard()" in text and "parameter '" in text, text
    assert "load_full_state_dict" in text


def test_post_accumulate_grad_hooks_see_each_gradient_once_per_step_and_give_parity():
    """Optimizer-in-backward (a per-parameter SGD step in register_post_accumulate_grad_hook)."""
    r = scenario(report(), "optimizer_in_backward")
    assert r["calls"] == STEPS * r["params"]
    name, err = r["err"]
    assert err <= 1e-6, f"{name} off by {err:.2e}"


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_bool_and_int8_parameters_in_units_train_in_parity(strategy):
    r = scenario(report(), "integer_params")[strategy]
    assert_parity(r["metrics"], label=strategy)
    if r["dtypes"] is not None:  # rank 0
        assert r["dtypes"] == ["torch.bool", "torch.float32", "torch.int8"], r["dtypes"]


def test_double_backward_is_a_named_error_and_the_engine_stays_usable():
    text = scenario(report(), "double_backward")
    assert "create_graph=True" in text and "unit" in text, text


def test_modules_and_methods_called_outside_the_root_forward_use_full_parameters():
    """model.lm_head(h) (tied weight in the root unit), a block alone, a registered method reading a weight,
    summon_full_params with and without writeback."""
    r = scenario(report(), "outside_forward")
    for key in ("head", "block", "method", "summoned", "after"):
        assert r[key] <= 1e-6, f"{key}: off by {r[key]:.2e}"
    assert r["shapes"] and r["shards_after"]


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_optimizer_steps_inside_a_registered_method_refill_the_gathered_root(strategy):
    r = scenario(report(), "steps_inside_a_method")[strategy]
    assert max(r["losses"]) <= 1e-6 and r["params"] <= 1e-6, r
