"""Blocking client: one connection to kvprefetchd (its Unix socket, or its TCP listener
over mutual TLS), used from one thread.

Requests may be pipelined with send()/recv(); replies are matched by id, and replies read
while looking for another id are kept until asked for, so out-of-order `wait` replies cost
nothing. Not thread-safe: give each thread its own Client (connections are cheap).
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvprefetch import protocol
from kvprefetch.errors import ConnectFailed, ConnectionClosed, ProtocolError, Timeout
from kvprefetch.operations import Exchange, Operations
from kvprefetch.protocol import READ_CHUNK_BYTES, Reply

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(slots=True)
class _Pending:
    # A `wait` request may legitimately take timeout_ms before its reply: that much is added
    # to the client's own timeout for it.
    extra_s: float
    # False once a call gave up on it (Timeout): its late reply is read and discarded.
    wanted: bool = True


class Client(Operations):
    """Talk to kvprefetchd, blocking: its calls and settings are Operations'.

    The connection is made on first use and remade on the first call after it broke.
    """

    def _init_transport(self) -> None:
        self._sock: socket.socket | None = None
        self._frames = protocol.FrameBuffer(self.max_frame)
        self._pending: dict[int, _Pending] = {}  # sent on this connection, no reply yet
        self._ready: dict[int, Reply] = {}  # replied, not yet collected (arrival order)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- connection -----------------------------------------------------------------------

    def connect(self) -> None:
        """Connect now rather than on first use (to fail early); a no-op when connected."""
        if self._sock is None:
            self._sock = self._open()

    def _open(self) -> socket.socket:
        endpoint = self.endpoint
        try:
            if endpoint.kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                try:
                    sock.connect(endpoint.path)
                except OSError:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((endpoint.host, endpoint.port), self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if endpoint.kind == "tls":
                    assert self.ssl_context is not None
                    try:
                        sock = self.ssl_context.wrap_socket(sock, server_hostname=endpoint.host)
                    except OSError:
                        sock.close()
                        raise
        except OSError as exc:
            raise ConnectFailed(self.socket_path, exc) from exc
        # From here on every wait goes through poll(), which can watch for replies while a
        # send is blocked (see _write).
        sock.setblocking(False)
        return sock

    def close(self) -> None:
        self._drop()
        self._ready.clear()

    def _drop(self) -> None:
        """Forget the connection and whatever was in flight on it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._frames.clear()
        self._pending.clear()

    def _live_socket(self) -> socket.socket:
        """The socket to send on, replacing one the daemon has closed.

        With no reply awaited a closed peer shows as EOF, and reconnecting loses nothing; so
        an idle client survives a daemon restart without failing a call.
        """
        idle = not any(p.wanted for p in self._pending.values())
        if self._sock is not None and idle and self._peer_gone(self._sock):
            self._drop()
        if self._sock is None:
            self._sock = self._open()
        return self._sock

    @staticmethod
    def _peer_gone(sock: socket.socket) -> bool:
        try:
            # The raw stream, under TLS too (an SSLSocket takes no flags): EOF is EOF.
            return socket.socket.recv(sock, 1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _deadline(self, extra_s: float = 0.0) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout + extra_s

    def _wait(self, sock: socket.socket, events: int, deadline: float | None) -> int:
        poller = select.poll()
        poller.register(sock, events)
        timeout_ms = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1000
        ready = poller.poll(timeout_ms)
        if not ready:
            raise Timeout(f"kvprefetchd at {self.socket_path} did not answer in time")
        return ready[0][1]

    def _write(self, sock: socket.socket, frame: bytes, deadline: float | None) -> None:
        """Send all of `frame`, reading replies whenever the daemon is not reading.

        A pipelining daemon stops reading once its bounded output buffer is full; if the
        client only wrote, both sides would block on each other. Returns early if a refusal
        read meanwhile ended the connection: it answered this request too.
        """
        view = memoryview(frame)
        while view:
            events = self._wait(sock, select.POLLIN | select.POLLOUT, deadline)
            if events & select.POLLIN:
                self._read_some(sock)
                if self._sock is not sock:
                    return
            if events & (select.POLLOUT | select.POLLERR | select.POLLHUP):
                try:
                    view = view[sock.send(view) :]
                except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    pass
                except OSError as exc:
                    # The daemon may have answered before it closed (a refusal): the kernel
                    # hands over what it sent before it reports the close, so read it first.
                    self._read_some(sock)
                    if self._sock is not sock:
                        return
                    self._drop()
                    raise ConnectionClosed(f"connection to {self.socket_path} lost: {exc}") from exc

    def _read_some(self, sock: socket.socket) -> None:
        """Read what has arrived and file every complete reply under its request id."""
        try:
            data = sock.recv(READ_CHUNK_BYTES)
            # TLS may hold more decrypted bytes than one recv took: poll() will not say.
            while isinstance(sock, ssl.SSLSocket) and data and sock.pending():
                data += sock.recv(READ_CHUNK_BYTES)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError as exc:
            self._drop()
            raise ConnectionClosed(f"connection to {self.socket_path} lost: {exc}") from exc
        if not data:
            self._drop()
            raise ConnectionClosed(f"kvprefetchd at {self.socket_path} closed the connection")
        self._frames.feed(data)
        try:
            while (reply := self._frames.pop()) is not None:
                for request_id, answer in protocol.answers(reply, self._pending):
                    if self._pending.pop(request_id).wanted:
                        self._ready[request_id] = answer
                if protocol.is_refusal(reply):
                    self._drop()  # every request on it is answered; the next call reconnects
                    return
        except ProtocolError:
            self._drop()
            raise

    # --- pipelining primitives ------------------------------------------------------------

    def send(self, request: Mapping[str, Any]) -> int:
        """Send one request (a map with `op`; the client adds `v` and `id`); return its id."""
        request_id, frame = self._frame(request)
        sock = self._live_socket()
        # In flight before its first byte goes out: _write reads replies as it writes, and
        # the daemon may answer before the write is done (a refusal, an id-less error).
        self._pending[request_id] = _Pending(protocol.wait_allowance_s(request))
        try:
            self._write(sock, frame, self._deadline())
        except Timeout:
            self._drop()  # part of the frame may be out: the stream can no longer be trusted
            raise
        return request_id

    def recv(self, request_id: int | None = None) -> Reply:
        """The reply to `request_id`, or the next reply to arrive when None.

        Error replies are returned as they are (`ok: false`); protocol.check_reply raises them.
        """
        if request_id is None:
            awaited = [p for p in self._pending.values() if p.wanted]
            if not awaited and not self._ready:
                raise RuntimeError("recv() with no request outstanding")
            extra = max((p.extra_s for p in awaited), default=0.0)
        elif request_id in self._ready:
            return self._ready.pop(request_id)
        else:
            pending = self._pending.get(request_id)
            if pending is None or not pending.wanted:
                raise RuntimeError(
                    f"request {request_id} is not outstanding (never sent, already "
                    "collected, given up on, or lost with its connection)"
                )
            extra = pending.extra_s
        deadline = self._deadline(extra)
        while True:
            if request_id is None and self._ready:
                return self._ready.pop(next(iter(self._ready)))
            if request_id in self._ready:
                return self._ready.pop(request_id)
            if self._sock is None:
                raise ConnectionClosed(f"not connected to {self.socket_path}")
            self._wait(self._sock, select.POLLIN, deadline)
            self._read_some(self._sock)

    # --- carrying the calls ---------------------------------------------------------------

    @staticmethod
    def _method(build: Callable[P, Exchange[T]]) -> Callable[Concatenate[Client, P], T]:
        def call(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
            return self._perform(build(*args, **kwargs))

        return call

    def _perform(self, exchange: Exchange[T]) -> T:
        """Every request on the wire, then every reply collected, in that order. If one fails
        the rest are given up on: their late replies are skipped, never mistaken for the
        replies of later calls."""
        ids: list[int] = []
        replies: list[Reply] = []
        try:
            for request in exchange.requests:
                ids.append(self.send(request))
            for request_id in ids:
                replies.append(self.recv(request_id))
        except BaseException:
            for request_id in ids[len(replies) :]:
                if request_id in self._pending:
                    self._pending[request_id].wanted = False
                self._ready.pop(request_id, None)
            raise
        return exchange.parse(replies)
