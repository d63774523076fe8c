"""The listening socket and the client connections: accept, peer checks, bytes in, frames out.

Knows sockets and frames, not ops: each complete frame is handed to the `on_frame`
callback, and replies come back through `Connection.send` (connection.py), buffered and
never blocking. Registered on the supervisor's selector with callbacks as key data, so
the event loop only calls them.

Who may hold a connection: peers the policy names (re-checked on every reload: a uid
taken out of `allowed_uids` loses its open connections), at most
`max_connections_per_uid` each and `max_connections` in all, plus a reserve of
PRIVILEGED_RESERVE that only root and the daemon's own user may use, so an operator's
ping gets through while others hog every slot. A connection that owes and asks nothing
for `idle_timeout`, or leaves a frame unfinished for `frame_timeout`, is closed.

What one connection throws costs that connection only: an error its peer caused (a
reset, TLS's EOF without close_notify: peer_errors.py) closes it quietly, and any other
exception out of its callback is logged with the peer, counted (`connection_errors`)
and closes it too (listening.Unforeseen); the loop goes on. The listener's own errors
(out of fds: a rest, see listening.AcceptRest) are not a peer's and are not swallowed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
import selectors
import socket
import time
import zlib
from collections import Counter
from collections.abc import Callable

from kvprefetchd import systemd
from kvprefetchd.config import Config
from kvprefetchd.listeners.connection import Connection, InputPool
from kvprefetchd.listeners.listening import (
    AcceptRest,
    Unforeseen,
    accept_ready,
    listen_unix,
    out_of_fds,
    refuse,
)
from kvprefetchd.listeners.peers import PRIVILEGED_RESERVE, Peer, PeerPolicy, Seats, peer_of
from kvprefetchd.listeners.tcp import TcpListener
from kvprefetchd.protocol import FORBIDDEN, OVERLOADED, TOO_LARGE, error_reply

log = logging.getLogger("kvprefetchd.server")

# How often idle and slow connections are looked for (their timeouts are this coarse).
SWEEP_SECONDS = 1.0


class Server:
    """The request socket and its connections, on the supervisor's selector.

    `on_frame(connection, payload)` is called for every whole frame; an oversized frame
    is answered `too_large` here (framing is the server's business) and skipped.
    """

    def __init__(
        self,
        config: Config,
        selector: selectors.BaseSelector,
        on_frame: Callable[[Connection, bytes], None],
        events: Counter[str],
        requests: Counter[str],
    ) -> None:
        self.config = config
        self.selector = selector
        self.on_frame = on_frame
        self.events = events  # connections_refused, peers_forbidden, accept_paused, ...
        self.requests = requests  # oversized frames count as requests that never parsed
        self.listener: socket.socket | None = None
        # (dev, ino) of the socket file we bound; None for a socket handed to us (systemd's
        # socket activation): its file belongs to whoever made it.
        self.socket_file: tuple[int, int] | None = None
        self.connections: dict[int, Connection] = {}
        self.seats = Seats()  # open connections by peer uid
        self.input_pool = InputPool(config.max_input_buffer_bytes, events)
        self.peer_policy: PeerPolicy | None = None  # made once the socket exists
        self.resting = AcceptRest("requests", log)  # out of fds: not accepting for a while
        self.next_sweep = time.monotonic() + SWEEP_SECONDS
        self.tcp: TcpListener | None = None  # listen_tcp: routers on other hosts
        self.unforeseen = Unforeseen(events, log)  # one peer's unexpected errors

    # ---- the listener ------------------------------------------------------------------------

    def listen(self, listener: socket.socket | None = None) -> None:
        """Take the given socket, or systemd's (socket activation), or bind our own."""
        if listener is None:
            passed = systemd.listen_fds()
            if passed:
                listener = passed[0]
                listener.setblocking(False)
            else:
                listener = listen_unix(self.config.socket, self.config.socket_mode)
                info = os.lstat(self.config.socket)
                self.socket_file = (info.st_dev, info.st_ino)
        self.listener = listener
        if self.config.listen_tcp and self.tcp is None:
            self.tcp = TcpListener(self, self.config, self.selector, self.events)
            try:
                self.tcp.listen()
            except BaseException:
                self.tcp = None
                self.close_listener()  # the socket file we bound goes too
                raise
        ensure_fd_room(self.config.max_connections + PRIVILEGED_RESERVE + 256)

    def start_accepting(self) -> None:
        assert self.listener is not None
        self.selector.register(self.listener, selectors.EVENT_READ, self.on_listener_event)
        if self.tcp is not None and not self.tcp.accepting:
            self.tcp.start_accepting()

    def on_listener_event(self, _events: int) -> None:
        assert self.listener is not None
        try:
            for sock in accept_ready(self.listener, "requests"):
                self.take(sock)
        except OSError as error:
            if not out_of_fds(error):
                raise
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.listener)
            self.resting.begin(error)
            self.events["accept_paused"] += 1
            return
        self.resting.accepted()

    def take(self, sock: socket.socket) -> None:
        """One accepted socket: admitted or refused. What goes wrong here is this peer's
        alone (it is closed), unless the daemon is out of fds (the listener rests)."""
        try:
            peer = self.admit_peer(sock)
            if peer is not None:
                self.add_connection(sock, peer)
        except Exception as error:
            if isinstance(error, OSError) and out_of_fds(error):
                sock.close()
                raise
            connection = self.connections.get(sock.fileno()) if sock.fileno() >= 0 else None
            if connection is not None and connection.sock is sock:
                self.fail(connection, error)
            else:
                self.unforeseen.happened("a new peer on the request socket", error)
                with contextlib.suppress(OSError):
                    sock.close()

    def next_due(self, now: float) -> float | None:
        dues = [] if self.resting.until is None else [self.resting.until - now]
        if self.tcp is not None and self.tcp.resting.until is not None:
            dues.append(self.tcp.resting.until - now)
        handshakes = self.tcp is not None and (self.tcp.handshakes or self.tcp.lingering)
        if ((self.connections and (self.config.idle_timeout or self.config.frame_timeout))
                or handshakes):
            dues.append(self.next_sweep - now)
        return max(0.0, min(dues)) if dues else None

    def tick(self, now: float) -> None:
        if self.resting.over(now) and self.listener is not None:
            self.start_accepting()
        if now >= self.next_sweep:
            self.next_sweep = now + SWEEP_SECONDS
            self.sweep(now)
            if self.tcp is not None:
                self.tcp.sweep(now)
        if self.tcp is not None:
            self.tcp.tick(now)

    def close_listener(self) -> None:
        if self.tcp is not None:
            self.tcp.close()
        if self.listener is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        self.listener.close()
        self.listener = None
        if self.socket_file is not None:
            # Only the file we bound: if its directory was removed and another daemon
            # bound the path since, the socket there is that daemon's.
            with contextlib.suppress(OSError):
                info = os.lstat(self.config.socket)
                if (info.st_dev, info.st_ino) == self.socket_file:
                    os.unlink(self.config.socket)
            self.socket_file = None

    # ---- peers ---------------------------------------------------------------------------

    def policy(self) -> PeerPolicy:
        if self.peer_policy is None:
            self.peer_policy = PeerPolicy.default(
                self.config.socket, self.config.allowed_uids, self.config.allowed_gids
            )
        return self.peer_policy

    def admit_peer(self, sock: socket.socket) -> Peer | None:
        """The peer, if it may have one more connection; else it gets one error reply
        (`forbidden`, or `overloaded` when its share or every slot is taken) and is closed."""
        try:
            peer = peer_of(sock)
        except OSError as error:
            log.warning("cannot read a peer's credentials (%s); refused", error)
            sock.close()
            return None
        if not self.policy().allows(peer):
            log.warning("refused a peer: pid %d uid %d is not allowed", peer.pid, peer.uid)
            self.events["peers_forbidden"] += 1
            refuse(sock, FORBIDDEN, "this user may not use kvprefetchd")
            return None
        refusal = self.seats.refusal(peer, len(self.connections), self.config.max_connections,
                                     self.config.max_connections_per_uid)
        if refusal is not None:
            self.events["connections_refused"] += 1
            refuse(sock, OVERLOADED, refusal)
            return None
        return peer

    def revoke_peers(self) -> None:
        """A reload: cut every open connection whose peer the new policy no longer allows."""
        policy = self.policy()
        for connection in list(self.connections.values()):
            peer = connection.peer
            if peer is None or policy.allows(peer):
                continue
            log.warning("reload: uid %d (pid %d) is no longer allowed; its connection is closed",
                        peer.uid, peer.pid)
            self.revoke(connection)

    def revoke(self, connection: Connection) -> None:
        """One `forbidden` reply (no id), then closed."""
        self.events["peers_revoked"] += 1
        connection.send(error_reply(None, FORBIDDEN, "this peer may no longer use kvprefetchd"))
        connection.flush()
        self.drop(connection)

    # ---- connections -----------------------------------------------------------------------

    def add_connection(self, sock: socket.socket, peer: Peer | None = None,
                       address: str | None = None) -> Connection:
        connection = Connection(
            sock, self.config.max_frame_bytes, self.config.max_output_bytes, self.refresh,
            pool=self.input_pool, peer=peer, events=self.events,
        )
        connection.address = address
        if address is not None:
            # The input pool's fairness is per user; a TCP peer has no uid, so each
            # address is a user of its own (negative: never a real uid).
            connection.user = -2 - zlib.crc32(address.encode())
        self.connections[sock.fileno()] = connection
        if peer is not None:
            self.seats.take(peer)
        connection.handler = functools.partial(self.on_connection_event, connection)
        self.refresh(connection)
        return connection

    def on_connection_event(self, connection: Connection, events: int) -> None:
        """The selector's callback for one connection: whatever it throws closes it only."""
        if connection.closed:
            return  # dropped earlier in this turn (its event was already in the list)
        try:
            self.handle(connection, events)
        except Exception as error:
            self.fail(connection, error)

    def fail(self, connection: Connection, error: Exception) -> None:
        """An exception no rule foresaw came out of this connection: logged with its peer,
        counted, and the connection closed; the daemon and its other peers go on."""
        self.unforeseen.happened(connection.who(), error)
        connection.broken = True
        try:
            self.drop(connection)
        except Exception:  # the books may be half updated: make sure it is gone at least
            log.exception("closing the connection of %s failed", connection.who())
            for fd, held in list(self.connections.items()):
                if held is connection:
                    del self.connections[fd]
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.selector.unregister(connection.sock)
            connection.close()

    def handle(self, connection: Connection, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            connection.flush()
        if events & selectors.EVENT_READ and connection.wants_input():
            connection.fill()
        self.serve(connection)
        # TLS may hold decrypted bytes the socket will never poll readable for again.
        while (connection.tls_pending() and connection.wants_input()
               and not (connection.broken or connection.closed)):
            connection.fill()
            self.serve(connection)
        self.refresh(connection)

    def serve(self, connection: Connection) -> None:
        """Hand on every whole frame buffered (until its client is backlogged), then
        settle what the connection may read next."""
        took = False
        output, most = connection.output, connection.max_output_bytes  # (kept flat: per frame)
        for frame in connection.frames.take():
            took = True
            connection.owed += 1
            payload = frame.payload
            if payload is None:
                self.requests[f"none:error_{TOO_LARGE}"] += 1
                connection.send(error_reply(
                    None, TOO_LARGE, f"frame of {frame.skipped_bytes} bytes exceeds the limit "
                    f"of {connection.frames.max_frame_bytes}",
                ))
            else:
                self.on_frame(connection, payload)
            if len(output) > most or connection.closed or connection.broken:
                break  # backlogged: the rest stays buffered until its client reads
        if took:
            connection.activity += 1
        for woken in connection.settle_input(took):
            self.refresh(woken)

    def refresh(self, connection: Connection) -> None:
        """Drop a connection that broke or closed; else watch what it needs now (a
        selector call only when that changed: replies are sent once per request)."""
        if connection.broken or connection.closed:
            if connection.failure is not None:
                self.unforeseen.happened(connection.who(), connection.failure)
                connection.failure = None
            self.drop(connection)
            return
        wanted = connection.wanted_events()
        if wanted == connection.watched:
            return
        if not wanted:
            self.selector.unregister(connection.sock)
        elif not connection.watched:
            self.selector.register(connection.sock, wanted, connection.handler)
        else:
            self.selector.modify(connection.sock, wanted, connection.handler)
        connection.watched = wanted

    def drop(self, connection: Connection) -> None:
        fd = connection.fileno()
        if fd >= 0 and self.connections.get(fd) is connection:
            del self.connections[fd]
            if connection.watched:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(connection.sock)
            connection.watched = 0
            if connection.peer is not None:
                self.seats.give_back(connection.peer)
            if connection.address is not None and self.tcp is not None:
                self.tcp.release(connection.address)
        connection.close()
        for woken in self.input_pool.give_back(connection):
            self.refresh(woken)

    def drop_all(self) -> None:
        for connection in list(self.connections.values()):
            self.drop(connection)

    def sweep(self, now: float) -> None:
        """Close connections idle past idle_timeout, or slow past frame_timeout."""
        idle, slow = self.config.idle_timeout, self.config.frame_timeout
        for connection in list(self.connections.values()):
            since = connection.partial_since
            if slow and since is not None and now - since > slow:
                self.events["connections_closed_slow"] += 1
                log.debug("closed a connection whose frame stayed unfinished for %.0f s", slow)
                self.drop(connection)
            elif idle and now - (connection.idle_since(now) or now) > idle:
                self.events["connections_closed_idle"] += 1
                self.drop(connection)

    def unsent(self) -> bool:
        """Replies still waiting to go out to a live client (the drain flushes them)."""
        return any(c.output for c in self.connections.values() if not c.broken)

    def apply(self, config: Config) -> None:
        """A reload: new limits for every connection; allowed peers re-checked now."""
        self.config = config
        self.peer_policy = None
        self.input_pool.limit = config.max_input_buffer_bytes
        for connection in self.connections.values():
            connection.set_limits(config.max_frame_bytes, config.max_output_bytes)
        self.revoke_peers()
        if self.tcp is not None:
            self.tcp.apply(config)
        for woken in self.input_pool.serve():
            self.refresh(woken)


def ensure_fd_room(wanted: int) -> None:
    """Raise the soft RLIMIT_NOFILE towards the hard one, so that the connection caps
    (and not EMFILE, which refuses root too) decide who gets a connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
