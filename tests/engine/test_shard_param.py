"""``engine/shard_param.py``'s probe of the torch it runs on: whether ``torch.autograd.backward`` lets a
sharded parameter see ``backward(inputs=...)`` (pytorch/pytorch#171473). Where it does, the table in
test_torch_apis.py shows ``backward(inputs=params)`` exact; where it does not, ``shard()`` says so once."""

import warnings

import pytest
import torch

from shardwise.engine.surface import shard_param


@pytest.fixture
def fresh_probe():
    shard_param.backward_consults_inputs.cache_clear()
    yield
    shard_param.backward_consults_inputs.cache_clear()


def test_the_probe_finds_torch_2_13_passing_backward_inputs(fresh_probe):
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip("pytorch/pytorch#171473 is checked in torch 2.13; older releases are what the probe is for")
    assert shard_param.backward_consults_inputs()


def test_the_probe_finds_a_torch_that_runs_backward_past_the_inputs(fresh_probe, monkeypatch):
    original = torch.autograd.backward

    def backward_without_dispatch(*args, **kwargs):  # what a torch before #171473 does with its inputs
        with torch._C.DisableTorchFunctionSubclass():
            return original(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", backward_without_dispatch)
    assert not shard_param.backward_consults_inputs()


def test_a_torch_that_hides_backward_inputs_is_named_once(monkeypatch):
    monkeypatch.setattr(shard_param, "backward_consults_inputs", lambda: False)
    monkeypatch.setattr(shard_param, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"backward\(inputs=\.\.\.\)'s inputs .* call loss.backward\(\)"):
        shard_param.warn_if_backward_inputs_unseen()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard_param.warn_if_backward_inputs_unseen()  # once per process
