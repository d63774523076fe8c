"""Helpers for the native tests: real files, the real page cache, the real extension.

Nothing is mocked.  Files are written and fsync'ed in tmp dirs, evicted with
posix_fadvise(DONTNEED) until nothing is cached (kvharness.pagecache.evict), and their
residency read back through the extension's kvp_resident_bytes(uptodate=1) (mincore:
counts only pages whose read is done).  What an engine warmed is checked by
assert_warm, which tells the host's reclaimer from a page never read (cachestat's
shadow entries); what a test needs resident is held with kvharness.pagecache.pinned.
"""

from __future__ import annotations

import errno
import json
import os
import select
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvharness import pagecache
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
    lib.KVP_OUT_EXPIRED: "EXPIRED",
}


def engine_table() -> list[tuple[str, str, bool]]:
    """C's own engine table (kvp_engines): (engine, warm mode, queued) per row."""
    count = lib.kvp_engines(ffi.NULL, 0)
    table = ffi.new("struct kvp_engine_name[]", count)
    assert lib.kvp_engines(table, count) == count
    return [(ffi.string(e.engine).decode(), ffi.string(e.warm_mode).decode(), bool(e.queued))
            for e in table]


# The rows C runs in its queue (native/queue.c), as C's table says: the others are batch
# engines (kvp_ctx_new).
QUEUED = {(e, m) for e, m, queued in engine_table() if queued}


def _engines_to_test() -> dict[str, tuple[str, str, int]]:
    """Test name -> (engine, warm mode, threads): every row of C's table (one thread, two
    for the io_uring advice engine's confirm), and pread's queue with 4 threads."""
    rows = {f"{e}-{m}": (e, m, 2 if (e, m) == ("io_uring", "advise") else 1)
            for e, m, _ in engine_table()}
    return {**rows, "pread-read-t4": ("pread", "read", 4)}


ENGINES = _engines_to_test()


def engine_unavailable(engine: str, warm_mode: str) -> str | None:
    """None when the engine can run here, else kvp_engine_detect's reason."""
    why = ffi.new("char[]", 256)
    if lib.kvp_engine_detect(engine.encode(), warm_mode.encode(), why, len(why)):
        return None
    return ffi.string(why).decode(errors="replace")


def new_ctx(engine: str, warm_mode: str, **config: int) -> Any:
    """kvp_ctx_new for a row of the table; the cdata (freed when collected) or OSError."""
    names = ffi.new("char[]", engine.encode()), ffi.new("char[]", warm_mode.encode())
    full = {"fadv_random": 1, "chunk": 65536, "queue_depth": 8, "threads": 1, "max_open": 8}
    full.update(config)
    cfg = ffi.new("struct kvp_config *", full)
    cfg.engine, cfg.warm_mode = names
    err = ffi.new("int *")
    ctx = lib.kvp_ctx_new(cfg, err)
    if ctx == ffi.NULL:
        raise OSError(err[0], os.strerror(err[0]))
    return ffi.gc(ctx, lib.kvp_ctx_free)


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
        read_bytes: int | Sequence[int],
        residency: int = lib.KVP_RES_OFF,
    ) -> None:
        self.n = len(rels)
        self.items = ffi.new("struct kvp_item[]", max(self.n, 1))
        each = [read_bytes] * self.n if isinstance(read_bytes, int) else list(read_bytes)
        self._names = []
        for item, rel, item_read_bytes in zip(self.items, rels, each, strict=False):
            name = ffi.new("char[]", rel.encode() if isinstance(rel, str) else rel)
            self._names.append(name)
            item.root_fd = root_fd
            item.residency = residency
            item.rel = name
            item.read_bytes = item_read_bytes

    def results(self) -> list[Result]:
        return [
            Result(OUTCOMES[it.outcome], errno.errorcode.get(it.err, str(it.err)) if it.err else "",
                   it.size, it.done)
            for it in self.items[0 : self.n]
        ]


def new_queue(engine: str = "pread", warm_mode: str = "read", **config: int) -> Any:
    """kvp_queue_new for a queue engine of the table; the cdata (freed when collected) or
    OSError."""
    names = ffi.new("char[]", engine.encode()), ffi.new("char[]", warm_mode.encode())
    full = {"fadv_random": 1, "chunk": 65536, "initial_depth": 4, "max_threads": 4,
            "timeout_ns": 0}
    full.update(config)
    cfg = ffi.new("struct kvp_queue_config *", full)
    cfg.engine, cfg.warm_mode = names
    err = ffi.new("int *")
    queue = lib.kvp_queue_new(cfg, err)
    if queue == ffi.NULL:
        raise OSError(err[0], os.strerror(err[0]))
    return ffi.gc(queue, lib.kvp_queue_free)


