"""The NCCL-rules test mode itself (tests/nccl_rules.py): tensors are tagged where a GPU run would hold them,
operations mixing the two kinds fail as on a GPU, and its process groups refuse what NCCL (or a host control
group) must never carry. The engine's own runs under the mode are tests/engine/test_under_nccl_rules.py."""

import pytest
import torch
import torch.distributed as dist

import nccl_rules
from harness import error_of, run_distributed
from nccl_rules import DEVICE, NcclRuleViolation, enforced, kind


def test_tensors_are_device_or_host_where_a_gpu_run_would_put_them():
    with enforced():
        on_device, on_host = torch.zeros(4, device=DEVICE), torch.zeros(4)
        assert (kind(on_device), kind(on_host), kind(torch.zeros(2, device="cpu"))) == ("device", "host", "host")
        assert on_device.device == DEVICE and on_host.device == torch.device("cpu")
        assert kind(torch.arange(3, device=on_device.device)) == "device"  # device=t.device: where t is
        assert kind(on_device[1:]) == kind(on_device * 2) == kind(torch.zeros_like(on_device)) == "device"
        assert kind(torch.tensor([1.0])) == "host" and kind(torch.tensor([1.0], device=DEVICE)) == "device"
        copied = on_device.cpu()
        assert kind(copied) == "host" and kind(on_device) == "device"
        assert copied.untyped_storage().data_ptr() != on_device.untyped_storage().data_ptr()  # a copy, as on a GPU
        assert kind(on_device.to("cpu", torch.float64)) == "host" and kind(on_host.to(DEVICE)) == "device"
        assert on_device.to(DEVICE) is on_device and on_host.to("cpu") is on_host  # already there: no copy
        w = torch.randn(3, device=DEVICE, requires_grad=True)
        (w * 2).sum().backward()
        assert kind(w.grad) == "device"  # autograd's backward is tagged too


def test_operations_mixing_device_and_host_tensors_fail_except_where_cuda_allows_them():
    with enforced():
        on_device, on_host = torch.ones(4, device=DEVICE), torch.ones(4)
        assert "mixes device and host tensors" in error_of(lambda: on_device + on_host)
        assert "mixes device and host tensors" in error_of(lambda: torch.nn.functional.embedding(
            torch.zeros(2, dtype=torch.long), on_device.view(2, 2)))
        assert (on_device * torch.tensor(2.0)).tolist() == [2.0] * 4  # a 0-dim host tensor: a scalar to CUDA
        assert kind(on_device[torch.tensor([0, 2])]) == "device"  # host indices
        on_device.copy_(on_host)  # copies cross freely
        with pytest.raises(NcclRuleViolation):
            on_device.numpy()


# torch 2.13 deprecates the *_tensor names; 2.11 has only them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _groups_refuse(rank: int, world: int) -> dict:
    host_group = dist.new_group(backend=nccl_rules.HOST_BACKEND)
    with enforced():
        data = torch.full((4,), float(rank + 1), device=DEVICE)
        dist.all_reduce(data)
        gathered = torch.empty(4 * world, device=DEVICE)
        _all_gather_single(gathered, torch.full((4,), float(rank), device=DEVICE))
        scattered = torch.empty(2, device=DEVICE)
        _reduce_scatter_single(scattered, torch.arange(2.0 * world, device=DEVICE))
        flag = torch.tensor([rank])
        dist.all_reduce(flag, group=host_group)
        return {"sum": data.tolist(), "gathered": gathered.tolist(), "scattered": scattered.tolist(),
                "flag": flag.item(),
                "host_on_nccl": error_of(lambda: dist.all_reduce(torch.ones(3))),
                "device_on_host_group": error_of(lambda: dist.all_reduce(torch.ones(3, device=DEVICE), group=host_group)),
                "backend": dist.get_backend_config()}


def test_its_groups_run_collectives_and_refuse_what_nccl_or_a_control_group_never_carries():
    results = run_distributed(_groups_refuse, 2, backend=nccl_rules.BACKEND)
    for rank, r in enumerate(results):
        assert r["sum"] == [3.0] * 4 and r["gathered"] == [0.0] * 4 + [1.0] * 4, r
        assert r["scattered"] == [4.0 * rank, 4.0 * rank + 2.0] and r["flag"] == 1, r  # arange(4) summed twice
        assert r["backend"] == f"cpu:{nccl_rules.BACKEND}"
        assert r["host_on_nccl"].startswith("NcclRuleViolation: all_reduce on a nccl_rules group got a host tensor")
        assert r["device_on_host_group"].startswith(
            "NcclRuleViolation: all_reduce on a host_rules group got a device tensor"), r
