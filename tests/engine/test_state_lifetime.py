"""State that follows the user's handles, and safety machinery that leaves healthy runs alone (issue #19,
causes 2 and 3). One spawn per world size runs every scenario (``run_scenarios``); each test reads its own.

* The no_sync accumulator lives only while the ``p.grad`` it belongs to does: ``zero_grad()`` drops the
  micro-batches accumulated before it, under every strategy.
* ZeRO-1/2's kept gathered parameters follow every write to the shards, however it is made (an optimizer
  step, ``load_pretrained`` after a forward, a write through ``p.data``, a write on one rank only), and
  the ranks agree on refilling them: outputs equal full_shard's.
* A forward whose graph is dropped (no backward) leaves no gathered unit that the next forward would reuse
  after the parameters were written: every strategy computes with the new values.
* Buffer broadcast does not write a buffer that already holds rank 0's values: two forwards before one
  backward with a buffer saved for backward work as in plain torch.
* A checkpoint of a base frozen at ``shard()`` and unfrozen after it saves what trains now.
* Under CPU offload a reference to last step's ``p.grad`` keeps its values through the next backward.
* ``offload_optimizer`` passes Muon's arguments and pairs its groups by parameters, and steps each unit
  during backward as its gradient lands (agreed on the training thread first), training as without offload.
* BatchNorm trains with each rank's own batch statistics, as under DDP (compared with torch DDP).
* ``copy.deepcopy`` of a sharded model, ``shard()`` of a model with a sharded submodule and a
  ``summon_full_params(writeback=True)`` edit made on one rank only are refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import shardwise
import hf_dirs
from harness import run_distributed
from models import GPT, Block, gpt_loss, tiny_gpt_config
from parity_utils import (assert_engine_clean, local_slice, make_batches, run_scenarios, scenario,
                          sharded_param_errors, spawn_once)

STRATEGIES = ("full_shard", "shard_grad_op", "shard_optim_grad", "shard_optim", "no_shard")
KEPT = ("shard_optim_grad", "shard_optim")  # the strategies that keep gathered parameters across steps
VOCAB = tiny_gpt_config().vocab_size


def _gpt(strategy=None):
    torch.manual_seed(0)
    model = GPT(tiny_gpt_config())
    return model if strategy is None else shardwise.shard(model, units={Block}, strategy=strategy)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _no_sync_dropped(rank, world):
    """Micro-batch A under no_sync, then zero_grad() (to None, and zeroed in place), then micro-batch B synced
    and a step: the result is B's step alone, as in plain torch."""
    (xa, ya), (xb, yb) = make_batches(2, VOCAB)
    ref = _gpt()
    opt = _sgd(ref.parameters())
    gpt_loss(ref, xb, yb).backward()
    opt.step()
    out = {}
    for i, strategy in enumerate(STRATEGIES):
        for set_to_none in (i % 2 == 0,):  # both kinds of zero_grad, alternating over the strategies
            model = _gpt(strategy)
            opt = _sgd(model.parameters())
            with shardwise.no_sync(model):
                gpt_loss(model, local_slice(xa, rank, world), local_slice(ya, rank, world)).backward()
            opt.zero_grad(set_to_none=set_to_none)
            gpt_loss(model, local_slice(xb, rank, world), local_slice(yb, rank, world)).backward()
            assert_engine_clean(model)
            opt.step()
            out[f"{strategy} set_to_none={set_to_none}"] = max(sharded_param_errors(model, ref).values())
    return out


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def _kept_copy_writes(rank, world):
    """After a step, the shards are written four ways between forwards; each strategy's outputs must
    equal full_shard's (which gathers at every forward, so it always reads the shards)."""
    (x, y), = make_batches(1, VOCAB)
    out = {}
    for strategy in ("full_shard",) + KEPT:
        model = _gpt(strategy)
        opt = _sgd(model.parameters())
        gpt_loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        seen = [_logits(model, x)]
        for p in model.parameters():  # an EMA swap / pruning, through .data: no version counter sees it
            p.data.mul_(0.5)
        seen.append(_logits(model, x))
        if rank == 0:  # a write on one rank only: that rank's shards change, the others' do not
            for p in model.parameters():
                p.data.add_(0.25)
        seen.append(_logits(model, x))
        with shardwise.summon_full_params(model, writeback=True), torch.no_grad():  # an edit of full parameters
            for p in model.parameters():
                p.mul_(0.75)
        seen.append(_logits(model, x))
        gpt_loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        assert_engine_clean(model)
        out[strategy] = seen
    return out


