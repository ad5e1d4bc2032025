"""The environment switches shardwise reads, in one place: their names, and what counts as on.

Every switch is read when it is needed (not at import), so a test or a launcher may set it late. A value
of ``0``, ``false``, ``no`` or ``off`` (any case) is off; any other non-empty value is on; unset or empty
is the switch's default.
"""

from __future__ import annotations

import os

DEBUG = "SHARDWISE_DEBUG"  # tracebacks instead of one-line errors (the CLI's --debug sets it for the workers)
CHECK_COLLECTIVES = "SHARDWISE_CHECK_COLLECTIVES"  # fingerprint every collective (fingerprint.py); default on
GLOO_NATIVE_COLLECTIVES = "SHARDWISE_GLOO_NATIVE_COLLECTIVES"  # gloo's own all-gather / reduce-scatter; default off
STALL_S = "SHARDWISE_STALL_S"  # seconds before a wait is a stall (watchdog.py); a number, not a switch

_OFF = ("0", "false", "no", "off")


def enabled(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    return raw.lower() not in _OFF


def debug() -> bool:
    return enabled(DEBUG)
