"""``engine/shard_param.py``'s probe of the torch it runs on: whether ``torch.autograd.backward`` lets a
sharded parameter see ``backward(inputs=...)`` (pytorch/pytorch#171473). Where it does, the table in
test_torch_apis.py shows ``backward(inputs=params)`` exact; where it does not, ``shard()`` says so once."""

import warnings

import pytest
import torch

from shardwise.engine import shard_param


def test_the_probe_sees_what_this_torch_does():
    seen = []

    class Recorder(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.autograd.backward:
                seen.append(func)
                return None
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    x = torch.zeros(1, requires_grad=True)
    torch.autograd.backward((x * 3).sum(), inputs=[torch.zeros(1).as_subclass(Recorder).requires_grad_()])
    assert shard_param.backward_consults_inputs() is bool(seen)


def test_a_torch_that_hides_backward_inputs_is_named_once(monkeypatch):
    monkeypatch.setattr(shard_param, "backward_consults_inputs", lambda: False)
    monkeypatch.setattr(shard_param, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"backward\(inputs=\.\.\.\)'s inputs .* call loss.backward\(\)"):
        shard_param.warn_if_backward_inputs_unseen()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard_param.warn_if_backward_inputs_unseen()  # once per process
