"""The launcher both ways: `shardwise train` starting its own local ranks (torch's elastic launcher), and
the same command run as one worker under torchrun. Each is a real end-to-end run of a tiny GPT."""

import json
import os
import re
import resource
import subprocess
import sys


from shardwise.engine.base.device import pick_backend
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
    assert pick_backend("gloo") == "gloo"


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


def test_a_bad_option_is_refused_before_any_worker_starts(tmp_path):
    r = _run([sys.executable, "-m", "shardwise", "train", *TINY, "--nproc", "1", "--seq-len", "4096",
              "--out", str(tmp_path / "run")])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "shardwise train: error: --seq-len 4096: longer than gpt-tiny's 128 positions; use --seq-len 128 or less"]
    assert not (tmp_path / "run").exists()  # checked in the launching process: no config.toml, no worker


def _small_files_only():
    resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, resource.RLIM_INFINITY))  # a checkpoint needs ~1.7 MB


def test_a_full_disk_during_a_save_is_one_line_naming_the_file(tmp_path):
    """A write that fails inside the workers (here EFBIG from a file-size limit, as ENOSPC would) reaches
    the user as one line, reported by both ranks, not as a traceback per rank; the failed save leaves no
    temporary directory behind and no step-* directory a resume could trip on."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "shardwise", "train", *TINY, "--nproc", "2", "--save-every", "1",
                        "--eval-every", "0", "--no-progress", "--out", str(out)],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240, preexec_fn=_small_files_only)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    # Both ranks raise the agreed error; the second may be stopped by the launcher before it reports.
    assert re.fullmatch(
        re.escape(f"shardwise train: error: writing {out}/.tmp-step-00000001/rank-00000-of-00002.safetensors failed "
                  f"on rank 0: OSError: [EFBIG] File too large; {out}/step-00000001 was not saved (earlier "
                  f"checkpoints are untouched) ") + r"\((ranks 0, 1|rank 0|rank 1)\)", lines[0]), lines[0]
    assert "Traceback" not in r.stdout
    assert sorted(os.listdir(out)) == ["config.toml", "metrics.jsonl"]
