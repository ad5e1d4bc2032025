"""Shared pieces of the checkpoint tests: a small model under any strategy, a deterministic global batch,
and a single-process reader that turns a checkpoint into full tensors for bitwise comparison."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

GLOBAL_BATCH = 12  # divisible by every world size tested (1, 2, 3, 4)
SEQ = 16


def build(strategy: str = "full_shard", mesh_shape=None, seed: int = 0, tie: bool = True):
    import shardwise
    from shardwise.models import GPT

    torch.manual_seed(seed)
    model = GPT.from_preset("gpt-tiny", tie_weights=tie)
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    model = shardwise.shard(model, strategy=strategy, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    return model, opt


def train_step(model, opt, step: int, rank: int, world_size: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world_size
    x = data[rank * per:(rank + 1) * per]
    loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous()).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return global_mean(loss.detach())


def global_mean(value: torch.Tensor) -> float:
    """The loss over the whole global batch (every rank's slice has the same size)."""
    import torch.distributed as dist

    value = value.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def full_params(model) -> dict[str, torch.Tensor]:
    import shardwise

    return {k: v.clone() for k, v in shardwise.full_state_dict(model).items()}


def contents(ckpt) -> dict[str, object]:
    """Every parameter and optimizer state tensor of a checkpoint, full size, plus scalar state and groups."""
    from safetensors import safe_open

    ckpt = Path(ckpt)
    m = json.loads((ckpt / "manifest.json").read_text())
    out: dict[str, object] = {}
    handles = {}

    def f(name):
        if name not in handles:
            handles[name] = safe_open(str(ckpt / name), "pt")
        return handles[name]

    for name, p in m["params"].items():
        numel = 1
        for d in p["shape"]:
            numel *= d
        out[name] = torch.cat([f(pc["file"]).get_tensor(pc["key"]) for pc in p["pieces"]]).view(p["shape"])
        state = (m.get("optimizer") or {}).get("state", {}).get(name)
        if state:
            for s in state["tensors"]:
                out[f"{name}/{s}"] = torch.cat([f(pc["file"]).get_tensor(pc["optim"][s]) for pc in p["pieces"]])
            out[f"{name}/scalars"] = state["scalars"]
    if m.get("optimizer"):
        out["param_groups"] = m["optimizer"]["param_groups"]
    return out


def assert_same_contents(a: dict, b: dict) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def run_with_manager(rank, world_size, run_dir):
    from shardwise.checkpoint import CheckpointManager, list_checkpoints
    from shardwise.errors import ShardwiseError

    model, opt = build()
    mgr = CheckpointManager(run_dir, keep_last=2)
    for step in (1, 2, 3):
        train_step(model, opt, step, rank, world_size)
        mgr.save(model, opt, step=step, extra={"step": step, "rank": rank})
    if rank == 0:
        # A save that crashed mid-way (same name as the next save's temporary directory): never picked up.
        os.makedirs(f"{run_dir}/.tmp-step-00000004")
        Path(f"{run_dir}/.tmp-step-00000004/rank-00000-of-00002.safetensors").write_bytes(b"junk")
        # A directory named like the newest checkpoint but without one: resume refuses it rather than
        # quietly going back to step 3.
        os.makedirs(f"{run_dir}/step-00000009")
    torch.distributed.barrier()
    steps_before = [s for s, _ in list_checkpoints(run_dir)]
    model2, opt2 = build(seed=9)
    try:
        mgr.resume(model2, opt2)
        decoy_error = None
    except ShardwiseError as e:
        decoy_error = str(e)
    if rank == 0:
        os.rmdir(f"{run_dir}/step-00000009")
    torch.distributed.barrier()
    resumed = mgr.resume(model2, opt2)
    same = all(torch.equal(a, b) for a, b in zip(full_params(model).values(), full_params(model2).values()))
    train_step(model, opt, 4, rank, world_size)
    mgr.save(model, opt, step=4, extra={"step": 4, "rank": rank})
    steps_after = [s for s, _ in list_checkpoints(run_dir)]
    return steps_before, resumed, same, steps_after, sorted(os.listdir(run_dir)), full_params(model), decoy_error
