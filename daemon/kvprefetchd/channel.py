"""Typed messages between the supervisor and a worker over their socketpair.

The same length-prefixed msgpack framing as the public protocol, without its request
envelope: both ends are ours. Each message is a small class; on the wire it is the array
[kind, field, field, ...] in the class's field order, and only this module knows that
order, so neither side indexes a message by position.

  supervisor -> worker   Warm: files to warm, in one warm mode, to one depth
                         Root: a root opened (or reopened) since the worker started; its
                         directory fd travels with the message (SCM_RIGHTS), or none:
                         the root was let go
  worker -> supervisor   Ready (booted, with its engine), BootFailed (why it cannot boot),
                         Done (outcomes since the last Done: the worker's heartbeat)

Files travel as buffers one way (a Warm carries its request's share: root indexes and
NUL-ended names, made by admission and read by the native probe without a Python object
per file) and as counts or plain arrays the other ([ticket, outcome, bytes, errno] for a
file not warmed, a bulk record per share for warmed ones): there are thousands per
message, and a class per file would cost more than the residency check it reports.
"""

from __future__ import annotations

import errno
import os
import select
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from kvprefetchd.protocol import HEADER, FrameReader

# A worker batch of 10^5 long paths stays well below this; anything larger is a bug.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_FDS = 16  # fds one read may carry: Root messages are rare and one fd each

# [ticket, outcome name, bytes read], [.., errno] for a file not warmed, and
# [ticket, state, 0, errno, size, cached bytes, tier bytes] for a check or evict.
Settled = list[Any]
# [share id, outcome ("read" or "resident"), files, bytes read, their indexes (uint32,
# native order)]: files of one share settled warm, reported at once.
Bulk = list[Any]


@dataclass(slots=True)
class Warm:
    """Files for a worker to warm `read_bytes` deep in `warm_mode` ("read" or "advise"),
    or to look at (INSPECT_MODES: check, evict), by `deadline` (CLOCK_MONOTONIC seconds,
    0: none: one clock for both processes) with item `flags` (KVP_ITEM_*).

    The files are a request's share (admit.Share): `roots` (uint16 per file, native
    order) and `paths` (relative names, each ended by NUL). `share` is its id in the
    books (file i's ticket is books.ticket_of(share, i)); 0: fire and forget, whose
    outcomes are reported as counts. `client` is who sent the request (the supervisor's
    number for its peer): the queue engines let clients take turns on a root
    (native/schedule.c)."""

    KIND: ClassVar[str] = "warm"
    read_bytes: int
    warm_mode: str
    share: int
    roots: bytes
    paths: bytes
    deadline: float = 0.0
    flags: int = 0
    client: int = 0


# Warm modes that read nothing: the check and evict verbs, run by kvp_inspect.
CHECK, EVICT_HEAD, EVICT_FILE = "check", "evict_head", "evict_file"
INSPECT_MODES = (CHECK, EVICT_HEAD, EVICT_FILE)


@dataclass(slots=True)
class Root:
    """A root that opened, was reopened or was let go after the worker was forked: `fd`
    is the one passed with the message (SCM_RIGHTS), -1 when none is (let go); on the
    wire 0 says one travels beside, -1 none. `rule` its KVP_RES_* code; `keep` and
    `whole` its tier profile's (RootTier)."""

    KIND: ClassVar[str] = "root"
    index: int
    rule: int
    keep: str = "pagecache"
    whole: bool = False
    fs_cache: str = ""
    hold: bool = False
    depth: int = 0
    fd: int = -1


@dataclass(frozen=True)
class RootTier:
    """What a worker needs of a root's tier profile (tiers.py): how a warm-up survives
    to the consumer (`keep`: pagecache, hold, fs_cache or probe) and whether it reads
    whole files; `fs_cache`: where the file system keeps its disk copy of the root's files
    (a glob; "" none known: fscache.py)."""

    keep: str = "pagecache"
    whole: bool = False
    fs_cache: str = ""
    hold: bool = False  # warmed files are held open for their consumer (holds.py)
    # Reads in flight this worker starts the root at (0: initial_depth), trusted from its
    # tier profile (residency.RootRule.start_depth): a FUSE mount's share of
    # max_background, past which reads only queue in the kernel; a network file system's
    # share of a deep start.
    depth: int = 0


