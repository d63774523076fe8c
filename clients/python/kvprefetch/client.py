"""Blocking client: one Unix-socket connection to kvprefetchd, used from one thread.

Requests may be pipelined with send()/recv(); replies are matched by id, and replies read
while looking for another id are kept until asked for, so out-of-order `wait` replies cost
nothing. Not thread-safe: give each thread its own Client (connections are cheap).
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from kvprefetch import protocol, results
from kvprefetch.errors import ConnectFailed, ConnectionClosed, ProtocolError, Timeout
from kvprefetch.protocol import MAX_FRAME_BYTES, PathLike, Reply, default_socket
from kvprefetch.stats import Stats

_RECV_CHUNK = 256 * 1024


@dataclass(slots=True)
class _Pending:
    # A `wait` request may legitimately take timeout_ms before its reply: that much is added
    # to the client's own timeout for it.
    extra_s: float
    # False once a call gave up on it (Timeout): its late reply is read and discarded.
    wanted: bool = True


class Client:
    """Talk to kvprefetchd over `socket_path`.

    `timeout` (seconds, None for none) bounds connecting, sending and each wait for a reply;
    a `wait` request's own `timeout_ms` is added to it. The connection is made on first use
    and remade on the first call after it broke.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        timeout: float | None = 5.0,
        *,
        max_frame: int = MAX_FRAME_BYTES,
    ) -> None:
        self.socket_path = os.fspath(socket_path) if socket_path is not None else default_socket()
        self.timeout = timeout
        self.max_frame = max_frame
        self._sock: socket.socket | None = None
        self._frames = protocol.FrameBuffer(max_frame)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}  # sent on this connection, no reply yet
        self._ready: dict[int, Reply] = {}  # replied, not yet collected (arrival order)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- connection -----------------------------------------------------------------------

    def connect(self) -> None:
        """Connect now rather than on first use (to fail early); a no-op when connected."""
        if self._sock is None:
            self._sock = self._open()

    def _open(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
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
            return sock.recv(1, socket.MSG_PEEK) == b""
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
        client only wrote, both sides would block on each other.
        """
        view = memoryview(frame)
        while view:
            events = self._wait(sock, select.POLLIN | select.POLLOUT, deadline)
            if events & select.POLLIN:
                self._read_some(sock)
            if events & (select.POLLOUT | select.POLLERR | select.POLLHUP):
                try:
                    view = view[sock.send(view) :]
                except BlockingIOError:
                    pass
                except OSError as exc:
                    self._drop()
                    raise ConnectionClosed(f"connection to {self.socket_path} lost: {exc}") from exc

    def _read_some(self, sock: socket.socket) -> None:
        """Read what has arrived and file every complete reply under its request id."""
        try:
            data = sock.recv(_RECV_CHUNK)
        except BlockingIOError:
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
                request_id = self._route(reply)
                if self._pending.pop(request_id).wanted:
                    self._ready[request_id] = reply
        except ProtocolError:
            self._drop()
            raise

    def _route(self, reply: Reply) -> int:
        request_id = reply.get("id")
        if isinstance(request_id, int) and request_id in self._pending:
            return request_id
        if reply.get("ok") is False and not isinstance(request_id, int) and self._pending:
            # An error for a request whose id the daemon could not read (e.g. too_large,
            # whose body is skipped unread): blame the oldest request still in flight.
            oldest = next(iter(self._pending))
            reply["id"] = oldest
            return oldest
        raise ProtocolError(f"reply for unknown request id {request_id!r}")

    # --- pipelining primitives ------------------------------------------------------------

    def send(self, request: Mapping[str, Any]) -> int:
        """Send one request (a map with `op`; the client adds `v` and `id`); return its id."""
        request_id = next(self._ids)
        frame = protocol.encode_frame(protocol.stamp(request, request_id), self.max_frame)
        sock = self._live_socket()
        try:
            self._write(sock, frame, self._deadline())
        except Timeout:
            self._drop()  # part of the frame may be out: the stream can no longer be trusted
            raise
        self._pending[request_id] = _Pending(protocol.wait_allowance_s(request))
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

    def call(self, request: Mapping[str, Any]) -> Reply:
        """Send one request and return its successful reply (ServerError otherwise)."""
        return protocol.check_reply(self._collect([self.send(request)])[0])

    def _collect(self, ids: list[int]) -> list[Reply]:
        """Replies to `ids` in that order. If one fails the rest are given up on: their late
        replies are skipped, never mistaken for the replies of later calls."""
        replies: list[Reply] = []
        try:
            for request_id in ids:
                replies.append(self.recv(request_id))
        except BaseException:
            for request_id in ids[len(replies) :]:
                if request_id in self._pending:
                    self._pending[request_id].wanted = False
                self._ready.pop(request_id, None)
            raise
        return replies

    # --- operations -----------------------------------------------------------------------

    def ping(self) -> results.PingResult:
        return results.parse_ping(self.call(protocol.ping_request()))

    def prefetch(
        self,
        paths: Iterable[PathLike],
        *,
        wait: bool = False,
        read_bytes: int | None = None,
        timeout_ms: int | None = None,
    ) -> results.PrefetchResult:
        request = protocol.prefetch_request(
            paths, wait=wait, read_bytes=read_bytes, timeout_ms=timeout_ms
        )
        return results.parse_prefetch(self.call(request))

    def prefetch_many(
        self,
        batches: Iterable[Iterable[PathLike]],
        *,
        wait: bool = False,
        read_bytes: int | None = None,
        timeout_ms: int | None = None,
    ) -> list[results.PrefetchResult]:
        """Pipeline one prefetch per batch and return their results in batch order.

        All requests are on the wire before the first reply is awaited, so with `wait` the
        daemon works on them together. Every reply is collected before the first ServerError
        is raised, leaving the connection clean.
        """
        requests = [
            protocol.prefetch_request(b, wait=wait, read_bytes=read_bytes, timeout_ms=timeout_ms)
            for b in batches
        ]
        replies = self._collect([self.send(r) for r in requests])
        return [results.parse_prefetch(protocol.check_reply(r)) for r in replies]

    def prefetch_blocks(
        self,
        *,
        wait: bool = False,
        read_bytes: int | None = None,
        timeout_ms: int | None = None,
        **kv_request: Any,
    ) -> results.PrefetchResult:
        """Warm the files a KV request (model or hash+layout, then prompts or block_hashes)
        maps to; the daemon does the hashing and path layout."""
        request = protocol.prefetch_blocks_request(
            kv_request, wait=wait, read_bytes=read_bytes, timeout_ms=timeout_ms
        )
        return results.parse_prefetch(self.call(request))

    def resolve(self, **kv_request: Any) -> results.ResolveResult:
        """The block hashes and file paths a KV request maps to, without any I/O."""
        return results.parse_resolve(self.call(protocol.resolve_request(kv_request)))

    def stats(self) -> Stats:
        return results.parse_stats(self.call(protocol.stats_request()))
