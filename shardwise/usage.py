"""What every subcommand's command line shares: the one ``UsageError`` (exit status 2) and ``ConfigError``,
the one size grammar, and an argparse parser that raises it instead of printing its usage block and exiting."""

from __future__ import annotations

import argparse
import re


class UsageError(Exception):
    """A command line that cannot be run; the message names the option (exit status 2)."""


class ConfigError(ValueError):
    """A training configuration (flags, TOML, Hugging Face spellings) that cannot run; says what is valid."""


class SizeError(ValueError, argparse.ArgumentTypeError):
    """Not a size: a ValueError for callers, and argparse prints its message as it is."""


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A positive number of bytes: '80GB', '80G' (10^9), '24GiB', '24Gi' (2^30), '512MiB', '.5GB', or plain bytes."""
    m = _SIZE.match(text)
    if not m:
        raise SizeError(f"{text!r} is not a size (e.g. 5GB, 500MB, 24GiB)")
    value, unit = float(m.group(1)), (m.group(2) or "").lower()
    power = "kmgt".find(unit[:1]) + 1 if unit[:1] in ("k", "m", "g", "t") else 0
    size = int(value * (1024 if "i" in unit else 1000) ** power)
    if size < 1:
        raise SizeError(f"{text!r} is not a positive size (e.g. 5GB, 500MB, 24GiB)")
    return size


class RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one UsageError naming the argument, not a usage block and exit(2)."""

    def error(self, message: str):
        raise UsageError(message)
