"""Files with real data, evicted for certain; heads kept resident for certain; and how
much of a file the page cache holds, or held before the host took it back.

A test that reads a file and later asserts on residency races the host: this VM's
reclaimer (DAMON, every 5 s) takes some freshly read pages within a second, and other
engineers' tests write drop_caches. Three tools make such tests exact instead of
tolerant:

- `pinned(paths, length)`: the heads mapped and mlocked for the `with` block. mlocked
  page-cache pages are unevictable: reclaim (DAMON included) and drop_caches pass them
  by. Where mlock is refused (no CAP_IPC_LOCK and RLIMIT_MEMLOCK too small), the heads
  are only mapped, and `Pin.kept()` says which of them are still whole just before the
  request, counting the ones the reclaimer took.
- `evict(path)`: DONTNEED, then verified empty (cachestat, else mincore), retried.
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
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvharness import kernel_pages as kp

PAGE = kp.PAGE
CHUNK = 1 << 20
EVICT_TIMEOUT_S = 10.0  # pages under a read or writeback settle in ms; mapped ones never


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


# --- eviction, verified ------------------------------------------------------------


class EvictionFailed(AssertionError):
    """Pages that DONTNEED would not drop within EVICT_TIMEOUT_S: mapped (a pin, another
    process's mmap) or mlocked, most likely. A test must not go on believing it cold."""


def evict(path: str | Path, *, sync: bool = True, verify: bool = True,
          timeout: float = EVICT_TIMEOUT_S) -> None:
    """Drop a file's pages and make sure they are gone.

    posix_fadvise(DONTNEED) invalidates clean, unmapped, unlocked pages (mm/fadvise.c,
    mm/truncate.c mapping_try_invalidate, which clears the range's shadow entries too,
    so a cold file shows no past reclaim to assert_warmed). It skips dirty pages (synced
    first unless the caller knows the file is clean: sync=False spares a disk flush),
    pages under writeback or a read in flight, and pages still in a CPU's LRU batch
    (fadvise drains those on a shortfall). So it is repeated until cachestat (or
    mincore) finds nothing cached, syncing when dirty pages are what is left.
    verify=False: one DONTNEED, nothing checked (a fault injector racing readers).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if sync:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if not verify:
            return
        give_up, pause = time.monotonic() + timeout, 0.001
        while (left := kp.cached_pages(fd)).pages:
            if time.monotonic() > give_up:
                raise EvictionFailed(f"{path}: {left.pages} pages still cached after "
                                     f"{timeout:.0f} s of DONTNEED ({left.dirty} dirty, "
                                     f"{left.writeback} under writeback; the rest mapped "
                                     "or locked)")
            if left.dirty or left.writeback:
                os.fdatasync(fd)
            time.sleep(pause)  # a read or writeback in flight: it settles, then retry
            pause = min(pause * 2, 0.05)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def make_file(path: Path, size: int, *, written: int | None = None) -> Path:
    """A file of `size` bytes whose first `written` (default: all) are real random data,
    allocated on disk; the rest is a hole (ftruncate), so st_blocks counts only the
    written head. Synced and evicted (verified): it starts cold."""
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
