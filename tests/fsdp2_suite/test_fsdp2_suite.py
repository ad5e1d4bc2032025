"""PyTorch FSDP2's own test scenarios, ported to shardwise and run three ways side by side.

Every scenario comes from ``test/distributed/_composable/fsdp/test_fully_shard_*.py`` in pytorch/pytorch
(named in each case's docstring) and lives in the module named after that file, ``fully_shard_<file>.py``
beside this one, which registers it (``fsdp2_cases.case`` / ``add_case``) with the world sizes at which it
runs only under ``-m slow``. This module runs them and holds the two tests. Each scenario is trained three
times on gloo, from the same initial model and the same global batches:

* ``shardwise``: our engine, units marked on the model (``unit(m)``), strategy and options per case;
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every marked module (children first), then the
  root, on ``init_device_mesh("cpu", (ws,))`` (full_shard <-> ``reshard_after_forward=True``,
  shard_grad_op <-> ``False``): the oracle;
* ``reference``: one process on the whole global batch (or, for mixed precision, the DDP emulation FSDP2's
  tests use: each rank computes in the low dtype on its slice and the gradients are reduced by hand).

The sides run one after the other (an exception on one side cannot stall the others). Losses are compared
every step (global mean over ranks), parameters at the end (``full_state_dict`` / ``full_tensor()``), in
fp32 to 1e-6 relative per tensor; ``parity_utils.assert_engine_clean`` runs after every backward of ours.
Everything runs in one spawn per world size (3, where no buffer divides evenly, and 2) and speed class.

Their harness (``FSDPTest``) skips these on CPU; FSDP2 itself runs fine on gloo except where
``FSDP2_FAILS`` says otherwise (then that oracle half is skipped with the reason, and the test checks
FSDP2 still fails, so the list cannot go stale).

Scenarios not ported, because shardwise has no equivalent API (no DTensor, no per-module knobs)::

    FSDP2 file / test                                   why it cannot be expressed on shardwise
    --------------------------------------------------  ------------------------------------------------
    training: shard_placement_fn (largest dim, TP+EP)   placements are DTensor API; we shard flat buffers
    training: explicit_prefetching (set_modules_to_*)   prefetch order is automatic (prefetch=True/False)
    training: post_optim_event, unshard_async_op,       CUDA streams/events; no async unshard handle
              share_comm_ctx, cudagraph
    training: reshard_after_forward=2 (int)             no resharding to a smaller mesh
    training: grouped fully_shard([a, b]) (mem_eff),    a unit is one module (or a predicate); grouping
              partial_group_reshard_toggle              several siblings / toggling reshard per module
                                                        has no equivalent
    training: set_requires_gradient_sync(recurse=False) no_sync is model-wide: per-module sync
              (grad acc modes root_only / some_mlps),   ("root_only", "some_mlps"), set_is_last_backward,
              set_reshard_after_backward,               set_requires_all_reduce (HSDP) do not exist
              set_requires_all_reduce
    training: 2D/3D/ND meshes with TP, HSDP on 4+ ranks tensor parallelism is out of scope; hybrid_shard
                                                        needs >= 4 ranks to be non-degenerate (tested in
                                                        test_parity at world size 4)
    training: world size 1, registered params as        world size 1 is in test_parity; DTensor vs
              DTensor after forward                     Tensor registration is DTensor-specific (the
                                                        shard invariant is checked here instead)
    training: shared_params_separate_fsdp_groups_error  ours has no error to raise: a parameter shared by
                                                        two units goes to their common parent
                                                        (test_runtime)
    mixed precision: per-module policies (fp16 on one   one MixedPrecision per model; no output_dtype
              submodule, output_dtype, cast off on one  (the ports below use one policy everywhere)
              unit), clamp_reduce_dtype, jvp
    clip_grad_norm_: 2D (TP) meshes                     no TP
    state_dict: DTensor state dicts (sharded save/load  state_dict() holds plain 1-D local shards; full
              writeback, distribute_tensor, assign=True, state dicts are full_state_dict /
              2D/TP/HSDP+TP)                            load_full_state_dict (ported below)
    init: managed modules/states, param module infos,   internal FSDP2 bookkeeping
              lazy init, is_root, double lazy init,
              process-group / DeviceMesh.from_group,
              mesh ndim errors, DTensor device moves
    init: invalid meta init (forward still on meta)     ours materialises inside shard(): no such state
    init: HSDP broadcast across replicas, custom        needs >= 4 ranks / all-reduce hooks on streams
              all-reduce hooks
    comm, overlap, compile, extensions, logging, debug, stream/compile/DTensor-extension internals
    block_shard, chunk_cat, copy_engine, 2d, ...
"""

