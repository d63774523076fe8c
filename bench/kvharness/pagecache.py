"""Files with real data, evicted; and how much of a file the page cache holds.

Residency is read through the daemon's own native wrapper (kvp_resident_bytes:
cachestat since Linux 6.5, mincore before), so tests and benchmarks judge the page
cache exactly as the daemon does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")
CHUNK = 1 << 20


def native_lib() -> Any:
    from kvprefetchd._native import lib

    return lib


def residency(path: str | Path, offset: int = 0, length: int | None = None, *,
              uptodate: bool = False) -> tuple[int, int]:
    """(resident bytes of [offset, offset+length), file size); length None: to EOF.

    uptodate=False uses cachestat when the kernel has it: one syscall, no mmap, and it
    counts pages still being read, which is right right after a warm-up that finished.
    uptodate=True forces mincore (only pages whose read completed). mincore reports
    page-cache state only for files the caller could open for writing (Linux 5.2+,
    commit 134fca9063ad), which holds for root and for the files' owner.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        want = size - offset if length is None else min(length, max(0, size - offset))
        if want <= 0:
            return 0, size
        result = int(native_lib().kvp_resident_bytes(fd, offset, want, 1 if uptodate else 0))
    finally:
        os.close(fd)
    if result < 0:
        raise OSError(-result, os.strerror(-result), str(path))
    return min(result, want), size


def resident_bytes(path: str | Path, length: int, *, uptodate: bool = True) -> int:
    """Bytes of the head [0, length) in the page cache; by default only pages whose read
    completed (mincore), which is what a check right after a `wait` reply wants."""
    return residency(path, 0, length, uptodate=uptodate)[0]


def evict(path: str | Path, *, sync: bool = True) -> None:
    """Drop a file's pages: posix_fadvise(DONTNEED) invalidates clean, unmapped pages
    (mm/fadvise.c); dirty ones are not dropped, so the data is synced first unless the
    caller knows it is clean (sync=False: no fdatasync, which may cost a disk flush)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if sync:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def make_file(path: Path, size: int, *, written: int | None = None) -> Path:
    """A file of `size` bytes whose first `written` (default: all) are real random data,
    allocated on disk; the rest is a hole (ftruncate), so st_blocks counts only the
    written head. Synced and evicted: it starts cold."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = size if written is None else min(written, size)
    block = os.urandom(min(written, CHUNK)) if written else b""
    with open(path, "wb") as handle:
        done = 0
        while done < written:
            chunk = block[: written - done]
            handle.write(chunk)
            done += len(chunk)
        handle.truncate(size)
    evict(path)
    return path