def _dropped_graph_then_write(rank, world):
    """A forward with grad whose graph is dropped (no backward: an evaluation left under grad mode, a loss
    skipped as NaN), then the parameters are written (p.data, an in-place write under no_grad, a load of
    the state dict) and the model is run again: every strategy computes with the new values, as one process
    does (units kept gathered for a backward that never came are not reused)."""
    (x, y), = make_batches(1, VOCAB)
    ref = _gpt()
    opt = _sgd(ref.parameters())
    gpt_loss(ref, x, y).backward()
    opt.step()
    writes = (lambda m: [p.data.mul_(0.5) for p in m.parameters()],
              lambda m: [p.mul_(0.75) for p in m.parameters()])
    want = []
    for write in writes:
        with torch.no_grad():
            write(ref)
        want.append(_logits(ref, x))
    whole = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.125)
    want.append(_logits(ref, x))
    out = {}
    for strategy in STRATEGIES:
        model = _gpt(strategy)
        opt = _sgd(model.parameters())
        gpt_loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        errs = []
        for write in writes:
            model(x).logits.sum()  # the graph is dropped here
            with torch.no_grad():
                write(model)
            errs.append((_logits(model, x) - want[len(errs)]).abs().max().item())
        model(x).logits.sum()
        shardwise.load_full_state_dict(model, {k: v + 0.125 if k in dict(ref.named_parameters()) else v
                                                for k, v in whole.items()})
        errs.append((_logits(model, x) - want[-1]).abs().max().item())
        gpt_loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        assert_engine_clean(model)
        out[strategy] = errs
    return out


def _buffer_saved_for_backward(rank, world):
    """A buffer that a forward saves for backward (a mask multiplied in), broadcast before every forward:
    two forwards, then one backward of both."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(7, 7) for _ in range(2))
            self.register_buffer("mask", torch.linspace(0.5, 1.5, 7))

        def forward(self, x):
            for b in self.blocks:
                x = b(x) * self.mask  # mul saves the mask for backward
            return x

    torch.manual_seed(0)
    ref = Masked()
    model = shardwise.shard(copy.deepcopy(ref), units={nn.Linear})
    x1, x2 = torch.randn(4, 7, generator=torch.Generator().manual_seed(1)), torch.randn(4, 7)
    (ref(x1).square().sum() + ref(x2).square().sum()).backward()
    loss = model(x1).square().sum() + model(x2).square().sum()
    loss.backward()  # every rank the same batch: the gradient is the single-process one
    _sgd(ref.parameters()).step()
    _sgd(model.parameters()).step()
    assert_engine_clean(model)
    return {"err": max(sharded_param_errors(model, ref).values())}


def _refusals(rank, world):
    out = {}
    model = _gpt("full_shard")
    try:
        copy.deepcopy(model)
        out["deepcopy"] = "no error"
    except shardwise.ShardwiseError as e:
        out["deepcopy"] = str(e)
    torch.manual_seed(0)
    outer = GPT(tiny_gpt_config())
    shardwise.shard(outer.blocks[0], units={type(outer.blocks[0].mlp)})
    try:
        shardwise.shard(outer, units={Block})
        out["nested"] = "no error"
    except shardwise.ShardwiseError as e:
        out["nested"] = str(e)
    with shardwise.summon_full_params(model), torch.no_grad():  # the same edit on every rank: written back
        model.lm_head.weight.mul_(2.0)
    try:
        with shardwise.summon_full_params(model), torch.no_grad():
            if rank == 0:
                model.lm_head.weight.add_(1.0)
        out["one_rank_edit"] = "no error"
    except shardwise.ShardwiseError as e:
        out["one_rank_edit"] = str(e)
    with shardwise.summon_full_params(model, writeback=False):
        out["lm_head"] = model.lm_head.weight.detach().clone()
    out["lm_head_ref"] = _gpt().lm_head.weight.detach() * 2.0
    return out


def _load_pretrained_after_forward(rank, world, directory):
    """Issue #17's regression: a forward, then load_pretrained, then a forward: ZeRO-1/2 equal full_shard."""
    from transformers import AutoConfig, AutoModelForCausalLM

    x = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    out = {}
    for strategy in ("full_shard",) + KEPT:
        torch.manual_seed(7)  # other weights than the file's
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32).eval()
        shardwise.shard(model, strategy=strategy)
        before = _logits(model, x)
        shardwise.load_pretrained(model, directory)
        out[strategy] = (before, _logits(model, x))
    return out


