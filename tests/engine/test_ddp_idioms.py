"""What DDP and FSDP users ask of the wrapper, answered by the sharded model itself (engine/ddp_idioms.py),
and ``units="auto"`` on a model without repeated blocks.

Accumulation written DDP's two ways (``with model.no_sync():`` as pytorch/examples and Accelerate write it,
``model.require_backward_grad_sync = last_micro_step`` as nanoGPT writes it) and FSDP2's way
(``model.set_requires_gradient_sync(last_micro_step)``, with ``set_is_last_backward`` and HSDP's
``set_requires_all_reduce`` beside it) trains exactly like one process on the global batch and communicates
nothing in the micro-batches it skips; ``model.module`` and FSDP2's other ``FSDPModule`` methods are named
errors that ``hasattr`` and unwrapping helpers read as absent; FSDP1's ``model.clip_grad_norm_`` is
``shardwise.clip_grad_norm_``. One spawn at world size 2.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from harness import error_of, run_distributed
from models import GPT, Block, gpt_loss, tiny_gpt_config
from parity_utils import (CollectiveCounter, assert_parity, make_batches, parity_check, run_scenarios, scenario,
                          spawn_once)
from shardwise.engine.ddp_idioms import NoFSDPMethodError, NoModuleError

VOCAB = tiny_gpt_config().vocab_size
MICRO = 3


def _accumulate(style: str, traffic: list):
    """``MICRO`` micro-batches per step, synchronised only by the last backward, written as DDP users write
    it; ``traffic`` gets the reduce-scatter / all-reduce calls of each skipped micro-batch."""

    def step(model, batch, _step, take):
        x, y = batch
        n = x.shape[0] // MICRO
        sharded = take(x) is not x
        total = 0.0
        for m in range(MICRO):
            xm, ym = take(x[m * n:(m + 1) * n]), take(y[m * n:(m + 1) * n])
            last = m == MICRO - 1
            with CollectiveCounter() as counter:
                if sharded and style == "no_sync" and not last:
                    with model.no_sync():
                        loss = gpt_loss(model, xm, ym) / MICRO
                        loss.backward()
                else:
                    if sharded and style == "require_backward_grad_sync":
                        model.require_backward_grad_sync = last  # nanoGPT: before the forward
                    if sharded and style == "set_requires_gradient_sync":  # FSDP2's, as torchtitan-style loops call it
                        model.set_requires_gradient_sync(last)
                        model.set_is_last_backward(last)
                        model.set_requires_all_reduce(last)
                    loss = gpt_loss(model, xm, ym) / MICRO
                    loss.backward()
            if sharded and not last:
                traffic.append(counter.calls["reduce_scatter_into"] + counter.calls["all_reduce_sum"])
            total = total + loss.detach()
        return total

    return step


def _accumulation(style: str):
    def run(rank, ws):
        out = {}
        for strategy in ("full_shard", "no_shard"):
            traffic: list = []
            torch.manual_seed(0)
            batches = make_batches(3, VOCAB, global_batch=6 * MICRO)
            metrics, model, _ = parity_check(GPT(tiny_gpt_config()), _accumulate(style, traffic), batches, rank, ws,
                                             shard_kwargs=dict(units={Block}, strategy=strategy))
            out[strategy] = dict(metrics=metrics, traffic=traffic, flag=model.require_backward_grad_sync)
        return out

    return run


class WithModuleChild(nn.Module):
    """A model whose own submodule is called ``module`` keeps it."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 4)


def _module_attribute(rank, ws):
    torch.manual_seed(0)
    model = shardwise.shard(GPT(tiny_gpt_config()), units={Block})

    def unwrap(m):  # the recursive helper many training scripts carry (timm's, transformers' fallback)
        while hasattr(m, "module"):
            m = m.module
        return m

    try:
        model.module
        raised = None
    except NoModuleError as e:
        raised = (isinstance(e, AttributeError), isinstance(e, shardwise.ShardwiseError), str(e))
    own = shardwise.shard(WithModuleChild(), units=None)
    return dict(raised=raised, has=hasattr(model, "module"), getattr_default=getattr(model, "module", None) is None,
                unwrapped=unwrap(model) is model, class_name=type(model).__name__, is_gpt=isinstance(model, GPT),
                other_attr=error_of(lambda: model.no_such_thing), own_child=isinstance(own.module, nn.Linear),
                flag=model.require_backward_grad_sync)


