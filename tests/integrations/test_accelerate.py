"""shardwise.integrations.accelerate: a user's own Accelerate loop on a sharded model, against the same loop
with Accelerate's DDP (``accelerator.prepare(model)``), bf16 mixed precision, gradient accumulation
(``accelerator.accumulate``) and clipping (``accelerator.clip_grad_norm_``) active.

- Accelerate's bf16 autocast is kept (a Linear computes in bf16 inside forward), the ranks accumulate without
  communicating (``no_sync``), losses and gradient norms equal DDP's, and ``save_model`` writes what
  ``accelerator.save_model`` writes for DDP's model (same names, same bytes), loadable by ``from_pretrained``.
- A model handed over unsharded, or an Accelerator set up for FSDP, is refused by name.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from harness import run_distributed
from hf_dirs import tiny_config
from parity_utils import CollectiveCounter, run_scenarios, scenario, spawn_once

VOCAB, SEQ, STEPS, ACCUM = 97, 16, 3, 2
# bf16 autocast on both sides from the same fp32 weights: the losses come out bit for bit. The clipping
# coefficient does not (the gradient norm sums the ranks' pieces in another order than torch's norm of whole
# gradients), nor, at 3 ranks, the gradients (summed in another order than DDP's, which bf16 activations
# downstream round up): the weight updates of 3 AdamW steps measured 1.7e-7 apart at 2 ranks and
# 5.8e-5 at 3, relative to the update.
BF16_RTOL = 1e-4
WORLDS = [2, pytest.param(3, marks=pytest.mark.slow)]


def _model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", VOCAB))


def _batches(rank: int, world: int) -> list[torch.Tensor]:
    """Each rank's micro-batches: rows of one global batch per micro-step."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (STEPS * ACCUM, 2 * world, SEQ), generator=g)
    return [r[2 * rank: 2 * rank + 2] for r in rows]


def _loop(kind: str, rank: int, world: int, root: str) -> dict:
    from accelerate import Accelerator

    from shardwise.integrations.accelerate import save_model, shard_and_prepare

    # cpu=True: what makes Accelerate take the gloo process group as MULTI_CPU (and wrap in DDP) on CPUs
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUM)
    model = _model()
    if kind == "ddp":
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
        model = shard_and_prepare(accelerator, model, units="auto")
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    inner_dtypes = []
    linear = accelerator.unwrap_model(model).model.layers[0].mlp.up_proj
    hook = linear.register_forward_hook(lambda m, i, o: inner_dtypes.append(o.dtype))
    losses, norms, synced = [], [], []
    model.train()
    for x in _batches(rank, world):
        with accelerator.accumulate(model), CollectiveCounter() as counted:
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
        synced.append(counted.calls["reduce_scatter_into"] > 0)
    hook.remove()
    if kind == "ddp":
        accelerator.save_model(model, os.path.join(root, kind))
    else:
        save_model(accelerator, model, os.path.join(root, kind))
    return {"losses": losses, "norms": norms, "synced": synced, "inner": str(inner_dtypes[0]),
            "wrapper": type(model).__name__}


def _against_ddp(rank: int, world: int, root: str) -> dict:
    runs = {kind: _loop(kind, rank, world, root) for kind in ("ddp", "shardwise")}
    out = {"ours": runs["shardwise"], "ddp_wrapper": runs["ddp"]["wrapper"],
           "losses": runs["ddp"]["losses"] == runs["shardwise"]["losses"],
           "norm_rel": max(abs(a - b) / a for a, b in zip(runs["ddp"]["norms"], runs["shardwise"]["norms"]))}
    if rank == 0:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        ours, theirs = (load_file(os.path.join(root, k, "model.safetensors")) for k in ("shardwise", "ddp"))
        start = _model().state_dict()
        out["names"] = ours.keys() == theirs.keys()
        # what training changed, relative: AdamW moves every weight by about lr, whatever its gradient
        out["update_rel"] = (sum((ours[k] - theirs[k]).norm() ** 2 for k in theirs) ** 0.5
                             / sum((theirs[k] - start[k]).norm() ** 2 for k in theirs) ** 0.5).item()
        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(root, "shardwise")).state_dict()
        out["loaded"] = all(torch.equal(loaded[k], ours[k]) for k in ours)
    return out


def _refusals(rank: int, world: int, root: str) -> dict:
    from accelerate import Accelerator

    from shardwise.errors import ShardwiseError
    from shardwise.integrations.accelerate import prepare_model

    try:
        prepare_model(Accelerator(cpu=True), _model())
    except ShardwiseError as e:
        return {"unsharded": str(e)}
    return {}


def _scenarios(rank: int, world: int, root: str) -> dict:
    return run_scenarios({"ddp": lambda r, w: _against_ddp(r, w, root),
                          "refusals": lambda r, w: _refusals(r, w, root)}, rank, world)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("accelerate"))


@spawn_once
def _report(world: int, root: str) -> list:
    """Both scenarios in one spawn per world size."""
    return run_distributed(_scenarios, world, root, timeout_s=120)


@pytest.mark.parametrize("world", WORLDS)
def test_accelerate_loop_keeps_autocast_accumulates_locally_and_equals_ddp(world, root):
    for rank, report in enumerate(_report(world, f"{root}/{world}")):
        r = scenario(report, "ddp")
        assert r["ddp_wrapper"] == "DistributedDataParallel" and r["ours"]["wrapper"] == "LlamaForCausalLM", r
        assert r["ours"]["inner"] == "torch.bfloat16", "Accelerate's bf16 autocast is kept"
        assert r["ours"]["synced"] == [False, True] * STEPS, "micro-batches before the last one do not communicate"
        assert r["losses"], "bf16 losses equal DDP's"
        # The norm sums the ranks' pieces in another order than torch's norm of whole gradients.
        assert r["norm_rel"] <= 1e-6 and min(r["ours"]["norms"]) > 0.5, r
        if rank == 0:
            assert r["names"] and r["loaded"], r
            assert r["update_rel"] <= BF16_RTOL, r


@pytest.mark.parametrize("world", WORLDS)
def test_accelerate_prepare_model_refuses_an_unsharded_model(world, root):
    r = scenario(_report(world, f"{root}/{world}")[0], "refusals")
    assert r["unsharded"].startswith("prepare_model: LlamaForCausalLM is not sharded"), r


def test_an_accelerator_set_up_for_fsdp_is_refused_by_name():
    """An Accelerate configuration that enables FSDP (accelerate config, ACCELERATE_USE_FSDP) would shard again."""
    import types

    from accelerate.utils import DistributedType

    from shardwise.errors import ShardwiseError
    from shardwise.integrations.accelerate import prepare_model

    with pytest.raises(ShardwiseError, match=r"^this Accelerator is configured for FSDP \(accelerate config or "
                                             r"ACCELERATE_USE_FSDP"):
        prepare_model(types.SimpleNamespace(distributed_type=DistributedType.FSDP), torch.nn.Linear(2, 2))
