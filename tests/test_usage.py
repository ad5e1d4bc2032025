"""The command line's shared grammar (``shardwise/usage.py``): sizes, and argparse errors as one ``UsageError``."""

from __future__ import annotations

import re

import pytest

from shardwise.usage import RaisingParser, SizeError, UsageError, parse_size


@pytest.mark.parametrize("text,size", [
    ("100", 100), ("100B", 100), ("5GB", 5 * 10**9), ("5G", 5 * 10**9), ("2GiB", 2 * 2**30), ("24Gi", 24 * 2**30),
    ("1K", 1000), ("1KB", 1000), ("1KiB", 1024), ("512MiB", 512 * 2**20), ("500MB", 500 * 10**6),
    ("1T", 10**12), ("1TiB", 2**40), (".5GB", 5 * 10**8), ("1.5GiB", 3 * 2**29), ("0.1GB", 10**8),
])
def test_sizes_in_decimal_and_binary_units(text, size):
    """A number (integer or decimal, '.5' too) and an optional unit: k/M/G/T are powers of 1000, with an 'i'
    powers of 1024; a trailing 'B' changes nothing, and no unit means bytes."""
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["24gib", "24GIB", " 24 GiB ", "24Gib"])
def test_units_ignore_case_and_surrounding_spaces(text):
    assert parse_size(text) == 24 * 2**30


@pytest.mark.parametrize("text", ["", "GB", "lots", "-5GB", "5XB", "5GBs", "1e9", "5 G B", "5,000"])
def test_what_is_not_a_size_is_refused_naming_it(text):
    with pytest.raises(SizeError, match="^" + re.escape(f"{text!r} is not a size")):
        parse_size(text)


@pytest.mark.parametrize("text", ["0", "0GB", "0.4", ".0000000001KB"])
def test_a_size_below_one_byte_is_refused(text):
    """Sizes are budgets and shard limits: zero (or a fraction that rounds down to it) is refused."""
    with pytest.raises(SizeError, match="^" + re.escape(f"{text!r} is not a positive size")):
        parse_size(text)


def test_a_refused_size_is_a_value_error_for_callers():
    with pytest.raises(ValueError):
        parse_size("lots")


def test_argparse_refuses_a_size_with_one_usage_error_naming_the_option():
    """As an argparse ``type``: the refusal is one UsageError naming the option and the text (no usage block,
    no SystemExit)."""
    parser = RaisingParser(prog="shardwise x")
    parser.add_argument("--max-shard-size", type=parse_size)
    assert parser.parse_args(["--max-shard-size", "2GiB"]).max_shard_size == 2 * 2**30
    with pytest.raises(UsageError, match=r"--max-shard-size: 'lots' is not a size"):
        parser.parse_args(["--max-shard-size", "lots"])
