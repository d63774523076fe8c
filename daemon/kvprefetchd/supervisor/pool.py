"""The workers: spawn, hand work to, listen to, reap, respawn and kill the wedged.

Each worker is a forked child with a socketpair to the supervisor (channel.py; its end
here: handle.py), told what it needs before the fork (plans.py). The pool books every
file it hands out (books.py) so a dead worker's files are failed, never forgotten, and
it collects the waiters whose last file was settled in `complete`; the supervisor's loop
takes them and has the ops answer them, so the pool never answers a client itself.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import selectors
import signal
import socket
import sys
import time
from collections import Counter

from kvprefetchd.channel import (
    CHECK,
    EVICT_FILE,
    BootFailed,
    ChannelReader,
    Check,
    Done,
    Evict,
    Message,
    Ready,
    Root,
    Share,
    Warm,
)
from kvprefetchd.config import Config
from kvprefetchd.metrics.histogram import FILE_BUCKETS, Histogram
from kvprefetchd.roots.rootset import RootSet, RootState
from kvprefetchd.supervisor.books import Books, Waiter
from kvprefetchd.supervisor.halting import halt_workers
from kvprefetchd.supervisor.handle import WorkerHandle
from kvprefetchd.supervisor.plans import engines_by_mode, worker_plan
from kvprefetchd.supervisor.stuck import Stuck
from kvprefetchd.worker.process import EXIT_BOOT_FAILED, worker_main

__all__ = ["HaltError", "WorkerPool"]

log = logging.getLogger("kvprefetchd")

BOOT_TIMEOUT = 20.0
# A worker that cannot be respawned (the supervisor is out of fds or processes)
# leaves its shard empty (its files are dropped) and is tried again this often.
RESPAWN_RETRY = 1.0
# Both ends of a worker's socketpair: room for a batch of outcomes without a stall.
CHANNEL_BUFFER_BYTES = 4 << 20


# A worker's counter -> the stats event it adds to.
WORKER_EVENTS = {"checked": "files_checked", "evicted": "files_evicted",
                 "noatime_fallbacks": "noatime_fallbacks"}


class HaltError(RuntimeError):
    """The daemon cannot go on (a worker cannot boot); the message is for the operator."""


class WorkerPool:
    def __init__(
        self, config: Config, roots: RootSet, books: Books,
        selector: selectors.BaseSelector, stuck: Stuck,
    ) -> None:
        self.config = config
        self.roots = roots
        self.stuck = stuck
        self.books = books
        self.selector = selector
        self.engines = engines_by_mode(config)
        self.workers: list[WorkerHandle | None] = [None] * config.worker_count
        self.complete: list[Waiter] = []  # answered by the supervisor's loop (take_complete)
        self.file_latency = Histogram(FILE_BUCKETS)
        self.restarts = 0
        self.killed_wedged = 0
        self.stopping = False
        self.problems_logged: set[str] = set()  # each said once, not once per worker
        # What the workers count that outlives any one of them (stats `events`).
        self.events: Counter[str] = Counter()
        self.held_back: set[int] = set()  # shards left empty while too many workers are stuck
        # No worker can be found wedged before this time (murder_workers keeps it a
        # lower bound of every busy worker's deadline), so the loop sleeps until then.
        self.wedge_check_due = time.monotonic() + config.worker_timeout
        self.respawn_due: dict[int, float] = {}  # worker index -> when to try again
        # Roots whose change could not be sent to every worker (out of fds), sent again
        # to all at roots_due.
        self.roots_owed: set[int] = set()
        self.roots_due = 0.0

    # ---- spawning ----------------------------------------------------------------------------

    def spawn(self, index: int) -> None:
        plan = worker_plan(self.config, self.roots, self.engines, index)
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for end in (parent_sock, child_sock):
                end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHANNEL_BUFFER_BYTES)
                end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CHANNEL_BUFFER_BYTES)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
        except OSError:
            parent_sock.close()
            child_sock.close()
            raise
        if pid == 0:  # pragma: no cover - the child never returns here
            parent_sock.close()
            worker_main(plan, child_sock)
        child_sock.close()
        parent_sock.setblocking(False)
        previous = self.workers[index]
        handle = WorkerHandle(index, pid, parent_sock, ChannelReader(parent_sock))
        if previous is not None:
            handle.restarts = previous.restarts + 1
        self.workers[index] = handle
        handle.handler = functools.partial(self.on_worker_event, handle)
        self.selector.register(parent_sock, handle.watched, handle.handler)
        log.debug("worker %d spawned as pid %d", index, pid)

    def spawn_all(self) -> None:
        for index in range(len(self.workers)):
            self.spawn(index)

    def all_ready(self) -> bool:
        return all(w is not None and w.ready for w in self.workers)

    def respawn(self, index: int) -> None:
        """Put a new worker on a shard; when that fails for want of fds or processes,
        leave the shard empty (its files are dropped, counted) and try again later,
        rather than let one dead worker take the whole daemon down."""
        self.respawn_due.pop(index, None)
        stuck = self.stuck.count("worker")
        if stuck >= self.config.max_stuck_workers:
            # Each stuck worker keeps its memory and threads until its tier answers: past
            # the cap, a shard stays empty (its files dropped, counted) rather than fork
            # without end while a dead tier holds every new worker the same way.
            self.workers[index] = None
            self.respawn_due[index] = time.monotonic() + RESPAWN_RETRY
            if index not in self.held_back:
                self.held_back.add(index)
                log.error("worker %d: not respawned while %d killed workers are stuck in the "
                          "kernel (max_stuck_workers); its files are dropped until one exits",
                          index, stuck)
            return
        self.held_back.discard(index)
        try:
            self.spawn(index)
        except OSError as error:
            if error.errno not in (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM):
                raise
            self.workers[index] = None
            self.respawn_due[index] = time.monotonic() + RESPAWN_RETRY
            log.error("worker %d: cannot respawn (%s); its files are dropped until it can, "
                      "trying again every %.0f s", index, error.strerror, RESPAWN_RETRY)
            return
        self.restarts += 1

    # ---- handing out work ------------------------------------------------------------------

    def room(self) -> list[int]:
        """How many more files each worker may take before new ones are dropped."""
        limit = self.config.queue_limit
        return [
            limit - self.books.outstanding(index) if handle is not None else 0
            for index, handle in enumerate(self.workers)
        ]

    def dispatch(
        self, shares: list[Share | None], waiter: Waiter | None, read_bytes: int,
        warm_mode: str, deadline: float = 0.0, flags: int = 0, client: int = 0,
    ) -> None:
        """Book each worker's share of a warm-up and send it; `client` is who sent it
        (Connection.client)."""
        for index, share_id, share in self.book(shares, waiter):
            self.send(index, Warm(share, share_id, read_bytes, warm_mode, deadline, flags,
                                  client))

    def inspect(self, shares: list[Share | None], waiter: Waiter, read_bytes: int,
                verb: str) -> None:
        """Book each worker's share of a check or an evict (`verb`: channel.CHECK,
        EVICT_HEAD or EVICT_FILE) and send it."""
        for index, share_id, share in self.book(shares, waiter):
            self.send(index, Check(share, share_id, read_bytes) if verb == CHECK
                      else Evict(share, share_id, read_bytes, whole=verb == EVICT_FILE))

    def book(self, shares: list[Share | None],
             waiter: Waiter | None) -> list[tuple[int, int, Share]]:
        """Book the shares of the workers there are: (worker, share id, share) each."""
        self.roots.wanted(shares)  # a root named there that is not open: looked at now
        now = time.monotonic()
        booked = []
        for index, share in enumerate(shares):
            handle = self.workers[index]
            if share is None or handle is None:
                continue
            if self.books.outstanding(index) == 0:
                handle.heard = now  # its silence counts from now, not from its last report
            booked.append((index, self.books.issue(index, waiter, share), share))
        return booked

    def send(self, index: int, message: Message) -> None:
        handle = self.workers[index]
        if handle is not None:
            handle.send(message, self.selector)

    def add_root(self, state: RootState) -> None:
        """A root opened, reopened or let go after the workers started: each hears of it in
        a Root message, with a copy of its fd beside it (none when let go); a worker puts
        the new directory under the number it held the old one at. Later workers inherit
        the supervisor's fd."""
        for handle in self.workers:
            if handle is None:
                continue
            # In line with the Root messages before it (let go after opened, not before);
            # a copy of the fd, since the supervisor's may be let go before this is sent.
            try:
                copy = os.dup(state.fd) if state.fd >= 0 else -1
            except OSError as error:  # out of fds: sent again (to all, harmless) later
                if state.index not in self.roots_owed:
                    log.error("root %s: cannot hand its new fd to the workers (%s); trying "
                              "again every %.0f s", state.path, error.strerror, RESPAWN_RETRY)
                self.roots_owed.add(state.index)
                self.roots_due = time.monotonic() + RESPAWN_RETRY
                continue
            handle.send_with_fd(Root(state.index, state.code, state.tier, copy), copy,
                                self.selector)

    # ---- listening ---------------------------------------------------------------------------

    def on_worker_event(self, handle: WorkerHandle, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            handle.flush(self.selector)
        if events & selectors.EVENT_READ and self.workers[handle.index] is handle:
            self.on_messages(handle, handle.reader.read_available())
            if handle.reader.closed:
                self.closed(handle)

    def on_messages(self, handle: WorkerHandle, messages: list[Message]) -> None:
        if messages:
            handle.heard = time.monotonic()
        for message in messages:
            if isinstance(message, Done):
                self.books.settle_report(handle.index, message, self.complete)
                handle.counters.update(message.counters)
                if message.counters:
                    self.count_events(message.counters)
                if message.queue:
                    handle.queue = message.queue
                for verdict in message.verdicts:
                    self.roots.verdict(verdict.root_index, verdict.verdict)
                self.file_latency.merge(message.latency_counts, message.latency_sum)
            elif isinstance(message, Ready):
                handle.ready = True
                handle.engine = message.engine
                log.debug("worker %d ready (pid %d)", handle.index, handle.pid)
                if message.problem and message.problem not in self.problems_logged:
                    self.problems_logged.add(message.problem)
                    log.warning("workers: %s", message.problem)
            elif isinstance(message, BootFailed):
                raise HaltError(f"worker {handle.index} could not boot: {message.reason}")

    def count_events(self, counters: dict[str, int]) -> None:
        for name in WORKER_EVENTS:
            if name in counters:
                self.events[WORKER_EVENTS[name]] += counters[name]
        if counters.get("noatime_fallbacks") and "noatime" not in self.problems_logged:
            self.problems_logged.add("noatime")
            log.warning("preserve_atime: the kernel refuses O_NOATIME for some files (not "
                        "their owner, no CAP_FOWNER): those reads update atime; counted in "
                        "stats events.noatime_fallbacks")

    def take_complete(self) -> list[Waiter]:
        """The waiters whose last file was settled since the last call, to be answered."""
        complete, self.complete = self.complete, []
        return complete

    # ---- deaths --------------------------------------------------------------------------

    def closed(self, handle: WorkerHandle) -> None:
        """EOF from a worker: it is exiting. Its status when the kernel has it already;
        else it is dropped now and tracked until it can be reaped (stuck.py)."""
        try:
            pid, status = os.waitpid(handle.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = handle.pid, -1
        if pid == 0:
            self.stuck.add(handle.pid, "worker", "closed its channel, not yet exited")
            status = -1
        self.died(handle, status)

    def child_exited(self, pid: int, status: int) -> bool:
        """A reaped child: True when it was a live worker (dropped, and replaced)."""
        for handle in self.workers:
            if handle is not None and handle.pid == pid:
                self.died(handle, status)
                return True
        return False

    def died(self, handle: WorkerHandle, status: int) -> None:
        if self.workers[handle.index] is not handle:
            return
        with_code = os.waitstatus_to_exitcode(status) if status >= 0 else None
        self.drop_worker(handle)
        killed_by_signal = with_code is not None and with_code < 0
        if with_code == EXIT_BOOT_FAILED or (not handle.ready and not killed_by_signal):
            # Respawning would fail the same way, forever: stop with the reason instead.
            raise HaltError(f"worker {handle.index} could not boot (exit status {with_code})")
        if self.stopping:
            self.workers[handle.index] = None
            return
        log.warning("worker %d (pid %d) died (exit status %s); its files failed; respawning",
                    handle.index, handle.pid, with_code)
        self.respawn(handle.index)

    def drop_worker(self, handle: WorkerHandle) -> None:
        """Stop listening to a worker that is gone or going; fail whatever it still owes."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(handle.sock)
        # Any outcomes it managed to send before dying still count.
        self.on_messages(handle, handle.reader.read_available())
        handle.sock.close()
        handle.drop_fds()
        self.complete.extend(self.books.fail_worker(handle.index))

    def murder_workers(self, now: float) -> None:
        """Kill every worker that owes outcomes and has been silent for worker_timeout.

        Progress-based, not time-based: a worker reports after every batch, so one
        with a long queue on a slow tier keeps its clock fresh, and an idle one owes
        nothing. What stays silent is stuck in a native call (a hung NFS server, a
        tier that never answers) or stopped; it cannot be asked to stop, so it is
        SIGKILLed. Also sets when the next one could be due, for the loop's sleep.
        """
        timeout = self.config.worker_timeout
        due = now + timeout
        for handle in list(self.workers):
            if handle is None or self.books.outstanding(handle.index) == 0:
                continue
            deadline = handle.heard + timeout
            if deadline <= now:
                self.kill_worker(handle, now - handle.heard)
            else:
                due = min(due, deadline)
        self.wedge_check_due = due

    def kill_worker(self, handle: WorkerHandle, silent: float) -> None:
        """SIGKILL a wedged worker, fail its files and put a new worker on its shard now.

        Its exit is not waited for: a process in uninterruptible I/O (D state) dies
        only when that I/O returns, which may be never. It is tracked as stuck until
        the supervisor reaps it, whenever it does.
        """
        log.warning(
            "worker %d (pid %d) wedged: %d files outstanding, nothing heard for %.1f s "
            "(worker_timeout); killed, its files failed%s",
            handle.index, handle.pid, self.books.outstanding(handle.index), silent,
            "" if self.stopping else "; respawning",
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(handle.pid, signal.SIGKILL)
        self.killed_wedged += 1
        self.stuck.add(handle.pid, "worker", f"wedged: silent {silent:.0f} s")
        self.drop_worker(handle)
        if self.stopping:
            self.workers[handle.index] = None
            return
        self.respawn(handle.index)

    # ---- the loop's side -----------------------------------------------------------------

    def next_due(self, now: float) -> float | None:
        dues = list(self.respawn_due.values())
        if self.roots_owed:
            dues.append(self.roots_due)
        if self.config.worker_timeout:
            dues.append(self.wedge_check_due)
        return max(0.0, min(dues) - now) if dues else None

    def tick(self, now: float) -> None:
        """After the events: a supervisor that was itself held up reads its workers'
        reports before it judges their silence."""
        if self.config.worker_timeout and now >= self.wedge_check_due:
            self.murder_workers(now)
        for index, due in list(self.respawn_due.items()):
            if due <= now and not self.stopping:
                self.respawn(index)
        if self.roots_owed and now >= self.roots_due:
            owed, self.roots_owed = self.roots_owed, set()
            for index in sorted(owed):
                self.add_root(self.roots.states[index])

    def apply(self, config: Config) -> None:
        self.config = config
        self.wedge_check_due = time.monotonic()  # worker_timeout may have changed: look again

    @property
    def engine_name(self) -> str:
        """The engine the workers run (the first choice until one reports otherwise)."""
        engines = {w.engine for w in self.workers if w is not None and w.ready}
        if len(engines) == 1:
            return engines.pop()
        if engines:
            return "+".join(sorted(engines))
        return self.engines[self.config.warm_mode][0].name

    def halt(self, deadline: float) -> None:
        """Stop the workers by `deadline` (monotonic) however they behave (halting.py)."""
        self.stopping = True
        live = [w for w in self.workers if w is not None]
        halt_workers([handle.pid for handle in live], deadline, self.stuck)
        for handle in live:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(handle.sock)
            handle.sock.close()
            handle.drop_fds()
        self.workers = [None] * len(self.workers)
