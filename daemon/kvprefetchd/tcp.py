"""The TCP listener: routers on other hosts, over mutual TLS, in the supervisor's one loop.

A daemon on a GPU node warms the node's own page cache for a router on a gateway host, so
it must take requests over the network; the Unix socket's gate (SO_PEERCRED) means nothing
there. Instead: TLS 1.2+, a client certificate signed by `tls_client_ca_file` is required,
and its identity (a SAN DNS or URI name, e.g. a SPIFFE ID, or the subject's CN) must be
one of `tls_allowed_clients`. Plaintext is refused, except on loopback when
`tcp_plaintext_loopback` asks for it (tests).

Nothing here blocks or starts a thread: sockets are non-blocking, the handshake is driven
by the selector (want-read, want-write) and bounded by `tls_handshake_timeout`, and a
connection that finished it becomes an ordinary Connection (same frames, limits, books).
At most `max_connections_per_address` per peer address, handshakes included. SIGHUP
re-reads the certificate files; a bad new set is refused and the old one kept, like a bad
config, and connections whose identity the new list drops are cut.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import selectors
import socket
import ssl
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvprefetchd.config import Config, split_host_port
from kvprefetchd.listening import AcceptRest, accept_ready, out_of_fds, refuse
from kvprefetchd.protocol import FORBIDDEN, OVERLOADED, encode_frame, error_reply

if TYPE_CHECKING:
    from kvprefetchd.server import Server

log = logging.getLogger("kvprefetchd.tcp")

LINGER_S = 2.0  # how long a refused peer is given to read why and close


class TlsSetupError(RuntimeError):
    """The certificate, key or CA files cannot make a server context."""


def server_context(config: Config) -> ssl.SSLContext | None:
    """The TLS context for the listener (None: plaintext on loopback)."""
    if config.tcp_plaintext_loopback:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        context.load_verify_locations(cafile=config.tls_client_ca_file)
    except (OSError, ssl.SSLError) as error:
        raise TlsSetupError(f"TLS files (tls_cert_file, tls_key_file, tls_client_ca_file): "
                            f"{error}") from error
    return context


def identities(cert: dict[str, Any]) -> set[str]:
    """A verified client certificate's names: SAN DNS and URI entries, and the CN."""
    names = {value for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "URI")}
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                names.add(value)
    return names


@dataclass(eq=False)
class Handshake:
    sock: ssl.SSLSocket
    address: str
    started: float
    handler: Any = None
    watched: int = 0


