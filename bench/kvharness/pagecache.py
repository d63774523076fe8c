"""Heads kept resident for certain, and how much of a file the page cache holds, or held
before the host took it back (files with real data, evicted for certain: files.py).

A test that reads a file and later asserts on residency races the host: this VM's
reclaimer (DAMON, every 5 s) takes some freshly read pages within a second, and other
engineers' tests write drop_caches. Three tools make such tests exact instead of
tolerant:

- `pinned(paths, length)`: the heads mapped and mlocked for the `with` block. mlocked
  page-cache pages are unevictable: reclaim (DAMON included) and drop_caches pass them
  by. Where mlock is refused (no CAP_IPC_LOCK and RLIMIT_MEMLOCK too small), the heads
  are only mapped, and `Pin.kept()` says which of them are still whole just before the
  request, counting the ones the reclaimer took.
- `evict(path)` (files.py, beside the verified `write`): DONTNEED, then verified empty
  (cachestat, else mincore), retried.
- `assert_warmed(paths, length, since=drops())`: after something read the heads, every
  page is in the page cache or was reclaimed after it got there (cachestat counts the
  shadow entries reclaim leaves); a drop_caches by someone else meanwhile skips.

Residency is read through the daemon's own native wrapper (kvp_resident_bytes:
cachestat since Linux 6.5, mincore before) by `residency`, so tests and benchmarks
judge the page cache exactly as the daemon does; the tools above call the kernel
themselves (kernel_pages.py), so that the native tests do not check the native code
with itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvharness import kernel_pages as kp
from kvharness.files import EVICT_TIMEOUT_S, EvictionFailed, evict, make_file

# evict and make_file live in files.py beside the one verified write; named here too for
# the benchmarks and native tests that import them from this module.
__all__ = ["EVICT_TIMEOUT_S", "PAGE", "EvictionFailed", "Pin", "Warmth", "assert_warmed",
           "cached_and_reclaimed", "drops", "evict", "make_file", "native_lib", "pinned",
           "residency", "resident_bytes", "warmth"]

PAGE = kp.PAGE


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
        got = fd_residency(fd, offset, length, uptodate=uptodate)
    finally:
        os.close(fd)
    if got[0] < 0:
        raise OSError(-got[0], os.strerror(-got[0]), str(path))
    return got


def fd_residency(fd: int, offset: int = 0, length: int | None = None, *,
                 uptodate: bool = False) -> tuple[int, int]:
    """residency() of an open file, through the caller's fd: where opening the file is
    itself an event (a FUSE tier's open is a request to the server, and ends a warmer's
    hold), the look must not add one. (-errno, size) when the look fails."""
    size = os.fstat(fd).st_size
    want = size - offset if length is None else min(length, max(0, size - offset))
    if want <= 0:
        return 0, size
    result = int(native_lib().kvp_resident_bytes(fd, offset, want, 1 if uptodate else 0))
    return (min(result, want) if result >= 0 else result), size


def cached_and_reclaimed(path: str | Path, offset: int = 0,
                         length: int | None = None) -> tuple[int, int]:
    """(bytes cached, bytes the host reclaimed after they were cached) of [offset,
    offset+length) (None: to EOF), from one cachestat call, so no page counts twice; the
    shadow entries reclaim leaves are what tells a warm-up's page taken back from one
    never read (without cachestat: mincore's count, and 0)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        end = size if length is None else min(size, offset + length)
        if end <= offset:
            return 0, 0
        first, last = kp.page_span(offset, end)
        got = kp.cached_pages(fd, first, last)
    finally:
        os.close(fd)
    return min(got.pages * PAGE, end - offset), min(got.evicted * PAGE, end - offset)


def resident_bytes(path: str | Path, length: int, *, uptodate: bool = True) -> int:
    """Bytes of the head [0, length) in the page cache; by default only pages whose read
    completed (mincore), which is what a check right after a `wait` reply wants."""
    return residency(path, 0, length, uptodate=uptodate)[0]


# --- pinning: heads that stay resident ---------------------------------------------


@dataclass
class Pin:
    """Heads held in the page cache by this process's mappings.

    locked: mlocked, so neither reclaim nor drop_caches nor DONTNEED takes them until
    the `with` ends. unlocked: mlock was refused (why says so); only mapped, which
    drop_caches respects but the reclaimer does not: ask kept() just before relying on
    them.
    """

    locked: list[str] = field(default_factory=list)
    unlocked: list[str] = field(default_factory=list)
    why: str = ""
    taken: int = 0  # unlocked heads kept() found short, over all its calls
    maps: dict[str, kp.Mapping] = field(default_factory=dict)  # this process's, by path

    @property
    def paths(self) -> list[str]:
        """Every pinned path, in the caller's order."""
        return list(self.maps)

    def kept(self) -> list[str]:
        """The pinned paths whose heads are whole in the page cache now, checked page by
        page with mincore on this process's own mappings. Every locked head is (else
        AssertionError: the pin itself failed); an unlocked head the reclaimer took is
        left out, counted in `taken` and printed."""
        short = [path for path, mapped in self.maps.items() if not mapped.resident()]
        locked = set(self.locked)
        broken = [path for path in short if path in locked]
        assert not broken, f"mlocked heads left the page cache: {broken[:5]}"
        if short:
            self.taken += len(short)
            print(f"pagecache.pinned: the reclaimer took {len(short)} of "
                  f"{len(self.unlocked)} unlocked heads ({self.why}); asserting on the "
                  f"other {len(self.maps) - len(short)}")
        gone = set(short)
        return [path for path in self.paths if path not in gone]

    def require_all(self) -> None:
        """For a test that needs every pinned head: skip (saying why) if the reclaimer
        took one of the unlocked ones; a no-op when all are mlocked."""
        if len(self.kept()) < len(self.maps):
            import pytest

            pytest.skip(f"the host reclaimed a head this test needs ({self.why})")


@contextmanager
def pinned(paths: Iterable[str | Path], length: int | None = None, *, offset: int = 0,
           lock: bool = True) -> Iterator[Pin]:
    """Read each file's head [offset, offset+length) (length None: to EOF; offset a
    multiple of the page) into the page cache, nothing beyond it, and keep it there until
    the block ends: mapped MAP_SHARED and mlocked (mlock(2) faults every page in, so the
    pin is also the read). An mlocked page is unevictable
    (mm/mlock.c; Documentation/mm/unevictable-lru.rst): reclaim, DAMON's pageout,
    drop_caches and DONTNEED all leave it. Memory locks are not inherited across fork,
    so a daemon started inside the block holds none of them; exec drops its mappings.

    mlock needs CAP_IPC_LOCK or room under RLIMIT_MEMLOCK (8 MiB by default); when it is
    refused (or lock=False) a head is only mapped and faulted in: see Pin.kept(). Every
    mlocked head is checked whole with mincore before the block starts. One mapping per
    file: vm.max_map_count (65,530 by default) bounds how many files one pin holds.
    """
    pin = Pin()
    try:
        for item in paths:
            path = str(item)
            mapped = kp.Mapping.of(path, length, offset)
            pin.maps[path] = mapped
            refused = mapped.lock() if lock else "lock=False"
            if refused:  # kept() tells what the reclaimer takes from now on
                mapped.fault_in()
                pin.unlocked.append(path)
                pin.why = pin.why or refused
            else:
                assert mapped.resident(), f"{path}: head not resident right after mlock"
                pin.locked.append(path)
        yield pin
    finally:
        for mapped in pin.maps.values():
            mapped.close()


# --- after a warm-up: resident, or reclaimed since ---------------------------------


def drops() -> int | None:
    """How many times anyone dropped the page cache since boot (/proc/vmstat
    drop_pagecache, counted by fs/drop_caches.c for echo 1 or 3); None if not shown.
    Take it before a warm-up and pass it to assert_warmed as `since`."""
    try:
        with open("/proc/vmstat") as handle:
            for line in handle:
                name, _, value = line.partition(" ")
                if name == "drop_pagecache":
                    return int(value)
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Warmth:
    """Pages of one head: wanted, in the cache and up to date, and reclaimed since they
    were cached (cachestat's nr_evicted: the shadow entries reclaim leaves)."""

    path: str
    wanted: int
    resident: int
    reclaimed: int

    @property
    def missing(self) -> int:
        return max(0, self.wanted - self.resident - self.reclaimed)


def warmth(path: str | Path, length: int | None = None, offset: int = 0) -> Warmth:
    """mincore (up to date pages) between two cachestat calls that agree on the
    reclaimed count, so that no page is counted both resident and reclaimed."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        end = size if length is None else min(size, offset + length)
        first, last = kp.page_span(offset, end)
        wanted = max(0, last - first)
        if not wanted:
            return Warmth(str(path), 0, 0, 0)
        while True:
            before = kp.cached_pages(fd, first, last)
            resident = kp.mincore_pages(fd, first, last)
            after = kp.cached_pages(fd, first, last)
            if before.evicted == after.evicted:
                return Warmth(str(path), wanted, resident, after.evicted)
    finally:
        os.close(fd)


def assert_warmed(paths: Sequence[str | Path], length: int | None = None, *,
                  since: int | None, offset: int = 0) -> int:
    """Every page of each head [offset, offset+length) was brought into the page cache:
    it is there and up to date (mincore), or the host reclaimed it since (cachestat's
    shadow entries). The heads must have been cold before (evict() clears old shadows).
    A page that is neither fails the test, unless someone dropped the page cache since
    `since` (drops() before the warm-up; drop_caches leaves no shadows): then it skips,
    saying so. Returns the reclaimed pages, printed when any."""
    heads = [warmth(path, length, offset) for path in paths]
    missing = [h for h in heads if h.missing]
    reclaimed = sum(h.reclaimed for h in heads)
    if reclaimed:
        print(f"pagecache.assert_warmed: the host reclaimed {reclaimed} of "
              f"{sum(h.wanted for h in heads)} pages after they were read")
    if missing:
        if since is not None and (now := drops()) is not None and now != since:
            import pytest

            pytest.skip(f"the page cache was dropped by another process ({now - since} "
                        f"drop_caches) while {len(missing)} heads were checked")
        if not kp.have_cachestat():
            import pytest

            pytest.skip("no cachestat (Linux < 6.5): pages the host reclaimed cannot be "
                        f"told from pages never read ({len(missing)} heads short)")
        raise AssertionError(f"{len(missing)} heads not warmed, e.g. {missing[:3]}")
    return reclaimed
