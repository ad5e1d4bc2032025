"""End to end: `shardwise train` with a Hugging Face command line on .jsonl SFT data at world size 2, then
`shardwise generate` on the run directory and on its export, which must continue a prompt the same way."""

import json
import math
import os
import subprocess
import sys

import pytest

from hf_dirs import make_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAT = [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four."}]


def _shardwise(*args, cwd):
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "shardwise", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.slow  # two ranks plus the launcher, each importing torch and transformers (~35 s)
def test_hf_command_line_trains_on_jsonl_and_generate_reads_run_and_export(tmp_path, capsys, monkeypatch):
    from shardwise import export_checkpoint
    from shardwise.cli import main
    from shardwise.trainer.generate import generate_text

    make_model_dir(str(tmp_path / "llama"), "llama")  # config + tokenizer (weights: the loader's business)
    records = [{"messages": CHAT}, {"prompt": "Question: what is two plus two?", "completion": " Answer: four."},
               {"text": "The quick brown fox jumps over the lazy dog."}] * 20
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = _shardwise("train", "--model_name_or_path", "llama", "--train_file", "sft.jsonl", "--fsdp",
                     "full_shard auto_wrap", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                     "2", "--max_steps", "2", "--output_dir", "run", "--seq-len", "32", "--val-fraction", "0.2",
                     "--eval-every", "2", "--eval-batches", "1", "--logging_steps", "1", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        steps = {r["step"]: r for r in map(json.loads, f)}
    assert sorted(steps) == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in steps.values())
    assert len(os.listdir(tmp_path / "run" / "data-cache")) == 1  # tokenised once: launcher built, ranks reused

    prompt = "Question: what is"
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # config.toml names --model as given: relative to where train ran
    assert main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0  # in-process: the CLI, without another interpreter's start-up
    printed = capsys.readouterr().out
    export_checkpoint(tmp_path / "run", tmp_path / "exported")
    from_export = generate_text(str(tmp_path / "exported"), prompt, max_new_tokens=8, temperature=0,
                                tokenizer=str(tmp_path / "llama"))
    assert from_export and printed.rstrip("\n") == prompt + from_export
