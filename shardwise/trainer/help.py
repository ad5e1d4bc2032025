"""``shardwise train --help``: the options by group (the ``# ---- title ----`` sections of TrainConfig's body),
each with its aliases, default and the field's docstring, which is the help text (config.py)."""

from __future__ import annotations

import dataclasses
import inspect

from shardwise.trainer.config import ALIASES, TrainConfig, field_help


def field_groups() -> dict[str, list[str]]:
    """The ``# ---- title ----`` sections of TrainConfig's body: title -> its field names, in order."""
    import re

    groups: dict[str, list[str]] = {}
    title = "options"
    for line in inspect.getsource(TrainConfig).splitlines():
        heading = re.match(r"\s*# -+ (.+?) -+$", line)
        field_line = re.match(r"\s{4}(\w+): [\w\[\], .]+ = ", line)
        if heading:
            title = heading.group(1)
        elif field_line:
            groups.setdefault(title, []).append(field_line.group(1))
    return groups


def help_text(width: int = 100) -> str:
    """``shardwise train --help``: the options by group, each with its aliases, default and what it does."""
    import textwrap

    from shardwise.trainer.hf_args import HF_HELP

    helps = field_help()
    defaults = dataclasses.asdict(TrainConfig())
    aliases: dict[str, list[str]] = {}
    for alias, key in ALIASES.items():
        aliases.setdefault(key, []).append("--" + alias)
    rows = ["usage: shardwise train [--config FILE.toml] [--option value ...] [--debug]", "",
            "Options: dashes on the command line, underscores in TOML (later ones win: defaults, then --config,",
            "then the command line); true/false options also as --flag / --no-flag.", "",
            "  --config FILE.toml  read options from a TOML file (a run's config.toml reruns it)",
            "  --debug             show tracebacks, the workers' too, instead of one-line errors",
            "  -h, --help          this text"]
    indent = " " * 6
    for title, names in field_groups().items():
        rows += ["", f"{title}:"]
        for name in names:
            also = f" (also {', '.join(aliases[name])})" if name in aliases else ""
            rows.append(f"  --{name.replace('_', '-')}{also}  [default: {defaults[name]!r}]")
            rows += textwrap.wrap(helps.get(name, ""), width, initial_indent=indent, subsequent_indent=indent)
    rows += ["", "Hugging Face Trainer / run_clm.py flags:"]
    rows += textwrap.wrap(HF_HELP, width, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(rows)