from __future__ import annotations

import copy
import importlib
import math
import traceback
from types import SimpleNamespace

import pytest
import torch

import shardwise
from fsdp2_cases import CASES, Case, fsdp2_shard, full_params, is_slow, is_unit
from harness import run_distributed
from parity_utils import global_mean, local_slice, make_optimizer, rel_err, scalar_rel_err, spawn_once, worst

# The scenarios, one module per FSDP2 test file they port (registered on import, in this order).
SCENARIO_FILES = ("fully_shard_training", "fully_shard_frozen", "fully_shard_autograd", "fully_shard_mixed_precision",
                  "fully_shard_clip_grad_norm_", "fully_shard_state_dict", "fully_shard_memory", "fully_shard_init")
pytest.register_assert_rewrite(*SCENARIO_FILES)  # their checks run here, in the test process
for _file in SCENARIO_FILES:
    importlib.import_module(_file)

SIDES = ("shardwise", "fsdp2", "reference")


# ---- running one case three ways ----------------------------------------------------------------------
def _run_side(side: str, case: Case, rank: int, ws: int, mesh, shared: dict) -> dict:
    ctx = SimpleNamespace(side=side, rank=rank, ws=ws, mesh=mesh, rec={}, i=0, initial=case.initial,
                          shared=shared, opt=None)
    local = side != "reference" or case.ref_local
    ctx.take = (lambda t: local_slice(t, rank, ws)) if local else (lambda t: t)
    names = [n for n, _ in case.initial.named_parameters()]
    model = copy.deepcopy(case.initial)
    torch.manual_seed(1234)  # every side, every rank: the same RNG state (a side may consume it per rank)
    if case.pre_wrap:
        model = case.pre_wrap(ctx, model) or model
    if side == "shardwise":
        model = shardwise.shard(model, **{"units": is_unit, **case.ours})
    elif side == "fsdp2":
        (case.fsdp2_wrap or (lambda m, msh: fsdp2_shard(m, msh, **case.fsdp2)))(model, mesh)
    if case.prepare:
        case.prepare(ctx, model)
    opt = case.optimizer(ctx, model) if callable(case.optimizer) else make_optimizer(case.optimizer, model.parameters())
    ctx.opt = opt
    losses = []
    for i, batch in enumerate(case.batches):
        ctx.i = i
        loss = case.step(ctx, model, batch)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=(i % 2 == 0))  # FSDP2's tests alternate: exercises both paths
        losses.append(global_mean(loss) if local else loss.item())
    params = full_params(side, model, names)
    extra = case.finish(ctx, model) if case.finish else {}
    extra.update({k: v for k, v in ctx.rec.items() if not k.startswith("_")})
    return dict(losses=losses, params=params, extra=extra)


def _compare(s: dict, other: dict) -> tuple[float, tuple[str, float]]:
    loss = max((scalar_rel_err(a, b) for a, b in zip(s["losses"], other["losses"])), default=0.0)
    if len(s["losses"]) != len(other["losses"]):
        loss = math.inf
    missing = sorted(set(other["params"]) - set(s["params"]))
    if missing:
        return loss, (f"missing {missing}", math.inf)
    return loss, worst({n: rel_err(s["params"][n], t) for n, t in other["params"].items()})


