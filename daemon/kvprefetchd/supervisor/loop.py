"""The supervisor: one thread, one event loop, signals, reload, drain and halt.

It owns the rooms a request walks through and drives them from one `selectors` loop:
the server (socket -> connection -> frame), the ops (frame -> request -> admission ->
ack), the pool (worker queue -> outcome -> books), and back through the ops (the
answer). Every key registered on the selector carries a callback, so the loop only
calls them; what is due at a time (deadlines, the heartbeat, a resting listener, the
watchdog) each room says through `next_due` and does in `tick`.

Signal handlers only record the signal; the loop does the work (gunicorn's arbiter
does the same), which keeps forking safe: no threads ever exist here. Nothing here
touches a file system that may hang: the roots are opened, and KV fingerprints looked
for, by the scout (scout.py), with deadlines.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvprefetch.stats import Stats
from kvprefetchd import systemd
from kvprefetchd.config import Config, ConfigError, merge_reload
from kvprefetchd.listeners.server import Server
from kvprefetchd.logs import LogPump
from kvprefetchd.logs import counters as log_counters
from kvprefetchd.metrics import exposition
from kvprefetchd.metrics.limits import MetricsLimits
from kvprefetchd.metrics.server import MetricsServer
from kvprefetchd.ops.doctor import diagnose
from kvprefetchd.ops.handlers import Ops
from kvprefetchd.ops.kvservice import KVService
from kvprefetchd.ops.stats import build_stats
from kvprefetchd.roots.rootset import RootSet, RootState
from kvprefetchd.roots.scout import Scout
from kvprefetchd.supervisor.books import Books
from kvprefetchd.supervisor.pool import BOOT_TIMEOUT, HaltError, WorkerPool
from kvprefetchd.supervisor.stuck import Stuck

__all__ = ["HaltError", "Supervisor"]

log = logging.getLogger("kvprefetchd")

# After the drain's answers, how long the replies still have to reach their clients.
FLUSH_SECONDS = 0.5
# SIGTERM to exit, whatever a worker or a tier does: systemd's TimeoutStopSec is 10 s,
# and we promise 5. The workers' stop gets at least HALT_SECONDS of it, the drain the
# rest (up to drain_seconds), and EXIT_MARGIN is left for the interpreter to exit.
STOP_SECONDS = 5.0
HALT_SECONDS = 1.5
EXIT_MARGIN = 0.3
# How long start-up waits for the roots to open (a scout lane answers each one, while the
# workers boot) before it serves without those that have not: they are served once they
# answer. Each root opens on its own lane, so this only bounds how long a root that hangs
# delays READY; a healthy root is open long before.
ROOTS_TIMEOUT = 2.0


class Supervisor:
    def __init__(
        self,
        config: Config,
        listener: socket.socket | None = None,
        reload_from: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        self.reload_from = reload_from
        self.listener = listener
        self.started = time.monotonic()
        self.selector = selectors.DefaultSelector()
        self.stuck = Stuck()
        self.scout = Scout(self.selector, self.stuck, config.fs_timeout)
        self.roots = RootSet(config, self.scout, self.root_changed)
        self.events: Counter[str] = Counter()  # reloads, refused peers, paused accepts ...
        self.books = Books(config.worker_count)
        self.kv = KVService.from_config(config, self.scout)
        self.pool = WorkerPool(config, self.roots, self.books, self.selector, self.stuck)
        self.ops = Ops(config, self.books, self.pool, self.kv, self.stats, self.diagnose)
        self.server = Server(config, self.selector, self.ops.handle_frame, self.events,
                             self.ops.requests)
        self.metrics: MetricsServer | None = None
        self.watchdog = systemd.Watchdog.from_environment()
        self.signals: list[int] = []
        self.stopping = False
        self.stop_at: float | None = None  # when SIGTERM came (monotonic)
        self.serving = False
        self.log_pump = LogPump(self.selector)  # held log lines: flushed, retried
        self._wakeup_r, self._wakeup_w = socket.socketpair()

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the process exit status."""
        self.install_signals()
        self.server.listen(self.listener)
        try:
            self.roots.watch_mounts(self.selector)
            self.roots.open_all()
            roots_deadline = time.monotonic() + ROOTS_TIMEOUT
            self.log_engine()
            self.pool.spawn_all()
            self.wait_for_workers()
            self.wait_for_roots(roots_deadline)
            self.server.start_accepting()
            if self.config.metrics:
                self.metrics = MetricsServer.open(
                    self.config.metrics,
                    lambda openmetrics: exposition.render(self.stats(), openmetrics=openmetrics),
                    limits=MetricsLimits.from_config(self.config),
                )
                self.metrics.attach(self.selector)
            workers = len(self.pool.workers)
            systemd.ready(f"serving on {self.config.socket} with {workers} workers")
            # The engine the workers actually chose (auto, or a fallback), and where metrics
            # are, so an operator's first look at the log answers both.
            log.info("serving on %s with %d workers (pid %d), engine %s, warm mode %s, "
                     "metrics %s", self.config.socket, workers, os.getpid(),
                     self.pool.engine_name, self.config.warm_mode,
                     f"on {self.config.metrics}" if self.config.metrics else "off")
            self.serving = True
            while not self.stopping:
                self.run_once(self.next_timeout())
            self.drain()
            return 0
        finally:
            self.halt()

    def wait_for_roots(self, deadline: float) -> None:
        """Wait for every root's first answer until `deadline` (a root that does not answer
        is served once it does). A root refused at start (a symlink, a directory another
        user could swap) stops the daemon with the reason."""
        while not self.roots.all_answered() and not self.stopping and time.monotonic() < deadline:
            self.run_once(min(0.1, max(0.0, deadline - time.monotonic())))
        for state in self.roots.states:
            if state.status == "opening":
                log.warning("root %s has not answered yet: served once it does (its files "
                            "are missing until then)", state.path)
        refused = self.roots.refused()
        if refused:
            raise HaltError("; ".join(state.message for state in refused))

    def root_changed(self, state: RootState) -> None:
        """A root opened, reopened or let go (rootset.py logs it): workers forked from now
        inherit its fd; those running are sent it."""
        if any(self.pool.workers):
            self.pool.add_root(state)

    def log_engine(self) -> None:
        engines = self.pool.engines[self.config.warm_mode]
        log.info("engine %s, warm mode %s",
                 " or ".join(e.name for e in engines), self.config.warm_mode)

    def wait_for_workers(self) -> None:
        """Serve nobody until every worker has booted; one that cannot boot halts the daemon."""
        deadline = time.monotonic() + BOOT_TIMEOUT
        while not self.pool.all_ready():
            if self.stopping:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HaltError(f"workers did not boot within {BOOT_TIMEOUT:.0f} s")
            self.run_once(min(remaining, 0.5))

    def diagnose(self) -> dict[str, Any]:
        return diagnose(self.pool.roots.states, self.config, self.pool.engine_name)

    def stats(self) -> Stats:
        return build_stats(
            started=self.started, warm_mode=self.config.warm_mode, ops=self.ops,
            pool=self.pool, books=self.books, server=self.server, kv=self.kv,
            roots=self.roots, stuck=self.stuck, scout=self.scout,
            # The log sink's and the metrics endpoint's counts ride along as events.
            events={**self.events, **log_counters(),
                    **(self.metrics.events() if self.metrics is not None else {})},
        )

    # ---- signals and reload ------------------------------------------------------------------

    def install_signals(self) -> None:
        self._wakeup_r.setblocking(False)
        self._wakeup_w.setblocking(False)
        signal.set_wakeup_fd(self._wakeup_w.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(signum, self._record_signal)
        self.selector.register(self._wakeup_r, selectors.EVENT_READ, self.handle_signals)

    def _record_signal(self, signum: int, _frame: Any) -> None:
        self.signals.append(signum)

    def handle_signals(self, _events: int = 0) -> None:
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
                    self.stop_at = time.monotonic()
                self.stopping = True
            elif signum == signal.SIGCHLD:
                self.reap_children()
            elif signum == signal.SIGHUP:
                self.reload()

    def reap_children(self) -> None:
        """Collect every child that exited: a worker (replaced), the scout, or one that
        was killed and stuck in the kernel until now."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.stuck.exited(pid):
                log.info("pid %d, killed earlier, has exited", pid)
            elif not self.pool.child_exited(pid, status):
                self.scout.child_exited(pid)

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
            merged, held = merge_reload(self.config, self.reload_from())
        except ConfigError as error:
            log.error("reload refused, the old configuration stays in force: %s", error)
            self.events["reload_refused"] += 1
            systemd.ready("reload refused; the old configuration stays in force")
            return
        if held:
            log.warning(
                "reload: keys that need a restart keep their old values: %s", ", ".join(held)
            )
        self.apply_config(merged)
        self.events["reloads"] += 1
        systemd.ready("configuration reloaded")
        log.info("configuration reloaded")

    def apply_config(self, config: Config) -> None:
        self.config = config
        self.ops.apply(config)
        self.pool.apply(config)
        self.server.apply(config)
        logging.getLogger().setLevel(config.log_level.upper())

    # ---- the loop --------------------------------------------------------------------------

    def next_timeout(self) -> float | None:
        now = time.monotonic()
        dues = [
            self.ops.next_due(now),
            self.pool.next_due(now),
            self.server.next_due(now),
            self.scout.next_due(now),
            self.roots.next_due(now),
            self.metrics.next_timeout(now) if self.metrics is not None else None,
            self.watchdog.timeout(now),
            self.log_pump.next_due(now),
        ]
        known = [due for due in dues if due is not None]
        return min(known) if known else None

    def run_once(self, timeout: float | None) -> None:
        for key, events in self.selector.select(timeout):
            key.data(events)
        # Waiters whose last file a worker's report (or death) settled are answered here,
        # after the events: the pool never answers a client itself.
        for waiter in self.pool.take_complete():
            self.ops.answer(waiter)
        now = time.monotonic()
        self.ops.expire(now)
        self.scout.tick(now)
        self.roots.tick(now)
        self.pool.tick(now)
        self.server.tick(now)
        if self.metrics is not None:
            self.metrics.expire(now)
        self.watchdog.tick(now)
        self.log_pump.tick(now)

    # ---- shutdown --------------------------------------------------------------------------

    def drain(self) -> None:
        """Stop taking connections, give waiting requests a moment, then answer them all."""
        systemd.stopping("draining")
        self.ops.draining = True
        self.server.close_listener()
        stop_at = self.stop_at if self.stop_at is not None else time.monotonic()
        deadline = min(time.monotonic() + self.config.drain_seconds,
                       stop_at + STOP_SECONDS - HALT_SECONDS - EXIT_MARGIN - FLUSH_SECONDS)
        while time.monotonic() < deadline and any(
            not waiter.answered for waiter in self.books.waiters()
        ):
            self.run_once(min(0.05, max(0.0, deadline - time.monotonic())))
        for waiter in self.books.waiters():
            self.ops.expire_waiter(waiter)
        flush_deadline = time.monotonic() + FLUSH_SECONDS
        while time.monotonic() < flush_deadline and self.server.unsent():
            self.run_once(0.05)

    def halt(self) -> None:
        """Stop the workers and close everything; bounded in time however they behave: by
        STOP_SECONDS after SIGTERM (less EXIT_MARGIN), or HALT_SECONDS from now."""
        self.stopping = True
        self.ops.draining = True
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.server.close_listener()
        self.server.drop_all()
        now = time.monotonic()
        deadline = now + HALT_SECONDS
        if self.stop_at is not None:
            deadline = max(now + 0.2, self.stop_at + STOP_SECONDS - EXIT_MARGIN)
        self.scout.stop()
        self.pool.halt(deadline)
        self.reap_children()
        self.stuck.say_left_behind()
        self.roots.close()
