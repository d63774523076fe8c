"""asyncio client: any number of concurrent calls share one connection.

A background task reads replies and resolves each call's future by id, so calls are truly
pipelined: `await asyncio.gather(*(c.prefetch(b, wait=True) for b in batches))` puts every
request on the wire at once and each await returns as its own reply lands.

The client drives its socket itself (loop.sock_recv, loop.sock_sendall) rather than through
asyncio streams: a stream whose write fails discards what the daemon sent before it closed,
and that can be the very reply the call is owed (a `forbidden` refusal).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from kvprefetch import protocol
from kvprefetch.errors import (
    ConnectFailed,
    ConnectionClosed,
    KVPrefetchError,
    ProtocolError,
    Timeout,
)
from kvprefetch.operations import Exchange, Operations
from kvprefetch.protocol import READ_CHUNK_BYTES, Reply

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[Reply]
    extra_s: float  # a `wait` request's timeout_ms, added to the client's timeout


@dataclass(slots=True, eq=False)
class _Connection:
    sock: socket.socket
    frames: protocol.FrameBuffer
    # Sent, reply not yet read. A waiter whose caller gave up (timeout, cancellation) stays
    # until its late reply arrives, so that reply is recognised and dropped.
    in_flight: dict[int, _Waiter] = field(default_factory=dict)
    # Held while a frame goes out, so concurrent senders never interleave their bytes.
    sending: asyncio.Lock = field(default_factory=asyncio.Lock)
    reader_task: asyncio.Task[None] | None = None
    closed: bool = False


class AsyncClient(Operations):
    """The asyncio twin of kvprefetch.Client: the same calls (Operations), the same errors,
    the same timeouts."""

    def _init_transport(self) -> None:
        self._conn: _Connection | None = None
        self._connecting = asyncio.Lock()
        self._uncollected: dict[int, _Waiter] = {}  # sent, recv() not yet called

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- connection -----------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect now rather than on first use (to fail early); a no-op when connected."""
        await self._connection()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._retire(conn, ConnectionClosed("client closed"))
            if conn.reader_task is not None:
                await conn.reader_task  # it sees the shutdown at once, and closes the socket
        self._uncollected.clear()

    async def _connection(self) -> _Connection:
        """The live connection, made anew when the last one broke.

        The reader task notices a closed peer as soon as the loop runs it, so an idle client
        usually reconnects here after a daemon restart without failing any call.
        """
        async with self._connecting:
            if self._conn is None or self._conn.closed:
                self._conn = await self._open()
            return self._conn

    async def _open(self) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            connecting = asyncio.get_running_loop().sock_connect(sock, self.socket_path)
            await asyncio.wait_for(connecting, self.timeout)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, OSError):  # TimeoutError included
                cause = OSError("connect timed out") if isinstance(exc, TimeoutError) else exc
                raise ConnectFailed(self.socket_path, cause) from exc
            raise
        conn = _Connection(sock, protocol.FrameBuffer(self.max_frame))
        conn.reader_task = asyncio.create_task(self._read_replies(conn))
        return conn

    async def _read_replies(self, conn: _Connection) -> None:
        """Read replies until the connection ends; then close its socket, the last user."""
        error: KVPrefetchError = ConnectionClosed(
            f"kvprefetchd at {self.socket_path} closed the connection"
        )
        try:
            while data := await asyncio.get_running_loop().sock_recv(conn.sock, READ_CHUNK_BYTES):
                self._take(conn, data)
        except ProtocolError as exc:
            error = exc
        except OSError as exc:
            error = ConnectionClosed(f"connection to {self.socket_path} lost: {exc}")
        finally:
            self._retire(conn, error)
            async with conn.sending:  # a write under way fails at once on the shut socket
                conn.sock.close()

    def _take(self, conn: _Connection, data: bytes) -> None:
        """Hand every complete reply in `data` to the calls it answers."""
        if conn.closed:
            return  # retired: what still arrives is nobody's
        conn.frames.feed(data)
        while (reply := conn.frames.pop()) is not None:
            for request_id, answer in protocol.answers(reply, conn.in_flight):
                waiter = conn.in_flight.pop(request_id)
                if not waiter.future.done():
                    waiter.future.set_result(answer)
            if protocol.is_refusal(reply):
                # Every request on it is answered; the next call connects anew.
                self._retire(conn, ConnectionClosed(f"kvprefetchd at {self.socket_path} refused"))
                return

    def _read_left(self, conn: _Connection) -> None:
        """Take what the daemon sent before the connection broke: the kernel hands it over
        before it reports the close."""
        try:
            while data := conn.sock.recv(READ_CHUNK_BYTES):
                self._take(conn, data)
        except ProtocolError as exc:
            self._retire(conn, exc)
        except OSError:
            pass  # nothing more (BlockingIOError), or the reset itself

    def _retire(self, conn: _Connection, error: KVPrefetchError) -> None:
        """Fail everything in flight on `conn` and shut it down; the next call opens a new
        connection. The shutdown wakes the reader, which closes the socket."""
        if conn.closed:
            return
        conn.closed = True
        for waiter in conn.in_flight.values():
            if not waiter.future.done():
                waiter.future.set_exception(error)
        conn.in_flight.clear()
        if self._conn is conn:
            self._conn = None
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)

    # --- pipelining primitives ------------------------------------------------------------

    async def send(self, request: Mapping[str, Any]) -> int:
        """Send one request (a map with `op`; the client adds `v` and `id`); return its id
        for recv()."""
        request_id, frame = self._frame(request)
        conn = await self._connection()
        waiter = _Waiter(
            asyncio.get_running_loop().create_future(), protocol.wait_allowance_s(request)
        )
        # In flight before its first byte goes out: the daemon may answer before the write
        # is done (a refusal, an id-less error).
        conn.in_flight[request_id] = waiter
        # The write is a task of its own, so a caller cancelled mid-frame never leaves half
        # a frame on the wire.
        write = asyncio.ensure_future(self._write(conn, frame))
        try:
            await asyncio.wait_for(asyncio.shield(write), self.timeout)
        except TimeoutError as exc:
            # Part of the frame may be out, so the stream is no longer trusted.
            error = Timeout(f"sending to {self.socket_path} timed out")
            conn.in_flight.pop(request_id, None)  # raised here, not through the future
            self._retire(conn, error)
            raise error from exc
        lost = waiter.future.exception() if waiter.future.done() else None
        if lost is not None:
            raise lost
        self._uncollected[request_id] = waiter
        return request_id

    async def _write(self, conn: _Connection, frame: bytes) -> None:
        """Put `frame` on the wire whole. A failed write ends the connection, once what the
        daemon sent before it closed is read: a refusal still answers its requests."""
        async with conn.sending:
            if conn.closed:
                return  # its requests are answered or failed already
            try:
                await asyncio.get_running_loop().sock_sendall(conn.sock, frame)
            except OSError as exc:
                self._read_left(conn)
                lost = ConnectionClosed(f"connection to {self.socket_path} lost: {exc}")
                self._retire(conn, lost)

    async def recv(self, request_id: int) -> Reply:
        """The reply to `request_id`, as it is: `ok: false` replies are returned, not raised."""
        waiter = self._uncollected.pop(request_id, None)
        if waiter is None:
            raise RuntimeError(f"request {request_id} was not sent or is already collected")
        budget = None if self.timeout is None else self.timeout + waiter.extra_s
        try:
            # On timeout wait_for cancels the future, which marks the request given up.
            return await asyncio.wait_for(waiter.future, budget)
        except TimeoutError:
            raise Timeout(f"no reply from {self.socket_path} in time") from None

    # --- carrying the calls ---------------------------------------------------------------

    def _bind(self, build: Callable[P, Exchange[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        async def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return await self._perform(build(*args, **kwargs))

        return call

    async def _perform(self, exchange: Exchange[T]) -> T:
        """Every request on the wire, then every reply awaited together; each is in before
        the first error is raised."""
        ids: list[int] = []
        try:
            for request in exchange.requests:
                ids.append(await self.send(request))
        except BaseException:
            for request_id in ids:  # give up on the ones already sent
                self._uncollected.pop(request_id).future.cancel()
            raise
        replies: list[Reply] = []
        for reply in await asyncio.gather(*map(self.recv, ids), return_exceptions=True):
            if isinstance(reply, BaseException):
                raise reply
            replies.append(reply)
        return exchange.parse(replies)
