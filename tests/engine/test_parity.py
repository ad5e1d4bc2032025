"""Numerical parity of every sharding strategy with single-process training on the global batch.

One spawn per world size (1-4; the slow cases, see ``is_slow``, in a spawn of their own) trains the tiny GPT
under every strategy it supports at that size, with SGD+momentum, AdamW, and SGD+momentum with gradient
clipping, and reports losses, clip norms and per-parameter errors; the tests below each read their slice of that report. Parameter errors are measured
after *every* step on the shards themselves (``parity_utils.sharded_param_errors``) and once more at the end
on ``full_state_dict``.

Tolerances (relative, per tensor, ``||a - b|| / ||b||``):
- fp32 SGD+momentum: 1e-6 for losses and parameters. Sharding changes only the order of float additions
  (local batch then sum over ranks), so errors are a few ulps amplified by a few steps (measured: losses
  1.2e-7, parameters 6.3e-7 at worst, on zero-initialised LayerNorm biases whose value is all updates).
- AdamW losses: 1e-6. AdamW parameters: 1e-5 per tensor, and 1e-3 for the attention key bias; the reason
  is Adam, not sharding. Adam's update per element is about ``lr * g / (|g| + eps)``, whatever the size of
  ``g``, so an element whose gradient is tiny turns its rounding noise into a full-size update. The extreme
  case is the attention *key* bias: its gradient is exactly zero in theory (softmax is invariant to adding
  ``q . b_k`` to every logit of a row), ~1e-9 of pure summation-order noise in practice, which Adam turns
  into steps of up to ``lr`` in both runs with unrelated signs; those elements dominate the error of
  ``c_attn.bias`` (measured ~2e-4). Zero-initialised biases with small gradients are the milder case
  (measured up to ~5e-6). SGD scales noise by ``lr`` only, which is why it carries the tight check.
"""

from __future__ import annotations

import copy

import pytest
import torch

import shardwise
from harness import run_distributed
from models import Block, GPT, gpt_loss, tiny_gpt_config
from parity_utils import (loss_errors, make_batches, reference_run, sharded_run, spawn_once, state_errors,
                          worst)

STEPS = 4
MAX_NORM = 0.5  # well below the tiny GPT's gradient norm (~1-3), so clipping is active every step
FP32_RTOL = 1e-6
ADAMW_KEY_BIAS_RTOL = 1e-3
ADAMW_PARAM_RTOL = 1e-5
# Tensors holding the attention key bias (a gradient that is zero in theory): see the module docstring.
KEY_BIAS_TENSORS = ("attn.c_attn.bias",)

BASIC = [("full_shard", None), ("shard_grad_op", None), ("no_shard", None)]
HYBRID = {
    2: [("hybrid_shard", (1, 2)), ("hybrid_shard", (2, 1)), ("hybrid_shard_zero2", (1, 2)),
        ("hybrid_shard_zero2", (2, 1))],
    4: [("hybrid_shard", (2, 2)), ("hybrid_shard_zero2", (2, 2))],
}
# ZeRO-1/2 (full parameters kept across steps) at the uneven size; SGD parity at every size, no_sync, tied and
# frozen parameters are in test_zero_strategies.py.
ZERO = {3: [("shard_optim", None), ("shard_optim_grad", None)]}
VARIANTS = ("sgd", "adamw", "sgd_clip")


def cases_for(world_size: int) -> list[tuple[str, tuple | None]]:
    return BASIC + HYBRID.get(world_size, []) + ZERO.get(world_size, [])


def is_slow(world_size: int, strategy: str) -> bool:
    """World size 1 (no collective runs) and the 1-D strategies at 4 (2 and 3 take their code paths, 3 with
    uneven shards) run under ``-m slow``; the 2 x 2 hybrid meshes need 4 and stay in the default run."""
    return world_size == 1 or (world_size == 4 and not strategy.startswith("hybrid"))


def case_key(strategy: str, mesh_shape, variant: str) -> str:
    return f"{strategy}{'' if mesh_shape is None else list(mesh_shape)}/{variant}"


