"""asyncio client: any number of concurrent calls share one connection.

A background task reads replies and resolves each call's future by id, so calls are truly
pipelined: `await asyncio.gather(*(c.prefetch(b, wait=True) for b in batches))` puts every
request on the wire at once and each await returns as its own reply lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from kvprefetch import protocol, results
from kvprefetch.errors import (
    ConnectFailed,
    ConnectionClosed,
    KVPrefetchError,
    ProtocolError,
    Timeout,
)
from kvprefetch.protocol import MAX_FRAME_BYTES, PathLike, Reply, default_socket
from kvprefetch.stats import Stats

_RECV_CHUNK = 256 * 1024


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[Reply]
    extra_s: float  # a `wait` request's timeout_ms, added to the client's timeout


@dataclass(slots=True)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    frames: protocol.FrameBuffer
    # Sent, reply not yet read. A waiter whose caller gave up (timeout, cancellation) stays
    # until its late reply arrives, so that reply is recognised and dropped.
    in_flight: dict[int, _Waiter] = field(default_factory=dict)
    reader_task: asyncio.Task[None] | None = None
    closed: bool = False


class AsyncClient:
    """The asyncio twin of kvprefetch.Client; same methods, same errors, same timeouts."""

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
        self._conn: _Connection | None = None
        self._connecting = asyncio.Lock()
        self._ids = itertools.count(1)
        self._uncollected: dict[int, _Waiter] = {}  # sent, recv() not yet called

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # --- connection -----------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect now rather than on first use (to fail early); a no-op when connected."""
        await self._connection()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if conn.reader_task is not None:
                conn.reader_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.reader_task
            self._retire(conn, ConnectionClosed("client closed"))
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()
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
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path), self.timeout
            )
        except (OSError, TimeoutError) as exc:
            cause = exc if isinstance(exc, OSError) else OSError("connect timed out")
            raise ConnectFailed(self.socket_path, cause) from exc
        conn = _Connection(reader, writer, protocol.FrameBuffer(self.max_frame))
        conn.reader_task = asyncio.create_task(self._read_replies(conn))
        return conn

    async def _read_replies(self, conn: _Connection) -> None:
        error: KVPrefetchError
        try:
            while data := await conn.reader.read(_RECV_CHUNK):
                conn.frames.feed(data)
                while (reply := conn.frames.pop()) is not None:
                    self._dispatch(conn, reply)
            error = ConnectionClosed(f"kvprefetchd at {self.socket_path} closed the connection")
        except ProtocolError as exc:
            error = exc
        except OSError as exc:
            error = ConnectionClosed(f"connection to {self.socket_path} lost: {exc}")
        self._retire(conn, error)

    def _dispatch(self, conn: _Connection, reply: Reply) -> None:
        request_id = reply.get("id")
        if not isinstance(request_id, int) and reply.get("ok") is False and conn.in_flight:
            # An error for a request whose id the daemon could not read (e.g. too_large,
            # whose body is skipped unread): blame the oldest request still in flight.
            request_id = next(iter(conn.in_flight))
            reply["id"] = request_id
        waiter = conn.in_flight.pop(request_id, None) if isinstance(request_id, int) else None
        if waiter is None:
            raise ProtocolError(f"reply for unknown request id {request_id!r}")
        if not waiter.future.done():
            waiter.future.set_result(reply)

    def _retire(self, conn: _Connection, error: KVPrefetchError) -> None:
        """Fail everything in flight on `conn`; the next call opens a new connection."""
        conn.closed = True
        conn.writer.close()
        for waiter in conn.in_flight.values():
            if not waiter.future.done():
                waiter.future.set_exception(error)
        conn.in_flight.clear()
        if self._conn is conn:
            self._conn = None

    # --- pipelining primitives ------------------------------------------------------------

    async def send(self, request: Mapping[str, Any]) -> int:
        """Send one request (a map with `op`; the client adds `v` and `id`); return its id
        for recv()."""
        request_id = next(self._ids)
        frame = protocol.encode_frame(protocol.stamp(request, request_id), self.max_frame)
        conn = await self._connection()
        waiter = _Waiter(
            asyncio.get_running_loop().create_future(), protocol.wait_allowance_s(request)
        )
        conn.in_flight[request_id] = waiter
        conn.writer.write(frame)  # whole frames only, so concurrent senders never interleave
        try:
            await asyncio.wait_for(conn.writer.drain(), self.timeout)
        except (TimeoutError, OSError) as exc:
            # Part of the frame may be out, so the stream is no longer trusted either way.
            error: KVPrefetchError = (
                Timeout(f"sending to {self.socket_path} timed out")
                if isinstance(exc, TimeoutError)
                else ConnectionClosed(f"connection to {self.socket_path} lost: {exc}")
            )
            del conn.in_flight[request_id]  # raised here, not through the future
            self._retire(conn, error)
            raise error from exc
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

    async def call(self, request: Mapping[str, Any]) -> Reply:
        """Send one request and return its successful reply (ServerError otherwise)."""
        return protocol.check_reply(await self.recv(await self.send(request)))

    # --- operations -----------------------------------------------------------------------

    async def ping(self) -> results.PingResult:
        return results.parse_ping(await self.call(protocol.ping_request()))

    async def prefetch(
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
        return results.parse_prefetch(await self.call(request))

    async def prefetch_many(
        self,
        batches: Iterable[Iterable[PathLike]],
        *,
        wait: bool = False,
        read_bytes: int | None = None,
        timeout_ms: int | None = None,
    ) -> list[results.PrefetchResult]:
        """One prefetch per batch, all in flight together; results in batch order. Every
        reply is awaited before the first error is raised."""
        requests = [
            protocol.prefetch_request(b, wait=wait, read_bytes=read_bytes, timeout_ms=timeout_ms)
            for b in batches
        ]
        ids: list[int] = []
        try:
            for request in requests:
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
        return [results.parse_prefetch(protocol.check_reply(r)) for r in replies]

    async def prefetch_blocks(
        self,
        *,
        wait: bool = False,
        read_bytes: int | None = None,
        timeout_ms: int | None = None,
        **kv_request: Any,
    ) -> results.PrefetchResult:
        """Warm the files a KV request maps to; the daemon does the hashing and layout."""
        request = protocol.prefetch_blocks_request(
            kv_request, wait=wait, read_bytes=read_bytes, timeout_ms=timeout_ms
        )
        return results.parse_prefetch(await self.call(request))

    async def resolve(self, **kv_request: Any) -> results.ResolveResult:
        """The block hashes and file paths a KV request maps to, without any I/O."""
        return results.parse_resolve(await self.call(protocol.resolve_request(kv_request)))

    async def stats(self) -> Stats:
        return results.parse_stats(await self.call(protocol.stats_request()))
