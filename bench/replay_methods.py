"""The router replay's warm-up methods: what happens at each request's arrival.

- `daemon`: kvprefetchd at its defaults (only its root, the mount, is set), one `prefetch` per
  request on one connection, as a router sends them, with `deadline_ms` = the request's delta
  (its consumer reads then: a file not started by then is of no use to it, docs/protocol.md
  "Deadlines"). The request carries `wait` too, so the reply says when every file of it had
  its outcome: that reply's arrival is the warm-up's completion. `wait` changes nothing in
  how the daemon schedules the files (it only keeps the reply until they settle); the
  replies are read by a thread of their own, so no request is sent late for a reply.
  A fresh daemon per run: runs are interleaved, and one run's learned depth must not carry
  into the next method's.
- `pool-N`: N threads behind one FIFO queue (unbounded: a request's files are never turned
  away), fed each request's files in arrival order; each reads the head (open,
  FADV_RANDOM, pread, close), as bench/warmup_tools.warm_pool does. A request's warm-up
  completes when its last file was read.
- `none`: nothing: the consumer fetches what is not warm itself.

Every method reports, per request index, (completed_s, ok): seconds from the stream's start
when its warm-up completed (None: never, or no warm-up), and whether every file was warmed
(the daemon: `read` or `resident`, nothing expired, dropped or failed).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from replay_stream import Request

from kvharness.daemon import Daemon, start_config
from kvharness.wire import RawConnection

ROOT = Path(__file__).resolve().parents[1]
POOL_PREFIX = "pool-"
METHODS = ("daemon", "pool-256", "none")
GOOD = ("read", "resident")


class Warmer(Protocol):
    def submit(self, request: Request, paths: Sequence[str], now: float) -> None: ...

    def finish(self, timeout: float) -> None: ...

    def results(self) -> dict[int, tuple[float | None, bool]]: ...

    def detail(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def unknown(method: str) -> str | None:
    """Why a name is not a replay method, None when it is one."""
    if method in ("daemon", "none"):
        return None
    count = method.removeprefix(POOL_PREFIX)
    if method.startswith(POOL_PREFIX) and count.isdigit() and 1 <= int(count) <= 4096:
        return None
    return f"{method}: not a method; use daemon, pool-N (1-4096) or none"


class NoWarmer:
    def submit(self, request: Request, paths: Sequence[str], now: float) -> None:
        pass

    def finish(self, timeout: float) -> None:
        pass

    def results(self) -> dict[int, tuple[float | None, bool]]:
        return {}

    def detail(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class PoolWarmer:
    """A FIFO pool of `threads` reading heads (module docstring)."""

    def __init__(self, threads: int, head: int, clock: Clock) -> None:
        self.head, self.clock = head, clock
        self.jobs: queue.Queue[tuple[int, str] | None] = queue.Queue()
        self.left: dict[int, int] = {}
        self.short: set[int] = set()
        self.done: dict[int, tuple[float | None, bool]] = {}
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.threads = [threading.Thread(target=self._work, daemon=True)
                        for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def submit(self, request: Request, paths: Sequence[str], now: float) -> None:
        with self.lock:
            self.left[request.index] = len(paths)
        for path in paths:
            self.jobs.put((request.index, path))

    def _work(self) -> None:
        buffer = bytearray(min(self.head, 1 << 20))
        while (job := self.jobs.get()) is not None:
            index, path = job
            ok = read_head(path, self.head, buffer) >= 0
            with self.lock:
                if not ok:
                    self.short.add(index)
                self.left[index] -= 1
                if not self.left[index]:
                    del self.left[index]
                    self.done[index] = (self.clock.now(), index not in self.short)
                    if not self.left:
                        self.idle.notify_all()

    def finish(self, timeout: float) -> None:
        with self.idle:
            self.idle.wait_for(lambda: not self.left, timeout)

    def results(self) -> dict[int, tuple[float | None, bool]]:
        with self.lock:
            return dict(self.done)

    def detail(self) -> dict[str, Any]:
        return {"threads": len(self.threads), "unfinished": len(self.left)}

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)
        for thread in self.threads:
            thread.join(30)


class DaemonWarmer:
    """kvprefetchd at its defaults, one request per arrival (module docstring)."""

    def __init__(self, root: Path, workdir: Path, clock: Clock) -> None:
        self.clock = clock
        self.daemon: Daemon = start_config(workdir, {"roots": [str(root)]}, name="replay",
                                           log_path=workdir / "replay-daemon.log",
                                           new_session=True)
        self.connection = RawConnection(self.daemon.socket_path, timeout=None)
        self.sent: dict[int, int] = {}  # wire id -> request index
        self.expected = 0
        self.done: dict[int, tuple[float | None, bool]] = {}
        self.outcomes: dict[str, int] = {}
        self.counts = {"accepted": 0, "dropped": 0, "rejected": 0}
        self.lock = threading.Lock()
        self.all_in = threading.Condition(self.lock)
        self.stats0 = self.daemon.stats()
        self.source = source_digest()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def submit(self, request: Request, paths: Sequence[str], now: float) -> None:
        deadline_ms = max(1, round(request.delta_s * 1000))
        with self.lock:
            wire_id = self.connection.request("prefetch", paths=list(paths), wait=True,
                                              deadline_ms=deadline_ms)
            self.sent[wire_id] = request.index
            self.expected += 1

    def _read(self) -> None:
        while True:
            try:
                reply = self.connection.recv()
            except (OSError, ConnectionError):
                return
            at = self.clock.now()
            with self.lock:
                index = self.sent.pop(int(reply.get("id", -1)), None)
                if index is None:
                    continue
                outcomes = reply.get("outcomes") or {}
                for name, count in outcomes.items():
                    self.outcomes[name] = self.outcomes.get(name, 0) + count
                for name in self.counts:
                    self.counts[name] += int(reply.get(name, 0))
                good = sum(outcomes.get(name, 0) for name in GOOD)
                ok = bool(reply.get("ok")) and good == reply.get("accepted", -1) \
                    and not reply.get("dropped") and not reply.get("rejected")
                self.done[index] = (at if ok else None, ok)
                if len(self.done) >= self.expected:
                    self.all_in.notify_all()

    def finish(self, timeout: float) -> None:
        with self.all_in:
            self.all_in.wait_for(lambda: len(self.done) >= self.expected, timeout)

    def results(self) -> dict[int, tuple[float | None, bool]]:
        with self.lock:
            return dict(self.done)

    def detail(self) -> dict[str, Any]:
        stats = self.daemon.stats()
        files = {k: stats["files"].get(k, 0) - self.stats0["files"].get(k, 0)
                 for k in ("accepted", "dropped", "read", "resident", "expired", "failed",
                           "futile")}
        with self.lock:
            return {"outcomes": dict(self.outcomes), **self.counts, "files": files,
                    "engine": str(self.daemon.call("ping").get("engine")),
                    "source": self.source,
                    "unanswered": self.expected - len(self.done)}

    def close(self) -> None:
        self.connection.close()
        self.reader.join(10)
        self.daemon.stop()


def source_digest() -> str:
    """A digest of the daemon's sources as this run started it: the daemon is being changed
    while the replay runs (issue 25), and runs started from different code must not pass
    for repetitions of one."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("daemon/kvprefetchd/**/*.py"), *ROOT.glob("native/*.[ch]")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


class Clock:
    """Seconds since the stream's start, on the monotonic clock."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.start


def read_head(path: str, head: int, buffer: bytearray,
              look: Callable[[int], int] | None = None) -> int:
    """open + FADV_RANDOM (exactly the head, no readahead window: mm/readahead.c) + pread
    of [0, head) or to the end of the file + close; -1 on an error. `look`, given the fd
    between the open and the first read, says how many bytes of the head are near then:
    the return value (else 0)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        near = look(fd) if look is not None else 0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        view, offset = memoryview(buffer), 0
        while offset < head:
            n = os.preadv(fd, [view[: min(len(buffer), head - offset)]], offset)
            if n <= 0:
                break
            offset += n
        return near
    except OSError:
        return -1
    finally:
        os.close(fd)


def make(method: str, root: Path, head: int, workdir: Path, clock: Clock) -> Warmer:
    """The warmer of a method name, ready before the stream's clock starts."""
    if method == "daemon":
        return DaemonWarmer(root, workdir, clock)
    if method.startswith(POOL_PREFIX):
        return PoolWarmer(int(method.removeprefix(POOL_PREFIX)), head, clock)
    return NoWarmer()