def _parity_worker(rank: int, world_size: int, slow: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    cfg = tiny_gpt_config()
    batches = make_batches(STEPS, cfg.vocab_size)
    torch.manual_seed(0)
    initial = GPT(cfg)

    references = {}
    for variant in VARIANTS:
        ref = copy.deepcopy(initial)
        optimizer = "adamw" if variant == "adamw" else "sgd"
        max_norm = MAX_NORM if variant == "sgd_clip" else None
        references[variant] = reference_run(ref, optimizer, gpt_loss, batches, max_norm=max_norm,
                                            snapshot_every_step=True)

    meshes = {}
    results = {}
    for strategy, mesh_shape in cases_for(world_size):
        if is_slow(world_size, strategy) != slow:
            continue
        if mesh_shape is not None and mesh_shape not in meshes:
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        for variant in VARIANTS:
            ref = references[variant]
            model = shardwise.shard(copy.deepcopy(initial), units={Block}, strategy=strategy,
                                    mesh=meshes.get(mesh_shape))
            run = sharded_run(model, "adamw" if variant == "adamw" else "sgd", gpt_loss, batches, rank, world_size,
                              reference_states=ref["states"], max_norm=MAX_NORM if variant == "sgd_clip" else None)
            sd = shardwise.full_state_dict(model)
            final = state_errors(sd, ref["states"][-1].state_dict()) if rank == 0 else None
            results[case_key(strategy, mesh_shape, variant)] = dict(
                losses=run["losses"], ref_losses=ref["losses"], norms=run["norms"], ref_norms=ref["norms"],
                param_errs=run["param_errs"], final=final)
    return results


@spawn_once
def parity_report(world_size: int, slow: bool) -> dict:
    return run_distributed(_parity_worker, world_size, slow)[0]


def _case(ws: int, strategy: str, mesh_shape):
    marks = [pytest.mark.slow] if is_slow(ws, strategy) else []
    return pytest.param(ws, strategy, mesh_shape, marks=marks,
                        id=f"ws{ws}-{strategy}{'' if mesh_shape is None else '-mesh' + 'x'.join(map(str, mesh_shape))}")


ALL_CASES = [_case(ws, s, m) for ws in (1, 2, 3, 4) for s, m in cases_for(ws)]


@pytest.mark.parametrize("world_size,strategy,mesh_shape", ALL_CASES)
def test_sgd_momentum_losses_and_parameters_match_reference_to_1e6(world_size, strategy, mesh_shape):
    """fp32 SGD+momentum: global loss every step and every parameter after every step equal the reference to 1e-6."""
    r = parity_report(world_size, is_slow(world_size, strategy))[case_key(strategy, mesh_shape, "sgd")]
    assert loss_errors(r["losses"], r["ref_losses"]) <= FP32_RTOL, (r["losses"], r["ref_losses"])
    for step, (name, err) in enumerate(r["param_errs"]):
        assert err <= FP32_RTOL, f"step {step}: {name} off by {err:.2e}"
    name, err = worst(r["final"])
    assert err <= FP32_RTOL, f"full_state_dict after training: {name} off by {err:.2e}"


@pytest.mark.parametrize("world_size,strategy,mesh_shape", ALL_CASES)
def test_adamw_losses_match_reference_and_parameters_within_adam_noise(world_size, strategy, mesh_shape):
    """AdamW: losses equal the reference to 1e-6; parameters to 1e-5, the attention key bias to 1e-3 (see docstring)."""
    r = parity_report(world_size, is_slow(world_size, strategy))[case_key(strategy, mesh_shape, "adamw")]
    assert loss_errors(r["losses"], r["ref_losses"]) <= FP32_RTOL, (r["losses"], r["ref_losses"])
    for name, err in r["final"].items():
        tol = ADAMW_KEY_BIAS_RTOL if name.endswith(KEY_BIAS_TENSORS) else ADAMW_PARAM_RTOL
        assert err <= tol, f"{name} off by {err:.2e} (tolerance {tol:.0e})"


@pytest.mark.parametrize("world_size,strategy,mesh_shape", ALL_CASES)
def test_clip_grad_norm_returns_reference_norm_and_clips_identically(world_size, strategy, mesh_shape):
    """clip_grad_norm_ returns torch.nn.utils.clip_grad_norm_'s global norm and the clipped run stays in parity."""
    r = parity_report(world_size, is_slow(world_size, strategy))[case_key(strategy, mesh_shape, "sgd_clip")]
    assert all(n > MAX_NORM for n in r["ref_norms"]), "test setup: clipping must be active"
    assert loss_errors(r["norms"], r["ref_norms"]) <= FP32_RTOL, (r["norms"], r["ref_norms"])
    assert loss_errors(r["losses"], r["ref_losses"]) <= FP32_RTOL, (r["losses"], r["ref_losses"])
    name, err = worst(r["final"])
    assert err <= FP32_RTOL, f"{name} off by {err:.2e}"
