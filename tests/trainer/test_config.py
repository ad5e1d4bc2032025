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


def test_unknown_key_lists_valid_keys():
    with pytest.raises(C.ConfigError) as e:
        C.resolve(["--save-evry", "3"])
    msg = str(e.value)
    assert "--save-evry" in msg and "did you mean '--save-every'" in msg
    assert "valid keys:" in msg and "--sharding-strategy" in msg and "--gradient-accumulation-steps" in msg


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
    text = C.help_text()
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
