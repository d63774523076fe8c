"""The supervisor: one thread, one event loop, the books, and the workers.

A request travels one line: socket -> frame -> request -> confine -> shard ->
worker queue, and outcomes travel back: worker -> books -> reply / stats.
Nothing here blocks on a file system: workers do every open and read, so a slow
or hung disk can never stall a caller's acknowledgement.

Signal handlers only record the signal; the loop does the work (gunicorn's
arbiter does the same), which keeps forking safe: no threads ever exist here.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
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
from typing import Any

import psutil

import kvprefetchd
from kvprefetchd import kv, metrics, systemd
from kvprefetchd.books import Books, PendingRequest
from kvprefetchd.channel import BOOT_FAILED, DONE, READY, WARM, ChannelReader, pack
from kvprefetchd.config import Config, ConfigError, merge_reload
from kvprefetchd.confine import Roots
from kvprefetchd.engines import EngineSpec, NoEngine, engine_candidates
from kvprefetchd.engines.base import EngineSettings
from kvprefetchd.kvservice import KVService
from kvprefetchd.peers import PeerPolicy, peer_of
from kvprefetchd.protocol import (
    FORBIDDEN,
    INTERNAL,
    OPS,
    OVERLOADED,
    PROTOCOL_VERSION,
    TOO_LARGE,
    Limits,
    Request,
    RequestError,
    WarmOptions,
    decode_payload,
    encode_frame,
    error_reply,
    ok_reply,
    parse_paths,
    parse_request,
    parse_warm_options,
)
from kvprefetchd.residency import RootRule, choose_rule
from kvprefetchd.server import ACCEPT_REST, Connection, accept_ready, listen_unix, out_of_fds
from kvprefetchd.shard import shard_of
from kvprefetchd.worker import EXIT_BOOT_FAILED, WorkerPlan, worker_main

log = logging.getLogger("kvprefetchd")

BOOT_TIMEOUT = 20.0
# A worker that cannot be respawned (the supervisor is out of fds or processes)
# leaves its shard empty (its files are dropped) and is tried again this often.
RESPAWN_RETRY = 1.0


def process_figures(pid: int) -> dict[str, Any]:
    """RSS, CPU seconds and open fds of a process, for stats and metrics (psutil)."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            cpu = process.cpu_times()
            return {
                "rss_bytes": process.memory_info().rss,
                "cpu_seconds": round(cpu.user + cpu.system, 3),
                "open_fds": process.num_fds(),
            }
    except psutil.Error:
        return {}


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


