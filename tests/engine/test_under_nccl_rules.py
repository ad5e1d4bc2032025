"""The engine's tables under the NCCL-rules test mode (tests/nccl_rules.py): the default group moves device
tensors only, as NCCL does, the control group host tensors only, and an operation mixing the two fails, as on
a GPU. Every strategy's parity with one process, CPU offload (with ``offload_optimizer``, its worker thread
too), clipping and exact gradient norms, buffers, ``full_state_dict`` / ``load_full_state_dict`` /
``summon_full_params``, Muon with and without offload, checkpoints saved, loaded and resharded (2 ranks to 3),
LoRA and QLoRA adapter saves, a whole-model save (``save_whole_model``): all run without breaking a rule. A planted host tensor fails the mode.

Inputs go to ``nccl_rules.DEVICE`` as a GPU script sends them to ``cuda``; the references train on the host.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

import nccl_rules
import shardwise
from harness import run_distributed
from parity_utils import local_slice, make_batches, run_scenarios, scenario, spawn_once
from shardwise.models import GPT, Block, GPTConfig

DEVICE = nccl_rules.DEVICE
CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=18)
STEPS = 3
RTOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _worst(model, ref) -> float:
    full = shardwise.full_state_dict(model)
    return max((_rel(full[k], v) for k, v in ref.state_dict().items()), default=0.0) if full else 0.0


def _train(model, opt, rank, world, *, clip=False, batches=STEPS) -> list[float]:
    losses = []
    for x, y in make_batches(batches, CFG.vocab_size, global_batch=2 * world, seq_len=16):
        x, y = (local_slice(t, rank, world).to(DEVICE) for t in (x, y))
        loss = model(x, y).loss
        loss.backward()
        if clip:
            shardwise.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _reference(world, *, clip=False, optimizer=torch.optim.SGD, **opt_kwargs):
    torch.manual_seed(0)
    ref = GPT(CFG)
    opt = optimizer(ref.parameters(), **opt_kwargs)
    for x, y in make_batches(STEPS, CFG.vocab_size, global_batch=2 * world, seq_len=16):
        ref(x, y).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return ref


def _parity(strategy: str, offload: bool = False, offload_optimizer: bool = False, worker_thread=None,
            clip: bool = False):
    def run(rank, world):
        torch.manual_seed(0)
        model = shardwise.shard(GPT(CFG), units={Block}, strategy=strategy,
                                offload=shardwise.CPUOffload(worker_thread=worker_thread) if offload else None)
        if offload_optimizer:
            opt = shardwise.offload_optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _train(model, opt, rank, world, clip=clip)
        return _worst(model, _reference(world, clip=clip, lr=0.1, momentum=0.9))

    return run


def _grad_norms_and_buffers(rank, world):
    """p.grad.norm() of a piece (an exact reduction over the shard group); rank 0's buffers broadcast at the
    start of the next forward (here in eval mode, which leaves them as broadcast)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    shardwise.shard(model, units={nn.Linear})
    x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(1))
    model(local_slice(x, rank, world).to(DEVICE)).square().mean().backward()
    ref(x).square().mean().backward()
    norms = max(_rel(p.grad.norm(), q.grad.norm()) for p, q in zip(model.parameters(), ref.parameters()))
    torch.manual_seed(0)
    with_norm = shardwise.shard(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), units={nn.Linear})
    with_norm(local_slice(x, rank, world).to(DEVICE)).sum()  # each rank's own statistics
    with_norm.eval()
    with_norm(x[:2].to(DEVICE))
    return {"norms": norms, "running_mean": with_norm[1].running_mean.tolist()}


def _state_dicts(rank, world):
    """full_state_dict under offload, load_full_state_dict of another model, summon with an edit written back."""
    torch.manual_seed(0)
    model = shardwise.shard(GPT(CFG), units={Block}, offload=shardwise.CPUOffload())
    torch.manual_seed(1)
    other = GPT(CFG)
    shardwise.load_full_state_dict(model, other.state_dict() if rank == 0 else {})
    loaded = _worst(model, other)
    with shardwise.summon_full_params(model):
        with torch.no_grad():
            model.blocks[0].attn.c_attn.weight.mul_(2)
    with torch.no_grad():
        other.blocks[0].attn.c_attn.weight.mul_(2)
    return {"loaded": loaded, "summoned_edit": _worst(model, other)}


def _muon(rank, world):
    """shardwise.optim.Muon with and without CPU offload: the exchange runs on the device either way."""
    from shardwise.optim import Muon

    finals = []
    for offload in (None, shardwise.CPUOffload()):
        torch.manual_seed(0)
        model = shardwise.shard(GPT(CFG), units={Block}, offload=offload)
        _train(model, Muon(model.parameters(), ns_dtype=torch.float32), rank, world)
        finals.append(shardwise.full_state_dict(model))
    return max((_rel(finals[1][k], v) for k, v in finals[0].items()), default=0.0)


def _planted_host_tensor(rank, world):
    """A bug of the kind the mode exists for: the engine believing its compute device is the host, so a
    norm it reduces over the shard group is a host tensor: the data group refuses it, as NCCL would."""
    from shardwise.engine.core.runtime import runtime_of

    torch.manual_seed(0)
    model = shardwise.shard(GPT(CFG), units={Block})
    x = torch.randint(0, 61, (2, 16)).to(DEVICE)
    model(x, x).loss.backward()
    runtime_of(model).device = torch.device("cpu")
    try:
        shardwise.clip_grad_norm_(model, 1.0)
    except nccl_rules.NcclRuleViolation as e:
        return str(e)
    return "no violation"


