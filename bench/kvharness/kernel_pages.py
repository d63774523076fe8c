"""The page-cache syscalls pagecache.py needs, called through libc (ctypes), apart from
the daemon's native code: mmap, mlock, mincore and cachestat.

Kernel facts, with their sources:
- mincore(2) on a MAP_SHARED file mapping reports the page cache, uptodate pages only
  (mm/mincore.c mincore_page), and the truth only for files the caller could open for
  writing (Linux 5.2+, commit 134fca9063ad): root, or the files' owner.
- cachestat(2) (Linux 6.5, commit cf264e1329fb; 451 on every architecture) counts the
  folios of a range, uptodate or not, and nr_evicted: the shadow entries that reclaim
  leaves where it took a page (mm/workingset.c); invalidation (DONTNEED, drop_caches)
  leaves none.
- mlock(2) populates the range and makes its pages unevictable (mm/mlock.c); without
  CAP_IPC_LOCK it is capped by RLIMIT_MEMLOCK (ENOMEM past it, EPERM when it is 0).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import resource
from dataclasses import dataclass

PAGE = os.sysconf("SC_PAGE_SIZE")
SYS_CACHESTAT = 451
CAP_IPC_LOCK = 14
MADV_PAGEOUT = 21  # Linux 5.4 (commit 1a4e58cce84e); not in Python's mmap module

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
MAP_FAILED = ctypes.c_void_p(-1).value


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def _fail(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


def page_span(offset: int, end: int) -> tuple[int, int]:
    """The pages [first, last) that hold the bytes [offset, end)."""
    return offset // PAGE, -(-end // PAGE) if end > offset else offset // PAGE


_cachestat: bool | None = None


def have_cachestat() -> bool:
    """cachestat exists here: fd -1 tells EBADF (present) from ENOSYS (absent, or
    refused by seccomp)."""
    global _cachestat
    if _cachestat is None:
        rng, out = _Range(0, 0), _Stat()
        rc = _libc.syscall(SYS_CACHESTAT, -1, ctypes.byref(rng), ctypes.byref(out), 0)
        _cachestat = not (rc < 0 and ctypes.get_errno() == errno.ENOSYS)
    return _cachestat


@dataclass(frozen=True)
class Cached:
    """Pages of a range in the page cache (any state), dirty, under writeback, and
    reclaimed (shadow entries); without cachestat, mincore's count and zeros."""

    pages: int
    dirty: int = 0
    writeback: int = 0
    evicted: int = 0


def cached_pages(fd: int, first: int = 0, last: int | None = None) -> Cached:
    """The page cache of pages [first, last) of fd (last None: to EOF)."""
    if last is None:
        last = -(-os.fstat(fd).st_size // PAGE)
    if last <= first:
        return Cached(0)
    if not have_cachestat():
        return Cached(mincore_pages(fd, first, last))
    rng, out = _Range(first * PAGE, (last - first) * PAGE), _Stat()
    if _libc.syscall(SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) < 0:
        raise _fail("cachestat")
    return Cached(out.nr_cache, out.nr_dirty, out.nr_writeback, out.nr_evicted)


def _mincore(addr: int, pages: int) -> int:
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(addr, pages * PAGE, vec) < 0:
        raise _fail("mincore")
    return sum(byte & 1 for byte in vec)


def mincore_pages(fd: int, first: int, last: int) -> int:
    """How many of pages [first, last) of fd are cached and up to date."""
    pages = last - first
    if pages <= 0:
        return 0
    addr = _libc.mmap(None, pages * PAGE, mmap.PROT_READ, mmap.MAP_SHARED, fd, first * PAGE)
    if addr in (None, MAP_FAILED):
        raise _fail("mmap")
    try:
        return _mincore(addr, pages)
    finally:
        _libc.munmap(addr, pages * PAGE)


def can_lock_unlimited() -> bool:
    """CAP_IPC_LOCK in the effective set: mlock ignores RLIMIT_MEMLOCK."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return False


class Mapping:
    """A file's range [offset, offset+length) mapped read-only, MAP_SHARED: its pages are
    the page cache's own (a private writable mapping would copy them on mlock)."""

    def __init__(self, path: str, addr: int, pages: int) -> None:
        self.path, self.addr, self.pages = path, addr, pages

    @classmethod
    def of(cls, path: str, length: int | None, offset: int = 0) -> Mapping:
        """The range mapped, its reads asked for (MADV_WILLNEED: exactly the range, in
        large reads) and no read-around beyond it on a fault (MADV_RANDOM: the fault path
        reads only the page it needs, mm/filemap.c do_sync_mmap_readahead)."""
        if offset % PAGE:
            raise ValueError(f"offset {offset} is not a multiple of the page size")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            end = size if length is None else min(size, offset + length)
            pages = max(0, -(-(end - offset) // PAGE))
            if not pages:
                return cls(path, 0, 0)
            addr = _libc.mmap(None, pages * PAGE, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
            if addr in (None, MAP_FAILED):
                raise _fail(f"mmap {path}")
            _libc.madvise(addr, pages * PAGE, mmap.MADV_RANDOM)
            _libc.madvise(addr, pages * PAGE, mmap.MADV_WILLNEED)
            return cls(path, int(addr), pages)
        finally:
            os.close(fd)  # the mapping holds the file

    def lock(self) -> str:
        """mlock the range: '' when locked, else why not (the pages stay mapped)."""
        if not self.pages:
            return ""
        if _libc.mlock(self.addr, self.pages * PAGE) == 0:
            return ""
        code = ctypes.get_errno()
        _libc.munlock(self.addr, self.pages * PAGE)  # EAGAIN may leave a part locked
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return (f"mlock {errno.errorcode.get(code, code)}: RLIMIT_MEMLOCK {soft} bytes, "
                f"{'with' if can_lock_unlimited() else 'no'} CAP_IPC_LOCK")

    def fault_in(self) -> None:
        """Read every page of the range through the mapping (an unlocked pin)."""
        for page in range(self.pages):
            ctypes.string_at(self.addr + page * PAGE, 1)

    def resident(self) -> bool:
        """Every page of the range cached and up to date."""
        return not self.pages or _mincore(self.addr, self.pages) == self.pages

    def page_out(self) -> int:
        """Reclaim the range's pages (MADV_PAGEOUT, Linux 5.4, commit 1a4e58cce84e: through
        reclaim_pages, as DAMON's pageout does, so shadow entries are left). Only pages
        this mapping maps alone are taken, so each is touched first; mlocked ones never.
        Returns the pages that left the page cache."""
        if not self.pages:
            return 0
        self.fault_in()
        before = _mincore(self.addr, self.pages)
        if _libc.madvise(self.addr, self.pages * PAGE, MADV_PAGEOUT) < 0:
            raise _fail("madvise(MADV_PAGEOUT)")
        return before - _mincore(self.addr, self.pages)

    def close(self) -> None:
        if self.pages:
            _libc.munmap(self.addr, self.pages * PAGE)  # unlocks, too
            self.pages, self.addr = 0, 0


def page_out(path: str, length: int, offset: int = 0) -> int:
    """Reclaim the pages of [offset, offset+length) as the host's reclaimer does, for
    tests that must show a reclaimed page told from one never read (Mapping.page_out).
    A page another mapping holds is skipped. Returns the pages that left the cache."""
    mapped = Mapping.of(path, length, offset)
    try:
        return mapped.page_out()
    finally:
        mapped.close()