def run_case(case: Case, rank: int, ws: int, mesh) -> dict:
    case.initial = case.make()
    out, shared = {}, {}
    for side in SIDES:
        if side == "reference" and rank != 0 and not case.ref_local:
            out[side] = dict(losses=[], params={}, extra={}, error=None)  # only rank 0 compares
            continue
        try:
            out[side] = {**_run_side(side, case, rank, ws, mesh, shared), "error": None}
        except Exception as e:  # noqa: BLE001 - recorded for the test of that side
            out[side] = dict(losses=[], params={}, extra={},
                             error=f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    ok = {k: v["error"] is None for k, v in out.items()}
    if rank == 0:
        for side in ("shardwise", "fsdp2"):
            if ok[side] and ok["reference"]:
                out[side]["vs_reference"] = _compare(out[side], out["reference"])
        if ok["shardwise"] and ok["fsdp2"]:
            out["shardwise"]["vs_fsdp2"] = _compare(out["shardwise"], out["fsdp2"])
    for s in out.values():
        s.pop("params")
    return out


# ---- one spawn per world size and speed class ------------------------------------------------------------
def _worker(rank: int, ws: int, slow: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, registered in CASES.items():
        if ws in registered.world_sizes and is_slow(name, ws) == slow:
            out[name] = run_case(registered.build(ws), rank, ws, mesh)
    return out


@spawn_once
def report(ws: int, slow: bool) -> list:
    return run_distributed(_worker, ws, slow, timeout_s=90)


PARAMS = [pytest.param(name, ws, id=f"{name}-ws{ws}", marks=[pytest.mark.slow] if is_slow(name, ws) else [])
          for name, registered in CASES.items() for ws in registered.world_sizes]


def _results(name: str, ws: int) -> list:
    return [r[name] for r in report(ws, is_slow(name, ws))]


# FSDP2 scenarios that fail on CPU/gloo (the oracle half is skipped with the reason; see the module docstring).
FSDP2_FAILS: dict[str, str] = {
    "mp_frozen_first_forward_int_param":
        "torch 2.13 FSDP2 raises 'attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype "
        "Float' in its post-backward: after a first forward with every parameter frozen it reduces in bf16 "
        "although reduce_dtype=float32 (the exact scenario of its own test, which only runs on GPU)",
    "parameter_replaced_after_shard":
        "torch 2.13 FSDP2's lazy init calls reset_sharded_param on the new plain nn.Parameter and fails with "
        "AttributeError: 'Parameter' object has no attribute '_local_tensor' (its test replaces it on a meta "
        "model; on a real model it fails)",
}


def _side_errors(results: list, side: str) -> list:
    return [r[side]["error"] for r in results if r[side]["error"]]


@pytest.mark.parametrize("name,ws", PARAMS)
def test_shardwise(name, ws):
    """Our engine on the scenario: no error on any rank, parity (losses every step, parameters at the end)
    with the single-process reference (or FSDP2 where no exact reference exists), the scenario's checks."""
    results = _results(name, ws)
    c = CASES[name].build(ws)
    errors = _side_errors(results, "reference")
    assert not errors, f"the reference itself failed:\n{errors[0]}"
    errors = _side_errors(results, "shardwise")
    if errors and c.ours_error is not None:
        import re

        assert len(errors) == len(results) and all(re.search(c.ours_error, e) for e in errors), errors[0]
        return  # a named error on every rank: allowed where FSDP2 fails as well
    assert not errors, f"{c.doc}\n{errors[0]}"
    mine, ref = results[0]["shardwise"], results[0]["reference"]
    if c.parity == "fsdp2":
        fsdp2_errors = _side_errors(results, "fsdp2")
        assert not fsdp2_errors, f"FSDP2, the only oracle here, failed:\n{fsdp2_errors[0]}"
        loss_err, (where, param_err) = mine["vs_fsdp2"]
        against = "FSDP2"
    else:
        loss_err, (where, param_err) = mine["vs_reference"]
        against = "the reference"
    assert loss_err <= c.rtol, f"losses off {against} by {loss_err:.2e}: {mine['losses']}"
    assert param_err <= c.rtol, f"{where} off {against} by {param_err:.2e}"
    for key in c.compare_extra:
        for a, b in zip(mine["extra"][key], ref["extra"][key], strict=True):
            assert scalar_rel_err(a, b) <= c.rtol, f"{key}: {mine['extra'][key]} vs reference {ref['extra'][key]}"
    if c.check:
        c.check(mine["extra"], "shardwise", ws)


@pytest.mark.parametrize("name,ws", PARAMS)
def test_fsdp2_oracle(name, ws):
    """torch FSDP2 on the same scenario: the oracle is sound here (or fails with FSDP2's own error, by design)."""
    results = _results(name, ws)
    c = CASES[name].build(ws)
    errors = _side_errors(results, "fsdp2")
    if c.fsdp2_error is not None:
        import re

        assert errors and all(re.search(c.fsdp2_error, e) for e in errors), \
            f"FSDP2 was expected to raise {c.fsdp2_error!r}, got: {errors[:1]}"
        return
    if name in FSDP2_FAILS:
        assert errors, f"FSDP2 now passes {name}: remove it from FSDP2_FAILS"
        pytest.skip(f"FSDP2 fails this on CPU: {FSDP2_FAILS[name]}")
    assert not errors, f"{c.doc}\n{errors[0]}"
    theirs, ref = results[0]["fsdp2"], results[0]["reference"]
    if c.fsdp2_parity and c.parity == "reference":
        loss_err, (where, param_err) = theirs["vs_reference"]
        assert loss_err <= c.rtol, f"FSDP2 losses off the reference by {loss_err:.2e}"
        assert param_err <= c.rtol, f"FSDP2 {where} off the reference by {param_err:.2e}"
        for key in c.compare_extra:
            for a, b in zip(theirs["extra"][key], ref["extra"][key], strict=True):
                assert scalar_rel_err(a, b) <= c.rtol, f"{key}: {theirs['extra'][key]} vs {ref['extra'][key]}"
    if c.check:
        c.check(theirs["extra"], "fsdp2", ws)