def _fsdp_methods(rank, ws):
    """FSDP1's clip method, FSDP2's methods shardwise does not offer, and a recurse=False it cannot honour."""
    torch.manual_seed(0)
    model = shardwise.shard(GPT(tiny_gpt_config()), units={Block})
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    gpt_loss(model, x, x).backward()
    reference = shardwise.clip_grad_norm_(model, float("inf")).item()  # the norm, nothing scaled
    norm = model.clip_grad_norm_(1e-3).item()
    after = shardwise.clip_grad_norm_(model, float("inf")).item()
    named = {}
    for name in ("unshard", "reshard", "set_reshard_after_backward", "set_modules_to_forward_prefetch"):
        try:
            getattr(model, name)
            named[name] = None
        except NoFSDPMethodError as e:
            named[name] = (isinstance(e, AttributeError), isinstance(e, shardwise.ShardwiseError), str(e),
                           hasattr(model, name))
    return dict(norm=norm, reference=reference, after=after, named=named,
                recurse=error_of(lambda: model.set_requires_gradient_sync(False, recurse=False)),
                flag=model.require_backward_grad_sync)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 11), nn.Linear(11, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class EmbeddedMLP(MLP):
    """An MLP behind an (untied) input embedding that it names as Hugging Face models do: units="auto" makes
    the embedding a unit, and still no block."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 6)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, ids):
        return super().forward(self.embed(ids))


def _auto_units_without_blocks(rank, ws):
    from shardwise.engine.core.runtime import runtime_of

    out = {}
    for name, build, units in (("auto", MLP, "auto"), ("None", MLP, None), ("embedded", EmbeddedMLP, "auto")):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = shardwise.shard(build(), units=units)
        out[name] = dict(units=len(runtime_of(model).units),
                         said=[str(w.message) for w in caught if "units='auto'" in str(w.message)])
    return out


SCENARIOS = {
    "no_sync": _accumulation("no_sync"),
    "require_backward_grad_sync": _accumulation("require_backward_grad_sync"),
    "set_requires_gradient_sync": _accumulation("set_requires_gradient_sync"),
    "module": _module_attribute,
    "fsdp_methods": _fsdp_methods,
    "auto_units": _auto_units_without_blocks,
}


def _worker(rank, ws):
    return run_scenarios(SCENARIOS, rank, ws)


@spawn_once
def report() -> list:
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("style", ["no_sync", "require_backward_grad_sync", "set_requires_gradient_sync"])
def test_accumulation_written_as_for_ddp_or_fsdp2_trains_exactly_and_skips_communication(style):
    for rank, res in enumerate(report()):
        for strategy, r in scenario(res, style).items():
            assert_parity(r["metrics"], label=f"rank {rank} {style} {strategy}")
            assert r["traffic"] and set(r["traffic"]) == {0}, f"{style} {strategy}: gradients sent in skipped micro-batches"
            assert r["flag"] is True


def test_model_module_is_a_named_error_that_hasattr_reads_as_absent():
    for res in report():
        r = scenario(res, "module")
        is_attribute_error, is_shardwise_error, text = r["raised"]
        assert is_attribute_error and is_shardwise_error
        assert "GPT.module" in text and "raw_model = model" in text, text
        assert not r["has"] and r["getattr_default"] and r["unwrapped"], "unwrapping helpers stop at the model"
        assert r["class_name"] == "GPT" and r["is_gpt"], "the class keeps its name (save_pretrained writes it)"
        assert "AttributeError" in r["other_attr"] and "no_such_thing" in r["other_attr"]
        assert r["own_child"], "a submodule called module stays reachable"
        assert r["flag"] is True


def test_fsdp1_clip_method_is_shardwise_clip_and_other_fsdp2_methods_are_named_errors():
    for res in report():
        r = scenario(res, "fsdp_methods")
        assert r["norm"] == pytest.approx(r["reference"], rel=1e-6), "returns the global norm before clipping"
        assert r["after"] == pytest.approx(1e-3, rel=1e-4), "clipped to max_norm"
        for name, raised in r["named"].items():
            assert raised is not None, f"model.{name} did not raise"
            is_attribute_error, is_shardwise_error, text, has = raised
            assert is_attribute_error and is_shardwise_error and not has, name
            assert f"GPT.{name}" in text and "FSDPModule" in text, text
        assert "shardwise.summon_full_params" in r["named"]["unshard"][2]
        assert "ShardwiseError" in r["recurse"] and "recurse=False" in r["recurse"], r["recurse"]
        assert r["flag"] is True, "a refused call changes nothing"


def test_units_auto_without_repeated_blocks_makes_one_unit_and_says_so():
    """Also when an untied input embedding is a unit of its own: the warning counts blocks, not units."""
    for rank, res in enumerate(report()):
        r = scenario(res, "auto_units")
        assert r["auto"]["units"] == r["None"]["units"] == 1
        assert r["None"]["said"] == []
        assert r["embedded"]["units"] == 2  # the embedding and the root
        if rank == 0:
            (said,) = r["auto"]["said"]
            assert "MLP has no repeated blocks" in said and "one unit" in said, said
            (said,) = r["embedded"]["said"]
            assert "EmbeddedMLP has no repeated blocks" in said and "but its embedding is one unit" in said, said
        else:
            assert r["auto"]["said"] == [] and r["embedded"]["said"] == []
