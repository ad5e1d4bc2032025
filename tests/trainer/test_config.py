"""Config parsing: defaults <- TOML <- command line, aliases, and rejection with the list of valid values."""

import pytest

from shardwise.trainer import config as C


def test_defaults_and_cli_overrides_with_dashes():
    cfg = C.resolve(["--save-every", "4", "--log-every", "1", "--mixed-precision", "BF16", "--lr=1e-4",
                     "--activation-checkpointing", "--no-progress", "--transformer-layer-cls-to-wrap", "A,B"])
    assert cfg.save_every == 4 and cfg.log_every == 1
    assert cfg.mixed_precision == "bf16" and cfg.lr == 1e-4
    assert cfg.activation_checkpointing is True and cfg.progress is False
    assert cfg.transformer_layer_cls_to_wrap == ["A", "B"]
    assert cfg.model == C.TrainConfig().model  # untouched keys keep their defaults


def test_toml_then_cli_precedence(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "gpt-tiny"\nsteps = 7\nsave_every = 2\n[fsdp]\nfsdp_offload_params = true\n'
                    'fsdp_sharding_strategy = "SHARD_GRAD_OP"\nlearning_rate = 0.01\n')
    cfg = C.resolve(["--config", str(path), "--steps", "9"])
    assert cfg.model == "gpt-tiny" and cfg.save_every == 2
    assert cfg.steps == 9  # the command line wins over the file
    assert cfg.cpu_offload is True and cfg.sharding_strategy == "shard_grad_op" and cfg.lr == 0.01


def test_resolved_config_round_trips(tmp_path):
    cfg = C.resolve(["--model", "gpt-tiny", "--steps", "3", "--transformer-layer-cls-to-wrap", "Block",
                     "--out", str(tmp_path / 'run "x"')])
    saved = C.save(cfg, str(tmp_path))
    assert C.resolve(["--config", saved]) == cfg


@pytest.mark.parametrize("typo, meant", [("--save-evry", "--save-every"), ("--learning-rat", "--learning-rate"),
                                         ("--learning_rat", "--learning_rate"), ("--per_device_batch_size",
                                                                                 "--per_device_train_batch_size")])
def test_a_misspelled_option_gets_the_closest_spelling_and_aliases_count(typo, meant):
    """The suggestion is among our options and their Hugging Face aliases, in the user's own style (dashes or
    underscores), in one short line pointing at --help rather than listing every option."""
    with pytest.raises(C.ConfigError) as e:
        C.resolve([typo, "3"])
    msg = str(e.value)
    assert f"unknown option {typo!r} (did you mean {meant!r}?)" in msg and "--help" in msg and len(msg) < 200


def test_hf_flags_with_no_meaning_say_why_and_bf16_with_fp16_is_refused():
    with pytest.raises(C.ConfigError, match="--do_train: a Hugging Face Trainer flag with no meaning here"):
        C.resolve(["--do_train"])
    with pytest.raises(C.ConfigError, match="--bf16 and --fp16: both given"):
        C.resolve(["--bf16", "--fp16"])


def test_hf_spelled_command_lines_take_hf_defaults_and_say_so():
    from shardwise.trainer.defaults import defaults_note

    """A run_clm.py-style command line gets HF Trainer's defaults for what it does not set; dashes keep
    shardwise's; --defaults chooses explicitly; given options always win."""
    hf = C.resolve(["--learning_rate", "2e-5", "--model", "gpt-tiny"])
    assert (hf.defaults, hf.lr, hf.lr_schedule, hf.warmup_steps, hf.weight_decay, hf.adam_beta2, hf.min_lr_ratio) \
        == ("huggingface", 2e-5, "linear", 0, 0.0, 0.999, 0.0)
    assert hf.seq_len == 128  # run_clm's block size: the model's positions (gpt-tiny: 128), at most 1024
    ours = C.resolve(["--lr", "2e-5"])
    assert (ours.defaults, ours.lr_schedule, ours.warmup_steps, ours.weight_decay) == ("shardwise", "cosine", 10, 0.1)
    assert C.resolve(["--bf16", "--defaults", "shardwise"]).weight_decay == 0.1
    assert C.resolve(["--defaults", "huggingface", "--weight-decay", "0.05"]).weight_decay == 0.05
    assert "defaults: Hugging Face Trainer's" in defaults_note(hf)


def test_config_toml_records_the_defaults_used(tmp_path):
    hf = C.resolve(["--learning_rate", "2e-5", "--model", "gpt-tiny"])
    assert C.resolve(["--config", C.save(hf, str(tmp_path))]) == hf


def test_unknown_key_in_toml_rejected(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("bogus_key = 1\n")
    with pytest.raises(C.ConfigError, match="unknown config key 'bogus_key'.*valid keys"):
        C.resolve(["--config", str(path)])


@pytest.mark.parametrize("argv, fragment", [
    (["--mixed-precision", "fp8"], "valid: no, bf16, fp16"),
    (["--sharding-strategy", "zero4"], "valid: full_shard, shard_grad_op, shard_optim_grad, shard_optim, no_shard"),
    (["--auto-wrap", "size_based_wrap"], "valid: transformer_based_wrap, no_wrap"),
    (["--steps", "ten"], "expected an integer"),
    (["--steps", "0"], "must be >= 1"),
    (["--lr", "-1"], "must be >= 0"),
    (["--cpu-offload", "maybe"], "expected true or false"),
    (["--min-lr-ratio", "2"], "between 0 and 1"),
])
def test_bad_values_rejected_with_valid_ones(argv, fragment):
    with pytest.raises(C.ConfigError, match=fragment):
        C.resolve(argv)


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "x.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(C.ConfigError, match="not valid TOML"):
        C.resolve(["--config", str(bad)])
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.resolve(["--config", str(tmp_path / "nope.toml")])
    with pytest.raises(C.ConfigError, match="unexpected argument"):
        C.resolve(["positional"])


def test_help_lists_every_field_with_its_docstring():
    from shardwise.trainer.help import help_text

    text = help_text()
    for name in C.TrainConfig.__dataclass_fields__:
        assert f"--{name.replace('_', '-')}" in text
    assert "Recompute each unit's forward during backward" in text


def test_cli_rejects_before_launching(capsys):
    from shardwise.cli import main

    assert main(["train", "--mixed-precision", "fp8"]) == 2
    assert "valid: no, bf16, fp16" in capsys.readouterr().err
    assert main(["train", "--model", "gpt-huge"]) == 2
    assert "unknown model 'gpt-huge'" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
