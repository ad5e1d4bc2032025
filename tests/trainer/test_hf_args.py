"""Hugging Face Trainer / run_clm.py command lines map onto shardwise train's keys (no processes)."""

import pytest

from shardwise.trainer import config as C


def test_run_clm_command_line_maps_onto_our_keys():
    cfg = C.resolve(["--model_name_or_path", "models/llama", "--train_file", "sft.jsonl",
                     "--fsdp", "full_shard auto_wrap", "--per_device_train_batch_size", "1",
                     "--gradient_accumulation_steps", "8", "--gradient_checkpointing", "--bf16",
                     "--learning_rate", "2e-5", "--max_steps", "30", "--output_dir", "out/ft"])
    assert (cfg.model, cfg.data, cfg.out) == ("models/llama", "sft.jsonl", "out/ft")
    assert (cfg.sharding_strategy, cfg.auto_wrap, cfg.cpu_offload) == ("full_shard", "transformer_based_wrap", False)
    assert (cfg.batch_size, cfg.gradient_accumulation_steps, cfg.steps, cfg.lr) == (1, 8, 30, 2e-5)
    assert cfg.activation_checkpointing is True and cfg.mixed_precision == "bf16"


@pytest.mark.parametrize("words, strategy, wrap, offload", [
    ("shard_grad_op auto_wrap", "shard_grad_op", "transformer_based_wrap", False),
    ("hybrid_shard auto_wrap", "hybrid_shard", "transformer_based_wrap", False),
    ("hybrid_shard_zero2", "hybrid_shard_zero2", "no_wrap", False),  # no auto_wrap: one unit, as HF does
    ("no_shard", "no_shard", "no_wrap", False),
    ("full_shard offload auto_wrap", "full_shard", "transformer_based_wrap", True),
    ("offload", "full_shard", "no_wrap", True),
])
def test_fsdp_words(words, strategy, wrap, offload):
    for argv in (["--fsdp", words], [f"--fsdp={words}"]):
        cfg = C.resolve(argv)
        assert (cfg.sharding_strategy, cfg.auto_wrap, cfg.cpu_offload) == (strategy, wrap, offload)


@pytest.mark.parametrize("argv, precision", [
    (["--bf16"], "bf16"), (["--fp16", "--max_steps", "3"], "fp16"), (["--bf16", "true"], "bf16"),
    (["--bf16=True"], "bf16"), (["--bf16", "False"], "no"), (["--fp16=false"], "no"),
])
def test_mixed_precision_flags(argv, precision):
    assert C.resolve(argv).mixed_precision == precision


@pytest.mark.parametrize("argv, message", [
    (["--fsdp", "full_shard wrap_everything"],
     "--fsdp 'full_shard wrap_everything': unknown word 'wrap_everything'; valid: full_shard, shard_grad_op"),
    (["--fsdp", "full_shard shard_grad_op"], "names 2 strategies"),
    (["--fsdp"], "--fsdp needs a value"),
    (["--bf16=maybe"], "--bf16='maybe' is not valid; expected true or false"),
    (["--do_train"], "--do_train: a Hugging Face Trainer flag with no meaning here \\(shardwise train always trains"),
    (["--report_to", "none"], "--report_to: a Hugging Face Trainer flag with no meaning here \\(metrics go to"),
    (["--push_to_hub"], "unknown option '--push_to_hub'; `shardwise train --help` lists every option and its "
                        "Hugging Face spellings"),
])
def test_unaccepted_hf_flags_are_refused_with_what_is_accepted(argv, message):
    with pytest.raises(C.ConfigError, match=message):
        C.resolve(argv)