def _save(rank, world, root):
    """A checkpoint of a trained model (AdamW), saved at 2 ranks; rank 0 keeps the full weights to compare."""
    from shardwise.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = shardwise.shard(GPT(CFG), units={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, world)
    save_checkpoint(os.path.join(root, "ckpt"), model, opt, step=STEPS)
    full = shardwise.full_state_dict(model)
    if rank == 0:
        torch.save(full, os.path.join(root, "full.pt"))
    return "saved"


def _load(rank, world, root):
    """The checkpoint loaded (at 2 ranks: as saved; at 3: resharded) into a fresh model, and one more step."""
    from shardwise.checkpoint import load_checkpoint

    torch.manual_seed(5)
    model = shardwise.shard(GPT(CFG), units={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_checkpoint(os.path.join(root, "ckpt"), model, opt)
    full = shardwise.full_state_dict(model)
    err = max(_rel(full[k], v) for k, v in torch.load(os.path.join(root, "full.pt")).items()) if rank == 0 else 0.0
    _train(model, opt, rank, world, batches=1)
    return err


def _lora_saves(rank, world, root):
    """Adapter saves of a LoRA model and of a QLoRA model (4-bit base), and a whole model saved: the adapters
    (the whole model) gathered over the device group, written by rank 0."""
    from hf_dirs import tiny_config
    from qlora_models import quantised_lora_model
    from shardwise.hf.lora import LoraSettings, apply_lora, save_adapter
    from transformers import AutoModelForCausalLM

    out = {}
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("llama", 97), attn_implementation="sdpa")
    for name, model in (("lora", apply_lora(base, LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj")))),
                        ("qlora", quantised_lora_model())):
        shardwise.shard(model, units="auto")
        x = torch.randint(0, 97, (2, 8)).to(DEVICE)
        model(input_ids=x, labels=x).loss.backward()
        path = save_adapter(model, os.path.join(root, name))
        out[name] = sorted(os.listdir(path)) if rank == 0 else "saved"
    whole = shardwise.shard(AutoModelForCausalLM.from_config(tiny_config("llama", 97)), units="auto")
    shardwise.save_whole_model(whole, os.path.join(root, "whole"))  # the whole-model save: every group gathered
    out["whole"] = sorted(os.listdir(os.path.join(root, "whole"))) if rank == 0 else "saved"
    return out


def _core(rank, world):
    with nccl_rules.enforced():
        scenarios = {s: _parity(s) for s in ("full_shard", "shard_grad_op", "shard_optim_grad", "shard_optim",
                                             "no_shard")}
        scenarios.update({
            "clip": _parity("full_shard", clip=True),
            "offload": _parity("full_shard", offload=True),
            "offload_optimizer": _parity("full_shard", offload=True, offload_optimizer=True),
            "zero2_offload_optimizer": _parity("shard_optim_grad", offload=True, offload_optimizer=True),
            "offload_worker_thread": _parity("full_shard", offload=True, offload_optimizer=True,
                                             worker_thread=True),
            "grad_norms_and_buffers": _grad_norms_and_buffers, "state_dicts": _state_dicts, "muon": _muon,
            "planted": _planted_host_tensor})
        return run_scenarios(scenarios, rank, world)


def _files(rank, world, root, phase):
    sys_path_hf()
    with nccl_rules.enforced():
        if phase == "save":
            return run_scenarios({"save": lambda r, w: _save(r, w, root),
                                  "lora": lambda r, w: _lora_saves(r, w, root)}, rank, world)
        return run_scenarios({"load": lambda r, w: _load(r, w, root)}, rank, world)


def sys_path_hf() -> None:
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for sub in ("", "quant"):  # hf_dirs, qlora_models
        if os.path.join(here, sub) not in sys.path:
            sys.path.insert(0, os.path.join(here, sub))


@spawn_once
def core() -> list:
    return run_distributed(_core, 2, backend=nccl_rules.BACKEND, timeout_s=120)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("nccl-rules"))


@spawn_once
def files(root: str, world: int, phase: str) -> list:
    return run_distributed(_files, world, root, phase, backend=nccl_rules.BACKEND, timeout_s=120)


@pytest.mark.parametrize("case", ["full_shard", "shard_grad_op", "shard_optim_grad", "shard_optim", "no_shard",
                                  "clip", "offload", "offload_optimizer", "zero2_offload_optimizer",
                                  "offload_worker_thread"])
def test_training_matches_one_process_without_breaking_nccl_s_rules(case):
    for r in core():
        assert scenario(r, case) <= RTOL


def test_exact_gradient_norms_and_buffers_follow_the_rules():
    results = [scenario(r, "grad_norms_and_buffers") for r in core()]
    assert all(r["norms"] <= RTOL for r in results), results
    assert all(r["running_mean"] == results[0]["running_mean"] for r in results), results  # rank 0's


def test_state_dicts_and_summon_follow_the_rules_under_offload():
    for r in core():
        s = scenario(r, "state_dicts")
        assert s["loaded"] == 0.0 and s["summoned_edit"] <= RTOL, s


def test_muon_exchanges_on_the_device_with_and_without_offload():
    for r in core():
        assert scenario(r, "muon") <= 1e-6


def test_a_planted_host_tensor_fails_the_mode():
    for r in core():
        assert scenario(r, "planted").startswith("all_reduce on a nccl_rules group got a host tensor"), r


def test_checkpoints_save_load_and_reshard_and_adapters_save_under_the_rules(root):
    saved = files(root, 2, "save")
    for r in saved:
        assert scenario(r, "save") == "saved"
    lora = scenario(saved[0], "lora")
    for name in ("lora", "qlora"):
        assert lora[name] == ["adapter_config.json", "adapter_model.safetensors"], lora
    assert "model.safetensors" in lora["whole"], lora
    for world in (2, 3):  # as saved, then resharded
        for r in files(root, world, "load"):
            assert scenario(r, "load") == 0.0
