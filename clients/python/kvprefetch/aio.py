"""asyncio client: any number of concurrent calls share one connection.

Replies are handed to each call's future by id as they arrive, so calls are truly
pipelined: `await asyncio.gather(*(c.prefetch(b, wait=True) for b in batches))` puts every
request on the wire at once and each await returns as its own reply lands.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

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


class _Connection(asyncio.Protocol):
    """One connection, as the event loop drives it.

    Frames go out whole through the transport's buffer, so concurrent senders never
    interleave; replies go to their calls as they arrive. When a write fails because the
    daemon closed first, the transport ends without reading what the daemon sent before it
    closed, which can be the very reply a call is owed (a refusal): connection_lost reads
    it through `spare`, a second descriptor of the socket.
    """

    def __init__(self, socket_path: str, max_frame: int) -> None:
        self.socket_path = socket_path
        self.frames = protocol.FrameBuffer(max_frame)
        # Sent, reply not yet read. A waiter whose caller gave up (timeout, cancellation)
        # stays until its late reply arrives, so that reply is recognised and dropped.
        self.in_flight: dict[int, _Waiter] = {}
        self.closed = False
        self.error: KVPrefetchError | None = None  # why it closed
        self.refusal: Reply | None = None  # the daemon's, if it refused this connection
        self.ended = asyncio.get_running_loop().create_future()  # once connection_lost ran
        self.drained: asyncio.Future[None] | None = None  # while the write buffer is full

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.spare: socket.socket | None = None
        if transport.get_extra_info("sslcontext") is None:  # TLS bytes say nothing read raw
            self.spare = cast(socket.socket, transport.get_extra_info("socket")).dup()
            self.spare.setblocking(False)

    def data_received(self, data: bytes) -> None:
        self.take(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.read_left()
        if self.spare is not None:
            self.spare.close()
        path = self.socket_path
        self.retire(
            ConnectionClosed(f"connection to {path} lost: {exc}")
            if exc is not None
            else ConnectionClosed(f"kvprefetchd at {path} closed the connection")
        )
        self.resume_writing()
        self.ended.set_result(None)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    # --- replies --------------------------------------------------------------------------

    def take(self, data: bytes) -> None:
        """Hand every complete reply in `data` to the calls it answers."""
        if self.closed:
            return  # retired: what still arrives is nobody's
        self.frames.feed(data)
        try:
            while (reply := self.frames.pop()) is not None:
                for request_id, answer in protocol.answers(reply, self.in_flight):
                    waiter = self.in_flight.pop(request_id)
                    if not waiter.future.done():
                        waiter.future.set_result(answer)
                if protocol.is_refusal(reply):
                    # Every call on it is answered; the next one connects anew.
                    self.refusal = reply
                    self.retire(ConnectionClosed(f"kvprefetchd at {self.socket_path} refused"))
        except ProtocolError as exc:
            self.retire(exc)

    def read_left(self) -> None:
        """Take what the daemon sent that the transport did not read: the kernel hands it
        over before it reports the close."""
        if self.spare is None:
            return
        try:
            while data := self.spare.recv(READ_CHUNK_BYTES):
                self.take(data)
        except OSError:
            pass  # nothing more (BlockingIOError), or the reset itself

    def enlist(self, request_id: int, waiter: _Waiter) -> None:
        """Put a call in flight before its first byte goes out: the daemon may answer before
        the write is done (a refusal, an id-less error). On a connection that ended already,
        even while it was being opened, the call is answered at once: refused, or failed."""
        if not self.closed:
            self.in_flight[request_id] = waiter
        elif self.refusal is not None:
            waiter.future.set_result({**self.refusal, "id": request_id})
        else:
            waiter.future.set_exception(self.error or ConnectionClosed("connection closed"))

    def retire(self, error: KVPrefetchError) -> None:
        """Fail every call in flight and drop the connection; the next call opens another."""
        if self.closed:
            return
        self.closed = True
        self.error = error
        for waiter in self.in_flight.values():
            if not waiter.future.done():
                waiter.future.set_exception(error)
        self.in_flight.clear()
        self.transport.abort()

    async def drain(self) -> None:
        """Wait while the write buffer is full. On a connection that is ending, let
        connection_lost run first: it answers or fails the calls on it."""
        if self.drained is not None:
            await asyncio.shield(self.drained)
        else:
            await asyncio.sleep(0)


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
            conn.retire(ConnectionClosed("client closed"))
            await conn.ended
        self._uncollected.clear()

    async def _connection(self) -> _Connection:
        """The live connection, made anew when the last one broke.

        A closed peer is noticed as soon as the loop reads it, so an idle client usually
        reconnects here after a daemon restart without failing any call.
        """
        async with self._connecting:
            if self._conn is None or self._conn.closed:
                self._conn = await self._open()
            return self._conn

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        endpoint = self.endpoint

        def made() -> _Connection:
            return _Connection(self.socket_path, self.max_frame)

        try:
            if endpoint.kind == "unix":
                opening = loop.create_unix_connection(made, endpoint.path)
            else:
                opening = loop.create_connection(
                    made, endpoint.host, endpoint.port,
                    ssl=self.ssl_context if endpoint.kind == "tls" else None,
                    server_hostname=endpoint.host if endpoint.kind == "tls" else None,
                )
            _, conn = await asyncio.wait_for(opening, self.timeout)
        except OSError as exc:  # TimeoutError included
            cause = OSError("connect timed out") if isinstance(exc, TimeoutError) else exc
            raise ConnectFailed(self.socket_path, cause) from exc
        return conn

    # --- pipelining primitives ------------------------------------------------------------

    async def send(self, request: Mapping[str, Any]) -> int:
        """Send one request (a map with `op`; the client adds `v` and `id`); return its id
        for recv()."""
        request_id, frame = self._frame(request)
        conn = await self._connection()
        waiter = _Waiter(
            asyncio.get_running_loop().create_future(), protocol.wait_allowance_s(request)
        )
        conn.enlist(request_id, waiter)
        if not conn.closed:
            conn.transport.write(frame)
        if conn.drained is not None or conn.transport.is_closing():
            try:
                await asyncio.wait_for(conn.drain(), self.timeout)
            except TimeoutError as exc:
                # Part of the frame may be out, so the stream is no longer trusted.
                error = Timeout(f"sending to {self.socket_path} timed out")
                conn.in_flight.pop(request_id, None)  # raised here, not through the future
                conn.retire(error)
                raise error from exc
        lost = waiter.future.exception() if waiter.future.done() else None
        if lost is not None:
            raise lost
        self._uncollected[request_id] = waiter
        return request_id

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

    @staticmethod
    def _method(
        build: Callable[P, Exchange[T]],
    ) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
        async def call(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
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
        if len(ids) == 1:  # most calls: no task to gather
            return exchange.parse([await self.recv(ids[0])])
        replies: list[Reply] = []
        for reply in await asyncio.gather(*map(self.recv, ids), return_exceptions=True):
            if isinstance(reply, BaseException):
                raise reply
            replies.append(reply)
        return exchange.parse(replies)
