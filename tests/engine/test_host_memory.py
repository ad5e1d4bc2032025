"""release_freed_host_memory hands memory that glibc keeps for reuse back to the OS: after a burst of freed
heap blocks pinned under a live one (so glibc cannot trim the top of its heap by itself) the RSS drops.

It runs in a fresh interpreter: in the test process the heap is whatever earlier tests left (holes the pin
may land in, a raised dynamic mmap threshold), and glibc's automatic trimming is turned off there
(MALLOC_TRIM_THRESHOLD_) so that only the call under test can give the pages back."""

import os
import subprocess
import sys
import textwrap

import pytest

from shardwise.engine.base.host_memory import _malloc_trim

_PROGRAM = textwrap.dedent(
    """
    from shardwise.engine.base.host_memory import release_freed_host_memory

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    blocks = [b"\\x01" * (64 * 1024) for _ in range(3000)]  # 192 MB written (below the mmap threshold)
    pin = bytearray(64 * 1024)  # above them in the heap: the free space is not at its top
    del blocks
    before = rss()
    assert release_freed_host_memory()
    print(before - rss())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc's malloc_trim")
def test_freed_heap_blocks_below_a_live_one_go_back_to_the_os():
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_=str(2**40), MALLOC_MMAP_THRESHOLD_=str(2**20), MALLOC_ARENA_MAX="1")
    done = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 100 * 2**20
