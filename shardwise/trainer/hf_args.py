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

from dataclasses import dataclass
from typing import Sequence

from shardwise.usage import ConfigError

FSDP_STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")
FSDP_WORDS = FSDP_STRATEGIES + ("offload", "auto_wrap")
MIXED_PRECISION_FLAGS = ("bf16", "fp16")
HF_ONLY_FLAGS = ("fsdp",) + MIXED_PRECISION_FLAGS  # rewritten here, not aliases of one key
# HF Trainer flags with no meaning here, and why: refused by name rather than silently ignored.
NO_MEANING = {
    "do_train": "shardwise train always trains",
    "do_eval": "validation runs every --eval-every steps",
    "report_to": "metrics go to RUN/metrics.jsonl and RUN/metrics.png",
    "overwrite_output_dir": "a run directory is reused as it is; --resume latest continues it",
    "logging_dir": "metrics go to the run directory (--out)",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class FsdpWords:
    """What HF's ``--fsdp`` words mean here: the sharding strategy, one unit per transformer block
    (``auto_wrap``) or the whole model as one, and CPU offload."""

    strategy: str
    auto_wrap: bool
    offload: bool


def parse_fsdp_words(words: str, label: str = "--fsdp") -> FsdpWords:
    """``"full_shard auto_wrap"`` -> FsdpWords, or ConfigError listing the words HF accepts."""
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
    return FsdpWords(strategies[0] if strategies else "full_shard", "auto_wrap" in parts, "offload" in parts)


def fsdp_options(words: str, label: str = "--fsdp") -> list[str]:
    """``"full_shard auto_wrap"`` -> our options, or ConfigError listing the words HF accepts."""
    fsdp = parse_fsdp_words(words, label)
    out = ["--sharding-strategy", fsdp.strategy,
           "--auto-wrap", "transformer_based_wrap" if fsdp.auto_wrap else "no_wrap"]
    if fsdp.offload:
        out.append("--cpu-offload")
    return out


def translate(argv: Sequence[str]) -> list[str]:
    """Rewrite the HF options that are not plain aliases (``--fsdp``, ``--bf16``, ``--fp16``) in ``argv``."""
    argv = list(argv)
    out: list[str] = []
    precisions: list[str] = []
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
                precisions.append(key)
        else:
            out.append(argv[i])
        i += 1
    if len(set(precisions)) > 1:  # the last one would win silently; HF's Trainer refuses the pair too
        raise ConfigError("--bf16 and --fp16: both given; choose one (--mixed-precision bf16 or fp16)")
    return out


HF_HELP = ("--fsdp 'WORDS': space-separated, as TrainingArguments takes them: a strategy (full_shard, "
           "shard_grad_op, hybrid_shard, hybrid_shard_zero2, no_shard), offload (--cpu-offload) and auto_wrap (one "
           "unit per transformer block; without it the whole model is one unit, as in HF). --bf16 / --fp16: "
           "--mixed-precision bf16 / fp16 (not both). The other HF spellings are the aliases listed above. A command "
           "line that uses any of them takes HF's defaults (see --defaults). Refused, with the reason: "
           + ", ".join("--" + k for k in NO_MEANING) + ".")

