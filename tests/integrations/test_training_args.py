"""shardwise.integrations.training_args: what TrainingArguments' FSDP settings become (shard() options), a copy
of the arguments the Trainer gets without them, and the line that says so. No process group needed."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("transformers")

import shardwise
from shardwise.errors import ShardwiseError
from shardwise.integrations.training_args import translate


def _args(**kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **kw)


def test_fsdp_settings_become_shard_options_and_the_trainer_gets_none_of_them():
    args = _args(fsdp="shard_grad_op auto_wrap offload", bf16=True,
                 fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "activation_checkpointing": True,
                              "state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": True})
    t = translate(args, {})
    options = dict(t.shard_options)
    assert isinstance(options.pop("offload"), shardwise.CPUOffload)
    assert options == {"strategy": "shard_grad_op", "units": ["LlamaDecoderLayer"], "activation_checkpointing": True}
    assert not t.hf_args.fsdp and t.hf_args.fsdp_plugin_args is None and t.hf_args.bf16
    assert args.fsdp and args.fsdp_plugin_args is not None, "the user's arguments are left as they were"
    line = t.line("2 LlamaDecoderLayer + the root")
    assert "\n" not in line and line.startswith("shardwise: fsdp_config reshard_after_forward=False -> strategy "
                                                "shard_grad_op; ")
    for said in ("transformer_layer_cls_to_wrap LlamaDecoderLayer -> one unit each", "cpu_offload -> offload=CPUOffload()",
                 "activation_checkpointing -> activation_checkpointing=True", "state_dict_type SHARDED_STATE_DICT ->",
                 "cpu_ram_efficient_loading -> always", "bf16 -> Accelerate's autocast", "units: 2 LlamaDecoderLayer"):
        assert said in line, (said, line)


def test_wrap_policies_defaults_and_explicit_options():
    assert translate(_args(fsdp="full_shard", fsdp_config={"auto_wrap_policy": "NO_WRAP"}), {}).shard_options == {
        "units": None, "strategy": "full_shard"}
    default = translate(_args(), {})
    assert default.shard_options == {"units": "auto", "strategy": "full_shard"}
    assert "no fsdp settings -> shardwise's defaults" in default.line("x")
    explicit = translate(_args(fsdp="full_shard"), {"strategy": "no_shard", "units": None})
    assert explicit.shard_options == {"units": None, "strategy": "no_shard"}
    assert "shard_options strategy=no_shard" in explicit.line("x")
    with pytest.raises(ShardwiseError, match=r"auto_wrap_policy SIZE_BASED_WRAP: not supported"):
        translate(_args(fsdp="full_shard", fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10}), {})


def test_older_transformers_words_mean_what_shardwise_train_makes_of_them():
    """transformers 4 keeps the words (a list of FSDPOption): read with trainer/hf_args.py's parser."""
    old = types.SimpleNamespace(fsdp=["hybrid_shard", "auto_wrap", "offload"], fsdp_config={}, fsdp_plugin_args=None,
                                bf16=False, fp16=False)
    options = translate(old, {}).shard_options
    assert options["strategy"] == "hybrid_shard" and options["units"] == "auto" and "offload" in options
    no_wrap = types.SimpleNamespace(**{**vars(old), "fsdp": ["full_shard"]})
    assert translate(no_wrap, {}).shard_options == {"units": None, "strategy": "full_shard"}
    with pytest.raises(ShardwiseError, match=r"TrainingArguments fsdp 'full_shard sharded': unknown word 'sharded'; "
                                             r"valid: full_shard"):
        translate(types.SimpleNamespace(**{**vars(old), "fsdp": "full_shard sharded"}), {})
