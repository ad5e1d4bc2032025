"""This process's resident memory from Linux's /proc: now, the peak, and restarting the peak."""

from __future__ import annotations

import os


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """VmHWM: the most this process has had resident since it started or since ``reset_peak_rss``."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> None:
    """Start VmHWM afresh from the current RSS (Linux >= 4.0: "5" to clear_refs); ``ru_maxrss`` restarts too."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
