"""The ``frozen_base`` record of an adapter-only checkpoint: a 4-bit base records how it was quantised, and a
load over the same weights quantised otherwise (or not at all) is refused in one line saying both; a record
without ``quantization`` is of a base in high precision (every record written before 4-bit bases)."""

from __future__ import annotations

import pytest

from shardwise.checkpoint.frozen_base import base_record, check_record, mismatch
from shardwise.errors import ShardwiseError

SHA = "ab" * 32
NF4 = {"quant_type": "nf4", "double_quant": True, "skip_modules": ["lm_head"]}


def _saved(quantization=None) -> dict:
    return {**base_record("/models/llama", SHA, quantization), "dtype": "float32"}


def test_a_record_carries_the_quantisation_only_when_there_is_one():
    assert base_record("/m", SHA) == {"source": "/m", "weights_sha256": SHA}
    assert base_record("/m", SHA, NF4)["quantization"] == NF4
    check_record(_saved(NF4), "frozen_base", saved=True)
    with pytest.raises(ShardwiseError, match=r"^frozen_base.quantization: expected an object$"):
        check_record({**_saved(), "quantization": "nf4"}, "frozen_base", saved=True)
    with pytest.raises(ShardwiseError, match=r"expected an object with exactly dtype, source, weights_sha256 \(and "
                                             r"optionally quantization\)"):
        check_record({**_saved(), "other": 1}, "frozen_base", saved=True)


def test_the_same_weights_quantised_otherwise_are_another_base():
    fp4 = {**NF4, "quant_type": "fp4"}
    assert mismatch(_saved(NF4), base_record("/elsewhere/llama", SHA, NF4), "float32") is None  # moved: the same
    assert mismatch(_saved(), base_record("/m", SHA), "float32") is None
    assert mismatch(_saved(NF4), base_record("/m", SHA, fp4), None) == (
        "its frozen base was quantised as double_quant=True, quant_type=nf4, skip_modules=['lm_head'], the model's as "
        "double_quant=True, quant_type=fp4, skip_modules=['lm_head']; the trained adapters belong to the base as it "
        "was quantised")
    assert "quantised as none (high precision), the model's as double_quant=True" in mismatch(
        _saved(), base_record("/m", SHA, NF4), None)
    assert "the model's as none (high precision)" in mismatch(_saved(NF4), base_record("/m", SHA), None)
