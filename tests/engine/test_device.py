"""One place decides the compute device, where each collective's tensors live and which group carries it
(``shardwise.engine.base.device``): the default group of ``init_process_group()`` without a backend reports
``'undefined'`` and carries CPU tensors over gloo and CUDA tensors over NCCL; a GPU machine must then compute
on the GPU. Data collectives run on shardwise's own copy of each group, control traffic on one gloo group."""

from __future__ import annotations

import pytest
import torch

from shardwise.engine.base import device


@pytest.mark.parametrize("config,expected", [
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
    ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("nccl", {"cuda": "nccl"}),
    ("cuda:nccl", {"cuda": "nccl"}),
])
def test_backend_config_strings_map_device_types_to_backends(monkeypatch, config, expected):
    monkeypatch.setattr(device.dist, "get_backend_config", lambda group=None: config)
    assert device.backends() == expected


def test_meta_or_cpu_parameters_compute_on_the_gpu_when_the_group_moves_cuda_tensors_over_nccl(monkeypatch):
    monkeypatch.setattr(device.dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device.compute_device([torch.device("meta")]) == torch.device("cuda", 3)


def test_a_gloo_only_group_computes_where_the_parameters_are(monkeypatch):
    monkeypatch.setattr(device.dist, "get_backend_config", lambda group=None: "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.compute_device([torch.device("cpu")]) == torch.device("cpu")
    assert device.compute_device([torch.device("cuda", 1)]) == torch.device("cuda", 1)
    assert device.compute_device([], explicit="cpu") == torch.device("cpu")


def test_an_nccl_only_group_computes_on_the_gpu_and_the_test_mode_stands_in_for_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device.dist, "get_backend_config", lambda group=None: "nccl")
    assert device.compute_device([torch.device("cpu")]) == torch.device("cuda", 0)
    monkeypatch.setitem(device.DEVICE_ONLY_BACKENDS, "nccl_rules", lambda: torch.device("cpu", 0))
    monkeypatch.setattr(device.dist, "get_backend_config", lambda group=None: "cpu:nccl_rules")
    assert device.compute_device([torch.device("cpu")]) == torch.device("cpu", 0)  # tests/nccl_rules.py


def _groups(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import shardwise
    from shardwise.engine.core.runtime import runtime_of

    first, second = (runtime_of(shardwise.shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), units={torch.nn.Linear})).pgs
                     for _ in range(2))
    control = device.control_group()
    return {"own": first.shard is not dist.group.WORLD and first.shard is first.world is second.shard,
            "ranks": dist.get_process_group_ranks(first.shard),
            "same backend": dist.get_backend_config(first.shard) == dist.get_backend_config(),
            "control": (device.backends(control)["cpu"], dist.get_process_group_ranks(control))}


def test_data_collectives_run_on_own_groups_and_control_traffic_on_one_gloo_group():
    """shard() copies the group it shards over (same ranks, same backend), once for every model over it, so a
    user's collective on the default group never meets one of ours at the wire; the control group is gloo."""
    from harness import run_distributed

    for r in run_distributed(_groups, 2):
        assert r == {"own": True, "ranks": [0, 1], "same backend": True, "control": ("gloo", [0, 1])}, r


@pytest.mark.parametrize("config, cuda, nccl", [("cpu:gloo,cuda:nccl", True, True), ("nccl", True, True),
                                                ("cpu:gloo,cuda:nccl", False, False), ("gloo", True, False)])
def test_one_nccl_decision_for_the_device_and_for_waits(monkeypatch, config, cuda, nccl):
    """Where CUDA tensors go over NCCL, the model computes on the GPU and a wait does not block the CPU."""
    from shardwise.engine.base import collectives

    monkeypatch.setattr(device.dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(collectives, "_cpu_wait_cache", {})  # (the wait decision is cached per group)
    group = object()
    assert device.moves_cuda_over_nccl(group) is nccl
    assert (device.compute_device([torch.device("cpu")], group).type == "cuda") is nccl
    assert collectives._waits_on_cpu(group) is not nccl
