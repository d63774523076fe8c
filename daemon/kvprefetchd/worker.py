"""A worker: receive files, skip what is warm or already on its way, warm the rest in batches.

Runs in a forked child that owns one engine. Its loop never waits for I/O while
there is work: it drains its socket, answers what its memory can answer at once,
hands the engine one batch, and reports the outcomes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import sys
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from kvprefetchd.channel import (
    BootFailed,
    ChannelReader,
    Done,
    Ready,
    Warm,
    close_other_fds,
    send_all_blocking,
)
from kvprefetchd.dedup import InFlight, Key, RecentlyWarmed
from kvprefetchd.engines.base import Completion, Engine, EngineSettings, QueueAnswer, WarmItem
from kvprefetchd.faults import WORKER_BOOT_FAILS, BatchFaults, injected
from kvprefetchd.histogram import FILE_BUCKETS, Histogram

log = logging.getLogger("kvprefetchd.worker")

# Named exit codes, so the supervisor can tell a worker that cannot boot (halt
# the daemon: respawning would fail the same way forever) from one that died.
EXIT_OK = 0
EXIT_BOOT_FAILED = 3

# Most head bytes one native call may be asked for. A worker says nothing to the
# supervisor while it is inside a batch, and the supervisor kills a worker that
# owes outcomes and says nothing for `worker_timeout` (60 s): so a batch must stay
# short on a slow tier. 256 MiB is batch_files x read_bytes at their defaults (no
# change there); requests with a large read_bytes get fewer files per batch, e.g.
# 4 heads of 64 MiB, which a tier delivering 5 MB/s still reads within 60 s.
MAX_BATCH_BYTES = 256 << 20


@dataclass(frozen=True)
class WorkerPlan:
    """Everything a worker needs, fixed by the supervisor before it forks."""

    index: int
    roots: tuple[str, ...]
    rules: tuple[int, ...]
    # Warm mode ("read", "advise") -> the engines to try, best first. The first mode is
    # the configured one (built at boot); another is there only when a model profile
    # chooses it and an engine of that mode can run here (built on first use).
    engines: Mapping[str, tuple[type[Engine], ...]]
    engine_settings: EngineSettings
    dedup_ttl: float
    dedup_entries: int
    dedup_bytes: int = 16 << 20
    nice: int = 0

    @property
    def warm_mode(self) -> str:
        return next(iter(self.engines))


# mallopt(3) parameter numbers, from glibc's <malloc.h>.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own initial value


def pin_mmap_threshold() -> None:
    """Keep buffers of 128 KiB and more out of the brk heap, where they fragment it.

    glibc raises its mmap threshold to the size of every mmapped chunk it frees
    (mallopt(3), M_MMAP_THRESHOLD), so once the first 1 MiB recv buffer is freed,
    later big buffers (recv, channel frames, msgpack arrays of a batch) come from the
    heap, and small long-lived blocks between them keep it from shrinking. Measured
    with bench/soak.py (8 clients, 10^6 requests, ~26M files): a worker's [heap] grew
    4.2 -> 12-14 MiB and its RSS drifted +11% after warm-up, still climbing over
    3x10^6 requests; with the threshold set, [heap] 4.2 -> 4.5 MiB and RSS drift +0.4-1%.
    Setting it explicitly also turns the dynamic adjustment off. Not glibc: a no-op.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def _open_root(path: str) -> int:
    """A directory fd to resolve beneath; -1 while the root does not exist (yet)."""
    try:
        return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1