@dataclass
class TcpListener:
    """The listening socket, the handshakes in progress, and connections per address."""

    server: Server
    config: Config
    selector: selectors.BaseSelector
    events: Counter[str]
    sock: socket.socket | None = None
    context: ssl.SSLContext | None = None
    handshakes: dict[int, Handshake] = field(default_factory=dict)
    per_address: Counter[str] = field(default_factory=Counter)
    # Refused peers told why: kept open (reads discarded) until they close or LINGER_S
    # passes, so the refusal is not lost to a reset (closing with their request unread
    # would send one, and the reset discards what the peer had not read yet).
    lingering: dict[int, tuple[socket.socket, float, str]] = field(default_factory=dict)
    accepting: bool = False
    resting: AcceptRest = field(default_factory=lambda: AcceptRest("tcp", log))

    def listen(self) -> None:
        """Bind and load the TLS files; any failure stops the daemon at start."""
        self.context = server_context(self.config)
        host, port = split_host_port(self.config.listen_tcp)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            sock.close()
            raise OSError(error.errno, error.strerror, self.config.listen_tcp) from error
        sock.listen(512)
        sock.setblocking(False)
        self.sock = sock
        log.info("listening on tcp %s (%s)", self.address,
                 "plaintext, loopback only" if self.context is None else "mutual TLS")
        if self.context is not None and not self.config.tls_allowed_clients:
            log.warning("listen_tcp: tls_allowed_clients is empty: any client certificate "
                        "the CA signed is let in")

    @property
    def address(self) -> str:
        """Where it listens, with the port the kernel chose for port 0."""
        assert self.sock is not None
        host, port = self.sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start_accepting(self) -> None:
        assert self.sock is not None
        self.selector.register(self.sock, selectors.EVENT_READ, self.on_listener_event)
        self.accepting = True

    def tick(self, now: float) -> None:
        if self.resting.over(now):
            self.start_accepting()

    def on_listener_event(self, _events: int) -> None:
        try:
            self.accept()
        except OSError as error:
            if not out_of_fds(error):
                raise
            assert self.sock is not None
            self.selector.unregister(self.sock)
            self.accepting = False
            self.resting.begin(error)
            self.events["accept_paused"] += 1
            return
        self.resting.accepted()

    def accept(self) -> None:
        assert self.sock is not None
        for sock in accept_ready(self.sock, "tcp"):
            # Replies are small frames: Nagle's wait for an ACK the peer delays costs
            # 40 ms a reply.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            address = _address_of(sock)
            refusal = self.refusal(address)
            if refusal is not None:
                self.events["connections_refused"] += 1
                log.warning("refused a TCP connection from %s: %s", address, refusal)
                if self.context is None:
                    refuse(sock, OVERLOADED, refusal)
                else:
                    sock.close()  # nothing can be said before the handshake
                continue
            self.per_address[address] += 1
            if self.context is None:
                self.server.add_connection(sock, address=address)
                continue
            tls = self.context.wrap_socket(sock, server_side=True,
                                           do_handshake_on_connect=False)
            handshake = Handshake(tls, address, time.monotonic())
            handshake.handler = functools.partial(self.on_handshake_event, handshake)
            self.handshakes[tls.fileno()] = handshake
            self.watch(handshake, selectors.EVENT_READ)

    def refusal(self, address: str) -> str | None:
        config = self.config
        if self.per_address[address] >= config.max_connections_per_address:
            return (f"{self.per_address[address]} connections from this address, the most "
                    "one may hold (max_connections_per_address)")
        if len(self.server.connections) + len(self.handshakes) >= config.max_connections:
            return "every connection slot is taken (max_connections)"
        return None

    def watch(self, handshake: Handshake, events: int) -> None:
        if handshake.watched == events:
            return
        if handshake.watched:
            self.selector.modify(handshake.sock, events, handshake.handler)
        else:
            self.selector.register(handshake.sock, events, handshake.handler)
        handshake.watched = events

    def on_handshake_event(self, handshake: Handshake, _events: int) -> None:
        try:
            handshake.sock.do_handshake()
        except ssl.SSLWantReadError:
            self.watch(handshake, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self.watch(handshake, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as error:
            self.fail(handshake, f"TLS handshake failed: {getattr(error, 'reason', None) or error}")
            return
        cert = handshake.sock.getpeercert()
        names = identities(cert) if cert else set()
        if not self.allows(names):
            self.fail(handshake, f"client certificate {sorted(names)} is not in "
                      "tls_allowed_clients", reply=True)
            return
        self.forget(handshake)
        connection = self.server.add_connection(handshake.sock, address=handshake.address)
        connection.identities = frozenset(names)
        log.debug("TLS client %s from %s", sorted(names), handshake.address)

    def allows(self, names: set[str] | frozenset[str]) -> bool:
        allowed = self.config.tls_allowed_clients
        return not allowed or not names.isdisjoint(allowed)

    def fail(self, handshake: Handshake, why: str, *, reply: bool = False) -> None:
        self.events["tls_refused"] += 1
        log.warning("refused a TLS peer at %s: %s", handshake.address, why)
        if reply:
            self.forget(handshake)
            self.linger(handshake.sock, handshake.address, encode_frame(error_reply(
                None, FORBIDDEN, "this client certificate may not use kvprefetchd")))
            return
        self.close_handshake(handshake)

    def linger(self, sock: ssl.SSLSocket, address: str, farewell: bytes) -> None:
        """Send one last frame, end our side, and wait for the peer to close."""
        with contextlib.suppress(OSError):
            sock.send(farewell)  # a few hundred bytes: the socket buffer takes them
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_WR)
        fd = sock.fileno()
        self.lingering[fd] = (sock, time.monotonic() + LINGER_S, address)
        self.selector.register(sock, selectors.EVENT_READ,
                               functools.partial(self.on_linger_event, fd))

    def on_linger_event(self, fd: int, _events: int) -> None:
        sock, _, _ = self.lingering[fd]
        try:
            if socket.socket.recv(sock, 4096):
                return  # discarded; wait for the close
        except BlockingIOError:
            return
        except OSError:
            pass
        self.end_linger(fd)

    def end_linger(self, fd: int) -> None:
        sock, _, address = self.lingering.pop(fd)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)
        self.release(address)
        with contextlib.suppress(OSError):
            sock.close()

    def forget(self, handshake: Handshake) -> None:
        self.handshakes.pop(handshake.sock.fileno(), None)
        if handshake.watched:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(handshake.sock)
            handshake.watched = 0

    def close_handshake(self, handshake: Handshake) -> None:
        self.forget(handshake)
        self.release(handshake.address)
        with contextlib.suppress(OSError):
            handshake.sock.close()

    def release(self, address: str) -> None:
        """A connection or handshake from `address` ended."""
        self.per_address[address] -= 1
        if self.per_address[address] <= 0:
            del self.per_address[address]

    def sweep(self, now: float) -> None:
        for fd, (_, until, _) in list(self.lingering.items()):
            if now >= until:
                self.end_linger(fd)
        timeout = self.config.tls_handshake_timeout
        for handshake in list(self.handshakes.values()):
            if timeout and now - handshake.started > timeout:
                self.events["tls_handshake_timeouts"] += 1
                log.warning("closed a TLS handshake from %s unfinished after %.1f s",
                            handshake.address, timeout)
                self.close_handshake(handshake)

    def apply(self, config: Config) -> None:
        """A reload: the TLS files read again (a bad set is refused, the old kept), and
        connections whose identity the new list no longer names are cut."""
        self.config = config
        if self.context is not None:
            try:
                self.context = server_context(config)
            except TlsSetupError as error:
                self.events["tls_reload_refused"] += 1
                log.error("reload: %s; the TLS files in force are kept", error)
        for connection in list(self.server.connections.values()):
            if connection.address is None or self.context is None:
                continue
            if not self.allows(connection.identities):
                log.warning("reload: TLS client %s at %s is no longer allowed; its connection "
                            "is closed", sorted(connection.identities), connection.address)
                self.server.revoke(connection)

    def close(self) -> None:
        for fd in list(self.lingering):
            self.end_linger(fd)
        for handshake in list(self.handshakes.values()):
            self.close_handshake(handshake)
        if self.sock is not None:
            if self.accepting:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(self.sock)
            self.accepting = False
            self.sock.close()
            self.sock = None


def _address_of(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"
