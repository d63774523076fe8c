"""Never down when the log cannot be written (issue 23, finding 6), through the real daemon.

0.3.0's log handler re-raised a write error out of `emit`: with stderr on a full file
system (ENOSPC; /dev/full here) or a terminal whose master side hung up (EIO; a pty whose
master this test closes), the first warning stopped the daemon (exit 1; with /dev/full
it never got as far as serving). Now a failing sink is counted and retried, and lines
beyond what it holds are dropped and counted (`log_write_errors`, `log_lines_dropped`),
or the journal takes over when the host has one.

The attack makes the daemon log a lot while its stderr fails: plaintext peers on its
TLS port (each refused with a warning) and requests naming paths outside the roots
(each path a debug line), some 300 KiB in all, more than the handler holds. Inside
attack.Watch: the Unix socket keeps answering pings (p99 < 50 ms), a listed router keeps
connecting over TLS (>= 99%), no worker dies, and SIGTERM still ends it within 6 s.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvharness import attack
from kvharness.certs import Issued, issue, make_ca, server_cert
from kvharness.daemon import Daemon, launch, write_config
from kvharness.wire import RawConnection
from kvprefetch import Client

ROUTER = "spiffe://cluster.local/ns/llm-d/sa/router"
FORK = multiprocessing.get_context("fork")
REFUSED_PEERS = 200
ATTACK_SECONDS = 3.0
OUTSIDE_REQUESTS = 30  # of 100 paths each: 3,000 debug lines, ~330 KB


@dataclass(frozen=True)
class Certs:
    ca: Path
    server: Issued
    router: Issued


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    directory = tmp_path_factory.mktemp("certs")
    ca = make_ca(directory)
    return Certs(ca.cert, server_cert(ca, directory),
                 issue(ca, directory, "router", common_name="router", uris=(ROUTER,)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def daemon_with_stderr(tmp_path: Path, certs: Certs, stderr: int,
                       before_ready: Callable[[], None] = lambda: None,
                       ) -> Iterator[tuple[Daemon, int]]:
    """The daemon (TLS listener on, debug logging) with `stderr` as its fd 2."""
    port = free_port()
    root = tmp_path / "kv"
    root.mkdir(exist_ok=True)
    socket_path = tmp_path / "kvprefetchd.sock"
    config = write_config(tmp_path / "kvprefetchd.toml", {
        "socket": str(socket_path), "roots": [str(root)], "workers": 2, "read_bytes": 4096,
        "log_level": "debug", "listen_tcp": f"127.0.0.1:{port}",
        "tls_cert_file": str(certs.server.cert), "tls_key_file": str(certs.server.key),
        "tls_client_ca_file": str(certs.ca), "tls_allowed_clients": [ROUTER],
    })
    daemon = launch(["--config", str(config)], socket_path=socket_path, root=root,
                    log_path=tmp_path / "daemon.log", stderr=stderr, wait=False)
    try:
        before_ready()
        daemon.wait_ready()
        yield daemon, port
    finally:
        daemon.kill()


def router_call(certs: Certs, port: int) -> Callable[[], None]:
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.load_cert_chain(str(certs.router.cert), str(certs.router.key))

    def call() -> None:
        with Client(f"tls://127.0.0.1:{port}", ssl_context=context, timeout=2) as client:
            client.ping()
    return call


def refused_peers(port: int, go: Any) -> None:
    """Plaintext peers on the TLS port, from 127.0.0.2 (not the router's address), paced
    over ATTACK_SECONDS: each one's failed handshake is a warning in the daemon's log."""
    go.wait()
    started = time.monotonic()
    for i in range(REFUSED_PEERS):
        pause = started + i * ATTACK_SECONDS / REFUSED_PEERS - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.settimeout(2)
            sock.bind(("127.0.0.2", 0))
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            sock.recv(100)  # until the daemon closes it


def log_a_lot(socket_path: str, go: Any) -> None:
    """Requests naming paths outside every root, paced over ATTACK_SECONDS: each path
    refused is a debug line."""
    outside = [f"/outside/{i:06d}/{'x' * 60}.bin" for i in range(100)]
    go.wait()
    started = time.monotonic()
    with RawConnection(socket_path, 10) as connection:
        for i in range(OUTSIDE_REQUESTS):
            pause = started + i * ATTACK_SECONDS / OUTSIDE_REQUESTS - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            reply = connection.call("prefetch", paths=outside)
            assert reply["ok"] and reply["rejected"] == 100


def attack_while_stderr_fails(daemon: Daemon, port: int, certs: Certs) -> dict[str, int]:
    """The attack inside the Watch; the daemon's events after it."""
    go = FORK.Event()
    attackers = [FORK.Process(target=refused_peers, args=(port, go)),
                 FORK.Process(target=log_a_lot, args=(daemon.socket_path, go))]
    for attacker in attackers:  # forked before the Watch's threads exist
        attacker.start()
    try:
        with attack.Watch(daemon, router=router_call(certs, port)) as watch:
            go.set()
            for attacker in attackers:
                attacker.join(ATTACK_SECONDS + 30)
    finally:
        for attacker in attackers:
            if attacker.is_alive():
                attacker.kill()
    assert [attacker.exitcode for attacker in attackers] == [0, 0]
    watch.assert_held()
    events: dict[str, int] = daemon.stats()["events"]
    print(f"events after the attack: {events}")
    assert events.get("tls_refused", 0) + events.get("connections_refused", 0) >= 1
    assert events["log_write_errors"] >= 1
    # More was logged than the handler holds: the rest was dropped and counted, unless
    # this host has a journal, which took over (and got the held lines).
    assert events.get("log_lines_dropped", 0) > 0 or events.get("log_sink_replaced", 0) == 1
    return events


def test_stderr_on_a_full_file_system_costs_log_lines_not_the_daemon(
    tmp_path: Path, certs: Certs
) -> None:
    full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
    try:
        with daemon_with_stderr(tmp_path, certs, full) as (daemon, port):
            attack_while_stderr_fails(daemon, port, certs)
            attack.assert_stops_within(daemon)
    finally:
        os.close(full)


class PtyReader:
    """Reads the master side of a pty (as a terminal would) until `hang_up` closes it."""

    def __init__(self, master: int) -> None:
        self.master = master
        self.stop = threading.Event()
        self.text = bytearray()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.stop.is_set():
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if ready:
                try:
                    self.text += os.read(self.master, 65536)
                except OSError:
                    return

    def hang_up(self) -> None:
        self.stop.set()
        self.thread.join(5)
        os.close(self.master)


def test_stderr_on_a_terminal_that_hung_up_costs_log_lines_not_the_daemon(
    tmp_path: Path, certs: Certs
) -> None:
    master, slave = os.openpty()
    reader = PtyReader(master)
    try:
        with daemon_with_stderr(tmp_path, certs, slave) as (daemon, port):
            os.close(slave)
            slave = -1
            give_up = time.monotonic() + 10
            while b"serving on" not in reader.text:  # the terminal works until now
                assert time.monotonic() < give_up, bytes(reader.text[-2000:])
                time.sleep(0.02)
            reader.hang_up()  # the daemon's writes to its stderr fail with EIO from here
            events = attack_while_stderr_fails(daemon, port, certs)
            assert events["log_write_errors"] >= 1
            attack.assert_stops_within(daemon)
    finally:
        if not reader.stop.is_set():
            reader.hang_up()
        if slave >= 0:
            os.close(slave)
