"""One client connection, and the memory its requests and replies may take.

Knows bytes and frames, not ops. What a connection may hold is bounded both ways:

- In: every connection may buffer FREE_INPUT_BYTES of an unfinished frame (a ping, a
  few hundred paths); a larger frame takes the rest of its size from one pool shared by
  all connections (`max_input_buffer_bytes`), granted whole frame at a time and first
  come, first served. A connection whose frame does not fit yet is not read at all (the
  kernel's socket buffer and then its client wait): 40 connections each sending all but
  the last byte of a 16 MiB frame held 640 MiB before. A grant always fits the pool
  (the pool is at least one frame), one user may hold at most half of it, and small
  frames never queue behind large ones (InputPool).
- Out: replies wait in `output`; a reply larger than `max_output_bytes` is refused
  `too_large` instead, and a connection whose client lets more than `max_output_bytes`
  pile up is neither read nor served until it reads: at most twice that is held.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import ssl
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from kvprefetchd.listeners.peer_errors import caused_by_peer, would_block
from kvprefetchd.listeners.peers import Peer
from kvprefetchd.protocol import TOO_LARGE, FrameReader, encode_frame, error_reply

# What any connection may buffer of a frame without a grant from the pool: every request
# a router sends routinely (a ping, stats, a prefetch of some hundred paths) fits.
FREE_INPUT_BYTES = 64 * 1024
RECV_BYTES = 256 * 1024


class InputPool:
    """Bytes of unfinished frames beyond each connection's free allowance, for all of them.

    A connection whose head frame needs more than its allowance asks for the rest, whole,
    and waits in a queue until it is granted; a grant is given back once its frame is
    whole (or its connection gone), which serves the queue again. The queue is served in
    order while the pool has room, except that one user may hold at most half the pool
    (one frame always): a user trickling frames on many connections holds half and
    waits behind itself, while other users' frames pass it.
    """

    def __init__(self, limit: int, events: Counter[str] | None = None) -> None:
        self.limit = limit
        self.granted = 0
        self.by_user: Counter[int] = Counter()
        self.queue: deque[Connection] = deque()
        self.events = events if events is not None else Counter()  # input_waits

    def ask(self, connection: Connection, need: int) -> list[Connection]:
        """Queue the connection for `need` bytes; the connections granted now (it, when
        it did not have to wait, and in principle others)."""
        connection.need = need
        connection.waiting = True
        self.queue.append(connection)
        woken = self.serve()
        if connection.waiting:
            self.events["input_waits"] += 1
        return woken

    def give_back(self, connection: Connection) -> list[Connection]:
        if connection.grant:
            self.granted -= connection.grant
            self.by_user[connection.user] -= connection.grant
            if self.by_user[connection.user] <= 0:
                del self.by_user[connection.user]
            connection.grant = 0
        if connection.waiting:
            connection.waiting = False
            with contextlib.suppress(ValueError):
                self.queue.remove(connection)
        return self.serve()

    def serve(self) -> list[Connection]:
        woken: list[Connection] = []
        for connection in list(self.queue):
            # A frame admitted under a larger max_frame_bytes before a reload may need
            # more than the whole pool: it gets the pool to itself rather than wait for ever.
            if connection.need > self.limit - self.granted and self.granted:
                break  # no room: the frames behind it wait too, or it would starve
            held = self.by_user[connection.user]
            if held and held + connection.need > self.limit // 2:
                continue  # its user holds its share: another user's turn
            self.queue.remove(connection)
            connection.waiting = False
            self.granted += connection.need
            self.by_user[connection.user] += connection.need
            connection.grant = connection.need
            woken.append(connection)
        return woken


class Connection:
    """One client: its frame reader, what it may buffer, and its replies not yet sent."""

    def __init__(
        self,
        sock: socket.socket,
        max_frame_bytes: int,
        max_output_bytes: int,
        on_change: Callable[[Connection], None] | None = None,
        *,
        pool: InputPool | None = None,
        peer: Peer | None = None,
        events: Counter[str] | None = None,
    ) -> None:
        self.sock = sock
        self.frames = FrameReader(max_frame_bytes)
        self.output = bytearray()
        self.max_output_bytes = max_output_bytes
        self.pool = pool  # None: unbounded input (a connection made for a test)
        self.peer = peer
        self.events = events if events is not None else Counter()
        self.closed = False
        self.broken = False
        self.failure: Exception | None = None  # what broke it, if no rule foresaw it
        self.watched = 0  # the selector events registered for it now (0: unregistered)
        self.handler: Callable[[int], None] | None = None  # its selector callback
        self._on_change = on_change
        self.user = peer.uid if peer is not None else -1  # whose share of the input pool
        self.grant = 0  # bytes granted by the pool for the frame at the head
        self.need = 0  # what it waits for in the pool's queue
        self.waiting = False
        self.owed = 0  # frames taken and not answered yet (every frame gets one reply)
        # Frames taken plus replies sent: a counter (cheaper than a clock per frame) that
        # the idle sweep compares with what it saw last time.
        self.activity = 0
        self.seen_activity = 0
        self.quiet_since = time.monotonic()
        self.partial_since: float | None = None  # when its unfinished frame began
        # A TCP connection (tcp.py): the peer's address, and its certificate's names.
        self.address: str | None = None
        self.identities: frozenset[str] = frozenset()
        self.trust: bytes | None = None  # the CA that vouched for it (tls_identity.trust_of)

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def client(self) -> int:
        """Who this is to the queue engines, which let clients take turns on a root
        (native/schedule.c): a Unix peer's process id, a TCP peer's address (crc32); 0
        when unknown. Not an identity: two that collide only share a turn."""
        if self.peer is not None:
            return self.peer.pid & 0xFFFFFFFF
        if self.address is not None:
            return zlib.crc32(self.address.encode())
        return 0

    def who(self) -> str:
        """The peer, for a log line: uid and pid on the Unix socket, the address and the
        certificate's identities on TCP."""
        if self.peer is not None:
            return f"uid {self.peer.uid} pid {self.peer.pid}"
        if self.address is not None:
            names = f" {sorted(self.identities)}" if self.identities else ""
            return f"{self.address}{names}"
        return "an unknown peer"

    def set_limits(self, max_frame_bytes: int, max_output_bytes: int) -> None:
        """A reload's new limits apply to the next frame and the next reply."""
        self.frames.max_frame_bytes = max_frame_bytes
        self.max_output_bytes = max_output_bytes

    # ---- out ---------------------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        """Queue one reply; one that would exceed max_output_bytes becomes `too_large`
        (the `resolve` op refuses its own before building it: this is the backstop)."""
        if self.closed or self.broken:
            return
        self.owed -= 1  # below 0 only for a reply to no frame (a revocation), then dropped
        self.activity += 1
        data = encode_frame(message)
        if len(data) > self.max_output_bytes:
            self.events["replies_too_large"] += 1
            data = encode_frame(error_reply(
                message.get("id"), TOO_LARGE, f"the reply would take {len(data)} bytes, "
                f"above max_output_bytes ({self.max_output_bytes})",
            ))
        self.output += data
        try:
            self.flush()
        except Exception as error:
            # Not its peer's doing (flush closes those quietly), and maybe not in a
            # selector callback (a waiter answered from the loop): the server's refresh
            # reports it with the peer and drops this connection only.
            self.broken = True
            self.failure = error
        if self._on_change is not None:
            self._on_change(self)

    def flush(self) -> None:
        """Send what the kernel takes now; the rest waits for the socket to be writable.

        A peer that went away (EPIPE, a reset, TLS 1.3's EOF without close_notify: it
        sent its request and closed without reading the reply) marks the connection
        broken; the server unregisters and closes it (closing here would leave the
        selector holding a dead fd). Anything else is ours and raised."""
        while self.output and not (self.closed or self.broken):
            try:
                sent = self.sock.send(self.output)
            except OSError as error:
                if would_block(error):
                    return
                if not caused_by_peer(error):
                    raise
                self.broken = True
                self.output.clear()
                return
            del self.output[:sent]

    @property
    def backlogged(self) -> bool:
        """True once a client stops reading: we stop reading too instead of buffering forever."""
        return len(self.output) > self.max_output_bytes

    # ---- in ----------------------------------------------------------------------------------

    def room(self) -> int:
        """Bytes it may read now: its free allowance plus its grant, less what it holds."""
        return FREE_INPUT_BYTES + self.grant - self.frames.buffered

    def wants_input(self) -> bool:
        return not (self.backlogged or self.waiting) and self.room() > 0

    def fill(self) -> None:
        """One recv of at most `room()` bytes into the frame reader; EOF, or an error
        its peer caused, marks it broken (anything else is ours and raised)."""
        try:
            data = self.sock.recv(min(RECV_BYTES, self.room()))
        except OSError as error:
            if would_block(error):
                return
            if not caused_by_peer(error):
                raise
            data = b""
        if not data:
            self.broken = True
            return
        self.frames.append(data)

    def settle_input(self, took: bool) -> list[Connection]:
        """After frames were taken: give back the grant of a frame now whole, ask for the
        next one's, and keep the unfinished frame's clock. Returns connections to wake."""
        woken: list[Connection] = []
        if self.pool is not None:
            if took and self.grant:
                woken = self.pool.give_back(self)
            if not self.backlogged and not self.waiting and self.room() <= 0:
                head = self.frames.head_bytes()
                if head is not None:
                    woken += self.pool.ask(self, head - FREE_INPUT_BYTES)
        if not self.frames.partial:
            self.partial_since = None
        elif self.partial_since is None or took:
            self.partial_since = time.monotonic()
        return woken

    def wanted_events(self) -> int:
        """Read while it may; write while output waits; nothing (unregistered) while it
        waits for the input pool with nothing to send. (Once per reply: kept flat.)"""
        pending = len(self.output)
        if pending > self.max_output_bytes or self.waiting:
            return selectors.EVENT_WRITE if pending else 0
        readable = FREE_INPUT_BYTES + self.grant > self.frames.buffered
        return (selectors.EVENT_READ if readable else 0) | (
            selectors.EVENT_WRITE if pending else 0)

    def idle_since(self, now: float) -> float | None:
        """Since when nothing was owed, sent, received or left half received (closing it
        loses nothing), as far as the sweeps that call this can tell; None: busy."""
        if self.activity != self.seen_activity:
            self.seen_activity = self.activity
            self.quiet_since = now
        if self.owed > 0 or self.output or self.frames.buffered:
            self.quiet_since = now
            return None
        return self.quiet_since

    def tls_pending(self) -> bool:
        """Bytes TLS decrypted already but we have not read: no poll will say so."""
        return isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.output.clear()
            with contextlib.suppress(OSError):
                self.sock.close()
