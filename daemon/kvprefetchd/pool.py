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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvprefetchd.books import Books, Waiter
from kvprefetchd.channel import BootFailed, ChannelReader, Done, Message, Ready, Warm, encode
from kvprefetchd.config import Config
from kvprefetchd.engines import EngineSpec, NoEngine, engine_candidates
from kvprefetchd.engines.base import EngineSettings
from kvprefetchd.histogram import FILE_BUCKETS, Histogram
from kvprefetchd.residency import RootRule
from kvprefetchd.worker import EXIT_BOOT_FAILED, WorkerPlan, worker_main

log = logging.getLogger("kvprefetchd")

BOOT_TIMEOUT = 20.0
# A worker that cannot be respawned (the supervisor is out of fds or processes)
# leaves its shard empty (its files are dropped) and is tried again this often.
RESPAWN_RETRY = 1.0
# Both ends of a worker's socketpair: room for a batch of outcomes without a stall.
CHANNEL_BUFFER_BYTES = 4 << 20


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
        self, config: Config, rules: list[RootRule], books: Books,
        selector: selectors.BaseSelector,
    ) -> None:
        self.config = config
        self.rules = rules
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
        # No worker can be found wedged before this time (murder_workers keeps it a
        # lower bound of every busy worker's deadline), so the loop sleeps until then.
        self.wedge_check_due = time.monotonic() + config.worker_timeout
        self.respawn_due: dict[int, float] = {}  # worker index -> when to try again

    # ---- spawning ----------------------------------------------------------------------------

    def plan(self, index: int) -> WorkerPlan:
        config = self.config
        return WorkerPlan(
            index=index,
            roots=config.roots,
            rules=tuple(rule.code for rule in self.rules),
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
            ),
            dedup_ttl=config.dedup_ttl_ms / 1000.0,
            dedup_entries=config.dedup_entries,
            dedup_bytes=config.dedup_bytes,
            nice=config.worker_nice,
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
        self, shares: list[list[list[object]]], waiter: Waiter | None, read_bytes: int,
        warm_mode: str,
    ) -> None:
        """Book each worker's share of a request and send it."""
        now = time.monotonic()
        for index, entries in enumerate(shares):
            handle = self.workers[index]
            if not entries or handle is None:
                continue
            if self.books.outstanding(index) == 0:
                handle.heard = now  # its silence counts from now, not from its last report
            self.books.issue(index, waiter, entries)
            self.send(handle, Warm(read_bytes, warm_mode, entries))

    def send(self, handle: WorkerHandle, message: Message) -> None:
        handle.output += encode(message)
        self.flush(handle)

    def flush(self, handle: WorkerHandle) -> None:
        while handle.output:
            try:
                sent = handle.sock.send(handle.output)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as error:
                if error.errno in (errno.EPIPE, errno.ECONNRESET):
                    handle.output.clear()  # it is dying; SIGCHLD settles its books
                    break
                raise
            del handle.output[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if handle.output else 0)
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
                for ticket, outcome, nbytes in message.settled:
                    waiter = settle(handle.index, ticket, outcome, nbytes)
                    if waiter is not None:
                        settled.append(waiter)
                handle.counters.update(message.counters)
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

    def take_settled(self) -> list[Waiter]:
        settled, self.settled = self.settled, []
        return settled

    # ---- deaths --------------------------------------------------------------------------

    def closed(self, handle: WorkerHandle) -> None:
        """EOF from a worker: it is dying; wait for it so its exit status is known."""
        try:
            _, status = os.waitpid(handle.pid, 0)
        except ChildProcessError:
            status = -1
        self.died(handle, status)

    def reap(self) -> None:
        """SIGCHLD: collect every child that exited, a worker or one killed as wedged."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for handle in self.workers:
                if handle is not None and handle.pid == pid:
                    self.died(handle, status)
                    break
            else:
                log.debug("reaped pid %d (a worker already replaced: killed as wedged)", pid)

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
        only when that I/O returns, which may be never. reap() collects it whenever
        it does.
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
        self.settle(handle)
        if self.stopping:
            self.workers[handle.index] = None
            return
        self.respawn(handle.index)

    # ---- the loop's side -----------------------------------------------------------------

    def next_due(self, now: float) -> float | None:
        dues = list(self.respawn_due.values())
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

    def halt(self) -> None:
        """Stop the workers; bounded in time however they behave."""
        self.stopping = True
        live = [w for w in self.workers if w is not None]
        for handle in live:
            try:
                os.kill(handle.pid, signal.SIGTERM)
                os.kill(handle.pid, signal.SIGCONT)  # a stopped worker acts on SIGTERM only then
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 1.0
        stubborn = [handle for handle in live if not _reaped_by(handle.pid, deadline)]
        for handle in stubborn:
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, signal.SIGKILL)
        # A worker in uninterruptible I/O (D state) dies only when that I/O returns:
        # give it a moment, then leave it to init rather than hang the shutdown.
        deadline = time.monotonic() + 1.0
        for handle in stubborn:
            if not _reaped_by(handle.pid, deadline):
                log.warning("worker %d (pid %d) did not exit; left behind",
                            handle.index, handle.pid)
        for handle in live:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(handle.sock)
            handle.sock.close()
        self.workers = [None] * len(self.workers)
