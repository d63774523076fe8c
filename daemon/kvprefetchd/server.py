"""The listening socket and the client connections: accept, peer checks, bytes in, frames out.

Knows sockets and frames, not ops: each complete frame is handed to the `on_frame`
callback, and replies come back through `Connection.send`, buffered and never
blocking. Registered on the supervisor's selector with callbacks as key data, so the
event loop only calls them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import selectors
import socket
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from kvprefetchd import systemd
from kvprefetchd.config import Config
from kvprefetchd.peers import PeerPolicy, peer_of
from kvprefetchd.protocol import FORBIDDEN, TOO_LARGE, FrameReader, encode_frame, error_reply

log = logging.getLogger("kvprefetchd.server")

# Out of file descriptors, accept(2) fails and leaves the connection in the
# backlog, so the listener stays readable: a level-triggered loop that simply
# tried again would spin (measured: 70% of a CPU and 80,000 log lines in 2 s).
# The listener is taken out of the selector for this long instead.
ACCEPT_REST = 0.5
RECV_BYTES = 256 * 1024


class SocketInUse(RuntimeError):
    """Another live daemon answers on the socket path: refuse rather than steal it."""


def _remove_stale(path: str) -> None:
    """Unlink a leftover socket file, but only if nothing listens on it and it is a socket."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: nobody accepts on it
        log.info("removed stale socket %s", path)
        return
    except OSError as error:
        raise SocketInUse(f"{path}: cannot tell whether it is in use ({error})") from error
    finally:
        probe.close()
    raise SocketInUse(f"another kvprefetchd is serving on {path}")


