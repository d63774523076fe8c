"""Helpers for the native tests: real files, the real page cache, the real extension.

Nothing is mocked.  Files are written and fsync'ed in tmp dirs, evicted with
posix_fadvise(DONTNEED), and their residency read back through the extension's
kvp_resident_bytes(uptodate=1) (mincore: counts only pages whose read is done).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvprefetchd._native import ffi, lib

PAGE = os.sysconf("SC_PAGE_SIZE")
KiB = 1024
MiB = 1024 * KiB

OUTCOMES = {
    lib.KVP_OUT_READ: "READ",
    lib.KVP_OUT_RESIDENT: "RESIDENT",
    lib.KVP_OUT_MISSING: "MISSING",
    lib.KVP_OUT_REJECTED: "REJECTED",
    lib.KVP_OUT_FAILED: "FAILED",
}

# name -> (engine, threads, needs io_uring)
ENGINES: dict[str, tuple[int, int, bool]] = {
    "pread1": (lib.KVP_ENGINE_PREAD, 1, False),
    "pread4": (lib.KVP_ENGINE_PREAD, 4, False),
    "fadvise": (lib.KVP_ENGINE_FADVISE, 1, False),
    "uring_read": (lib.KVP_ENGINE_URING_READ, 1, True),
    "uring_fadvise": (lib.KVP_ENGINE_URING_FADVISE, 2, True),
}


def uring_unavailable() -> str | None:
    """None when io_uring works here, else kvp_uring_probe's reason."""
    why = ffi.new("char[]", 256)
    if lib.kvp_uring_probe(why, len(why)):
        return None
    return ffi.string(why).decode(errors="replace")


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass(frozen=True)
class Result:
    outcome: str
    err: str  # errno name, "" for 0
    size: int
    done: int


class Batch:
    """A kvp_item array plus the C strings it points to (kept alive here)."""

    def __init__(
        self,
        root_fd: int,
        rels: Sequence[str | bytes],
        want: int | Sequence[int],
        residency: int = lib.KVP_RES_NONE,
    ) -> None:
        self.n = len(rels)
        self.items = ffi.new("struct kvp_item[]", max(self.n, 1))
        wants = [want] * self.n if isinstance(want, int) else list(want)
        self._names = []
        for item, rel, w in zip(self.items, rels, wants, strict=False):
            name = ffi.new("char[]", rel.encode() if isinstance(rel, str) else rel)
            self._names.append(name)
            item.root_fd = root_fd
            item.residency = residency
            item.rel = name
            item.want = w

    def results(self) -> list[Result]:
        return [
            Result(OUTCOMES[it.outcome], errno.errorcode.get(it.err, str(it.err)) if it.err else "",
                   it.size, it.done)
            for it in self.items[0 : self.n]
        ]


class Ctx:
    def __init__(
        self,
        engine: str,
        *,
        chunk: int = 256 * KiB,
        queue_depth: int = 32,
        max_open: int = 64,
        fadv_random: int = 1,
        threads: int | None = None,
        fallback: int = 0,
    ) -> None:
        eng, default_threads, _ = ENGINES[engine]
        cfg = ffi.new(
            "struct kvp_config *",
            {
                "engine": eng,
                "fadv_random": fadv_random,
                "chunk": chunk,
                "queue_depth": queue_depth,
                "threads": default_threads if threads is None else threads,
                "max_open": max_open,
            },
        )
        err = ffi.new("int *")
        ctx = lib.kvp_ctx_new(cfg, err)
        if ctx == ffi.NULL:
            raise OSError(err[0], os.strerror(err[0]))
        self.ctx = ffi.gc(ctx, lib.kvp_ctx_free)
        if fallback:
            lib.kvp_ctx_force_fallback(self.ctx, fallback)

    def run_batch(self, batch: Batch) -> list[Result]:
        before = fd_count()
        rc = lib.kvp_run_batch(self.ctx, batch.items, batch.n)
        assert fd_count() == before, "kvp_run_batch leaked or closed a descriptor"
        assert rc == 0, os.strerror(-rc)
        return batch.results()

    def run(self, root_fd: int, rels: Sequence[str | bytes], want: Any, **kw: Any) -> list[Result]:
        return self.run_batch(Batch(root_fd, rels, want, **kw))


def write_file(path: Path, size: int, *, seed: int = 0) -> Path:
    block = (seed.to_bytes(4, "little") + os.urandom(MiB - 4)) if size else b""
    with open(path, "wb") as f:
        left = size
        while left:
            k = min(left, len(block))
            f.write(block[:k])
            left -= k
        f.flush()
        os.fsync(f.fileno())
    return path


def evict(path: Path) -> None:
    """Drop the file's clean pages (written pages were fsync'ed: DONTNEED
    cannot drop dirty or writeback pages) and check they are gone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        left = lib.kvp_resident_bytes(fd, 0, size, 1)
        assert 0 <= left <= size // 100, f"{path}: {left} bytes still cached after DONTNEED"
    finally:
        os.close(fd)


def resident(path: Path, off: int = 0, length: int | None = None, uptodate: int = 1) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        if length is None:
            length = os.fstat(fd).st_size
        r = lib.kvp_resident_bytes(fd, off, length, uptodate)
        assert r >= 0, os.strerror(-r)
        return int(r)
    finally:
        os.close(fd)


_canary: Path | None = None


def set_canary(path: Path | None) -> None:
    """A small file read into the page cache when a test starts (conftest)."""
    global _canary
    _canary = path
    if path is not None:
        write_file(path, 64 * KiB)
        with open(path, "rb") as f:
            f.read()


def skip_if_dropped() -> bool:
    """Skip the test if the canary was evicted (the page cache was dropped
    under it by another process); False otherwise, for `assert x or ...`."""
    if _canary is not None and resident(_canary) < 64 * KiB:
        pytest.skip("page cache dropped under the test by another process")
    return False


def check_warm(got: int, want: int, what: str) -> None:
    """Fail unless at least 99% of want is resident (a host reclaimer may evict
    a little late).  If the canary is gone too, something dropped the whole
    page cache under the test (another benchmark's drop_caches on a shared
    machine): skip rather than blame the engine."""
    if got < want - want // 100 and not skip_if_dropped():
        raise AssertionError(f"{what}: {got} of {want} bytes resident")


def assert_warm(path: Path, head: int) -> None:
    """The head is in the page cache and uptodate (mincore)."""
    check_warm(resident(path, 0, head, 1), head, str(path))


def open_root(path: Path) -> int:
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
