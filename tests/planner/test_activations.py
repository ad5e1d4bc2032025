"""Activations measured on meta (``planner.activations``): checkpointing cuts them, a forward that cannot
run on meta falls back to the formula, and the process-wide patches and warning filters the measurement
needs are gone once it returns."""

import sys
import warnings

import pytest
import torch.nn as nn
import torch.nn.functional as F

from hf_dirs import tiny_config
from shardwise.hf.model_spec import resolve_model
from shardwise.planner.activations import measure_activations
from shardwise.planner.memory import PlanInputs, plan_memory


def test_activation_checkpointing_cuts_planned_activations():
    plain = plan_memory(PlanInputs("gpt-34m", 2, batch_size=8, seq_len=256))
    ckpt = plan_memory(PlanInputs("gpt-34m", 2, batch_size=8, seq_len=256, activation_checkpointing=True))
    assert plain.activation_method.startswith("measured")
    assert ckpt.activation_bytes < 0.6 * plain.activation_bytes


def test_the_patches_and_warning_filters_last_only_for_the_measurement(tmp_path):
    pytest.importorskip("transformers")
    tiny_config("qwen2", 320).save_pretrained(tmp_path)
    sdpa, filters = F.scaled_dot_product_attention, list(warnings.filters)
    masking = sys.modules.get("transformers.masking_utils")
    is_tracing = getattr(masking, "is_tracing", None)
    plan = plan_memory(PlanInputs(str(tmp_path / "config.json"), 1, batch_size=1, seq_len=16))  # HF forward on meta
    assert plan.activation_method.startswith("measured")
    assert F.scaled_dot_product_attention is sdpa
    assert warnings.filters == filters
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None and is_tracing is not None:
        assert masking.is_tracing is is_tracing


class _DataDependent(nn.Module):
    def forward(self, idx):
        raise RuntimeError("a forward that reads tensor values cannot run on meta")


def test_a_forward_that_cannot_run_on_meta_falls_back_to_the_formula():
    spec = resolve_model("gpt-tiny")
    prof = measure_activations(spec, _DataDependent(), [], batch_size=2, seq_len=8, cast_to=None, itemsize=4)
    assert prof.method.startswith("formula")
    assert prof.saved_bytes == 17 * 2 * 8 * spec.hidden * 4 * spec.n_layer + 2 * 8 * spec.vocab_size * 4