def listen_unix(path: str, mode: int, backlog: int = 512) -> socket.socket:
    """Bind with the umask set around bind(), so the socket is never briefly too open.

    (A chmod after bind leaves a window in which anyone may connect.)
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except OSError as error:
        sock.close()
        # bind's error names no file; the operator needs to know which socket (the
        # request socket or the metrics one) and where: ENOSPC on a tmpfs out of inodes.
        raise OSError(error.errno, error.strerror, path) from error
    finally:
        os.umask(old_umask)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def out_of_fds(error: OSError) -> bool:
    """EMFILE (this process) or ENFILE (the system): the listener must rest (ACCEPT_REST)."""
    return error.errno in (errno.EMFILE, errno.ENFILE)


def accept_ready(listener: socket.socket, what: str) -> Iterator[socket.socket]:
    """Every connection waiting on a non-blocking listener, as non-blocking sockets.

    A peer that gave up before we accepted it costs that connection, never the
    event loop that called us. Running out of fds raises the OSError (see
    `out_of_fds`) after yielding what was accepted before it.
    """
    while True:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            if error.errno == errno.ECONNABORTED:
                continue
            if out_of_fds(error):
                log.debug("%s: accept: %s", what, error.strerror)
            raise
        sock.setblocking(False)
        yield sock


class Connection:
    """One client: its frame reader and a bounded buffer of replies not yet sent."""

    def __init__(
        self,
        sock: socket.socket,
        max_frame_bytes: int,
        max_output_bytes: int,
        on_change: Callable[[Connection], None] | None = None,
    ) -> None:
        self.sock = sock
        self.frames = FrameReader(max_frame_bytes)
        self.output = bytearray()
        self.max_output_bytes = max_output_bytes
        self.closed = False
        self.broken = False
        self.watched = 0  # the selector events registered for it now
        self.handler: Callable[[int], None] | None = None  # its selector callback
        self._on_change = on_change

    def fileno(self) -> int:
        return self.sock.fileno()

    def set_limits(self, max_frame_bytes: int, max_output_bytes: int) -> None:
        """A reload's new limits apply to the next frame and the next reply."""
        self.frames.max_frame_bytes = max_frame_bytes
        self.max_output_bytes = max_output_bytes

    def send(self, message: dict[str, Any]) -> None:
        if self.closed or self.broken:
            return
        self.output += encode_frame(message)
        self.flush()
        if self._on_change is not None:
            self._on_change(self)

    def flush(self) -> None:
        """Send what the kernel takes now; the rest waits for the socket to be writable."""
        while self.output and not (self.closed or self.broken):
            try:
                sent = self.sock.send(self.output)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                if error.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    # The server unregisters and closes it; closing here would
                    # leave the selector holding a dead fd.
                    self.broken = True
                    self.output.clear()
                    return
                raise
            del self.output[:sent]

    def receive(self) -> list[bytes | int]:
        """What one recv brought: each whole frame's payload, or the size of a frame
        skipped as too large (an int). EOF or a reset marks the connection broken."""
        try:
            data = self.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.broken = True
            return []
        return [
            frame.payload if frame.payload is not None else frame.skipped_bytes
            for frame in self.frames.feed(data)
        ]

    @property
    def backlogged(self) -> bool:
        """True once a client stops reading: we stop reading too instead of buffering forever."""
        return len(self.output) > self.max_output_bytes

    def wanted_events(self) -> int:
        """Read unless backlogged; write while output waits (never nothing: a paused,
        drained connection still needs an event to be noticed)."""
        events = 0 if self.backlogged else selectors.EVENT_READ
        if self.output:
            events |= selectors.EVENT_WRITE
        return events or selectors.EVENT_WRITE

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.output.clear()
            with contextlib.suppress(OSError):
                self.sock.close()


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
        self.events = events  # connections_refused, peers_forbidden, accept_paused
        self.requests = requests  # oversized frames count as requests that never parsed
        self.listener: socket.socket | None = None
        self.socket_passed = False  # systemd owns a passed socket's file
        self.connections: dict[int, Connection] = {}
        self.peer_policy: PeerPolicy | None = None  # made once the socket exists
        self.resting_until: float | None = None  # out of fds: not accepting
        self.out_of_fds_since: float | None = None

    # ---- the listener ------------------------------------------------------------------------

    def listen(self, listener: socket.socket | None = None) -> None:
        """Take the given socket, or systemd's (socket activation), or bind our own."""
        if listener is None:
            passed = systemd.listen_fds()
            if passed:
                listener = passed[0]
                listener.setblocking(False)
                self.socket_passed = True
            else:
                listener = listen_unix(self.config.socket, self.config.socket_mode)
        self.listener = listener

    def start_accepting(self) -> None:
        assert self.listener is not None
        self.selector.register(self.listener, selectors.EVENT_READ, self.on_listener_event)

    def on_listener_event(self, _events: int) -> None:
        assert self.listener is not None
        try:
            for sock in accept_ready(self.listener, "requests"):
                if len(self.connections) >= self.config.max_connections:
                    sock.close()
                    self.events["connections_refused"] += 1
                    continue
                if self.peer_allowed(sock):
                    self.add_connection(sock)
        except OSError as error:
            if not out_of_fds(error):
                raise
            self.rest(error)
            return
        if self.out_of_fds_since is not None:
            log.warning("accepting connections again after %.1f s out of file descriptors",
                        time.monotonic() - self.out_of_fds_since)
            self.out_of_fds_since = None

    def rest(self, error: OSError) -> None:
        """Out of fds: stop watching the listener for ACCEPT_REST s instead of spinning on it.

        Connections wait in the listen backlog until a connection closes or the
        limit is raised. Logged once per episode; counted as accept_paused.
        """
        assert self.listener is not None
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        self.resting_until = time.monotonic() + ACCEPT_REST
        self.events["accept_paused"] += 1
        if self.out_of_fds_since is None:
            self.out_of_fds_since = time.monotonic()
            log.warning("cannot accept connections: %s; they wait in the backlog (pausing "
                        "accept %.1f s at a time)", error.strerror, ACCEPT_REST)

    def next_due(self, now: float) -> float | None:
        return None if self.resting_until is None else max(0.0, self.resting_until - now)

    def tick(self, now: float) -> None:
        if self.resting_until is not None and now >= self.resting_until:
            self.resting_until = None
            if self.listener is not None:
                self.start_accepting()

    def close_listener(self) -> None:
        if self.listener is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        self.listener.close()
        self.listener = None
        if not self.socket_passed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket)

    # ---- peers ---------------------------------------------------------------------------

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
        self.events["peers_forbidden"] += 1
        with contextlib.suppress(OSError):
            refusal = error_reply(None, FORBIDDEN, "this user may not use kvprefetchd")
            sock.send(encode_frame(refusal))
        sock.close()
        return False

    # ---- connections -----------------------------------------------------------------------

    def add_connection(self, sock: socket.socket) -> Connection:
        connection = Connection(
            sock, self.config.max_frame_bytes, self.config.max_output_bytes, self.refresh
        )
        self.connections[sock.fileno()] = connection
        connection.watched = selectors.EVENT_READ
        connection.handler = functools.partial(self.on_connection_event, connection)
        self.selector.register(sock, connection.watched, connection.handler)
        return connection

    def on_connection_event(self, connection: Connection, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            connection.flush()
        if events & selectors.EVENT_READ:
            for frame in connection.receive():
                if isinstance(frame, int):
                    self.requests[f"none:error_{TOO_LARGE}"] += 1
                    connection.send(error_reply(
                        None, TOO_LARGE, f"frame of {frame} bytes exceeds the limit of "
                        f"{connection.frames.max_frame_bytes}",
                    ))
                else:
                    self.on_frame(connection, frame)
        self.refresh(connection)

    def refresh(self, connection: Connection) -> None:
        """Drop a connection that broke or closed; else watch what it needs now (a
        selector call only when that changed: replies are sent once per request)."""
        if connection.broken or connection.closed:
            self.drop(connection)
            return
        wanted = connection.wanted_events()
        if wanted != connection.watched:
            connection.watched = wanted
            self.selector.modify(connection.sock, wanted, connection.handler)

    def drop(self, connection: Connection) -> None:
        fd = connection.fileno()
        if fd >= 0 and self.connections.get(fd) is connection:
            del self.connections[fd]
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(connection.sock)
        connection.close()

    def drop_all(self) -> None:
        for connection in list(self.connections.values()):
            self.drop(connection)

    def unsent(self) -> bool:
        """Replies still waiting to go out to a live client (the drain flushes them)."""
        return any(c.output for c in self.connections.values() if not c.broken)

    def apply(self, config: Config) -> None:
        """A reload: new limits for every connection; allowed peers re-read on next accept."""
        self.config = config
        self.peer_policy = None
        for connection in self.connections.values():
            connection.set_limits(config.max_frame_bytes, config.max_output_bytes)
