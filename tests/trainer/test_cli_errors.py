"""Bad command lines, as a table: each ends with a non-zero exit status and exactly one line on stderr,
``shardwise <command>: error: ...``, naming the option or file at fault; no traceback, no worker started,
and nothing left behind that a later ``--resume auto`` could trip on.

The CLI is called in-process (``shardwise.cli.main``), with the launcher replaced by a function that fails
the test if it is ever reached, and CUDA hidden so that the table means the same on every machine.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import run_distributed

# (command line, fragments the one error line must contain). {t} is a scratch directory of prepared
# files (see `files`), {ck} a real gpt-tiny trainer checkpoint. Train lines get valid defaults first
# (--model gpt-tiny --data {t}/text.txt --out {t}/run --nproc 2), so each line has exactly one problem.
TRAIN = [
    ("--lr nan", ["--lr", "finite number"]),
    ("--lr inf", ["--lr", "finite number"]),
    ("--lr 1e400", ["--lr", "finite number"]),
    ("--lr -1", ["--lr", "must be >= 0"]),
    ("--lr fast", ["--lr", "expected a number"]),
    ("--max-grad-norm nan", ["--max-grad-norm", "finite number"]),
    ("--max-grad-norm -1", ["--max-grad-norm", "must be >= 0"]),
    ("--timeout-s 0", ["--timeout-s", "must be >= 1"]),
    ("--timeout-s 99999999", ["--timeout-s", "must be <= 604800"]),
    ("--nproc 0", ["--nproc", "must be >= 1"]),
    ("--nproc 100000", ["--nproc 100000", "usable CPU core"]),
    ("--seq-len 100000", ["--seq-len 100000", "gpt-tiny's 128 positions"]),
    ("--seq-len 0", ["--seq-len", "must be >= 1"]),
    ("--batch-size 0", ["--batch-size", "must be >= 1"]),
    ("--steps 0", ["--steps", "must be >= 1"]),
    ("--steps 1.5", ["--steps", "expected an integer"]),
    ("--steps 10000000000", ["--steps", "must be <= 2147483647"]),
    ("--gradient-accumulation-steps 0", ["--gradient-accumulation-steps", "must be >= 1"]),
    ("--warmup-steps -1", ["--warmup-steps", "must be >= 0"]),
    ("--min-lr-ratio 2", ["--min-lr-ratio", "between 0 and 1"]),
    ("--min-lr-ratio nan", ["--min-lr-ratio", "finite number"]),
    ("--val-fraction 0", ["--val-fraction", "between 0 and 1"]),
    ("--val-fraction 1", ["--val-fraction", "between 0 and 1"]),
    ("--adam-beta1 1", ["--adam-beta1", "in [0, 1)"]),
    ("--adam-beta2 nan", ["--adam-beta2", "finite number"]),
    ("--weight-decay -0.1", ["--weight-decay", "must be >= 0"]),
    ("--seed -1", ["--seed", "must be >= 0"]),
    ("--seed 4294967296", ["--seed", "32-bit"]),
    ("--eval-batches 0", ["--eval-batches", "must be >= 1"]),
    ("--log-every 0", ["--log-every", "must be >= 1"]),
    ("--peak-tflops inf", ["--peak-tflops", "finite number"]),
    ("--mixed-precision fp8", ["--mixed-precision", "valid: no, bf16, fp16"]),
    ("--sharding-strategy zero4", ["--sharding-strategy", "valid: full_shard"]),
    ("--backend mpi", ["--backend", "valid: auto, gloo, nccl"]),
    ("--backend nccl", ["--backend nccl", "--backend gloo"]),
    ("--auto-wrap size_based_wrap", ["--auto-wrap", "valid: transformer_based_wrap, no_wrap"]),
    ("--transformer-layer-cls-to-wrap NoSuchBlock", ["--transformer-layer-cls-to-wrap", "NoSuchBlock not in GPT"]),
    ("--cpu-offload maybe", ["--cpu-offload", "true or false"]),
    ("--no-lr", ["--no-lr", "not a true/false option"]),
    ("--save-evry 3", ["--save-evry", "did you mean '--save-every'"]),
    ("positional", ["'positional'", "unexpected argument"]),
    ("--steps", ["--steps needs a value"]),
    ("--config", ["--config needs a path"]),
    ("--config {t}/configdir", ["--config", "configdir", "is a directory"]),
    ("--config {t}/missing.toml", ["missing.toml", "does not exist"]),
    ("--config {t}/bad.toml", ["bad.toml", "not valid TOML"]),
    ("--config {t}/nan.toml", ["lr in", "nan.toml", "finite number"]),
    ("--config {t}/unknown.toml", ["unknown config key 'bogus_key'"]),
    ("--model gpt-huge", ["--model", "unknown model 'gpt-huge'"]),
    ("--model {t}/vit.json", ["--model", "vit.json", "not a causal language model"]),
    ("--model {t}/t5.json", ["--model", "t5.json", "not a causal language model"]),
    ("--model {t}/missing/config.json", ["--model", "does not exist"]),
    ("--model {t}/no_type.json", ["--model", "no_type.json", "no 'model_type'"]),
    ("--model {t}/unknown_type.json", ["--model", "does not know model_type"]),
    ("--model {t}/gpt_bad.json", ["--model", "gpt_bad.json", "GPTConfig fields"]),
    ("--model {t}/configdir", ["--model", "cannot read Hugging Face config"]),
    ("--data {t}/missing.txt", ["--data", "missing.txt", "no such file"]),
    ("--data {t}/empty.txt", ["--data", "empty.txt", "holds 0 tokens"]),
    ("--data {t}/emptydir", ["--data", "emptydir", "fewer than 2"]),
    ("--data {t}/onefile", ["--data", "onefile", "fewer than 2"]),
    ("--data {t}/tiny.txt", ["--data", "tiny.txt", "fewer than --seq-len + 2"]),
    ("--data {t}/big_ids.bin", ["--data", "big_ids.bin", "token id 599", "256 entries"]),
    ("--out {t}/a_file", ["--out", "a_file", "not a directory"]),
    ("--out {t}/a_file/run", ["--out", "a_file", "not a directory"]),
    ("--out /proc/shardwise-run", ["--out /proc/shardwise-run", "cannot write"]),
    ("--resume {t}/missing-run", ["--resume", "missing-run", "no such checkpoint"]),
    ("--resume {t}/emptydir", ["--resume", "emptydir", "neither a checkpoint"]),
    ("--model gpt-small --resume {ck}", ["--resume", "checkpoint of a different model", "--model gpt-small"]),
    ("--resume {t}/uncommitted", ["uncommitted", "commit.json: missing"]),
    ("--out {t}/decoy-run --resume latest", ["step-00000009", "commit.json"]),
]
EXPORT = [
    ("{t}/missing-ckpt {t}/out", ["missing-ckpt", "no such checkpoint"]),
    ("{t}/emptydir {t}/out", ["emptydir", "neither a shardwise checkpoint"]),
    ("{ck} {t}/a_file", ["a_file", "exists and is not a directory"]),
    ("{ck} /proc/shardwise-export", ["/proc/shardwise-export", "cannot write"]),
    ("{ck} {t}/onefile", ["onefile", "which export does not write"]),
    ("{ck} {ck}", ["overlaps the checkpoint"]),
    ("{ck} {t}/ck-run", ["ck-run", "overlaps the checkpoint"]),
    ("{t}/flipped {t}/out", ["flipped", "rank-00000-of-00001.safetensors", "checksum mismatch"]),
    ("{t}/uncommitted {t}/out", ["uncommitted", "commit.json: missing"]),
    ("{ck} {t}/out --dtype int8", ["--dtype", "invalid choice: 'int8'"]),
    ("{ck} {t}/out --max-shard-size lots", ["--max-shard-size", "'lots' is not a size"]),
    ("{ck} {t}/out --max-shard-size 0", ["--max-shard-size", "not a positive size"]),
    ("", ["the following arguments are required: CHECKPOINT_OR_RUN_DIR, OUT"]),
]
ESTIMATE = [
    ("--model gpt-tiny --world-size 0", ["--world-size 0", "between 1 and"]),
    ("--model gpt-tiny --world-size 12 --ranks-per-node 8 --sharding-strategy hybrid_shard",
     ["--ranks-per-node 8 does not divide --world-size 12"]),
    ("--model gpt-tiny --world-size 4 --ranks-per-node 0", ["--ranks-per-node 0", "between 1 and"]),
    ("--model gpt-tiny --world-size 2 --batch-size 0", ["--batch-size 0"]),
    ("--model gpt-huge --world-size 2", ["unknown model 'gpt-huge'"]),
    ("--model gpt-tiny --world-size 2 --seq-len 100000", ["--seq-len 100000", "128 positions"]),
    ("--model gpt-tiny --world-size 2 --device-memory lots", ["--device-memory 'lots'"]),
    ("--world-size 2", ["the following arguments are required: --model"]),
    ("--model gpt-tiny --world-size many", ["--world-size", "invalid int value: 'many'"]),
]
CASES = ([("train", a, f) for a, f in TRAIN] + [("export", a, f) for a, f in EXPORT]
         + [("estimate-memory", a, f) for a, f in ESTIMATE] + [("frobnicate", "", ["unknown command 'frobnicate'"])])


def _save_tiny(rank, world_size, root):
    from shardwise.trainer import state
    from shardwise.trainer.config import TrainConfig
    from shardwise.trainer.loop import build_optimizer, build_sharded_model
    from shardwise.hf.model_spec import resolve_model

    cfg = TrainConfig(model="gpt-tiny")
    model = build_sharded_model(cfg, resolve_model(cfg.model), torch.device("cpu"))
    return str(state.save_training_state(root, model, build_optimizer(model, cfg), step=1, seed=0, train_tokens=1))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    t = tmp_path_factory.mktemp("cli")
    ck = Path(run_distributed(_save_tiny, 1, str(t / "ck-run"))[0])
    (t / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 500)
    (t / "empty.txt").write_bytes(b"")
    (t / "tiny.txt").write_text("too short\n" * 5)
    (t / "emptydir").mkdir()
    (t / "onefile").mkdir()
    (t / "onefile" / "a.txt").write_text("x" * 1000)
    (t / "configdir").mkdir()
    (t / "a_file").write_text("not a directory")
    np.arange(200, 600, dtype=np.uint16).repeat(50).tofile(t / "big_ids.bin")
    (t / "bad.toml").write_text("steps = = 3\n")
    (t / "nan.toml").write_text("lr = nan\n")
    (t / "unknown.toml").write_text("bogus_key = 1\n")
    for name, cfg in (("vit.json", {"model_type": "vit"}), ("t5.json", {"model_type": "t5"}),
                      ("no_type.json", {"hidden_size": 8}), ("unknown_type.json", {"model_type": "no-such-arch"}),
                      ("gpt_bad.json", {"model_type": "shardwise-gpt", "n_layers": 2})):
        (t / name).write_text(json.dumps(cfg))
    shutil.copytree(ck, t / "uncommitted")
    os.remove(t / "uncommitted" / "commit.json")
    shutil.copytree(ck, t / "flipped")
    data = bytearray((t / "flipped" / "rank-00000-of-00001.safetensors").read_bytes())
    data[-5] ^= 0x10
    (t / "flipped" / "rank-00000-of-00001.safetensors").write_bytes(bytes(data))
    (t / "decoy-run" / "step-00000009").mkdir(parents=True)  # the newest step-* entry, not a checkpoint
    return t, ck


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def no_workers(monkeypatch):
    """The launcher may not be reached, CUDA is absent, and this process does not look like a torchrun worker."""
    from shardwise.trainer import launch

    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch, "launch", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SHARDWISE_DEBUG"):
        monkeypatch.delenv(key, raising=False)


def test_at_least_sixty_bad_invocations():
    assert len(CASES) >= 60


@pytest.mark.parametrize("command, args, fragments", CASES, ids=[f"{c} {a}"[:70] for c, a, _ in CASES])
def test_bad_invocation_is_one_line_naming_the_culprit(files, no_workers, capsys, command, args, fragments):
    from shardwise.cli import main

    t, ck = files
    argv = [a.format(t=t, ck=ck) for a in args.split()]
    if command == "train":
        argv = ["--model", "gpt-tiny", "--data", str(t / "text.txt"), "--out", str(t / "run"), "--nproc", "2"] + argv
    before = _listing(t)
    code = main([command] + argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2  # refused before any work, for something given: one rule for every command
    assert len(lines) == 1, err
    assert lines[0].startswith(f"shardwise{'' if command == 'frobnicate' else ' ' + command}: error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    for fragment in fragments:
        assert fragment.format(t=t, ck=ck) in lines[0], (fragment, lines[0])
    assert _listing(t) == before, "the failed command left files behind"


def test_the_table_passes_a_valid_command_line_to_the_launcher(files, no_workers, capsys):
    """The defaults every train line starts from are valid: the launcher is reached (and refuses)."""
    from shardwise.cli import main

    t, _ = files
    code = main(["train", "--model", "gpt-tiny", "--data", str(t / "text.txt"), "--out", str(t / "ok-run")])
    err = capsys.readouterr().err
    assert code == 1 and "internal error: AssertionError: a worker was started" in err
    shutil.rmtree(t / "ok-run", ignore_errors=True)


@pytest.mark.parametrize("signum", [2, 15])
def test_an_interrupted_run_says_so_and_how_to_resume(files, no_workers, capsys, monkeypatch, signum):
    """Ctrl-C reaches the launcher as KeyboardInterrupt, SIGTERM as torch's SignalException: both are an
    interruption, not an internal error, with the way to continue and 128 + the signal as exit status."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from shardwise.cli import main
    from shardwise.trainer import launch

    def interrupted(*args, **kwargs):
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SignalException("terminated", signal.Signals(signum))

    monkeypatch.setattr(launch, "launch", interrupted)
    t, _ = files
    code = main(["train", "--model", "gpt-tiny", "--data", str(t / "text.txt"), "--out", str(t / "stopped")])
    err = capsys.readouterr().err
    assert code == 128 + signum
    assert err.strip() == (f"shardwise train: interrupted ({signal.Signals(signum).name}) before its first "
                           f"checkpoint in {t / 'stopped'}: the same command starts it again (--save-every N saves "
                           f"along the way)")
    shutil.rmtree(t / "stopped", ignore_errors=True)


def test_version(capsys):
    from shardwise.cli import main

    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("shardwise ")


def test_debug_shows_the_traceback(files, no_workers, monkeypatch):
    from shardwise.cli import main
    from shardwise.trainer.config import ConfigError

    monkeypatch.setenv("SHARDWISE_DEBUG", "0")  # restored after the test; --debug sets it for the workers
    with pytest.raises(ConfigError, match="--lr"):
        main(["--debug", "train", "--lr", "nan"])
    assert os.environ["SHARDWISE_DEBUG"] == "1"
