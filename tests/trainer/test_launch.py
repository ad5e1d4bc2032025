"""The launcher both ways: `shardwise train` starting its own local ranks (torch's elastic launcher), and
the same command run as one worker under torchrun. Each is a real end-to-end run of a tiny GPT."""

import json
import os
import subprocess
import sys


from shardwise.trainer import launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--model", "gpt-tiny", "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--eval-every", "3",
        "--eval-batches", "1", "--log-every", "1", "--warmup-steps", "1"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # the outer test process must look like a plain shell
    return env


def _run(cmd, timeout=240):
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def _check_run_dir(out, steps=3):
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in recs] == list(range(0, steps + 1))
    assert "val_loss" in recs[0] and "val_loss" in recs[-1]
    assert all("loss" in r for r in recs)
    assert os.path.getsize(os.path.join(out, "metrics.png")) > 1000
    assert os.path.isdir(os.path.join(out, f"step-{steps:08d}"))
    assert 'model = "gpt-tiny"' in open(os.path.join(out, "config.toml")).read()


def test_under_torchrun_detection(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    assert not launch.under_torchrun()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert launch.under_torchrun()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch.under_torchrun()
    assert launch.pick_backend("gloo") == "gloo"


def test_self_launched_two_ranks(tmp_path):
    out = str(tmp_path / "run")
    r = _run([sys.executable, "-m", "shardwise", "train", *TINY, "--nproc", "2", "--out", out])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 rank(s), gloo" in r.stdout
    assert "step 3 | loss" in r.stdout and "| mem " in r.stdout and "(max over ranks)" in r.stdout
    assert "3/3" in r.stderr  # the progress bar (rank 0 only)
    _check_run_dir(out)
    # `shardwise export RUN_DIR OUT` finds the run's newest checkpoint (checkpoints sit in the run directory)
    r = _run([sys.executable, "-m", "shardwise", "export", out, str(tmp_path / "exported")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert any(name.endswith(".safetensors") for name in os.listdir(tmp_path / "exported"))


def test_under_torchrun_runs_as_one_worker(tmp_path):
    out = str(tmp_path / "run")
    cfg = tmp_path / "run.toml"
    cfg.write_text("nproc = 7\n")  # in a file: torchrun's own parser would claim a --nproc on the command line
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "shardwise", "train", "--config", str(cfg), *TINY, "--no-progress", "--out", out])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 rank(s), gloo" in r.stdout  # torchrun's 2 workers, not a nested launch of --nproc 7
    _check_run_dir(out)


def test_failing_rank_is_reported(tmp_path):
    r = _run([sys.executable, "-m", "shardwise", "train", *TINY, "--nproc", "1", "--seq-len", "4096",
              "--out", str(tmp_path / "run")])
    assert r.returncode != 0
    assert "seq_len=4096 is longer than gpt-tiny's 128 positions" in r.stdout + r.stderr
