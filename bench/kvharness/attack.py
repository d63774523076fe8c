"""What a daemon must keep doing while it is attacked, measured from outside (issue 23).

`Watch` runs around an attack against a real daemon and holds it to the bar every
"never down" regression test shares:

- the Unix socket keeps serving: a ping on a fresh connection every 50 ms, p99 < 50 ms
  (a ping that fails or times out counts as infinitely slow);
- listed TLS routers keep connecting: when a `router` callable is given (one connect,
  handshake and ping; it raises on failure), it is called every 100 ms and >= 99% of
  the calls must succeed;
- no worker dies: the workers' pids after the attack are the ones before it;
- memory stays bounded: the supervisor's and the workers' RSS, sampled with every
  ping, grows by < 100 MiB over its value before the attack.

`assert_stops_within` is the last check: SIGTERM ends the daemon (exit 0) within 6 s.

Figures are read from /proc (psutil) and from the pings themselves, never from the
daemon's own account of itself.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from kvharness.certs import issue as issue_cert
from kvharness.certs import make_ca, server_cert
from kvharness.daemon import Daemon
from kvharness.wire import RawConnection

MIB = 1 << 20
PING_P99_MS = 50.0
ROUTER_SHARE = 0.99
RSS_GROWTH_MIB = 100.0
STOP_SECONDS = 6.0


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (share in 0..1); inf for no values."""
    if not values:
        return float("inf")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(share * len(ordered) + 0.999999) - 1))
    return ordered[rank]