@dataclass(slots=True)
class Ready:
    """A worker booted: its engine is built and it takes work."""

    KIND: ClassVar[str] = "ready"
    engine: str
    pid: int
    problem: str = ""  # what it could not do but serves without (e.g. renice)


@dataclass(slots=True)
class BootFailed:
    """A worker cannot boot; respawning would fail the same way, so the daemon halts."""

    KIND: ClassVar[str] = "boot_failed"
    reason: str


@dataclass(slots=True)
class Done:
    """Everything a worker settled since its last report; every batch ends in one."""

    KIND: ClassVar[str] = "done"
    settled: list[Settled] = field(default_factory=list)  # followed files, one by one
    bulk: list[Bulk] = field(default_factory=list)  # followed files warmed, per share
    counters: dict[str, int] = field(default_factory=dict)  # deltas: batches, dedup hits
    anonymous: dict[str, int] = field(default_factory=dict)  # fire-and-forget: outcome -> n
    anonymous_bytes: int = 0
    latency_counts: list[int] = field(default_factory=list)  # per-file histogram, merged
    latency_sum: float = 0.0
    # The queue engines' state now (not deltas), at most twice a second: threads, reads
    # running and stalled, files timed out, and per root index [depth, service time us].
    queue: dict[str, Any] = field(default_factory=dict)
    # [root index, "kept" or "dropped"]: what a reopen found of a root whose profile
    # could not say whether a warm-up survives to the consumer (worker.Verdicts).
    verdicts: list[list[Any]] = field(default_factory=list)


Message = Warm | Root | Ready | BootFailed | Done
_KINDS: dict[str, type[Message]] = {
    kind.KIND: kind for kind in (Warm, Root, Ready, BootFailed, Done)
}


def encode(message: Message) -> bytes:
    fields = [getattr(message, name) for name in message.__slots__]  # declaration order
    if isinstance(message, Root):
        fields[-1] = 0 if message.fd >= 0 else -1  # the fd itself goes beside (SCM_RIGHTS)
    body: bytes = msgpack.packb([message.KIND, *fields], use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode(payload: bytes) -> Message:
    raw = msgpack.unpackb(payload, raw=False)
    if not isinstance(raw, list) or not raw or raw[0] not in _KINDS:
        raise ValueError(f"not a channel message: {str(raw)[:80]}")
    kind = _KINDS[raw[0]]
    if len(raw) - 1 != len(kind.__slots__):
        raise ValueError(f"{raw[0]}: {len(raw) - 1} fields, expected {len(kind.__slots__)}")
    return kind(*raw[1:])


class ChannelReader:
    """Non-blocking reader of whole messages from one end of a socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._frames = FrameReader(MAX_MESSAGE_BYTES)
        self._fds: deque[int] = deque()  # passed fds, for the Root messages they came with
        self.closed = False

    def read_available(self) -> list[Message]:
        messages: list[Message] = []
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, MAX_FDS)
                self._fds.extend(fds)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as error:
                if error.errno in (errno.ECONNRESET, errno.EPIPE):
                    self.closed = True
                    break
                raise
            if not data:
                self.closed = True
                break
            for frame in self._frames.feed(data):
                if frame.payload is not None:
                    message = decode(frame.payload)
                    if isinstance(message, Root):
                        message.fd = self._fds.popleft() if message.fd >= 0 and self._fds else -1
                    messages.append(message)
        return messages


def send_with_fd(sock: socket.socket, data: bytes, fd: int) -> int:
    """Send the start of `data` with `fd` beside it (SCM_RIGHTS); the bytes sent. The
    fd goes with the first byte, so the reader pairs it with the message those start."""
    return socket.send_fds(sock, [data], [fd])


def send_all_blocking(sock: socket.socket, message: Message) -> None:
    """Worker side: write a whole message, waiting when the supervisor is behind."""
    view = memoryview(encode(message))
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLOUT)
            poller.poll(1000)
            continue
        view = view[sent:]


def close_other_fds(keep: set[int]) -> None:
    """In a fresh worker: drop every fd inherited from the supervisor but the ones it needs.

    The listening socket and client connections must not live on in a worker: a
    socket held open by a child keeps a dead supervisor's clients hanging.
    """
    highest = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536
    start = 3
    for fd in sorted(keep):
        if fd >= start:
            os.closerange(start, fd)
            start = fd + 1
    os.closerange(start, highest)