def run_queue(queue: Any, batch: Batch, timeout: float = 60.0) -> None:
    """Submit a batch to a queue and reap until every item is settled, writing each
    outcome back into the batch's items (the tag is the item's index)."""
    tags = ffi.new("uint64_t[]", list(range(max(batch.n, 1))))
    assert lib.kvp_queue_submit(queue, batch.items, tags, batch.n) == batch.n
    out = ffi.new("struct kvp_done[]", 256)
    poller = select.poll()
    poller.register(lib.kvp_queue_fd(queue), select.POLLIN)
    left, deadline = batch.n, time.monotonic() + timeout
    while left:
        assert time.monotonic() < deadline, f"{left} files never settled"
        poller.poll(100)
        lib.kvp_queue_tick(queue)
        for k in range(lib.kvp_queue_reap(queue, out, 256)):
            done = out[k]
            item = batch.items[done.tag]
            item.outcome, item.err, item.size, item.done = (done.outcome, done.err, done.size,
                                                            done.done)
            left -= 1


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
        name, warm_mode, default_threads = ENGINES[engine]
        count = default_threads if threads is None else threads
        self.queue: Any = None
        self.ctx: Any = None
        if (name, warm_mode) in QUEUED:
            self.queue = new_queue(name, warm_mode, fadv_random=fadv_random, chunk=chunk,
                                   initial_depth=count, max_threads=count)
            if fallback:
                lib.kvp_queue_force_fallback(self.queue, fallback)
            return
        self.ctx = new_ctx(
            name,
            warm_mode,
            fadv_random=fadv_random,
            chunk=chunk,
            queue_depth=queue_depth,
            threads=count,
            max_open=max_open,
        )
        if fallback:
            lib.kvp_ctx_force_fallback(self.ctx, fallback)

    def run_batch(self, batch: Batch) -> list[Result]:
        before = fd_count()
        if self.queue is not None:
            run_queue(self.queue, batch)
            assert fd_count() == before, "the queue leaked or closed a descriptor"
            return batch.results()
        rc = lib.kvp_run_batch(self.ctx, batch.items, batch.n)
        assert fd_count() == before, "kvp_run_batch leaked or closed a descriptor"
        assert rc == 0, os.strerror(-rc)
        return batch.results()

    def run(
        self, root_fd: int, rels: Sequence[str | bytes], read_bytes: Any, **kw: Any
    ) -> list[Result]:
        return self.run_batch(Batch(root_fd, rels, read_bytes, **kw))


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
    """Drop the file's pages (synced first: DONTNEED cannot drop dirty or writeback
    pages) and check that none is left, retrying (kvharness.pagecache.evict)."""
    pagecache.evict(path)


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
_drops: int | None = None


def set_canary(path: Path | None) -> None:
    """A small file read into the page cache when a test starts (conftest), and the
    count of drop_caches so far (assert_warm skips if someone dropped caches since)."""
    global _canary, _drops
    _canary = path
    _drops = pagecache.drops()
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


def assert_warm(path: Path, head: int, offset: int = 0) -> None:
    """Every page of [offset, offset+head) was read in: up to date in the page cache
    (mincore), or taken by the host's reclaimer since (a shadow entry); a drop_caches by
    someone else since the test started skips it. The file must have been cold."""
    pagecache.assert_warmed([path], head, since=_drops, offset=offset)


def open_root(path: Path) -> int:
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


class Child:
    """fn() in a forked child, its JSON result through a pipe: a call held by a file system
    that never answers shows as no result by the deadline, not as a hung test. Reap the
    child once whatever holds it is released."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(self._read)
                os.write(write, json.dumps(fn()).encode())
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(write)

    def result(self, seconds: float) -> Any:
        """fn's result, or None when the child has not answered within `seconds`."""
        ready, _, _ = select.select([self._read], [], [], seconds)
        if not ready:
            return None
        with os.fdopen(self._read) as pipe:
            text = pipe.read()
        self._read = -1
        return json.loads(text) if text else None

    def reap(self, seconds: float = 30.0) -> int:
        """Wait for the child to exit (it may need a released file system first); its
        exit code."""
        if self._read >= 0:
            os.close(self._read)
            self._read = -1
        deadline = time.monotonic() + seconds
        while (waited := os.waitpid(self.pid, os.WNOHANG)) == (0, 0):
            assert time.monotonic() < deadline, f"child {self.pid} is still held"
            time.sleep(0.05)
        return os.waitstatus_to_exitcode(waited[1])


NOBODY = 65534


def as_nobody(fn: Callable[[], dict[str, Any]], seconds: float = 120.0) -> dict[str, Any]:
    """Run fn in a forked child (Child) that dropped to nobody first; its result."""
    def dropped() -> dict[str, Any]:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        return fn()

    child = Child(dropped)
    result = child.result(seconds)
    assert child.reap(seconds) == 0, "child failed (traceback above)"
    assert isinstance(result, dict), result
    return result