def request_limits(config: Config) -> Limits:
    """What a peer may make the supervisor decode, from the (possibly reloaded) config."""
    return Limits(
        config.max_frame_bytes,
        config.max_paths_per_request,
        config.max_path_bytes,
        config.max_tokens,
        config.max_nesting_depth,
    )


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
    # The heartbeat: when the worker last sent anything (every batch ends in a `done`),
    # or was handed work while it owed nothing. A worker that owes outcomes and has
    # been silent for worker_timeout since then is wedged (murder_workers).
    heard: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(
        self,
        config: Config,
        listener: socket.socket | None = None,
        reload_from: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        self.reload_from = reload_from
        self.roots = Roots(config.roots, config.max_path_bytes)
        self.limits = request_limits(config)
        self.rules: list[RootRule] = [
            choose_rule(root, config.residency_for(root)) for root in config.roots
        ]
        self.engine_classes = engine_candidates(config.engine, config.warm_mode)
        self.other_mode = "advise" if config.warm_mode == "read" else "read"
        self.other_mode_classes: tuple[EngineSpec, ...] = ()
        if self.other_mode in config.model_warm_modes.values():
            try:
                self.other_mode_classes = engine_candidates(config.engine, self.other_mode)
            except NoEngine as error:
                log.warning("%s mode for model profiles unavailable: %s", self.other_mode, error)
        self.plan_settings = EngineSettings(
            chunk_bytes=config.chunk_bytes,
            queue_depth=config.queue_depth,
            pread_threads=config.pread_threads,
            fadv_random=config.fadv_random,
            batch_files=config.batch_files,
            max_open_files=config.max_open_files,
        )
        self.books = Books(config.worker_count)
        self.peer_policy: PeerPolicy | None = None  # made once the socket exists
        self.kv = KVService(
            config.models,
            kv.Limits(max_prompts=config.max_prompts, max_tokens=config.max_tokens),
            allow_inline=config.allow_inline_layouts,
            stale_streak=config.stale_streak,
            roots=config.roots,
        )
        self.workers: list[WorkerHandle | None] = [None] * config.worker_count
        self.selector = selectors.DefaultSelector()
        self.listener = listener
        self.connections: dict[int, Connection] = {}
        self.timers: list[tuple[float, int, PendingRequest]] = []
        self._timer_seq = itertools.count()
        self.signals: list[int] = []
        self.stopping = False
        self.started = time.monotonic()
        self.requests: Counter[str] = Counter()  # "op:ok", "op:error_CODE", events
        self.ack_latency = metrics.Histograms(metrics.ACK_BUCKETS)
        self.wait_latency = metrics.Histogram(metrics.WAIT_BUCKETS)
        self.file_latency = metrics.Histogram(metrics.FILE_BUCKETS)
        self.worker_restarts = 0
        self.workers_killed_wedged = 0
        # No worker can be found wedged before this time (murder_workers keeps it a
        # lower bound of every busy worker's deadline), so the loop sleeps until then.
        self.wedge_check_due = time.monotonic() + config.worker_timeout
        self.respawn_due: dict[int, float] = {}  # worker index -> when to try again
        self.listener_rests_until: float | None = None  # out of fds: not accepting
        self.out_of_fds_since: float | None = None
        self._wakeup_r, self._wakeup_w = socket.socketpair()
        self.metrics: metrics.MetricsServer | None = None
        self.watchdog = systemd.Watchdog.from_environment()
        self.socket_passed = False

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the process exit status."""
        for rule in self.rules:
            if not os.path.isdir(rule.root):
                log.warning("root %s does not exist (yet): its files are missing until it does",
                            rule.root)
            log.info(
                "root %s: %s file system, %s rule (%s)", rule.root, rule.fstype, rule.rule, rule.why
            )
        log.info(
            "engine %s, warm mode %s",
            " or ".join(e.name for e in self.engine_classes),
            self.config.warm_mode,
        )
        self.install_signals()
        if self.listener is None:
            passed = systemd.listen_fds()
            if passed:
                self.listener = passed[0]
                self.listener.setblocking(False)
                self.socket_passed = True
            else:
                self.listener = listen_unix(self.config.socket, self.config.socket_mode)
        try:
            for index in range(self.config.worker_count):
                self.spawn_worker(index)
            self.wait_for_workers()
            self.selector.register(self.listener, selectors.EVENT_READ, "listener")
            if self.config.metrics:
                self.metrics = metrics.MetricsServer.open(
                    self.config.metrics, lambda: metrics.render(self.stats())
                )
                self.metrics.attach(self.selector)
            systemd.ready(f"serving on {self.config.socket} with {len(self.workers)} workers")
            log.info(
                "serving on %s with %d workers (pid %d)",
                self.config.socket,
                len(self.workers),
                os.getpid(),
            )
            while not self.stopping:
                self.run_once(self.next_timeout())
            self.drain()
            return 0
        finally:
            self.halt()

    def install_signals(self) -> None:
        self._wakeup_r.setblocking(False)
        self._wakeup_w.setblocking(False)
        signal.set_wakeup_fd(self._wakeup_w.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(signum, self._record_signal)
        self.selector.register(self._wakeup_r, selectors.EVENT_READ, "signals")

    def _record_signal(self, signum: int, _frame: Any) -> None:
        self.signals.append(signum)

    def handle_signals(self) -> None:
        try:
            while self._wakeup_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        signals, self.signals = self.signals, []
        for signum in signals:
            if signum in (signal.SIGTERM, signal.SIGINT):
                if not self.stopping:
                    log.info("%s: draining and stopping", signal.Signals(signum).name)
                self.stopping = True
            elif signum == signal.SIGCHLD:
                self.reap_workers()
            elif signum == signal.SIGHUP:
                self.reload()

    def reload(self) -> None:
        """Re-read the configuration; an invalid file changes nothing and is logged.

        Queued work, connections and the socket are untouched; keys baked into the
        socket or the workers keep their old values until a restart (logged).
        """
        if self.reload_from is None:
            log.warning("SIGHUP: no configuration source to reload from")
            return
        systemd.reloading()
        try:
            new = self.reload_from()
        except ConfigError as error:
            log.error("reload refused, the old configuration stays in force: %s", error)
            self.requests["reload_refused"] += 1
            systemd.ready("reload refused; the old configuration stays in force")
            return
        merged, held = merge_reload(self.config, new)
        if held:
            log.warning(
                "reload: keys that need a restart keep their old values: %s", ", ".join(held)
            )
        self.apply_config(merged)
        self.requests["reloads"] += 1
        systemd.ready("configuration reloaded")
        log.info("configuration reloaded")

    def apply_config(self, config: Config) -> None:
        self.config = config
        self.peer_policy = None  # rebuilt with the new allowed ids on the next connection
        self.limits = request_limits(config)
        self.kv.reconfigure(
            config.models,
            kv.Limits(max_prompts=config.max_prompts, max_tokens=config.max_tokens),
            allow_inline=config.allow_inline_layouts,
        )
        logging.getLogger().setLevel(config.log_level.upper())
        self.wedge_check_due = time.monotonic()  # worker_timeout may have changed: look again
        for connection in self.connections.values():
            connection.frames.max_frame_bytes = config.max_frame_bytes
            connection.max_output_bytes = config.max_output_bytes

    # ---- workers ---------------------------------------------------------------------------

    def spawn_worker(self, index: int) -> None:
        plan = WorkerPlan(
            index=index,
            roots=self.config.roots,
            rules=tuple(rule.code for rule in self.rules),
            engine_classes=self.engine_classes,
            other_mode_classes=self.other_mode_classes,
            engine_settings=self.plan_settings,
            dedup_ttl=self.config.dedup_ttl_ms / 1000.0,
            dedup_entries=self.config.dedup_entries,
            nice=self.config.worker_nice,
        )
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for end in (parent_sock, child_sock):
                end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
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
        self.selector.register(parent_sock, selectors.EVENT_READ, handle)
        log.debug("worker %d spawned as pid %d", index, pid)

    def wait_for_workers(self) -> None:
        """Serve nobody until every worker has booted; one that cannot boot halts the daemon."""
        deadline = time.monotonic() + BOOT_TIMEOUT
        while not all(w is not None and w.ready for w in self.workers):
            if self.stopping:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HaltError(f"workers did not boot within {BOOT_TIMEOUT:.0f} s")
            self.run_once(min(remaining, 0.5))

    def reap_workers(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for handle in self.workers:
                if handle is not None and handle.pid == pid:
                    self.worker_died(handle, status)
                    break
            else:
                log.debug("reaped pid %d (a worker already replaced: killed as wedged)", pid)

    def worker_died(self, handle: WorkerHandle, status: int) -> None:
        if self.workers[handle.index] is not handle:
            return
        with_code = os.waitstatus_to_exitcode(status) if status >= 0 else None
        self.settle_worker(handle)
        killed_by_signal = with_code is not None and with_code < 0
        if with_code == EXIT_BOOT_FAILED or (not handle.ready and not killed_by_signal):
            # Respawning would fail the same way, forever: stop with the reason instead.
            raise HaltError(f"worker {handle.index} could not boot (exit status {with_code})")
        if self.stopping:
            self.workers[handle.index] = None
            return
        log.warning(
            "worker %d (pid %d) died (exit status %s); its files failed; respawning",
            handle.index,
            handle.pid,
            with_code,
        )
        self.respawn_worker(handle.index)

    def settle_worker(self, handle: WorkerHandle) -> None:
        """Stop listening to a worker that is gone or going; fail whatever it still owes."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(handle.sock)
        # Any outcomes it managed to send before dying still count.
        self.on_worker_messages(handle, handle.reader.read_available())
        handle.sock.close()
        for request in self.books.fail_worker(handle.index):
            self.answer(request)

    def respawn_worker(self, index: int) -> None:
        """Put a new worker on a shard; when that fails for want of fds or processes,
        leave the shard empty (its files are dropped, counted) and try again later,
        rather than let one dead worker take the whole daemon down."""
        self.respawn_due.pop(index, None)
        try:
            self.spawn_worker(index)
        except OSError as error:
            if error.errno not in (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM):
                raise
            self.workers[index] = None
            self.respawn_due[index] = time.monotonic() + RESPAWN_RETRY
            log.error("worker %d: cannot respawn (%s); its files are dropped until it can, "
                      "trying again every %.0f s", index, error.strerror, RESPAWN_RETRY)
            return
        self.worker_restarts += 1

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
        only when that I/O returns, which may be never. reap_workers collects it
        whenever it does.
        """
        log.warning(
            "worker %d (pid %d) wedged: %d files outstanding, nothing heard for %.1f s "
            "(worker_timeout); killed, its files failed%s",
            handle.index,
            handle.pid,
            self.books.outstanding(handle.index),
            silent,
            "" if self.stopping else "; respawning",
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(handle.pid, signal.SIGKILL)
        self.workers_killed_wedged += 1
        self.settle_worker(handle)
        if self.stopping:
            self.workers[handle.index] = None
            return
        self.respawn_worker(handle.index)

    def on_worker_messages(self, handle: WorkerHandle, messages: list[list[Any]]) -> None:
        if messages:
            handle.heard = time.monotonic()
        for message in messages:
            kind = message[0]
            if kind == DONE:
                settle = self.books.settle
                for ticket, outcome, nbytes in message[1]:
                    request = settle(handle.index, ticket, outcome, nbytes)
                    if request is not None:
                        self.answer(request)
                handle.counters.update(message[2])
                self.books.settle_anonymous(handle.index, message[3], message[4])
                self.file_latency.merge(*message[5])
            elif kind == READY:
                handle.ready = True
                handle.engine = message[1].get("engine", "")
                log.debug("worker %d ready (pid %d)", handle.index, handle.pid)
            elif kind == BOOT_FAILED:
                raise HaltError(f"worker {handle.index} could not boot: {message[1]}")

    def send_to_worker(self, handle: WorkerHandle, message: list[Any]) -> None:
        handle.output += pack(message)
        self.flush_worker(handle)

    def flush_worker(self, handle: WorkerHandle) -> None:
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
        self.selector.modify(handle.sock, events, handle)

    # ---- the loop --------------------------------------------------------------------------

    def next_timeout(self) -> float | None:
        now = time.monotonic()
        timeout = max(0.0, self.timers[0][0] - now) if self.timers else None
        for due in (
            self.metrics.next_timeout(now) if self.metrics is not None else None,
            self.watchdog.timeout(now),
            max(0.0, self.wedge_check_due - now) if self.config.worker_timeout else None,
            max(0.0, min(self.respawn_due.values()) - now) if self.respawn_due else None,
            max(0.0, self.listener_rests_until - now) if self.listener_rests_until else None,
        ):
            if due is not None:
                timeout = due if timeout is None else min(timeout, due)
        return timeout

    def run_once(self, timeout: float | None) -> None:
        for key, events in self.selector.select(timeout):
            data = key.data
            if data == "signals":
                self.handle_signals()
            elif data == "listener":
                self.accept_connections()
            elif isinstance(data, WorkerHandle):
                if events & selectors.EVENT_WRITE:
                    self.flush_worker(data)
                if events & selectors.EVENT_READ and self.workers[data.index] is data:
                    self.on_worker_messages(data, data.reader.read_available())
                    if data.reader.closed:
                        self.worker_closed(data)
            elif self.metrics is not None and self.metrics.handles(data):
                self.metrics.on_event(key, events)
            elif isinstance(data, Connection):
                if events & selectors.EVENT_WRITE:
                    data.flush()
                if events & selectors.EVENT_READ:
                    self.read_connection(data)
                self.update_connection(data)
        self.fire_timers()
        now = time.monotonic()
        # After the events: a supervisor that was itself held up reads its workers'
        # reports before it judges their silence.
        if self.config.worker_timeout and now >= self.wedge_check_due:
            self.murder_workers(now)
        for index, due in list(self.respawn_due.items()):
            if due <= now and not self.stopping:
                self.respawn_worker(index)
        if self.listener_rests_until is not None and now >= self.listener_rests_until:
            self.listener_rests_until = None
            if self.listener is not None:
                self.selector.register(self.listener, selectors.EVENT_READ, "listener")
        if self.metrics is not None:
            self.metrics.expire(now)
        self.watchdog.tick(now)

    def worker_closed(self, handle: WorkerHandle) -> None:
        """EOF from a worker: it is dying; wait for it so its exit status is known."""
        try:
            _, status = os.waitpid(handle.pid, 0)
        except ChildProcessError:
            status = -1
        self.worker_died(handle, status)

    def fire_timers(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, _, request = heapq.heappop(self.timers)
            if not request.answered:
                self.books.expire(request)
                self.answer(request)

    # ---- connections -----------------------------------------------------------------------

    def accept_connections(self) -> None:
        assert self.listener is not None
        try:
            for sock in accept_ready(self.listener, "requests"):
                if len(self.connections) >= self.config.max_connections:
                    sock.close()
                    self.requests["connections_refused"] += 1
                    continue
                if not self.peer_allowed(sock):
                    continue
                connection = Connection(
                    sock, self.config.max_frame_bytes, self.config.max_output_bytes
                )
                self.connections[sock.fileno()] = connection
                self.selector.register(sock, selectors.EVENT_READ, connection)
        except OSError as error:
            if not out_of_fds(error):
                raise
            self.rest_listener(error)
            return
        if self.out_of_fds_since is not None:
            log.warning("accepting connections again after %.1f s out of file descriptors",
                        time.monotonic() - self.out_of_fds_since)
            self.out_of_fds_since = None

    def rest_listener(self, error: OSError) -> None:
        """Out of fds: stop watching the listener for ACCEPT_REST s instead of spinning on it.

        Connections wait in the listen backlog until a connection closes or the
        limit is raised. Logged once per episode; counted as accept_paused.
        """
        assert self.listener is not None
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        self.listener_rests_until = time.monotonic() + ACCEPT_REST
        self.requests["accept_paused"] += 1
        if self.out_of_fds_since is None:
            self.out_of_fds_since = time.monotonic()
            log.warning("cannot accept connections: %s; they wait in the backlog (pausing "
                        "accept %.1f s at a time)", error.strerror, ACCEPT_REST)

    def peer_allowed(self, sock: socket.socket) -> bool:
        """Refuse a peer the policy does not name: one `forbidden` reply, then closed."""
        try:
            peer = peer_of(sock)
        except OSError as error:
            log.warning("cannot read a peer's credentials (%s); refused", error)
            sock.close()
            return False
        if self.peer_policy is None:
            self.peer_policy = PeerPolicy.default(
                self.config.socket, self.config.allowed_uids, self.config.allowed_gids
            )
        if self.peer_policy.allows(peer):
            return True
        log.warning("refused a peer: pid %d uid %d is not allowed", peer.pid, peer.uid)
        self.requests["peers_forbidden"] += 1
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            refusal = error_reply(None, FORBIDDEN, "this user may not use kvprefetchd")
            sock.send(encode_frame(refusal))
        sock.close()
        return False

    def read_connection(self, connection: Connection) -> None:
        try:
            data = connection.sock.recv(256 * 1024)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            connection.broken = True
            return
        for frame in connection.frames.feed(data):
            if frame.payload is None:
                connection.send(
                    error_reply(
                        None,
                        TOO_LARGE,
                        f"frame of {frame.skipped_bytes} bytes exceeds the limit of "
                        f"{self.config.max_frame_bytes}",
                    )
                )
                self.requests[f"none:error_{TOO_LARGE}"] += 1
                continue
            self.handle_frame(connection, frame.payload)

    def update_connection(self, connection: Connection) -> None:
        if connection.broken or connection.closed:
            self.drop_connection(connection)
            return
        connection.paused = connection.backlogged
        events = 0 if connection.paused else selectors.EVENT_READ
        if connection.output:
            events |= selectors.EVENT_WRITE
        if events == 0:
            events = selectors.EVENT_WRITE
        self.selector.modify(connection.sock, events, connection)

    def drop_connection(self, connection: Connection) -> None:
        fd = connection.fileno()
        if fd >= 0:
            self.connections.pop(fd, None)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(connection.sock)
        connection.close()

    # ---- requests --------------------------------------------------------------------------

    def handle_frame(self, connection: Connection, payload: bytes) -> None:
        started = time.perf_counter()
        request_id: int | None = None
        op = "none"  # a label for requests whose op could not be read
        try:
            message = decode_payload(payload, self.limits)
            raw_id = message.get("id")
            if isinstance(raw_id, int) and not isinstance(raw_id, bool) and raw_id >= 0:
                request_id = raw_id
            raw_op = message.get("op")
            op = raw_op if raw_op in OPS else "unknown"
            request = parse_request(message)
            if self.stopping:
                raise RequestError(OVERLOADED, "the daemon is shutting down", request_id)
            self.dispatch(connection, request)
            self.requests[f"{op}:ok"] += 1
        except RequestError as error:
            self.requests[f"{op}:error_{error.code}"] += 1
            rid = error.request_id if error.request_id is not None else request_id
            connection.send(error_reply(rid, error.code, error.message))
        except Exception as error:  # a bug must cost one reply, never the daemon
            log.exception("internal error handling a request")
            self.requests[f"{op}:error_{INTERNAL}"] += 1
            connection.send(error_reply(request_id, INTERNAL, f"{type(error).__name__}: {error}"))
        self.ack_latency.observe(op, time.perf_counter() - started)

    def dispatch(self, connection: Connection, request: Request) -> None:
        if request.op == "ping":
            connection.send(
                ok_reply(
                    request.request_id,
                    version=kvprefetchd.__version__,
                    protocol=PROTOCOL_VERSION,
                    engine=self.engine_name,
                    workers=len(self.workers),
                )
            )
        elif request.op == "stats":
            connection.send(ok_reply(request.request_id, stats=self.stats()))
        elif request.op == "prefetch":
            self.prefetch(connection, request)
        elif request.op == "prefetch_blocks":
            self.prefetch_blocks(connection, request)
        elif request.op == "resolve":
            self.resolve(connection, request)

    def prefetch(self, connection: Connection, request: Request) -> None:
        options = self.warm_options(request)
        self.warm(connection, request, parse_paths(request), options)

    def prefetch_blocks(self, connection: Connection, request: Request) -> None:
        options = self.warm_options(request)
        profile, resolution = self.kv.resolve(request.body, request.request_id, for_prefetch=True)

        def feed_stale_detector(done: PendingRequest) -> None:
            self.kv.record(profile, resolution.fingerprint, done.outcomes)

        mode = self.config.model_warm_modes.get(request.body.get("model", ""))
        self.warm(
            connection, request, resolution.paths, options,
            extra={"files": len(resolution.paths)}, on_done=feed_stale_detector,
            other_mode=mode is not None and mode != self.config.warm_mode,
        )

    def resolve(self, connection: Connection, request: Request) -> None:
        _, resolution = self.kv.resolve(request.body, request.request_id, for_prefetch=False)
        connection.send(
            ok_reply(
                request.request_id,
                block_hashes=resolution.block_hashes_hex(),
                paths=resolution.paths,
                fingerprint=resolution.fingerprint,
            )
        )

    def warm_options(self, request: Request) -> WarmOptions:
        return parse_warm_options(request, self.config.read_bytes, self.config.max_read_bytes)

    def warm(
        self,
        connection: Connection,
        request: Request,
        paths: list[Any],
        options: WarmOptions,
        *,
        extra: dict[str, Any] | None = None,
        on_done: Callable[[PendingRequest], None] | None = None,
        other_mode: bool = False,
    ) -> None:
        """Queue the files; reply now (fire and forget) or once they are settled (`wait`)."""
        if len(paths) > self.config.max_paths_per_request:
            raise RequestError(
                TOO_LARGE,
                f"paths: {len(paths)} exceeds the limit of {self.config.max_paths_per_request}",
                request.request_id,
            )
        extra = extra or {}
        now = time.monotonic()
        pending: PendingRequest | None = None
        if options.wait or on_done is not None:
            timeout_ms = options.timeout_ms if options.wait else None
            deadline = now + timeout_ms / 1000.0 if timeout_ms is not None else None

            def reply_to(done: PendingRequest, connection: Connection = connection) -> None:
                if on_done is not None:
                    on_done(done)
                if not options.wait:
                    return
                self.wait_latency.observe(time.monotonic() - done.started)
                connection.send(
                    ok_reply(
                        done.request_id,
                        accepted=done.accepted,
                        dropped=done.dropped,
                        rejected=done.rejected,
                        outcomes=done.outcome_map(),
                        elapsed_us=int((time.monotonic() - done.started) * 1e6),
                        **extra,
                    )
                )
                self.update_connection(connection)

            pending = PendingRequest(request.request_id, reply_to, now, deadline)
        idle = [self.books.outstanding(index) == 0 for index in range(len(self.workers))]
        batches, (accepted, dropped, rejected) = self.enqueue(paths, pending)
        if not options.wait:
            # The ack goes out before the workers hear of the files: once they wake they
            # take both CPUs of a small host, and the caller must not wait behind them.
            connection.send(
                ok_reply(
                    request.request_id,
                    accepted=accepted, dropped=dropped, rejected=rejected, **extra,
                )
            )
        for index, batch in enumerate(batches):
            handle = self.workers[index]
            if batch and handle is not None:
                if idle[index]:
                    handle.heard = now  # its silence counts from now, not from its last report
                self.send_to_worker(handle, [WARM, options.read_bytes, int(other_mode), batch])
        if pending is None:
            return
        if pending.outstanding == 0:
            self.answer(pending)
        elif pending.deadline is not None:
            heapq.heappush(self.timers, (pending.deadline, next(self._timer_seq), pending))

    def enqueue(
        self, paths: list[Any], pending: PendingRequest | None
    ) -> tuple[list[list[list[Any]]], tuple[int, int, int]]:
        """Confine, shard and book each path; a full worker queue drops the file, never blocks.

        Returns each worker's batch (for the caller to send) and the counts
        (accepted, dropped, rejected).
        """
        workers = len(self.workers)
        batches: list[list[list[Any]]] = [[] for _ in range(workers)]
        limit = self.config.queue_limit
        accepted = dropped = rejected = 0
        place, issue = self.roots.place, self.books.issue
        room = [
            limit - self.books.outstanding(index) if handle is not None else 0
            for index, handle in enumerate(self.workers)
        ]
        debug = log.isEnabledFor(logging.DEBUG)
        for path in paths:
            placed = place(path)
            if isinstance(placed, str):
                rejected += 1
                if debug:
                    log.debug("rejected %r: %s", path, placed)
                continue
            root_index, relative = placed
            index = shard_of(root_index, relative, workers)
            if room[index] <= 0:
                dropped += 1
                continue
            room[index] -= 1
            ticket = issue(index, pending) if pending is not None else 0
            batches[index].append([ticket, root_index, relative])
            accepted += 1
        if pending is None:
            for index, batch in enumerate(batches):
                self.books.issue_anonymous(index, len(batch))
        if rejected:
            self.books.count_refused("rejected", pending, rejected)
        if dropped:
            self.books.count_refused("dropped", pending, dropped)
        return batches, (accepted, dropped, rejected)

    def answer(self, request: PendingRequest) -> None:
        if request.answered:
            return
        request.answered = True
        request.reply_to(request)

    @property
    def engine_name(self) -> str:
        """The engine the workers run (the first choice until one reports otherwise)."""
        engines = {w.engine for w in self.workers if w is not None and w.ready}
        if len(engines) == 1:
            return engines.pop()
        return "+".join(sorted(engines)) if engines else self.engine_classes[0].name

    # ---- stats -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        totals = self.books.totals
        return {
            "uptime_s": round(time.monotonic() - self.started, 3),
            "version": kvprefetchd.__version__,
            "engine": self.engine_name,
            "warm_mode": self.config.warm_mode,
            "requests": dict(self.requests),
            "files": {
                "accepted": totals["accepted"],
                "dropped": totals["dropped"],
                "rejected_by_supervisor": totals["rejected_by_supervisor"],
                "read": totals["read"],
                "resident": totals["resident"],
                "missing": totals["missing"],
                "rejected": totals["rejected"],
                "failed": totals["failed"],
                "expired_replies": totals["expired_replies"],
                "in_flight": sum(self.books.outstanding(i) for i in range(len(self.workers))),
            },
            "bytes_read": self.books.bytes_read,
            "kv": self.kv.stats(),
            "latency": {
                "ack_seconds": self.ack_latency.snapshot(),
                "wait_seconds": self.wait_latency.snapshot(),
                "file_seconds": self.file_latency.snapshot(),
            },
            "worker_restarts": self.worker_restarts,
            "workers_killed_wedged": self.workers_killed_wedged,
            "supervisor": {"pid": os.getpid(), **process_figures(os.getpid())},
            "connections": len(self.connections),
            "roots": [
                {"root": r.root, "fstype": r.fstype, "rule": r.rule, "why": r.why}
                for r in self.rules
            ],
            "workers": [self._worker_stats(handle) for handle in self.workers if handle],
        }

    def _worker_stats(self, handle: WorkerHandle) -> dict[str, Any]:
        owes = self.books.outstanding(handle.index) > 0
        return {
            **process_figures(handle.pid),
            "index": handle.index,
            "pid": handle.pid,
            "ready": handle.ready,
            "engine": handle.engine,
            "queue_depth": self.books.outstanding(handle.index),
            "queue_limit": self.config.queue_limit,
            "restarts": handle.restarts,
            # The heartbeat, observable: seconds without a report while owing outcomes.
            "silent_s": round(time.monotonic() - handle.heard, 3) if owes else 0.0,
            **dict(handle.counters),
        }

    # ---- shutdown --------------------------------------------------------------------------

    def drain(self) -> None:
        """Stop taking connections, give waiting requests a moment, then answer them all."""
        systemd.stopping("draining")
        if self.listener is not None:
            self._close_listener()
        deadline = time.monotonic() + self.config.drain_seconds
        while time.monotonic() < deadline and any(
            request is not None and not request.answered
            for open_ in self.books.open
            for request in open_.values()
        ):
            self.run_once(min(0.05, max(0.0, deadline - time.monotonic())))
        for open_ in self.books.open:
            for request in list(open_.values()):
                if request is not None and not request.answered:
                    self.books.expire(request)
                    self.answer(request)
        flush_deadline = time.monotonic() + 0.5
        while time.monotonic() < flush_deadline and any(
            c.output for c in self.connections.values() if not c.broken
        ):
            self.run_once(0.05)

    def _close_listener(self) -> None:
        assert self.listener is not None
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        self.listener.close()
        self.listener = None
        if not self.socket_passed:  # systemd owns a passed socket's file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket)

    def halt(self) -> None:
        """Stop the workers and close everything; bounded in time however the workers behave."""
        self.stopping = True
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.listener is not None:
            self._close_listener()
        for connection in list(self.connections.values()):
            self.drop_connection(connection)
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
            handle.sock.close()
        self.workers = [None] * len(self.workers)