def _unfrozen_after_shard_is_saved(rank, world, ckpt_dir):
    """A checkpoint with a frozen base stores what trains *now*: a parameter frozen at shard() and unfrozen
    after it is saved and restored, not silently reverted to the base."""
    from shardwise.checkpoint.frozen_base import base_record

    base = base_record("/base", "0" * 64)

    def frozen_gpt():
        model = _gpt()
        for p in model.parameters():
            p.requires_grad_(False)
        model.lm_head.weight.requires_grad_(True)
        model.blocks[0].mlp.c_fc.weight.requires_grad_(True)  # frozen base, trained head: LoRA's shape
        return shardwise.shard(model, units={Block})

    model = frozen_gpt()
    wanted = dict(model.named_parameters())["blocks.1.mlp.c_fc.weight"]
    wanted.requires_grad_(True)  # unfrozen after shard()
    with torch.no_grad():
        wanted.add_(1.0)
    shardwise.save_checkpoint(ckpt_dir, model, frozen_base=base)
    fresh = frozen_gpt()
    fresh_param = dict(fresh.named_parameters())["blocks.1.mlp.c_fc.weight"]
    fresh_param.requires_grad_(True)
    shardwise.load_checkpoint(ckpt_dir, fresh, frozen_base=base)
    return {"restored": torch.equal(fresh_param.detach(), wanted.detach())}


def _offload_grad_kept(rank, world):
    """Under CPU offload a reference to last step's ``p.grad`` keeps its values through the next backward,
    as in plain torch (one reused host buffer used to be overwritten under it)."""
    (x, y), (x2, y2) = make_batches(2, VOCAB)
    torch.manual_seed(0)
    model = shardwise.shard(GPT(tiny_gpt_config()), units={Block}, offload=shardwise.CPUOffload())
    opt = _sgd(model.parameters())
    gpt_loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    kept = [(p.grad, p.grad.clone()) for p in model.parameters() if p.grad is not None]
    opt.step()
    opt.zero_grad()
    gpt_loss(model, local_slice(x2, rank, world), local_slice(y2, rank, world)).backward()
    assert_engine_clean(model)
    return {"kept": bool(kept) and all(torch.equal(g, c) for g, c in kept)}


def _offload_muon_kwargs(rank, world):
    """offload_optimizer(model, Muon, use_muon=..., adamw_lr=...) steps each parameter as Muon with the same
    arguments does on the model without offload (the inner optimizers get the keyword arguments, and their
    groups take their options by the parameters they hold, not by position)."""
    from shardwise.optim import Muon

    kwargs = dict(lr=0.02, adamw_lr=3e-3, use_muon=lambda name, info: ".mlp." in name and len(info.shape) == 2)
    batches = make_batches(2, VOCAB)
    params = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = shardwise.shard(GPT(tiny_gpt_config()), units={Block},
                                offload=shardwise.CPUOffload() if offload else None)
        opt = shardwise.offload_optimizer(model, Muon, **kwargs) if offload else Muon(model.parameters(), **kwargs)
        for x, y in batches:
            gpt_loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return {"err": max((a - b).abs().max().item() for a, b in zip(*params))}  # (pieces: every rank calls each)


