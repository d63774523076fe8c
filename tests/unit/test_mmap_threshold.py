"""The worker pins glibc's mmap threshold, so big transient buffers never land in (and
fragment) the brk heap: found by bench/soak.py, where workers' RSS kept climbing."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

# One fresh interpreter per case: malloc's threshold is process-wide state.
PROBE = """
import ctypes, sys
from kvprefetchd.worker.process import pin_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
                .split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "pinned":
    pin_mmap_threshold()
first = bytearray(1 << 20)  # mmapped: above the initial 128 KiB threshold
del first                   # freeing it raises a dynamic threshold to ~1 MiB
before = libc.mallinfo2().hblks
second = bytearray(1 << 20)
print(libc.mallinfo2().hblks - before)  # 1: mmapped; 0: carved from the heap
"""


def glibc_with_mallinfo2() -> bool:
    libc, version = platform.libc_ver()
    try:
        ctypes.CDLL(None).mallinfo2  # noqa: B018 - glibc >= 2.33
    except AttributeError:
        return False
    return libc == "glibc" and bool(version)


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="glibc >= 2.33 only (mallinfo2)")
@pytest.mark.parametrize(("mode", "mmapped"), [("dynamic", 0), ("pinned", 1)])
def test_a_freed_1_mib_buffer_no_longer_sends_the_next_one_to_the_heap(
    mode: str, mmapped: int
) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                          timeout=60, check=True)
    assert int(done.stdout) == mmapped, (mode, done.stdout, done.stderr)
