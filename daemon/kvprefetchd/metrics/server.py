"""GET /metrics over HTTP/1.0, driven by the supervisor's own `selectors` loop.

No threads (forking stays safe) and no http.server: each client is bounded (8 KiB of
request header, which must arrive within 0.5 s of the accept; 2 s from accept to close;
at most 32 at once, 4 per address; new connections rate-limited); anything but
`GET|HEAD /metrics` gets 404/405/400/431 and is closed. The body is whatever the
supervisor's callback renders (exposition.render of the current stats), reused for
scrapes within `cache_seconds`. metrics_limits.py says why each bound is there and
what it stops; each refusal is counted (`counts`, the `metrics_*` events of `stats`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from kvprefetchd.addresses import MetricsAddress, parse_metrics_address
from kvprefetchd.listeners.listening import AcceptRest, accept_ready, listen_unix, out_of_fds
from kvprefetchd.listeners.tokenbucket import TokenBucket
from kvprefetchd.metrics.exposition import CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE
from kvprefetchd.metrics.limits import (
    CLOSE_REASONS,
    OTHER_COUNTS,
    SCRAPE_RESULTS,
    Admission,
    MetricsLimits,
    address_key,
)

log = logging.getLogger("kvprefetchd.metrics")


def open_metrics_listener(
    address: str | MetricsAddress, *, mode: int = 0o660, backlog: int = 64
) -> socket.socket:
    """A non-blocking listening socket for the `metrics` setting (port 0: any free port).

    A Unix socket is bound like the main one (umask around bind, a stale file
    replaced, a live one refused: kvprefetchd.listeners.listening.listen_unix).
    """
    where = address if isinstance(address, MetricsAddress) else parse_metrics_address(address)
    if where.family == socket.AF_UNIX:
        return listen_unix(where.path, mode, backlog)
    sock = socket.socket(where.family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((where.host, where.port))
        sock.listen(backlog)
    except OSError as error:
        sock.close()
        raise OSError(error.errno, error.strerror, f"metrics {where.host}:{where.port}") from error
    sock.setblocking(False)
    return sock


MAX_HEADER_BYTES = 8 * 1024
# Connections accepted per listener event at most: a flood of connects is taken in
# slices, so the loop serves the request socket between them.
ACCEPTS_PER_EVENT = 64
# However a flood comes, the listener is read ACCEPTS_PER_SECOND times a second at most
# (bursts of ACCEPT_BURST); then it leaves the selector until the bucket has refilled and
# the rest wait in the backlog (or are dropped by the kernel when it is full). Each
# accept and close, even of a connection refused at once, costs some 50 us of the
# supervisor (most of it in the kernel, measured on loopback): this bounds the flood's
# share at about 10% of a core.
ACCEPTS_PER_SECOND = 2000.0
ACCEPT_BURST = 100.0
_READING, _WRITING, _DRAINING = "reading", "writing", "draining"
_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
}


class _Client:
    __slots__ = ("accepted", "deadline", "handler", "inbound", "key", "outbound", "sock",
                 "state")

    def __init__(self, server: MetricsServer, sock: socket.socket, key: str | None,
                 accepted: float) -> None:
        self.handler = functools.partial(server.on_client_event, self)
        self.sock = sock
        self.key = key
        self.accepted = accepted
        self.deadline = accepted + server.limits.header_timeout  # until the header is in
        self.inbound = bytearray()
        self.outbound = b""
        self.state = _READING


class MetricsServer:
    """GET /metrics over HTTP/1.0, one response per connection, on the caller's selector.

    Every selector key it registers carries a callback taking the ready events, as
    every key of the supervisor's loop does. After the response it shuts its side
    down and reads until the client closes (or the deadline), so unread request
    bytes never turn the close into a reset that could cut the response short.
    `limits` bound what an unauthenticated client may hold or cost (metrics_limits.py).
    """

    def __init__(
        self,
        listener: socket.socket,
        get_body: Callable[[bool], bytes],  # True: OpenMetrics, False: text 0.0.4
        *,
        unlink_path: str | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        limits: MetricsLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        listener.setblocking(False)
        self.listener = listener
        self.get_body = get_body
        self.unlink_path = unlink_path
        self.max_header_bytes = max_header_bytes
        self.limits = limits if limits is not None else MetricsLimits()
        self.clock = clock
        self.admission = Admission(self.limits, clock())
        self.selector: selectors.BaseSelector | None = None
        self.clients: dict[int, _Client] = {}  # in accept order (the oldest first)
        self.cache: dict[bool, tuple[float, bytes]] = {}  # openmetrics? -> (rendered, body)
        self.counts = dict.fromkeys((*SCRAPE_RESULTS, *CLOSE_REASONS, *OTHER_COUNTS), 0)
        self.family = listener.family
        self.resting = AcceptRest("metrics", log, clock)  # out of fds: listener not watched
        self.accepts = TokenBucket(ACCEPTS_PER_SECOND, ACCEPT_BURST, clock())
        self.paused_until: float | None = None  # accepts over budget: listener not watched

    @classmethod
    def open(
        cls, address: str | MetricsAddress, get_body: Callable[[bool], bytes], **options: Any
    ) -> MetricsServer:
        """Bind `address` (the `metrics` setting) and serve it; a Unix socket goes on close."""
        where = address if isinstance(address, MetricsAddress) else parse_metrics_address(address)
        listener = open_metrics_listener(where)
        unlink = where.path if where.family == socket.AF_UNIX else None
        return cls(listener, get_body, unlink_path=unlink, **options)

    # -- the loop's side --

    def attach(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        selector.register(self.listener, selectors.EVENT_READ, self.on_listener_event)

    def on_listener_event(self, _events: int) -> None:
        self._accept()

    def on_client_event(self, client: _Client, events: int) -> None:
        if events & selectors.EVENT_READ:
            self._read(client)
        if events & selectors.EVENT_WRITE and client.state == _WRITING:
            self._write(client)

    def next_timeout(self, now: float) -> float | None:
        """Seconds until the earliest client deadline or the end of a rest (None: neither)."""
        dues = [c.deadline for c in self.clients.values()]
        for until in (self.resting.until, self.paused_until):
            if until is not None:
                dues.append(until)
        return max(0.0, min(dues) - now) if dues else None

    def expire(self, now: float) -> int:
        """Close every client past its deadline (slow or silent ones); returns how many.

        Also puts a resting or paused listener (see _accept) back in the selector once
        its rest or pause is over.
        """
        rested = self.resting.over(now)
        if self.paused_until is not None and now >= self.paused_until:
            self.paused_until, rested = None, True
        if rested and self.resting.until is None and self.paused_until is None:
            self._watch_listener()
        late = [c for c in self.clients.values() if c.deadline <= now]
        for client in late:
            if client.state != _DRAINING:
                self.counts["expired"] += 1
            self._close(client)
        return len(late)

    def close(self) -> None:
        for client in list(self.clients.values()):
            self._close(client)
        if self.selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.listener)
        self.listener.close()
        if self.unlink_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unlink_path)
            self.unlink_path = None

    # -- the work --

    def _accept(self) -> None:
        try:
            self._accept_ready()
        except OSError as error:
            if not out_of_fds(error) or self.selector is None:
                raise
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.listener)
            self.resting.begin(error)
            return
        self.resting.accepted()

    def _watch_listener(self) -> None:
        if self.selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.register(self.listener, selectors.EVENT_READ,
                                       self.on_listener_event)

    def _accept_ready(self) -> None:
        ready = accept_ready(self.listener, "metrics")
        for sock in itertools.islice(ready, ACCEPTS_PER_EVENT):
            now = self.clock()
            self._admit(sock, now)
            if not self.accepts.take(now):  # over budget: pause until the bucket refills
                self.counts["accept_paused"] += 1
                self.paused_until = now + ACCEPT_BURST / ACCEPTS_PER_SECOND / 2
                if self.selector is not None:
                    with contextlib.suppress(KeyError, ValueError):
                        self.selector.unregister(self.listener)
                return

    def _admit(self, sock: socket.socket, now: float) -> None:
        """Let a new connection in (evicting another when every slot is taken), or close
        it at once with the reason counted."""
        key = address_key(sock, self.family)
        refusal = self.admission.refusal(key, now)
        if refusal is None and len(self.clients) >= self.limits.max_clients:
            refusal = None if self._evict_one() else "refused"
        if refusal is not None or self.selector is None:
            self.counts[refusal or "refused"] += 1
            sock.close()  # at once: no read, no render
            return
        client = _Client(self, sock, key, now)
        self.clients[sock.fileno()] = client
        self.admission.opened(key)
        self.selector.register(sock, selectors.EVENT_READ, client.handler)

    def _evict_one(self) -> bool:
        """Make room for a newcomer: close the oldest client already answered (its
        response is sent: only the wait for its close is cut short), else the oldest
        still reading (a scraper sends its request at once; one that has not is slow
        or an attacker holding the slot), else the oldest being written to."""
        for state in (_DRAINING, _READING, _WRITING):
            oldest = next((c for c in self.clients.values() if c.state == state), None)
            if oldest is not None:
                self.counts["evicted"] += 1
                self._close(oldest)
                return True
        return False

    def events(self) -> dict[str, int]:
        """The counts as `stats` events: metrics_served, metrics_refused_rate, ..."""
        return {f"metrics_{name}": value for name, value in self.counts.items() if value}

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client closed (or reset): nothing more to say to it
            self._close(client)
            return
        if client.state != _READING:
            return  # draining (or a pipelined extra request): discarded
        client.inbound += data
        end = _header_end(client.inbound)
        if end < 0:
            if len(client.inbound) > self.max_header_bytes:
                self._respond(client, 431, b"request header too large\n")
            return
        if end > self.max_header_bytes:
            self._respond(client, 431, b"request header too large\n")
            return
        self._answer(client, bytes(client.inbound[:end]))

    def _answer(self, client: _Client, head: bytes) -> None:
        line = head.split(b"\n", 1)[0].rstrip(b"\r")
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self.counts["bad"] += 1
            self._respond(client, 400, b"bad request\n")
            return
        method, target = parts[0], parts[1]
        if method not in (b"GET", b"HEAD"):
            self.counts["bad"] += 1
            self._respond(client, 405, b"only GET\n", extra=b"Allow: GET, HEAD\r\n")
            return
        # urlsplit copes with the query and with the absolute form (RFC 9112 3.2.2).
        if urlsplit(target.decode("latin-1")).path != "/metrics":
            self.counts["not_found"] += 1
            self._respond(client, 404, b"not found: try /metrics\n")
            return
        openmetrics = wants_openmetrics(head)
        try:
            body = self._body(openmetrics)
        except Exception:  # a bug in the figures must cost one scrape, never the daemon
            log.exception("metrics: rendering failed")
            self._respond(client, 500, b"rendering the metrics failed; see the daemon's log\n")
            return
        self.counts["served"] += 1
        self.admission.served(client.key, self.clock())
        content_type = OPENMETRICS_CONTENT_TYPE if openmetrics else CONTENT_TYPE
        self._respond(
            client, 200, body, content_type=content_type.encode(), head_only=method == b"HEAD"
        )

    def _body(self, openmetrics: bool) -> bytes:
        """The page, rendered at most once per cache_seconds per format."""
        now = self.clock()
        cached = self.cache.get(openmetrics)
        if cached is not None and 0 <= now - cached[0] < self.limits.cache_seconds:
            self.counts["cached"] += 1
            return cached[1]
        body = self.get_body(openmetrics)
        self.cache[openmetrics] = (now, body)
        return body

    def _respond(
        self,
        client: _Client,
        code: int,
        body: bytes,
        *,
        content_type: bytes = b"text/plain; charset=utf-8",
        extra: bytes = b"",
        head_only: bool = False,
    ) -> None:
        header = (
            b"HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
            b"Cache-Control: no-store\r\nConnection: close\r\n%s\r\n"
            % (code, _REASONS[code].encode(), content_type, len(body), extra)
        )
        client.outbound = header if head_only else header + body
        client.inbound.clear()
        client.state = _WRITING
        client.deadline = client.accepted + self.limits.deadline
        self._write(client)

    def _write(self, client: _Client) -> None:
        try:
            sent = client.sock.send(client.outbound)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(client)
            return
        client.outbound = client.outbound[sent:]
        if client.outbound:
            self._watch(client, selectors.EVENT_WRITE)
            return
        # All sent: half-close, then wait for the client's EOF (bounded by the deadline).
        client.state = _DRAINING
        try:
            client.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(client)
            return
        self._watch(client, selectors.EVENT_READ)

    def _watch(self, client: _Client, events: int) -> None:
        if self.selector is not None:
            self.selector.modify(client.sock, events, client.handler)

    def _close(self, client: _Client) -> None:
        fd = client.sock.fileno()
        if fd >= 0 and self.clients.get(fd) is client:
            del self.clients[fd]
            self.admission.closed(client.key)
            if self.selector is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(client.sock)
        with contextlib.suppress(OSError):
            client.sock.close()


def _header_end(buffer: bytearray) -> int:
    """Index just past the blank line ending the header, or -1 (CRLF or bare LF)."""
    crlf = buffer.find(b"\r\n\r\n")
    lf = buffer.find(b"\n\n")
    ends = [i + n for i, n in ((crlf, 4), (lf, 2)) if i >= 0]
    return min(ends) if ends else -1


def wants_openmetrics(head: bytes) -> bool:
    """Whether the request's Accept header asks for OpenMetrics (as Prometheus does when
    scrape_protocols lists it); anything else gets the text format every scraper parses."""
    for line in head.split(b"\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"accept":
            return b"application/openmetrics-text" in value.lower()
    return False
