"""The workers: spawn, hand work to, listen to, reap, respawn and kill the wedged.

Each worker is a forked child with a socketpair to the supervisor (channel.py). The
pool books every file it hands out (books.py) so a dead worker's files are failed,
never forgotten, and it collects the waiters whose last file was settled in
`settled`; the supervisor's loop takes them and has the ops answer them, so the pool
never answers a client itself.
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
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvprefetchd.channel import (
    BootFailed,
    ChannelReader,
    Done,
    Message,
    Ready,
    Root,
    Warm,
    encode,
    send_with_fd,
)
from kvprefetchd.config import Config
from kvprefetchd.engines import EngineSpec, NoEngine, engine_candidates
from kvprefetchd.engines.base import EngineSettings
from kvprefetchd.metrics.histogram import FILE_BUCKETS, Histogram
from kvprefetchd.roots.rootset import RootSet, RootState
from kvprefetchd.supervisor.admit import Share
from kvprefetchd.supervisor.books import Books, Waiter
from kvprefetchd.supervisor.stuck import Stuck
from kvprefetchd.worker.holds import HoldBudget
from kvprefetchd.worker.loop import WorkerPlan
from kvprefetchd.worker.process import EXIT_BOOT_FAILED, worker_main

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


@dataclass
class WorkerHandle:
    index: int
    pid: int
    sock: socket.socket
    reader: ChannelReader
    output: bytearray = field(default_factory=bytearray)
    ready: bool = False
    engine: str = ""
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    # The heartbeat: when the worker last sent anything (every batch ends in a Done),
    # or was handed work while it owed nothing. A worker that owes outcomes and has
    # been silent for worker_timeout since then is wedged (murder_workers).
    heard: float = field(default_factory=time.monotonic)
    handler: Callable[[int], None] | None = None  # its selector callback
    # Root messages, each with an fd beside it (our own copy, closed once sent; -1 for
    # none), behind `output`.
    with_fds: deque[tuple[bytes, int]] = field(default_factory=deque)
    queue: dict[str, Any] = field(default_factory=dict)  # its queue engines, as last said
    watched: int = selectors.EVENT_READ  # the selector events registered for it now


def engines_by_mode(config: Config) -> dict[str, tuple[EngineSpec, ...]]:
    """The engines to try for each warm mode the workers may be asked for: the configured
    one (NoEngine if none can run), and the other one when a model profile chooses it."""
    choices = {config.warm_mode: engine_candidates(config.engine, config.warm_mode)}
    other = "advise" if config.warm_mode == "read" else "read"
    if other in config.model_warm_modes.values():
        try:
            choices[other] = engine_candidates(config.engine, other)
        except NoEngine as error:
            log.warning("%s mode for model profiles unavailable: %s", other, error)
    return choices


def drop_fds(handle: WorkerHandle) -> None:
    """Close the fd copies still waiting to go to a worker that is gone or going."""
    while handle.with_fds:
        fd = handle.with_fds.popleft()[1]
        if fd >= 0:
            os.close(fd)


def _reaped_by(pid: int, deadline: float) -> bool:
    """Wait for a child to exit until deadline (monotonic); True once it is gone."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


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
        self.settled: list[Waiter] = []  # answered by the supervisor's loop (take_settled)
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

    def plan(self, index: int) -> WorkerPlan:
        config = self.config
        return WorkerPlan(
            index=index,
            roots=config.roots,
            root_fds=self.roots.fds(),
            rules=self.roots.codes(),
            tiers=self.roots.tiers(),
            holds=HoldBudget(
                max_files=-(-config.hold_max_files // config.worker_count),
                max_bytes=config.hold_max_bytes // config.worker_count,
                seconds=config.hold_seconds,
            ),
            engines=self.engines,
            engine_settings=EngineSettings(
                chunk_bytes=config.chunk_bytes,
                queue_depth=config.queue_depth,
                pread_threads=config.pread_threads,
                fadv_random=config.fadv_random,
                batch_files=config.batch_files,
                max_open_files=config.max_open_files,
                initial_depth=config.initial_depth,
                max_in_flight=config.max_in_flight,
                file_timeout=config.file_timeout,
                other_mount_threads=config.other_mount_threads,
            ),
            dedup_ttl=config.dedup_ttl_ms / 1000.0,
            dedup_entries=config.dedup_entries,
            dedup_bytes=config.dedup_bytes,
            nice=config.worker_nice,
            batch=config.worker_batch,
        )

    def spawn(self, index: int) -> None:
        plan = self.plan(index)
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
        """Book each worker's share of a request and send it; `client` is who sent it
        (Connection.client)."""
        self.roots.wanted(shares)  # a root named there that is not open: looked at now
        now = time.monotonic()
        for index, share in enumerate(shares):
            handle = self.workers[index]
            if share is None or handle is None:
                continue
            if self.books.outstanding(index) == 0:
                handle.heard = now  # its silence counts from now, not from its last report
            share_id = self.books.issue(index, waiter, share)
            self.send(handle, Warm(read_bytes, warm_mode, share_id, share.roots, share.paths,
                                   deadline, flags, client))

    def send(self, handle: WorkerHandle, message: Message) -> None:
        handle.output += encode(message)
        self.flush(handle)

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
            handle.with_fds.append((encode(Root(state.index, state.code, state.tier.keep,
                                                   state.tier.whole, state.tier.fs_cache,
                                                   state.tier.hold, state.tier.depth, copy)), copy))
            self.flush(handle)

    def flush(self, handle: WorkerHandle) -> None:
        while handle.output or handle.with_fds:
            try:
                if handle.output:
                    sent = handle.sock.send(handle.output)
                    del handle.output[:sent]
                    continue
                # A message with an fd starts only once what came before it is out, so
                # the fd goes with that message's first byte (channel.send_with_fd).
                data, fd = handle.with_fds[0]
                sent = send_with_fd(handle.sock, data, fd) if fd >= 0 else handle.sock.send(data)
                handle.with_fds.popleft()
                if fd >= 0:
                    os.close(fd)
                handle.output += data[sent:]
            except (BlockingIOError, InterruptedError):
                break
            except OSError as error:
                if error.errno in (errno.EPIPE, errno.ECONNRESET):
                    handle.output.clear()  # it is dying; SIGCHLD settles its books
                    drop_fds(handle)
                    break
                raise
        waiting = handle.output or handle.with_fds
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if waiting else 0)
        if events != handle.watched:
            handle.watched = events
            self.selector.modify(handle.sock, events, handle.handler)

    # ---- listening ---------------------------------------------------------------------------

    def on_worker_event(self, handle: WorkerHandle, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self.flush(handle)
        if events & selectors.EVENT_READ and self.workers[handle.index] is handle:
            self.on_messages(handle, handle.reader.read_available())
            if handle.reader.closed:
                self.closed(handle)

    def on_messages(self, handle: WorkerHandle, messages: list[Message]) -> None:
        if messages:
            handle.heard = time.monotonic()
        for message in messages:
            if isinstance(message, Done):
                settle, settled = self.books.settle, self.settled
                for record in message.settled:
                    waiter = settle(handle.index, record)
                    if waiter is not None:
                        settled.append(waiter)
                for share_id, outcome, count, nbytes, indexes in message.bulk:
                    waiter = self.books.settle_bulk(handle.index, share_id, outcome, count,
                                                    nbytes, indexes)
                    if waiter is not None:
                        settled.append(waiter)
                handle.counters.update(message.counters)
                if message.counters:
                    self.count_events(message.counters)
                if message.queue:
                    handle.queue = message.queue
                for index, verdict in message.verdicts:
                    self.roots.verdict(index, verdict)
                self.books.settle_anonymous(handle.index, message.anonymous,
                                            message.anonymous_bytes)
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

    def take_settled(self) -> list[Waiter]:
        settled, self.settled = self.settled, []
        return settled

    # ---- deaths --------------------------------------------------------------------------

    def closed(self, handle: WorkerHandle) -> None:
        """EOF from a worker: it is exiting. Its status when the kernel has it already;
        else it is settled now and tracked until it can be reaped (stuck.py)."""
        try:
            pid, status = os.waitpid(handle.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = handle.pid, -1
        if pid == 0:
            self.stuck.add(handle.pid, "worker", "closed its channel, not yet exited")
            status = -1
        self.died(handle, status)

    def child_exited(self, pid: int, status: int) -> bool:
        """A reaped child: True when it was a live worker (settled, and replaced)."""
        for handle in self.workers:
            if handle is not None and handle.pid == pid:
                self.died(handle, status)
                return True
        return False

    def died(self, handle: WorkerHandle, status: int) -> None:
        if self.workers[handle.index] is not handle:
            return
        with_code = os.waitstatus_to_exitcode(status) if status >= 0 else None
        self.settle(handle)
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

    def settle(self, handle: WorkerHandle) -> None:
        """Stop listening to a worker that is gone or going; fail whatever it still owes."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(handle.sock)
        # Any outcomes it managed to send before dying still count.
        self.on_messages(handle, handle.reader.read_available())
        handle.sock.close()
        drop_fds(handle)
        self.settled.extend(self.books.fail_worker(handle.index))

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
        self.settle(handle)
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
        """Stop the workers by `deadline` (monotonic) however they behave: SIGTERM, half the
        time left, then SIGKILL; one still there after that is stuck in the kernel (D
        state dies only when its I/O returns) and is left behind, named (stuck.py)."""
        self.stopping = True
        live = [w for w in self.workers if w is not None]
        for handle in live:
            try:
                os.kill(handle.pid, signal.SIGTERM)
                os.kill(handle.pid, signal.SIGCONT)  # a stopped worker acts on SIGTERM only then
            except ProcessLookupError:
                pass
        halfway = time.monotonic() + max(0.0, deadline - time.monotonic()) / 2
        stubborn = [handle for handle in live if not _reaped_by(handle.pid, halfway)]
        for handle in stubborn:
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, signal.SIGKILL)
        for handle in stubborn:
            if not _reaped_by(handle.pid, deadline):
                self.stuck.add(handle.pid, "worker", "did not exit when the daemon stopped")
        for handle in live:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(handle.sock)
            handle.sock.close()
            drop_fds(handle)
        self.workers = [None] * len(self.workers)
