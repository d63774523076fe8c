"""The TCP listener with mutual TLS, through the real daemon and the real clients.

Certificates are made per test run (kvharness/certs.py). A client the daemon does not
trust, whose certificate expired, or whose identity is not listed, and plaintext, are
refused, logged and counted, and open nothing; an allowed one gets the same protocol as
on the Unix socket. Reloads re-read the certificates (a bad set is refused) and cut
connections the new list drops.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvharness.certs import CA, Issued, issue, make_ca, server_cert
from kvharness.daemon import Daemon, start_config, write_config
from kvharness.files import write_all
from kvharness.fixtures import until
from kvharness.pagecache import resident_bytes
from kvprefetch import AsyncClient, Client
from kvprefetch.errors import ConnectFailed, ConnectionClosed, KVPrefetchError, ServerError

ROUTER = "spiffe://cluster.local/ns/llm-d/sa/router"


@dataclass(frozen=True)
class Certs:
    ca: CA
    server: Issued
    router: Issued  # listed
    other: Issued  # trusted CA, identity not listed
    expired: Issued  # listed identity, expired
    stranger: Issued  # listed identity, another CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    directory = tmp_path_factory.mktemp("certs")
    ca = make_ca(directory)
    other_ca = make_ca(directory / "other", "another CA")
    return Certs(
        ca=ca,
        server=server_cert(ca, directory),
        router=issue(ca, directory, "router", common_name="router", uris=(ROUTER,)),
        other=issue(ca, directory, "other", common_name="other",
                    uris=("spiffe://cluster.local/ns/x/sa/other",)),
        expired=issue(ca, directory, "expired", common_name="router", uris=(ROUTER,),
                      expired=True),
        stranger=issue(other_ca, directory, "stranger", common_name="router", uris=(ROUTER,)),
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def client_context(certs: Certs, who: Issued | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca.cert))
    if who is not None:
        context.load_cert_chain(str(who.cert), str(who.key))
    return context


def settings(tmp_path: Path, certs: Certs, port: int, **extra: Any) -> dict[str, Any]:
    root = tmp_path / "kv"
    root.mkdir(exist_ok=True)
    return {"roots": [str(root)], "workers": 1, "read_bytes": 4096, "log_level": "info",
            "listen_tcp": f"127.0.0.1:{port}", "tls_cert_file": str(certs.server.cert),
            "tls_key_file": str(certs.server.key), "tls_client_ca_file": str(certs.ca.cert),
            "tls_allowed_clients": [ROUTER], **extra}


@pytest.fixture
def tls_daemon(tmp_path: Path, certs: Certs) -> Any:
    port = free_port()
    daemon = start_config(tmp_path, settings(tmp_path, certs, port, tls_handshake_timeout=1))
    yield daemon, f"tls://127.0.0.1:{port}"
    daemon.kill()


def make_files(daemon: Daemon, count: int) -> list[str]:
    return write_all((daemon.root / f"f{i}.bin" for i in range(count)), 8192)


def test_an_allowed_router_gets_the_protocol(tls_daemon: Any, certs: Certs) -> None:
    daemon, address = tls_daemon
    paths = make_files(daemon, 20)
    with Client(address, ssl_context=client_context(certs, certs.router)) as client:
        assert client.ping().protocol == 1
        done = client.prefetch(paths, wait=True)
        assert done.outcomes is not None and done.outcomes["read"] == 20

    async def pipelined() -> int:
        async with AsyncClient(address, ssl_context=client_context(certs, certs.router)) as c:
            results = await asyncio.gather(*(c.prefetch([p], wait=True) for p in paths))
            return sum(r.accepted for r in results)

    assert asyncio.run(pipelined()) == 20


@pytest.mark.parametrize("who", ["other", "expired", "stranger", "none"])
def test_an_unlisted_untrusted_or_expired_client_is_refused_and_opens_nothing(
    tls_daemon: Any, certs: Certs, who: str
) -> None:
    daemon, address = tls_daemon
    (path,) = make_files(daemon, 1)
    identity = None if who == "none" else getattr(certs, who)
    context = client_context(certs, identity)
    with pytest.raises((ConnectFailed, ConnectionClosed, ServerError)) as refused, \
            Client(address, ssl_context=context, timeout=5) as client:
        client.prefetch([path], wait=True)
    if who == "other":  # the handshake held: the daemon says why, as on the Unix socket
        assert isinstance(refused.value, ServerError) and refused.value.code == "forbidden"
    stats = daemon.stats()
    assert stats["events"]["tls_refused"] == 1
    assert stats["files"]["accepted"] == 0 and resident_bytes(path, 8192) == 0
    assert "refused a TLS peer at 127.0.0.1" in daemon.log()


def test_plaintext_is_refused_on_the_tls_port_and_a_silent_peer_times_out(
    tls_daemon: Any, certs: Certs
) -> None:
    daemon, address = tls_daemon
    with pytest.raises(KVPrefetchError), \
            Client(address.replace("tls://", "tcp://"), timeout=5) as client:
        client.ping()
    host, port = address[len("tls://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as silent:
        assert silent.recv(1) == b""  # closed at tls_handshake_timeout (1 s)
    stats = daemon.stats()
    assert stats["events"]["tls_refused"] >= 1
    assert stats["events"]["tls_handshake_timeouts"] == 1


def test_connections_per_address_are_capped(tmp_path: Path, certs: Certs) -> None:
    port = free_port()
    daemon = start_config(tmp_path, settings(tmp_path, certs, port,
                                             max_connections_per_address=2))
    try:
        context = client_context(certs, certs.router)
        held = [Client(f"tls://127.0.0.1:{port}", ssl_context=context) for _ in range(2)]
        for client in held:
            client.ping()
        with pytest.raises(KVPrefetchError):
            Client(f"tls://127.0.0.1:{port}", ssl_context=context, timeout=5).ping()
        held[0].close()
        # The slot comes back once the daemon has seen the close: left, the other TLS
        # client and the connection asking.
        until(lambda: daemon.stats()["connections"] <= 2, "the closed connection dropped")
        with Client(f"tls://127.0.0.1:{port}", ssl_context=context) as again:
            assert again.ping().protocol == 1  # the slot came back
        for client in held:
            client.close()
        assert daemon.stats()["events"]["connections_refused"] == 1
    finally:
        daemon.kill()


def test_reload_refuses_a_bad_certificate_and_cuts_a_dropped_identity(
    tmp_path: Path, certs: Certs
) -> None:
    port = free_port()
    config = settings(tmp_path, certs, port)
    broken = tmp_path / "broken.crt"
    broken.write_text("not a certificate\n")
    daemon = start_config(tmp_path, config)
    try:
        context = client_context(certs, certs.router)
        address = f"tls://127.0.0.1:{port}"
        with Client(address, ssl_context=context) as kept:
            kept.ping()
            write_config(tmp_path / "kvprefetchd.toml", {**config, "socket": str(
                daemon.socket_path), "log_level": "warning", "tls_cert_file": str(broken)})
            os.kill(daemon.process.pid, signal.SIGHUP)
            until(lambda: daemon.stats()["events"].get("tls_reload_refused", 0) == 1,
                  "the bad certificate refused")
            with Client(address, ssl_context=context) as fresh:
                assert fresh.ping().protocol == 1  # the old certificate still serves
            kept.ping()
            write_config(tmp_path / "kvprefetchd.toml", {**config, "socket": str(
                daemon.socket_path), "log_level": "warning", "tls_allowed_clients": ["x"]})
            os.kill(daemon.process.pid, signal.SIGHUP)
            until(lambda: daemon.stats()["events"].get("peers_revoked", 0) == 1,
                  "the dropped identity cut")
            with pytest.raises(KVPrefetchError):
                kept.ping()
    finally:
        daemon.kill()


def test_many_handshakes_and_requests_leave_memory_and_fds_flat(
    tmp_path: Path, certs: Certs
) -> None:
    # One client handshaking back to back, hundreds a second: above the handshake rates
    # a stranger gets (test_never_down_tls.py), which are not what this measures.
    port = free_port()
    daemon = start_config(tmp_path, settings(
        tmp_path, certs, port, tls_handshake_rate=100_000,
        tls_handshake_rate_per_address=100_000))
    address = f"tls://127.0.0.1:{port}"
    try:
        leaves_memory_and_fds_flat(daemon, address, certs)
    finally:
        daemon.kill()


def leaves_memory_and_fds_flat(daemon: Daemon, address: str, certs: Certs) -> None:
    (path,) = make_files(daemon, 1)
    context = client_context(certs, certs.router)

    def round_of(handshakes: int, requests: int) -> None:
        for _ in range(handshakes):
            with Client(address, ssl_context=context) as client:
                client.ping()
        with Client(address, ssl_context=context) as client:
            for _ in range(requests // 100):
                client.prefetch_many([[path]] * 100)

    round_of(100, 2000)  # warm-up: allocator, caches
    before = daemon.stats()["supervisor"]
    round_of(1000, 100_000)  # the issue's figures: 1,000 handshakes, 10^5 requests
    after = daemon.stats()["supervisor"]
    print(f"supervisor before {before}, after {after}")
    assert after["open_fds"] == before["open_fds"]
    assert after["rss_bytes"] < before["rss_bytes"] * 1.10, (before, after)


def test_unloadable_tls_files_stop_the_daemon_at_start_leaving_no_socket(
    tmp_path: Path, certs: Certs
) -> None:
    config = settings(tmp_path, certs, free_port(), tls_key_file=str(tmp_path / "missing.key"))
    daemon = start_config(tmp_path, config, wait=False)
    assert daemon.process.wait(30) == 1
    assert "TLS files" in daemon.log()  # named, with the error
    assert not Path(daemon.socket_path).exists()
