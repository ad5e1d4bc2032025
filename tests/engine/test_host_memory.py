"""release_freed_host_memory hands memory that glibc keeps for reuse back to the OS: after a burst of freed
heap blocks pinned under a live one (so glibc cannot trim the top of its heap by itself) the RSS drops."""

import sys

import pytest

from shardwise.engine.base.host_memory import _malloc_trim, release_freed_host_memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc's malloc_trim")
def test_freed_heap_blocks_below_a_live_one_go_back_to_the_os():
    blocks = [b"\x01" * (64 * 1024) for _ in range(3000)]  # 192 MB written (below the mmap threshold)
    pin = bytearray(64 * 1024)  # above them in the heap: the free space is not at its top
    del blocks
    before = _rss()
    assert release_freed_host_memory()
    assert before - _rss() > 100 * 2**20
    del pin