def rss_bytes(pids: list[int]) -> int:
    """The summed resident set of these processes now (gone ones count 0)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total


def ping_unix(socket_path: str, timeout: float) -> None:
    """One ping on a fresh connection; raises unless it is answered ok in time."""
    with RawConnection(socket_path, timeout) as connection:
        connection.call_ok("ping")


@dataclass
class Figures:
    pings: int = 0
    ping_failures: int = 0
    ping_p99_ms: float = float("inf")
    ping_worst_ms: float = float("inf")
    router_calls: int = 0
    router_failures: int = 0
    workers_before: list[int] = field(default_factory=list)
    workers_after: list[int] = field(default_factory=list)
    rss_before_mib: float = 0.0
    rss_peak_mib: float = 0.0
    router_errors: list[str] = field(default_factory=list)

    @property
    def router_share(self) -> float:
        return 1.0 if not self.router_calls else 1 - self.router_failures / self.router_calls

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_peak_mib - self.rss_before_mib

    def line(self) -> str:
        return (f"pings={self.pings} failed={self.ping_failures} "
                f"p99={self.ping_p99_ms:.1f}ms worst={self.ping_worst_ms:.1f}ms "
                f"router={self.router_calls - self.router_failures}/{self.router_calls} "
                f"workers={self.workers_before}->{self.workers_after} "
                f"rss=+{self.rss_growth_mib:.1f}MiB (from {self.rss_before_mib:.1f})")


class Watch:
    """Pings (and a router's connects) around an attack; `assert_held` judges them.

    with Watch(daemon, router=connect_listed_router) as watch:
        attack()
    watch.assert_held()
    """

    def __init__(self, daemon: Daemon, *, router: Callable[[], Any] | None = None,
                 ping_interval: float = 0.05, router_interval: float = 0.1,
                 ping_timeout: float = 2.0) -> None:
        self.daemon = daemon
        self.router = router
        self.ping_interval = ping_interval
        self.router_interval = router_interval
        self.ping_timeout = ping_timeout
        self.figures = Figures()
        self._latencies: list[float] = []
        self._pids: list[int] = []
        self._halt = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Watch:
        self.figures.workers_before = sorted(self.daemon.worker_pids())
        self._pids = [self.daemon.process.pid, *self.figures.workers_before]
        self.figures.rss_before_mib = rss_bytes(self._pids) / MIB
        self.figures.rss_peak_mib = self.figures.rss_before_mib
        self._threads = [threading.Thread(target=self._pinger, daemon=True)]
        if self.router is not None:
            self._threads.append(threading.Thread(target=self._routing, daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._halt.set()
        for thread in self._threads:
            thread.join(self.ping_timeout + 5)
        figures = self.figures
        figures.pings = len(self._latencies)
        slow = [*self._latencies, *([float("inf")] * figures.ping_failures)]
        figures.ping_p99_ms = percentile(slow, 0.99) * 1e3
        figures.ping_worst_ms = max(slow, default=float("inf")) * 1e3
        if kind is None:
            figures.workers_after = sorted(self.daemon.worker_pids())
        print(f"attack watch: {figures.line()}")

    def _pinger(self) -> None:
        while not self._halt.is_set():
            started = time.monotonic()
            try:
                ping_unix(self.daemon.socket_path, self.ping_timeout)
                self._latencies.append(time.monotonic() - started)
            except (OSError, RuntimeError, ValueError):
                self.figures.ping_failures += 1
            rss = rss_bytes(self._pids) / MIB
            self.figures.rss_peak_mib = max(self.figures.rss_peak_mib, rss)
            self._halt.wait(self.ping_interval)

    def _routing(self) -> None:
        assert self.router is not None
        while not self._halt.is_set():
            self.figures.router_calls += 1
            try:
                self.router()
            except Exception as error:  # any failure to connect counts against the bar
                self.figures.router_failures += 1
                if len(self.figures.router_errors) < 5:
                    self.figures.router_errors.append(repr(error))
            self._halt.wait(self.router_interval)

    def assert_held(self, *, ping_p99_ms: float = PING_P99_MS,
                    router_share: float = ROUTER_SHARE,
                    rss_growth_mib: float = RSS_GROWTH_MIB) -> Figures:
        """The daemon held: the Unix socket served, routers connected, no worker died,
        memory stayed bounded, and the daemon is still running."""
        figures = self.figures
        assert self.daemon.process.poll() is None, (
            f"the daemon exited ({self.daemon.process.returncode}):\n{self.daemon.log()[-3000:]}")
        assert figures.pings > 0, "no ping was answered during the attack"
        assert figures.ping_p99_ms < ping_p99_ms, f"ping p99 too slow: {figures.line()}"
        assert figures.router_share >= router_share, (
            f"routers could not connect: {figures.line()} {figures.router_errors}")
        assert figures.workers_after == figures.workers_before, (
            f"a worker died or was replaced: {figures.line()}")
        assert figures.rss_growth_mib < rss_growth_mib, f"memory grew: {figures.line()}"
        return figures


ROUTER_ID = "spiffe://cluster.local/ns/llm-d/sa/attack-watch-router"


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class ListedRouter:
    """A TLS listener for the daemon under attack and a router it lists, so that every
    attack test holds the routers' bar too: pass `settings()` (a config file's keys) or
    `args()` (command-line flags) to the daemon, and the object itself as Watch's router.
    Each call is what a router does on a fresh connection: connect, handshake, ping."""

    port: int
    cert: Path
    key: Path
    ca: Path
    client_cert: Path
    client_key: Path
    timeout: float = 2.0

    @classmethod
    def make(cls, directory: Path) -> ListedRouter:
        ca = make_ca(directory / "attack-ca")
        server = server_cert(ca, directory / "attack-ca")
        client = issue_cert(ca, directory / "attack-ca", "router", common_name="router",
                            uris=(ROUTER_ID,))
        return cls(free_tcp_port(), server.cert, server.key, ca.cert, client.cert, client.key)

    def settings(self) -> dict[str, Any]:
        return {"listen_tcp": f"127.0.0.1:{self.port}", "tls_cert_file": str(self.cert),
                "tls_key_file": str(self.key), "tls_client_ca_file": str(self.ca),
                "tls_allowed_clients": [ROUTER_ID]}

    def args(self) -> list[str]:
        return ["--listen-tcp", f"127.0.0.1:{self.port}", "--tls-cert-file", str(self.cert),
                "--tls-key-file", str(self.key), "--tls-client-ca-file", str(self.ca),
                "--tls-allowed-client", ROUTER_ID]

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context

    def __call__(self) -> None:
        from kvprefetch import Client  # the router's own client, as a router imports it

        with Client(f"tls://127.0.0.1:{self.port}", ssl_context=self.context(),
                    timeout=self.timeout) as client:
            client.ping()


def assert_stops_within(daemon: Daemon, seconds: float = STOP_SECONDS) -> float:
    """SIGTERM, and the daemon exits 0 within `seconds`; how long it took."""
    started = time.monotonic()
    daemon.process.send_signal(signal.SIGTERM)
    try:
        status = daemon.process.wait(seconds)
    except Exception:
        daemon.kill()
        raise AssertionError(f"the daemon did not exit within {seconds} s of SIGTERM") from None
    took = time.monotonic() - started
    assert status == 0, f"exit status {status}:\n{daemon.log()[-3000:]}"
    return took


def connect_from(source: str, port: int) -> socket.socket | None:
    """A non-blocking TCP connect to 127.0.0.1:`port` from the loopback address `source`
    (an attacker of its own: 127.0.0.2, .3, ...), under way; None when it cannot start
    (out of ports or fds: the caller tries again later)."""
    sock = socket.socket()
    sock.setblocking(False)
    try:
        sock.bind((source, 0))
        sock.connect_ex(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def hold_open(count: int, connect: Callable[[], socket.socket]) -> list[socket.socket]:
    """`count` connections from `connect`, kept open by the caller (closed by it too)."""
    held: list[socket.socket] = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            held.append(connect())
    return held
