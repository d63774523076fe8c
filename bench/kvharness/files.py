"""Files with real data, checked to have landed, and evicted for certain.

One `write` and one `evict` for every test and benchmark, so that no test believes a
file is there, or cold, when it is not:

- `write(path, size)`: real random data (or the caller's), read back and compared, its
  size checked; then, unless cold=False, synced and evicted (verified). `written` leaves
  the tail a hole (ftruncate), so st_blocks counts only the written head.
- `write_all(paths, size)`: the same for many files, with one sync(2) for all of them
  instead of an fdatasync each (one disk flush instead of thousands).
- `make_files(directory, count, size)`: that many files in the fs connector's layout of
  folders; their names relative to `directory` (what a tier's backing holds).
- `evict(path)`: DONTNEED, then checked empty (cachestat, else mincore), retried.

`make_file` (a Path) is `write` for the callers that keep Paths.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from kvharness import kernel_pages as kp

CHUNK = 1 << 20
EVICT_TIMEOUT_S = 10.0  # pages under a read or writeback settle in ms; mapped ones never


class WriteFailed(AssertionError):
    """A file read back short, long or different from what was written: a full disk, a
    file system that lied, or another process writing the same path."""


class EvictionFailed(AssertionError):
    """Pages that DONTNEED would not drop within EVICT_TIMEOUT_S: mapped (a pin, another
    process's mmap) or mlocked, most likely. A test must not go on believing it cold."""


# --- writing, verified ----------------------------------------------------------------


def _fill(path: Path, size: int, written: int, block: bytes) -> None:
    """`block` repeated over [0, written), the rest of `size` a hole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        done = 0
        while done < written:
            chunk = block[: written - done]
            handle.write(chunk)
            done += len(chunk)
        handle.truncate(size)


def check_landed(path: Path, size: int, written: int, block: bytes) -> None:
    """The size is `size` and the head reads back as written (through the page cache,
    which is what every reader of the file sees)."""
    with open(path, "rb") as handle:
        got = os.fstat(handle.fileno()).st_size
        if got != size:
            raise WriteFailed(f"{path}: {got} bytes after writing {size}")
        done = 0
        while done < written:
            want = block[: written - done]
            if handle.read(len(want)) != want:
                raise WriteFailed(f"{path}: bytes at {done} read back different")
            done += len(want)


def _block(size: int, written: int | None, data: bytes | None) -> tuple[int, bytes]:
    written = size if written is None else min(written, size)
    if data is not None:
        if written and not data:
            raise ValueError("data must not be empty when there is something to write")
        return written, data
    return written, os.urandom(min(written, CHUNK)) if written else b""


def write(path: str | Path, size: int, *, data: bytes | None = None,
          written: int | None = None, cold: bool = True) -> str:
    """A file of `size` bytes whose first `written` (default: all) are `data` repeated
    (default: random, 1 MiB at most, repeated), the rest a hole; read back and checked
    (WriteFailed), then, unless cold=False, synced and evicted (verified: it starts cold).
    Its path as a string, what a request carries."""
    path = Path(path)
    written, block = _block(size, written, data)
    _fill(path, size, written, block)
    check_landed(path, size, written, block)
    if cold:
        evict(path)
    return str(path)


def make_file(path: Path, size: int, *, written: int | None = None) -> Path:
    """`write` for callers that keep Paths: random data, checked, cold."""
    return Path(write(path, size, written=written))


def write_all(paths: Iterable[str | Path], size: int, *, data: bytes | None = None,
              cold: bool = True) -> list[str]:
    """`write` for many files of `size` bytes (all of them `data` repeated, default: one
    random block for all): each checked, then one sync(2) and each evicted (verified)
    unless cold=False."""
    written, block = _block(size, None, data)
    out = []
    for item in paths:
        path = Path(item)
        _fill(path, size, written, block)
        check_landed(path, size, written, block)
        out.append(str(path))
    if cold:
        os.sync()  # one flush for all: DONTNEED cannot drop dirty pages
        for path_text in out:
            evict(path_text, sync=False)
    return out


def make_files(directory: Path, count: int, size: int, folder: str = "m", *,
               cold: bool = False) -> list[str]:
    """`count` files of `size` bytes (one random block, so one fetch costs as much as
    another) as the fs connector lays them out, 16 to a folder under `folder`; their
    names relative to `directory`. Left in the page cache unless cold: a tier's backing
    is read by the simulator, whose model (not the host's page cache) makes them cold."""
    names = [f"{folder}/{i % 16:02x}/{i:05d}.bin" for i in range(count)]
    write_all((directory / name for name in names), size, data=os.urandom(size), cold=cold)
    return names


# --- eviction, verified ---------------------------------------------------------------


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