def _offload_steps_in_backward(rank, world):
    """offload_optimizer steps each unit during backward, as its gradient lands (every collective behind that
    gradient was agreed before it was issued, and which of its parameters got a gradient was agreed before
    its hand-out, on the training thread: core/reduction.py, grad_usage.agree_now), and training equals the
    run without offload."""
    (x, y), = make_batches(1, VOCAB)
    params, moved_in_backward = [], None
    for offload in (False, True):
        torch.manual_seed(0)
        model = shardwise.shard(GPT(tiny_gpt_config()), units={Block},
                                offload=shardwise.CPUOffload() if offload else None)
        opt = (shardwise.offload_optimizer(model, torch.optim.AdamW, lr=1e-2) if offload
               else torch.optim.AdamW(model.parameters(), lr=1e-2))
        before = [p.detach().clone() for p in model.parameters()]
        gpt_loss(model, local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        if offload:
            moved_in_backward = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return {"moved_in_backward": moved_in_backward,
            "err": max((a - b).abs().max().item() for a, b in zip(*params))}  # (pieces: every rank calls each)


def _batchnorm_is_ddp(rank, world):
    """BatchNorm trains with each rank's own batch statistics, as DDP does (the README's parity claim names
    this exception): after a step, parameters and running statistics equal torch DDP's on the same data."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    class WithNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 3)])
            self.norm = nn.BatchNorm1d(6)

        def forward(self, x):
            return self.blocks[1](torch.relu(self.norm(self.blocks[0](x))))

    torch.manual_seed(0)
    base = WithNorm()
    ddp = DDP(copy.deepcopy(base))
    model = shardwise.shard(copy.deepcopy(base), units={nn.Linear})
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(5))  # divides by 2 and 3
    mine = local_slice(x, rank, world)
    for net in (ddp, model):
        opt = _sgd(net.parameters())
        net(mine).square().mean().backward()
        opt.step()
    with shardwise.summon_full_params(model, writeback=False):
        ours = {k: v.detach().clone() for k, v in model.state_dict().items()}
    theirs = ddp.module.state_dict()
    return {"err": max((ours[k].double() - theirs[k].double()).abs().max().item() for k in theirs)}


def _scenarios(directory):
    return {"no_sync_dropped": _no_sync_dropped, "kept_copy_writes": _kept_copy_writes,
            "buffer_saved_for_backward": _buffer_saved_for_backward, "refusals": _refusals,
            "dropped_graph_then_write": _dropped_graph_then_write,
            "load_pretrained_after_forward": lambda r, w: _load_pretrained_after_forward(r, w, directory),
            "offload_steps_in_backward": _offload_steps_in_backward,
            "offload_grad_kept": _offload_grad_kept, "batchnorm_is_ddp": _batchnorm_is_ddp, "offload_muon_kwargs": _offload_muon_kwargs,
            "unfrozen_after_shard": lambda r, w: _unfrozen_after_shard_is_saved(r, w, directory + "-ckpt")}


def _worker(rank, world, directory):
    return run_scenarios(_scenarios(directory), rank, world)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return hf_dirs.make_model_dir(str(tmp_path_factory.mktemp("hf") / "llama"), "llama", tokenizer=False)


# World size 2 by default; 3 (uneven pieces: a rank's piece of a parameter may be shorter or empty) under -m slow.
@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def world(request):
    return request.param


@spawn_once
def _report(world: int, directory: str) -> list:
    return run_distributed(_worker, world, directory)


def test_zero_grad_drops_the_no_sync_accumulation_under_every_strategy(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        errs = scenario(rank_report, "no_sync_dropped")
        assert all(e < 1e-6 for e in errs.values()), errs


def test_kept_parameters_follow_every_write_to_the_shards(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        seen = scenario(rank_report, "kept_copy_writes")
        for strategy in KEPT:
            for when, (got, want) in enumerate(zip(seen[strategy], seen["full_shard"])):
                assert torch.equal(got, want), (strategy, ["after a step", "after p.data", "after rank 0", "after summon writeback"][when])


def test_a_forward_whose_graph_is_dropped_leaves_no_stale_parameters_for_the_next(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        errs = scenario(rank_report, "dropped_graph_then_write")
        for strategy, by_write in errs.items():
            assert all(e < 1e-5 for e in by_write), (strategy, ["p.data", "in place under no_grad",
                                                                "load_full_state_dict"], by_write)


def test_load_pretrained_after_a_forward_is_used_under_zero1_and_zero2(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        seen = scenario(rank_report, "load_pretrained_after_forward")
        want_before, want_after = seen["full_shard"]
        assert not torch.equal(want_before, want_after)  # the load changed the weights
        for strategy in KEPT:
            assert torch.equal(seen[strategy][1], want_after), strategy


def test_two_forwards_before_a_backward_keep_a_broadcast_buffer_saved_for_backward(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        assert scenario(rank_report, "buffer_saved_for_backward")["err"] < 1e-6


def test_deepcopy_nested_shard_and_one_rank_writeback_are_refused_by_name(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        out = scenario(rank_report, "refusals")
        assert out["deepcopy"].startswith("copy.deepcopy() of a sharded model"), out
        assert "submodule 'blocks.0'" in out["nested"] and "already sharded" in out["nested"], out
        assert "were edited differently on different ranks" in out["one_rank_edit"], out
        assert torch.equal(out["lm_head"], out["lm_head_ref"])  # the common edit kept, the one-rank one refused


def test_a_checkpoint_with_a_frozen_base_saves_parameters_unfrozen_after_shard(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        assert scenario(rank_report, "unfrozen_after_shard")["restored"]


def test_cpu_offload_keeps_a_users_reference_to_last_steps_grad(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        assert scenario(rank_report, "offload_grad_kept")["kept"]


def test_offload_optimizer_passes_muons_arguments_and_pairs_groups_by_parameters(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        assert scenario(rank_report, "offload_muon_kwargs")["err"] < 1e-6


def test_offload_optimizer_steps_units_during_backward_and_trains_as_without_offload(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        out = scenario(rank_report, "offload_steps_in_backward")
        assert out["moved_in_backward"] is True and out["err"] < 1e-6, out


def test_batchnorm_trains_with_per_rank_batch_statistics_as_ddp_does(llama_dir, world):
    for rank_report in _report(world, llama_dir):
        assert scenario(rank_report, "batchnorm_is_ddp")["err"] < 1e-6