class Worker:
    def __init__(self, plan: WorkerPlan, sock: socket.socket, engine: Engine) -> None:
        self.plan = plan
        self.sock = sock
        self.reader = ChannelReader(sock)
        self.root_fds = [_open_root(root) for root in plan.roots]
        self.recent = RecentlyWarmed(plan.dedup_ttl, plan.dedup_entries,
                                     budget_bytes=plan.dedup_bytes)
        self.in_flight = InFlight()
        # Per warm mode: its engine (built when first needed) and the files waiting for it.
        self.engines: dict[str, Engine] = {plan.warm_mode: engine}
        self.pending: dict[str, deque[WarmItem]] = {plan.warm_mode: deque()}
        self.outcomes: list[list[Any]] = []  # [ticket, outcome, bytes] of waiting requests
        self.anonymous: Counter[str] = Counter()  # outcomes of fire-and-forget files
        self.anonymous_bytes = 0
        self.latency = Histogram(FILE_BUCKETS)  # per file, since the last report
        self.counters = {
            "batches": 0, "batches_other_mode": 0, "dedup_recent": 0, "dedup_in_flight": 0
        }
        self.faults = BatchFaults.from_environment()  # None unless a test injects one

    @property
    def engine(self) -> Engine:
        """The engine of the configured warm mode."""
        return self.engines[self.plan.warm_mode]

    def run(self) -> None:
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        while True:
            poller.poll(0 if any(self.pending.values()) else None)
            for message in self.reader.read_available():
                if isinstance(message, Warm):
                    self.accept(message)
                else:
                    log.warning("worker %d: unexpected %s", self.plan.index, type(message))
            if self.reader.closed:
                return  # the supervisor is gone: nobody to report to
            self.flush()
            for mode, pending in self.pending.items():
                if pending:
                    self.warm_one_batch(self.engine_for(mode), pending)
                    if mode != self.plan.warm_mode:
                        self.counters["batches_other_mode"] += 1
                    self.flush()

    def accept(self, message: Warm) -> None:
        received = time.monotonic()
        want = message.read_bytes
        queue = self.pending.get(message.warm_mode)
        if queue is None:
            queue = self.pending[message.warm_mode] = deque()
        for ticket, root_index, relative in message.entries:
            key: Key = (root_index, relative)
            if self.recent.covers(key, want):
                self.counters["dedup_recent"] += 1
                self.outcome(ticket, "resident", 0)
                self.latency.observe(0.0)
                continue
            if not self.in_flight.join(key, want, ticket):
                self.counters["dedup_in_flight"] += 1
                continue
            root_fd = self.root_fd(root_index)
            if root_fd < 0:
                for waiting in self.in_flight.settle(key, want):
                    self.outcome(waiting, "missing", 0)
                continue
            rule = self.plan.rules[root_index]
            queue.append(WarmItem(root_fd, rule, relative, want, key, received))

    def root_fd(self, index: int) -> int:
        """A root that did not exist at start may have been created since: look again."""
        if self.root_fds[index] < 0:
            self.root_fds[index] = _open_root(self.plan.roots[index])
        return self.root_fds[index]

    def warm_one_batch(self, engine: Engine, pending: deque[WarmItem]) -> None:
        """Hand the engine one batch (at most batch_files files and MAX_BATCH_BYTES) and settle it.

        Every batch ends in a Done message (each file gets an outcome), which is
        the worker's heartbeat: bounding a batch bounds the supervisor's silence.
        """
        queued: list[WarmItem] = []
        budget = MAX_BATCH_BYTES
        while (
            pending
            and (not queued or pending[0].want <= budget)
            and engine.queue(pending[0]) is QueueAnswer.QUEUED
        ):
            item = pending.popleft()
            budget -= item.want
            queued.append(item)
        if self.faults is not None:
            self.faults.apply([item.relative for item in queued])
        engine.submit()
        self.counters["batches"] += 1
        for completion in engine.reap():
            self.settle(completion)

    def engine_for(self, warm_mode: str) -> Engine:
        """Built on first use; where it cannot be built, the configured engine serves."""
        engine = self.engines.get(warm_mode)
        if engine is None:
            candidates = self.plan.engines.get(warm_mode, ())
            try:
                engine = build_engine(self.plan, candidates)
            except Exception as error:
                log.warning("worker %d: %s warm mode unavailable (%s); using %s",
                            self.plan.index, warm_mode, error, self.engine.name)
                engine = self.engine
            self.engines[warm_mode] = engine
        return engine

    def settle(self, completion: Completion) -> None:
        item = completion.item
        if completion.outcome in ("read", "resident"):
            self.recent.remember(item.key, item.want)
        bytes_read = completion.done if completion.outcome == "read" else 0
        self.latency.observe(time.monotonic() - item.received)
        tickets = self.in_flight.settle(item.key, item.want)
        for position, ticket in enumerate(tickets):
            # Bytes are counted once per real read, not once per waiting request.
            self.outcome(ticket, completion.outcome, bytes_read if position == 0 else 0)
        if completion.outcome == "failed":
            log.debug(
                "worker %d: %r failed: %s",
                self.plan.index,
                item.relative,
                os.strerror(completion.error) if completion.error else "unknown",
            )

    def outcome(self, ticket: int, outcome: str, nbytes: int) -> None:
        """Ticket 0 is a fire-and-forget file: reported as a count, not one by one."""
        if ticket:
            self.outcomes.append([ticket, outcome, nbytes])
        else:
            self.anonymous[outcome] += 1
            self.anonymous_bytes += nbytes

    def flush(self) -> None:
        if not self.outcomes and not self.anonymous:
            return
        counters = {k: v for k, v in self.counters.items() if v}
        self.counters = dict.fromkeys(self.counters, 0)
        send_all_blocking(self.sock, Done(
            settled=self.outcomes,
            counters=counters,
            anonymous=dict(self.anonymous),
            anonymous_bytes=self.anonymous_bytes,
            latency_counts=self.latency.counts,
            latency_sum=self.latency.sum,
        ))
        self.outcomes = []
        self.anonymous.clear()
        self.anonymous_bytes = 0
        self.latency = Histogram(FILE_BUCKETS)


def build_engine(plan: WorkerPlan, candidates: tuple[type[Engine], ...]) -> Engine:
    """The first candidate engine that sets up here; the last one's error if none does."""
    failure: Exception | None = None
    for engine_class in candidates:
        try:
            return engine_class(plan.engine_settings)
        except Exception as error:
            log.warning("worker %d: engine %s: %s", plan.index, engine_class.name, error)
            failure = error
    if failure is None:
        raise RuntimeError("no engine to build")
    raise failure


def worker_main(plan: WorkerPlan, sock: socket.socket) -> NoReturn:
    """Entry point in the forked child; never returns into the supervisor's code."""
    status = EXIT_OK
    try:
        close_other_fds({0, 1, 2, sock.fileno()})
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        try:
            import setproctitle

            setproctitle.setproctitle(f"kvprefetchd: worker {plan.index}")
        except ImportError:
            pass
        sock.setblocking(False)
        if plan.nice:
            os.nice(plan.nice)
        pin_mmap_threshold()
        try:
            if injected(WORKER_BOOT_FAILS):
                raise RuntimeError("boot failure injected by KVPREFETCHD_FAULTS")
            engine = build_engine(plan, plan.engines[plan.warm_mode])
        except Exception as error:
            send_all_blocking(sock, BootFailed(f"{type(error).__name__}: {error}"))
            os._exit(EXIT_BOOT_FAILED)
        send_all_blocking(sock, Ready(engine.name, os.getpid()))
        Worker(plan, sock, engine).run()
    except BaseException:
        log.exception("worker %d crashed", plan.index)
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)
