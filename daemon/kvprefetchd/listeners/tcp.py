"""The TCP listener: routers on other hosts, over mutual TLS, in the supervisor's one loop.

A daemon on a GPU node warms the node's own page cache for a router on a gateway host, so
it must take requests over the network; the Unix socket's gate (SO_PEERCRED) means nothing
there. Instead: TLS 1.2+, a client certificate signed by `tls_client_ca_file` is required,
and its identity must be one of `tls_allowed_clients`: its SAN DNS or URI names (e.g. a
SPIFFE ID) when it has any, else the subject's CN (RFC 6125: tls_identity.py). Plaintext
is refused, except on loopback when `tcp_plaintext_loopback` asks for it (tests).

Nothing here blocks or starts a thread: sockets are non-blocking, the handshake is driven
by the selector (want-read, want-write) and bounded by `tls_handshake_timeout`, and a
connection that finished it becomes an ordinary Connection (same frames, limits, books).

Strangers cannot lock routers out or take the loop (issue 23, finding 3; handshakes.py):
- handshakes have slots of their own, `max_tls_handshakes` (64), apart from the
  established connections of `max_connections`, which only a listed identity reaches;
  when every handshake slot is taken a newcomer displaces the oldest handshake of the
  address holding the most, if it holds more than the newcomer's (fair share: 17
  addresses x 64 silent handshakes hold ~4 slots each, and a router's gets in);
- new handshakes are rate-limited by token buckets: `tls_handshake_rate_per_address`
  a second per address (at accept), and `tls_handshake_rate` a second for all addresses
  together (when the first message comes: silent connections never spend it), which
  addresses a listed router connected from before skip (the reserve for routers already
  seen); a connection over a rate or with no slot is closed at once, unread;
- at most HANDSHAKE_STEPS handshake steps (~1.4 ms a handshake) per turn of
  the loop, and ACCEPTS_PER_TURN accepts: a flood waits its turn behind the Unix
  socket's pings instead of making them wait;
- refusals are counted always and logged a few per ten seconds (listening.Hush).
At most `max_connections_per_address` connections and handshakes per address.

SIGHUP re-reads the certificate files; a bad new set is refused and the old one kept,
like a bad config; connections whose identity the new list drops, or whose chain ended
at a CA the new `tls_client_ca_file` no longer holds, are cut (`tls_ca_revoked`).
Whatever a peer's socket throws costs that peer only (peer_errors.py, listening.Unforeseen).
The TLS context is made in tls_context.py; refused peers are let go in linger.py.
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
from typing import Protocol

from kvprefetchd.addresses import split_host_port
from kvprefetchd.config import Config
from kvprefetchd.listeners.connection import Connection
from kvprefetchd.listeners.handshakes import Handshake, HandshakeGate, displaced
from kvprefetchd.listeners.linger import Lingering
from kvprefetchd.listeners.listening import (
    AcceptRest,
    Hush,
    Unforeseen,
    accept_ready,
    out_of_fds,
    refuse,
)
from kvprefetchd.listeners.peer_errors import caused_by_peer, describe, would_block
from kvprefetchd.listeners.tls_context import TlsSetupError, server_context
from kvprefetchd.listeners.tls_identity import identities, trust_of, trusted
from kvprefetchd.protocol import FORBIDDEN, OVERLOADED, encode_frame, error_reply

log = logging.getLogger("kvprefetchd.tcp")
# Handshake steps (do_handshake calls) and accepts per turn of the loop. A handshake costs
# the supervisor ~1.4 ms in all, most of it in the step that does the key exchange and the
# signature (0.3.0 measured: 374 certificate-less handshakes a second took 54% of a core,
# ECDSA P-256, 2-vCPU VM); the rest wait one turn, their sockets still ready.
HANDSHAKE_STEPS = 8
ACCEPTS_PER_TURN = 64


class Connections(Protocol):
    """What the listener asks of the server that keeps the connections (server.py, which
    makes the listener: named here so that this module does not import it back)."""

    connections: dict[int, Connection]
    unforeseen: Unforeseen

    def add_connection(self, sock: socket.socket, *, address: str) -> Connection: ...

    def revoke(self, connection: Connection) -> None: ...


@dataclass
class TcpListener:
    """The listening socket, the handshakes in progress, and connections per address."""

    server: Connections
    config: Config
    selector: selectors.BaseSelector
    events: Counter[str]
    sock: socket.socket | None = None
    context: ssl.SSLContext | None = None
    trusted: frozenset[bytes] = frozenset()  # what tls_identity.trust_of may say now
    handshakes: dict[int, Handshake] = field(default_factory=dict)
    per_address: Counter[str] = field(default_factory=Counter)
    lingering: Lingering = field(init=False)  # refused peers told why, until they close
    accepting: bool = False
    resting: AcceptRest = field(default_factory=lambda: AcceptRest("tcp", log))
    gate: HandshakeGate = field(init=False)
    hush: Hush = field(default_factory=lambda: Hush(log))
    steps: int = 0  # handshake steps this turn of the loop

    def __post_init__(self) -> None:
        self.gate = HandshakeGate(self.config.tls_handshake_rate,
                                  self.config.tls_handshake_rate_per_address)
        self.lingering = Lingering(self.selector, self.release, self.server.unforeseen)

    def listen(self) -> None:
        """Bind and load the TLS files; any failure stops the daemon at start."""
        self.use_context(server_context(self.config))
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

    def use_context(self, context: ssl.SSLContext | None) -> None:
        self.context = context
        self.trusted = trusted(context) if context is not None else frozenset()

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
        self.steps = 0  # a new turn of the loop
        if self.resting.over(now):
            self.start_accepting()

    # ---- accepting -------------------------------------------------------------------------

    def on_listener_event(self, _events: int) -> None:
        assert self.sock is not None
        try:
            for sock in accept_ready(self.sock, "tcp", ACCEPTS_PER_TURN):
                self.take(sock)
        except OSError as error:
            if not out_of_fds(error):
                raise
            self.selector.unregister(self.sock)
            self.accepting = False
            self.resting.begin(error)
            self.events["accept_paused"] += 1
            return
        self.resting.accepted()

    def take(self, sock: socket.socket) -> None:
        """One accepted socket: a handshake begun, a plaintext connection, or refused.
        What goes wrong here is this peer's alone, unless the daemon is out of fds."""
        address = "?"
        try:
            address = _address_of(sock)
            self.begin(sock, address)
        except Exception as error:
            if isinstance(error, OSError) and out_of_fds(error):
                sock.close()
                raise
            self.server.unforeseen.happened(f"{address} (new TCP peer)", error)
            with contextlib.suppress(OSError):
                sock.close()  # (a no-op once wrapped: the handshake closed its own)

    def begin(self, sock: socket.socket, address: str) -> None:
        """The caps (per address, connections), then the address's rate and a handshake
        slot (displacing another's when all are taken), then the handshake's first wait."""
        # Replies are small frames: Nagle's wait for an ACK the peer delays costs
        # 40 ms a reply.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        refusal = self.refusal(address)
        if refusal is not None:
            self.events["connections_refused"] += 1
            self.hush.warning("refused", "refused a TCP connection from %s: %s", address,
                              refusal)
            if self.context is None:
                refuse(sock, OVERLOADED, refusal)
            else:
                sock.close()  # nothing can be said before the handshake
            return
        if self.context is None:
            self.per_address[address] += 1
            self.server.add_connection(sock, address=address)
            return
        refusal = self.gate.admit(address)
        if refusal is None and len(self.handshakes) >= self.config.max_tls_handshakes:
            victim = displaced(self.handshakes.values(), address)
            if victim is None:
                refusal = "every handshake slot is taken (max_tls_handshakes)"
            else:
                self.events["tls_handshakes_displaced"] += 1
                self.hush.warning("displaced", "closed a TLS handshake from %s for one from "
                                  "%s: every slot was taken (max_tls_handshakes)",
                                  victim.address, address)
                self.close_handshake(victim)
        if refusal is not None:
            self.events["tls_handshakes_limited"] += 1
            self.hush.warning("limited", "refused a TLS handshake from %s: %s", address,
                              refusal)
            sock.close()
            return
        assert self.context is not None
        try:
            tls = self.context.wrap_socket(sock, server_side=True,
                                           do_handshake_on_connect=False)
        except OSError as error:
            sock.close()
            if not caused_by_peer(error):
                raise
            return
        self.per_address[address] += 1
        handshake = Handshake(tls, address, time.monotonic())
        handshake.handler = functools.partial(self.on_handshake_event, handshake)
        self.handshakes[tls.fileno()] = handshake
        try:
            self.watch(handshake, selectors.EVENT_READ)
        except Exception:
            self.close_handshake(handshake)
            raise

    def refusal(self, address: str) -> str | None:
        """Why a connection from `address` may not even begin (counted by address: its
        handshakes and connections; the connection slots, full of listed routers)."""
        config = self.config
        if self.per_address[address] >= config.max_connections_per_address:
            return (f"{self.per_address[address]} connections from this address, the most "
                    "one may hold (max_connections_per_address)")
        if len(self.server.connections) >= config.max_connections:
            return "every connection slot is taken (max_connections)"
        return None

    # ---- handshakes ------------------------------------------------------------------------

    def watch(self, handshake: Handshake, events: int) -> None:
        if handshake.watched == events:
            return
        if handshake.watched:
            self.selector.modify(handshake.sock, events, handshake.handler)
        else:
            self.selector.register(handshake.sock, events, handshake.handler)
        handshake.watched = events

    def on_handshake_event(self, handshake: Handshake, _events: int) -> None:
        """The selector's callback for one handshake: whatever it throws closes it only."""
        if self.handshakes.get(handshake.sock.fileno()) is not handshake:
            return  # closed earlier in this turn (displaced): its event was already listed
        try:
            self.step(handshake)
        except Exception as error:
            self.server.unforeseen.happened(f"{handshake.address} (TLS handshake)", error)
            self.close_handshake(handshake)

    def step(self, handshake: Handshake) -> None:
        if self.steps >= HANDSHAKE_STEPS:
            return  # its turn is the next one: the socket is still ready, the loop comes back
        if not handshake.charged:
            refusal = self.gate.charge(handshake.address)
            if refusal is not None:
                self.events["tls_handshakes_limited"] += 1
                self.hush.warning("limited", "refused a TLS handshake from %s: %s",
                                  handshake.address, refusal)
                self.close_handshake(handshake)
                return
            handshake.charged = True
        self.steps += 1
        try:
            handshake.sock.do_handshake()
        except OSError as error:
            if isinstance(error, ssl.SSLWantWriteError):
                self.watch(handshake, selectors.EVENT_WRITE)
            elif would_block(error):
                self.watch(handshake, selectors.EVENT_READ)
            elif caused_by_peer(error):
                self.fail(handshake, f"TLS handshake failed: {describe(error)}")
            else:
                raise
            return
        self.finished(handshake)

    def finished(self, handshake: Handshake) -> None:
        """The handshake succeeded: an allowed, still-trusted identity with a free slot
        becomes a connection; anyone else is told why (forbidden, overloaded) and closed."""
        cert = handshake.sock.getpeercert()
        names = identities(cert) if cert else set()
        if not self.allows(names):
            self.fail(handshake, f"client certificate {sorted(names)} is not in "
                      "tls_allowed_clients", reply=FORBIDDEN)
            return
        trust = trust_of(handshake.sock)
        if trust is not None and trust not in self.trusted:
            # Begun under the CA file a reload has since replaced.
            self.fail(handshake, "its CA is no longer in tls_client_ca_file", reply=FORBIDDEN)
            return
        if len(self.server.connections) >= self.config.max_connections:
            self.events["connections_refused"] += 1
            self.fail(handshake, "every connection slot is taken (max_connections)",
                      reply=OVERLOADED, counted=True)
            return
        self.forget(handshake)
        self.gate.seen(handshake.address)
        connection = self.server.add_connection(handshake.sock, address=handshake.address)
        connection.identities = frozenset(names)
        connection.trust = trust
        log.debug("TLS client %s from %s", sorted(names), handshake.address)

    def allows(self, names: set[str] | frozenset[str]) -> bool:
        allowed = self.config.tls_allowed_clients
        return not allowed or not names.isdisjoint(allowed)

    def fail(self, handshake: Handshake, why: str, *, reply: str | None = None,
             counted: bool = False) -> None:
        if not counted:
            self.events["tls_refused"] += 1
        self.hush.warning("tls", "refused a TLS peer at %s: %s", handshake.address, why)
        if reply is not None:
            self.forget(handshake)
            message = ("this client certificate may not use kvprefetchd" if reply == FORBIDDEN
                       else why)
            self.lingering.linger(handshake.sock, handshake.address,
                                  encode_frame(error_reply(None, reply, message)))
            return
        self.close_handshake(handshake)

    # ---- books -----------------------------------------------------------------------------

    def forget(self, handshake: Handshake) -> None:
        for fd, held in list(self.handshakes.items()):
            if held is handshake:
                del self.handshakes[fd]
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
        self.lingering.sweep(now)
        timeout = self.config.tls_handshake_timeout
        for handshake in list(self.handshakes.values()):
            if timeout and now - handshake.started > timeout:
                self.events["tls_handshake_timeouts"] += 1
                self.hush.warning("timeout", "closed a TLS handshake from %s unfinished "
                                  "after %.1f s", handshake.address, timeout)
                self.close_handshake(handshake)
        self.gate.sweep()
        self.hush.sweep()

    # ---- reload and close --------------------------------------------------------------------

    def apply(self, config: Config) -> None:
        """A reload: the TLS files read again (a bad set is refused, the old kept), and
        connections whose identity the new list no longer names, or whose CA the new
        CA file no longer holds, are cut."""
        allowed_before, trusted_before = self.config.tls_allowed_clients, self.trusted
        self.config = config
        self.gate.configure(config.tls_handshake_rate, config.tls_handshake_rate_per_address)
        if self.context is not None:
            try:
                self.use_context(server_context(config))
            except TlsSetupError as error:
                self.events["tls_reload_refused"] += 1
                log.error("reload: %s; the TLS files in force are kept", error)
        if config.tls_allowed_clients != allowed_before or self.trusted != trusted_before:
            self.gate.forget_seen()
        for connection in list(self.server.connections.values()):
            if connection.address is None or self.context is None:
                continue
            if not self.allows(connection.identities):
                log.warning("reload: TLS client %s at %s is no longer allowed; its connection "
                            "is closed", sorted(connection.identities), connection.address)
                self.server.revoke(connection)
            elif connection.trust is not None and connection.trust not in self.trusted:
                self.events["tls_ca_revoked"] += 1
                log.warning("reload: the CA of TLS client %s at %s is no longer in "
                            "tls_client_ca_file; its connection is closed",
                            sorted(connection.identities), connection.address)
                self.server.revoke(connection)

    def close(self) -> None:
        self.lingering.close()
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
