"""Hugging Face Trainer / run_clm.py command lines, translated into ``shardwise train`` options.

Most HF names are plain aliases of our keys (``config.ALIASES``: ``--learning_rate``, ``--max_steps``,
``--per_device_train_batch_size``, ``--model_name_or_path``, ``--train_file`` ...). Three take rewriting:

- ``--fsdp "full_shard auto_wrap"``: space-separated words, as ``TrainingArguments.fsdp`` takes them. A
  strategy (full_shard, shard_grad_op, hybrid_shard, hybrid_shard_zero2, no_shard), ``offload`` (CPU offload)
  and ``auto_wrap`` (one unit per transformer block). Without ``auto_wrap`` HF wraps the whole model as one
  FSDP unit, and so do we (``--auto-wrap no_wrap``).
- ``--bf16`` / ``--fp16``: bare flags (or ``--bf16 true|false``) -> ``--mixed-precision bf16|fp16``.

HF flags that have no meaning here (``--do_train``, ``--report_to`` ...) are refused by name, like any
unknown key, rather than silently ignored.
"""

from __future__ import annotations

from typing import Sequence

from shardwise.usage import ConfigError

FSDP_STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")
FSDP_WORDS = FSDP_STRATEGIES + ("offload", "auto_wrap")
MIXED_PRECISION_FLAGS = ("bf16", "fp16")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# HF names accepted, for messages (the aliases live in config.ALIASES).
ACCEPTED = ("--model_name_or_path", "--model_name", "--train_file", "--dataset", "--fsdp", "--fsdp_sharding_strategy (and Accelerate's fsdp_* keys)", "--per_device_train_batch_size", "--gradient_accumulation_steps",
            "--gradient_checkpointing", "--bf16", "--fp16", "--learning_rate", "--max_steps", "--output_dir",
            "--logging_steps", "--save_steps", "--eval_steps", "--warmup_steps", "--weight_decay", "--seed",
            "--max_grad_norm", "--adam_beta1", "--adam_beta2", "--resume_from_checkpoint")


def fsdp_options(words: str, label: str = "--fsdp") -> list[str]:
    """``"full_shard auto_wrap"`` -> our options, or ConfigError listing the words HF accepts."""
    parts = words.replace(",", " ").split()
    unknown = [w for w in parts if w.lower() not in FSDP_WORDS]
    if unknown or not parts:
        raise ConfigError(f"{label} {words!r}: {'unknown word ' + repr(unknown[0]) if unknown else 'no words'}; "
                          f"valid: {', '.join(FSDP_WORDS)} (space-separated, e.g. 'full_shard auto_wrap')")
    parts = [w.lower() for w in parts]
    strategies = [w for w in parts if w in FSDP_STRATEGIES]
    if len(strategies) > 1:
        raise ConfigError(f"{label} {words!r}: names {len(strategies)} strategies ({', '.join(strategies)}); "
                          f"give one")
    out = ["--sharding-strategy", strategies[0] if strategies else "full_shard",
           "--auto-wrap", "transformer_based_wrap" if "auto_wrap" in parts else "no_wrap"]
    if "offload" in parts:
        out.append("--cpu-offload")
    return out


def translate(argv: Sequence[str]) -> list[str]:
    """Rewrite the HF options that are not plain aliases (``--fsdp``, ``--bf16``, ``--fp16``) in ``argv``."""
    argv = list(argv)
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        key = name.replace("-", "_").lower()
        if key == "fsdp":
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"--fsdp needs a value; valid words: {', '.join(FSDP_WORDS)}")
                i += 1
                inline = argv[i]
            out += fsdp_options(inline)
        elif key in MIXED_PRECISION_FLAGS:
            value = inline if eq else None
            if value is None and i + 1 < len(argv) and argv[i + 1].lower() in _TRUE + _FALSE:
                i += 1
                value = argv[i]
            if value is not None and value.lower() not in _TRUE + _FALSE:
                raise ConfigError(f"--{name}={value!r} is not valid; expected true or false (or the bare flag)")
            if value is None or value.lower() in _TRUE:
                out += ["--mixed-precision", key]
        else:
            out.append(argv[i])
        i += 1
    return out


def accepted_text() -> str:
    return "Hugging Face Trainer flags accepted: " + ", ".join(ACCEPTED)
