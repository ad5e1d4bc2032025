"""The pieces that need no process group: the streaming safetensors writer and the pickle-free encoding
of ``extra``."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from shardwise.checkpoint.format import write_safetensors
from shardwise.checkpoint.values import decode, encode
from shardwise.errors import ShardwiseError


def test_writer_output_is_standard_safetensors(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "i64": torch.arange(4),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0),
        "strided": torch.randn(4, 6)[:, ::2],  # non-contiguous: written in row-major order
    }
    size, sha = write_safetensors(tmp_path / "x.safetensors", tensors, metadata={"format": "pt"})
    data = (tmp_path / "x.safetensors").read_bytes()
    assert size == len(data) and sha == hashlib.sha256(data).hexdigest()
    back = load_file(tmp_path / "x.safetensors")
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_extra_round_trips_without_pickle():
    rng = np.random.RandomState(3)
    value = {
        "python_rng": random.Random(1).getstate(),
        "numpy_rng": rng.get_state(),
        "torch_rng": torch.get_rng_state(),
        "nested": {"a": [1, 2.5, None, True, "s"], "t": (1, (2, 3))},
        "odd_keys": {1: "int key", "__tuple__": "marker-like key"},
        "floats": [float("inf"), 0.1, -0.0],
    }
    store = {}

    def sink(where, t):
        store[f"k{len(store)}"] = t.clone()
        return f"k{len(store) - 1}"

    encoded = json.loads(json.dumps(encode(value, sink)))  # must survive JSON
    back = decode(encoded, store.__getitem__)
    assert back["python_rng"] == value["python_rng"]
    random.Random().setstate(back["python_rng"])
    assert back["numpy_rng"][0] == "MT19937" and np.array_equal(back["numpy_rng"][1], value["numpy_rng"][1])
    np.random.RandomState().set_state(back["numpy_rng"])
    assert torch.equal(back["torch_rng"], value["torch_rng"])
    assert back["nested"] == value["nested"] and back["odd_keys"] == value["odd_keys"]
    assert back["floats"][0] == float("inf") and str(back["floats"][2]) == "-0.0"


def test_extra_refuses_what_it_cannot_store_without_pickle():
    with pytest.raises(ShardwiseError, match=r"extra\.sched of type object"):
        encode({"sched": object()}, lambda w, t: "k")
