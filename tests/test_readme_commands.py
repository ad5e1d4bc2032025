"""Every command of every ```bash block of README.md, run as a newcomer would run it, in README order, in one
working directory: a README edit is tested as soon as it is made, and a README command that breaks is a red CI.

The README's placeholders are the only thing substituted (``PLACEHOLDERS``): a tiny Llama-style model saved with
``save_pretrained`` (one file, and the same weights index-sharded), a locally trained BPE tokenizer with a chat
template, and small .txt / prompt-completion / messages .jsonl files, all made once per session. ``shardwise
train`` commands get ``SHRINK`` appended (a few steps of short sequences: the commands' other options stand).
A command is skipped only for a reason named in ``SKIPS``. After each command its claims are checked: the files
it says it writes exist and load with transformers / peft, a resume continues bit for bit, generate prints text.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("tokenizers")

import hf_dirs

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"

# README placeholder -> the fixture's path (relative to the working directory the commands run in).
PLACEHOLDERS = {
    "path/to/Llama-3.2-1B": "models/llama",
    "path/to/llama": "models/llama-sharded",
    "DIR": "models/llama",
    "path/to/config.json": "models/llama/config.json",
}
# Appended to every `shardwise train`: later options win, so the command's own options stand except these. One
# rank (one worker to start, not two) except for LoRA, whose shards must split mid-tensor as on real machines.
SHRINK = ["--steps", "4", "--save-every", "2", "--log-every", "1", "--batch-size", "2", "--seq-len", "32",
          "--eval-batches", "1", "--no-progress"]
ONE_RANK = ["--nproc", "1"]
RESUMED_FROM = 2  # a resume command continues from the step-2 checkpoint of the command that wrote its run
# The only commands not run: each keyed by how its text starts (after substitution), with the reason shown in the
# skip. A README command that cannot run here (one that needs a GPU, say) is added here with its reason.
SKIPS = {
    "pip": "installs packages; test_setup_lines_install_what_the_readme_and_the_tests_use checks the extras",
    "python -m pytest": "runs the test suite this test is part of",
    "torchrun --nnodes 2": "needs two machines",
}


@dataclass
class Command:
    line: str  # as the README writes it (continuation lines joined)
    argv: list[str]  # after substituting the placeholders

    @property
    def id(self) -> str:
        return " ".join(self.argv[:6])[:70]


def readme_commands(text: str) -> list[Command]:
    """The commands of every ```bash block: continuation lines joined, comments dropped, ``&&`` split."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            while words:
                end = words.index("&&") if "&&" in words else len(words)
                argv = [PLACEHOLDERS.get(w, w) for w in words[:end]]
                out.append(Command(line.split("#")[0].strip(), argv))
                words = words[end + 1:]
    return out


COMMANDS = readme_commands(README.read_text())


def skip_reason(cmd: Command) -> str | None:
    text = " ".join(cmd.argv)
    return next((why for start, why in SKIPS.items() if text.startswith(start)), None)


# ---- the fixture: what the README's placeholders stand for ---------------------------------------------------


def _records() -> list[dict]:
    qa = [("what is two plus two?", "four."), ("Name a fast animal.", "The quick brown fox."),
          ("What keeps one shard of every parameter?", "Each rank.")]
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in qa]
    prompts = [{"prompt": f"Question: {q}", "completion": f" Answer: {a}"} for q, a in qa]
    return (chats + prompts + [{"text": line} for line in hf_dirs.CORPUS[:6]]) * 14


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    hf_dirs.make_model_dir(str(root / "models/llama"), "llama", seed=0)
    hf_dirs.make_model_dir(str(root / "models/llama-sharded"), "llama", seed=0, shards=True)  # the same weights
    records = _records()
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if "messages" in r) * 3)
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "text.txt").write_text("\n".join(hf_dirs.CORPUS * 6))
    (root / "run.toml").write_text('model = "gpt-tiny"\ndata = "text.txt"\nout = "runs/toml"\n')
    return root


# ---- running a command ---------------------------------------------------------------------------------------

_LAUNCHER_SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]


def run_shardwise(argv: list[str], capfd) -> tuple[int, str]:
    """``shardwise ARGS`` in this process (the launcher's start-up once, not per command); (status, output)."""
    from shardwise.cli import main

    handlers = [signal.getsignal(s) for s in _LAUNCHER_SIGNALS]  # torch's launcher installs its own
    capfd.readouterr()
    try:
        status = main(argv)
    finally:
        for s, h in zip(_LAUNCHER_SIGNALS, handlers):
            signal.signal(s, h)
    out, err = capfd.readouterr()
    return status, out + err


def option(argv: list[str], *names: str, default: str | None = None) -> str | None:
    """The value of the last of ``names`` on the command line (later options win)."""
    value = default
    for i, a in enumerate(argv[:-1]):
        if a in names:
            value = argv[i + 1]
    return value


def run_dir_of(argv: list[str]) -> Path:
    from shardwise.trainer.config import parse_overrides

    _, values = parse_overrides(argv)
    out = values.get("out")
    if out is None and option(argv, "--config"):
        import tomllib

        out = tomllib.loads(Path(option(argv, "--config")).read_text()).get("out")
    return Path(out or "runs/train")


def _interrupt(run: Path) -> Path:
    """Move ``run`` aside as the unbroken run and leave in its place the run as it stood after step
    ``RESUMED_FROM``: what a killed job leaves for its resume command."""
    unbroken = run.with_name(run.name + "-unbroken")
    shutil.rmtree(unbroken, ignore_errors=True)
    run.rename(unbroken)
    run.mkdir()
    shutil.copytree(unbroken / f"step-{RESUMED_FROM:08d}", run / f"step-{RESUMED_FROM:08d}")
    return unbroken


def _final_metrics(run: Path) -> dict:
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f][-1]


# ---- the claims ----------------------------------------------------------------------------------------------


def check_train(argv: list[str], output: str, unbroken: Path | None) -> None:
    run = run_dir_of(argv)
    for name in ("config.toml", "metrics.jsonl", "metrics.png"):
        assert (run / name).is_file(), f"{run}/{name} not written"
    assert (run / "step-00000004" / "commit.json").is_file(), sorted(os.listdir(run))
    if unbroken is not None:  # a resume continues bit for bit
        assert f"resumed at step {RESUMED_FROM}" in output, output[-2000:]
        exact = ("step", "loss", "val_loss", "grad_norm", "lr")
        assert [_final_metrics(run).get(k) for k in exact] == [_final_metrics(unbroken).get(k) for k in exact]
    if option(argv, "--lora-r"):
        adapter = run / "adapter"
        base = option(argv, "--model", "--model_name_or_path")
        peft_model = load_adapter(adapter, base)
        assert peft_model is not None
        if unbroken is not None:
            from safetensors.torch import load_file

            ours, theirs = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (run, unbroken))
            assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)


def load_adapter(adapter: Path, base_dir: str | None):
    """The adapter directory as peft loads it, over the base its adapter_config.json names."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardwise.hf.lora import quiet_peft

    for name in ("adapter_config.json", "adapter_model.safetensors"):
        mode = stat.S_IMODE((adapter / name).stat().st_mode)
        assert mode == 0o644 & ~_umask(), f"{adapter / name}: mode {oct(mode)}"
    recorded = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    if base_dir is not None:
        assert recorded and Path(recorded).resolve() == Path(base_dir).resolve(), recorded
    with quiet_peft():  # peft's FutureWarning about transformers, as in shardwise's own loading
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(recorded), str(adapter))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_export(argv: list[str], output: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import tomllib

    src, out = Path(argv[0]), Path(argv[1])
    assert "exported" in output
    base = tomllib.loads((src / "config.toml").read_text())["model"]
    if (out / "adapter_config.json").is_file():
        load_adapter(out, base)
        return
    if (out / "shardwise_model.json").is_file():  # a GPT preset: shardwise's own layout
        assert (out / "model.safetensors").is_file()
        return
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert (out / "tokenizer.json").is_file(), "export copies the tokenizer files of DIR"
    if "--merge" in argv:  # the merged model is the trained one: the adapter over its base gives the same logits
        peft_model = load_adapter(src / "adapter", base)
        ids = torch.tensor([[1, 5, 9, 30, 2]])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, peft_model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def check_generate(argv: list[str], output: str) -> None:
    prompt = option(argv, "--prompt")
    assert output.startswith(prompt), output[:300]
    if "--chat" in argv:
        assert output.startswith(prompt + "\n\n"), "a chat reply is set apart from the prompt"
    assert "</s>" not in output and "<|endoftext|>" not in output



@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_readme_command(cmd: Command, workdir, monkeypatch, capfd):
    reason = skip_reason(cmd)
    if reason:
        pytest.skip(f"{cmd.line!r}: {reason}")
    monkeypatch.chdir(workdir)
    assert cmd.argv[0] == "shardwise", f"{cmd.line!r}: a README command this test does not know how to run"
    command = cmd.argv[1]
    args = cmd.argv[2:] + (SHRINK + ([] if "--lora-r" in cmd.argv else ONE_RANK) if command == "train" else [])
    unbroken = None
    if command == "train" and option(args, "--resume", "--resume_from_checkpoint"):
        unbroken = _interrupt(run_dir_of(args))
    status, output = run_shardwise([command, *args], capfd)
    assert status == 0, f"{cmd.line!r} failed ({status}):\n{output[-3000:]}"
    assert "Warning" not in output, f"{cmd.line!r} printed a library's warning:\n{output[-3000:]}"
    if command == "train":
        check_train(args, output, unbroken)
    elif command in ("export", "generate"):
        {"export": check_export, "generate": check_generate}[command](args, output)


def test_lora_resume_accepts_the_same_base_in_another_file_layout_and_refuses_another_base(workdir, monkeypatch):
    """The README's LoRA resume with DIR's weights saved as index-sharded files instead of one: the same base,
    accepted; with other weights: refused naming --model, before any worker starts (the launcher's checks)."""
    from shardwise.errors import ShardwiseError
    from shardwise.trainer.config import resolve
    from shardwise.trainer.preflight import check_before_launch

    monkeypatch.chdir(workdir)
    resume = next(c for c in COMMANDS if "--lora-r" in c.argv and "--resume" in c.argv)
    if not Path(option(resume.argv, "--out")).is_dir():
        pytest.skip("runs after the README's LoRA commands")

    def preflight(base: str) -> None:
        argv = [base if a == PLACEHOLDERS["DIR"] else a for a in resume.argv[2:]] + SHRINK
        check_before_launch(resolve(argv), world_size=2, local_ranks=2, launching=False)

    preflight(PLACEHOLDERS["path/to/llama"])
    hf_dirs.make_model_dir(str(workdir / "models/other"), "llama", seed=1)
    refusal = r"^--model \S*models/other: its weights \(identity .*\) are not the base "
    with pytest.raises(ShardwiseError, match=refusal):
        preflight("models/other")


def test_resuming_a_finished_run_says_to_raise_steps(workdir, monkeypatch, capfd):
    """The README's `--resume auto` once more: its run is at --steps already, so nothing is trained (no worker
    starts) and the note says why."""
    monkeypatch.chdir(workdir)
    resume = next(c for c in COMMANDS if c.argv[:2] == ["shardwise", "train"] and "--resume" in c.argv)
    if not (workdir / run_dir_of(resume.argv[2:] + SHRINK) / "step-00000004").is_dir():
        pytest.skip("runs after the README's commands")
    status, output = run_shardwise(resume.argv[1:] + SHRINK + ONE_RANK, capfd)
    assert status == 0 and "is at step 4 and --steps is 4: nothing left to train" in output, output


def test_setup_lines_install_what_the_readme_and_the_tests_use():
    """The README's test command is what CI runs, verbatim; its extras hold what the tests import, the
    fine-tuning extra what --model DIR, LoRA and .jsonl data need, the Lightning extra the version tested."""
    import tomllib

    setup = [c.line for c in COMMANDS if c.argv[0] == "pip"]
    ci = (REPO / ".ci" / "run").read_text()
    test_line = next(line for line in setup if "pytest" in line)
    assert test_line in ci
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {key: {re.split(r"[<>=!~\[ ]", d)[0] for d in deps} for key, deps in extras.items()}
    assert {"transformers", "peft", "tokenizers"} <= names["hf"]
    assert names["hf"] | {"pytest", "bitsandbytes"} <= names["test"]
    assert any('.[hf]' in line for line in setup), "the README installs the fine-tuning extra"
    assert set(extras["lightning"]) <= set(extras["test"]), "the tests run the Lightning version users install"
    assert any('.[lightning]' in line for line in setup), "the README installs the Lightning extra"
    for framework in ("hf-trainer", "accelerate"):  # the integrations' extras, tested at the test extra's versions
        assert any(f'.[{framework}]' in line for line in setup), framework
        assert names[framework] <= names["test"], framework
