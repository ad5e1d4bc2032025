"""One place decides the compute device and which backend carries a collective (``shardwise.engine.base.device``):
the default group of ``init_process_group()`` without a backend reports ``'undefined'`` and carries CPU
tensors over gloo and CUDA tensors over NCCL; a GPU machine must then compute on the GPU."""

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
    assert device.communication_device() == torch.device("cpu")  # gloo carries the small CPU tensors


def test_a_gloo_only_group_computes_where_the_parameters_are(monkeypatch):
    monkeypatch.setattr(device.dist, "get_backend_config", lambda group=None: "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.compute_device([torch.device("cpu")]) == torch.device("cpu")
    assert device.compute_device([torch.device("cuda", 1)]) == torch.device("cuda", 1)
    assert device.compute_device([], explicit="cpu") == torch.device("cpu")


def test_an_nccl_only_group_communicates_small_tensors_on_the_gpu(monkeypatch):
    monkeypatch.setattr(device.dist, "get_backend_config", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert device.communication_device() == torch.device("cuda", 0)


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
