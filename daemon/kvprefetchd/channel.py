"""Every record that crosses between the supervisor and a worker, typed, and its wire form.

The same length-prefixed msgpack framing as the public protocol, without its request
envelope: both ends are ours. Each message is a class; on the wire it is the array
[kind, field, field, ...], and only this module knows that order (encode, decode), so
neither side indexes a record by position (tests/unit/test_channel_records.py reads the
other modules' code to keep it so).

  supervisor -> worker   Warm: a share of files to warm, in one warm mode, to one depth
                         Check, Evict: a share of files to look at, or to drop from cache
                         Root: a root opened, reopened or let go since the worker started
                         (its directory fd travels beside, SCM_RIGHTS)
  worker -> supervisor   Ready (booted, with its engine), BootFailed (why it cannot boot),
                         Done (outcomes since the last Done: the worker's heartbeat)

Files travel as columns, never as a Python object per file: thousands go in one message,
and a record per file would cost more than the residency check it reports. One way a
Share (root indexes, NUL-ended names: made by admission, read by the native probe); the
other a Settled (followed files not warmed: tickets, outcomes, bytes, errnos), a Looked
(check and evict results) and per share a Bulk (files warmed, by index), plus counts of
unfollowed files. A followed file is named by its ticket (ticket_of); an unfollowed one
(a fire-and-forget request's: nobody waits for it) has share id and ticket UNFOLLOWED.
"""

from __future__ import annotations

import errno
import os
import socket
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from kvprefetchd.protocol import HEADER, FrameReader

# A worker batch of 10^5 long paths stays well below this; anything larger is a bug.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_FDS = 16  # fds one read may carry: Root messages are rare and one fd each

# ---- tickets -------------------------------------------------------------------------------

# A ticket names one file of a followed request: its share's id in the high bits, its
# index in that share in the low ones. max_paths_per_request (at most 10^7) fits.
TICKET_INDEX_BITS = 24
_TICKET_INDEX_MASK = (1 << TICKET_INDEX_BITS) - 1
UNFOLLOWED = 0  # the share id, and the ticket, of unfollowed files: reported as counts


def ticket_of(share_id: int, index: int) -> int:
    return share_id << TICKET_INDEX_BITS | index


def share_id_of(ticket: int) -> int:
    return ticket >> TICKET_INDEX_BITS


def index_of(ticket: int) -> int:
    return ticket & _TICKET_INDEX_MASK


# ---- the share: a worker's part of a request ---------------------------------------------

ROOT_INDEX_TYPE = "H"  # a root index: uint16, native order (native/admit.c, native/probe.c)


@dataclass(slots=True, frozen=True)
class Share:
    """A worker's part of a request: per file its root index (ROOT_INDEX_TYPE) and its
    relative name, each name ended by NUL. Both buffers go to the native probe as they
    are."""

    roots: bytes
    paths: bytes

    @staticmethod
    def roots_size(count: int) -> int:
        """The bytes of `roots` for `count` files."""
        return count * array(ROOT_INDEX_TYPE).itemsize

    @property
    def count(self) -> int:
        return len(self.roots) // array(ROOT_INDEX_TYPE).itemsize

    def names(self) -> list[bytes]:
        return self.paths.split(b"\0")[:-1]

    def root_indexes(self) -> array[int]:
        indexes = array(ROOT_INDEX_TYPE)
        indexes.frombytes(self.roots)
        return indexes

    @classmethod
    def of(cls, roots: Sequence[int], names: Sequence[bytes]) -> Share:
        return cls(array(ROOT_INDEX_TYPE, roots).tobytes(),
                   b"".join(name + b"\0" for name in names))


# ---- supervisor -> worker ------------------------------------------------------------------


@dataclass(slots=True)
class Warm:
    """`files` for a worker to warm `read_bytes` deep in `warm_mode` ("read" or "advise"),
    by `deadline` (CLOCK_MONOTONIC seconds, 0: none: one clock for both processes) with
    item `flags` (KVP_ITEM_*). `share_id` is the share's id in the books (file i's ticket
    is ticket_of(share_id, i)); UNFOLLOWED: their outcomes are reported as counts.
    `client` is who sent the request (the supervisor's number for its peer): the queue
    engines let clients take turns on a root (native/schedule.c)."""

    KIND: ClassVar[str] = "warm"
    files: Share
    share_id: int
    read_bytes: int
    warm_mode: str
    deadline: float = 0.0
    flags: int = 0
    client: int = 0


@dataclass(slots=True)
class Check:
    """`files` for a worker to look at (kvp_inspect), `read_bytes` deep: each file's
    state and figures come back in a Done's `looked`. Always followed."""

    KIND: ClassVar[str] = "check"
    files: Share
    share_id: int
    read_bytes: int


@dataclass(slots=True)
class Evict:
    """`files` for a worker to drop from the page cache: their heads (`read_bytes`), or
    the `whole` files. Reported as a Check is."""

    KIND: ClassVar[str] = "evict"
    files: Share
    share_id: int
    read_bytes: int
    whole: bool = False


# The verbs the ops hand the pool's inspect: a Check, or an Evict of heads or whole files.
CHECK, EVICT_HEAD, EVICT_FILE = "check", "evict_head", "evict_file"


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
    # Reads in flight to start the root at (0: initial_depth), from its tier profile
    # (residency.RootRule.start_depth): a FUSE mount's share of max_background, past
    # which reads only queue in the kernel; a network file system's share of a deep start.
    depth: int = 0
    gauge: str = ""  # a FUSE connection's fusectl dir: admission by its count (gauge.c)


@dataclass(slots=True)
class Root:
    """A root that opened, was reopened or was let go after the worker was forked: `fd`
    is the one passed with the message (SCM_RIGHTS), -1 when none is (let go); on the
    wire 0 says one travels beside, -1 none. `rule` its KVP_RES_* code."""

    KIND: ClassVar[str] = "root"
    index: int
    rule: int
    tier: RootTier = field(default_factory=RootTier)
    fd: int = -1


# ---- worker -> supervisor ------------------------------------------------------------------


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


class Settled:
    """Followed files that were not warmed, column by column: per file its ticket, its
    outcome, the bytes read of it (a file read and then found futile) and its errno (0:
    none), which the reply names it with."""

    __slots__ = ("errnos", "nbytes", "outcomes", "tickets")

    def __init__(self) -> None:
        self.tickets = array("Q")
        self.outcomes: list[str] = []
        self.nbytes = array("q")
        self.errnos = array("i")

    def __len__(self) -> int:
        return len(self.tickets)

    def add(self, ticket: int, outcome: str, nbytes: int = 0, error: int = 0) -> None:
        self.tickets.append(ticket)
        self.outcomes.append(outcome)
        self.nbytes.append(nbytes)
        self.errnos.append(error)

    def add_run(self, share_id: int, indexes: Sequence[int], outcome: str,
                error: int = 0) -> None:
        """Files of one share settled alike, nothing read of them."""
        count = len(indexes)
        self.tickets.extend([share_id << TICKET_INDEX_BITS | index for index in indexes])
        self.outcomes.extend([outcome] * count)
        self.nbytes.frombytes(bytes(self.nbytes.itemsize * count))
        self.errnos.extend(array("i", [error]) * count)


class Looked:
    """Files a Check or an Evict looked at, column by column: per file its ticket, its
    state, errno, size, bytes cached and bytes in its file system's own cache (`tiers`)."""

    __slots__ = ("cached", "errnos", "sizes", "states", "tickets", "tiers")

    def __init__(self) -> None:
        self.tickets = array("Q")
        self.states: list[str] = []
        self.errnos = array("i")
        self.sizes = array("q")
        self.cached = array("q")
        self.tiers = array("q")

    def __len__(self) -> int:
        return len(self.tickets)

    def add(self, ticket: int, state: str, error: int = 0, size: int = 0, cached: int = 0,
            tier: int = 0) -> None:
        self.tickets.append(ticket)
        self.states.append(state)
        self.errnos.append(error)
        self.sizes.append(size)
        self.cached.append(cached)
        self.tiers.append(tier)


@dataclass(slots=True)
class Bulk:
    """Files of one share settled alike, warm (`outcome` "read" or "resident"), reported
    at once: how many, the bytes read, and their indexes, which the books keep should
    the worker die with the rest out."""

    share_id: int
    outcome: str
    count: int = 0
    nbytes: int = 0
    indexes: array[int] = field(default_factory=lambda: array("I"))

    def add_one(self, index: int, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes
        self.indexes.append(index)

    def add(self, indexes: Sequence[int]) -> None:
        """Files that were found warm: nothing read."""
        self.count += len(indexes)
        self.indexes.extend(indexes)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What reopening a file just warmed found of its root: "kept", "dropped" (reopen.py)."""

    root_index: int
    verdict: str


@dataclass(slots=True)
class Done:
    """Everything a worker settled since its last report; every batch ends in one."""

    KIND: ClassVar[str] = "done"
    settled: Settled = field(default_factory=Settled)  # followed files not warmed
    looked: Looked = field(default_factory=Looked)  # followed files checked or evicted
    bulk: list[Bulk] = field(default_factory=list)  # followed files warmed, per share
    counters: dict[str, int] = field(default_factory=dict)  # deltas: batches, dedup hits
    unfollowed: dict[str, int] = field(default_factory=dict)  # outcome -> files
    unfollowed_bytes: int = 0
    latency_counts: list[int] = field(default_factory=list)  # per-file histogram, merged
    latency_sum: float = 0.0
    # The queue engines' state now (not deltas), at most twice a second: threads, reads
    # running and stalled, files timed out, and per root index [depth, service time us]
    # (as stats reports it: docs/protocol.md).
    queue: dict[str, Any] = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)  # in the order they came


Message = Warm | Check | Evict | Root | Ready | BootFailed | Done
_KINDS: dict[str, type[Message]] = {
    kind.KIND: kind for kind in (Warm, Check, Evict, Root, Ready, BootFailed, Done)
}

# ---- the wire ------------------------------------------------------------------------------


def _columns(values: list[str]) -> tuple[list[str], bytes]:
    """A column of a few distinct names as (the names, one byte per value)."""
    names: dict[str, int] = {}
    codes = bytes([names.setdefault(value, len(names)) for value in values])
    return list(names), codes


def _array(typecode: str, data: bytes) -> array[int]:
    column = array(typecode)
    column.frombytes(data)
    return column


def _fields(message: Message) -> list[Any]:
    """A message's fields in wire order; nested records flattened to columns."""
    if isinstance(message, Warm | Check | Evict):
        rest = [getattr(message, name) for name in message.__slots__[2:]]
        return [message.files.roots, message.files.paths, message.share_id, *rest]
    if isinstance(message, Root):
        tier = message.tier
        return [message.index, message.rule, tier.keep, tier.whole, tier.fs_cache, tier.hold,
                tier.depth, tier.gauge, -1 if message.fd < 0 else 0]  # fd: SCM_RIGHTS
    if isinstance(message, Done):
        s, lk = message.settled, message.looked
        names, codes = _columns(s.outcomes)
        states, state_codes = _columns(lk.states)
        return [
            [s.tickets.tobytes(), names, codes,  # bytes: none (b"") for most reports
             s.nbytes.tobytes() if s.nbytes.count(0) != len(s.nbytes) else b"",
             s.errnos.tobytes()],
            [lk.tickets.tobytes(), states, state_codes, lk.errnos.tobytes(),
             lk.sizes.tobytes(), lk.cached.tobytes(), lk.tiers.tobytes()],
            [[b.share_id, b.outcome, b.count, b.nbytes, b.indexes.tobytes()]
             for b in message.bulk],
            message.counters, message.unfollowed, message.unfollowed_bytes,
            message.latency_counts, message.latency_sum, message.queue,
            [[v.root_index, v.verdict] for v in message.verdicts],
        ]
    return [getattr(message, name) for name in message.__slots__]


def _message(kind: type[Message], raw: list[Any]) -> Message:
    if kind is Warm or kind is Check or kind is Evict:
        return kind(Share(raw[0], raw[1]), *raw[2:])
    if kind is Root:
        return Root(raw[0], raw[1], RootTier(*raw[2:8]), raw[8])
    if kind is Done:
        settled, looked = Settled(), Looked()
        tickets, names, codes, nbytes, errnos = raw[0]
        settled.tickets = _array("Q", tickets)
        settled.nbytes = _array("q", nbytes or bytes(len(settled.tickets) * 8))
        settled.outcomes, settled.errnos = [names[c] for c in codes], _array("i", errnos)
        tickets, names, codes, errnos, sizes, cached, tiers = raw[1]
        looked.tickets, looked.states = _array("Q", tickets), [names[c] for c in codes]
        looked.errnos, looked.sizes = _array("i", errnos), _array("q", sizes)
        looked.cached, looked.tiers = _array("q", cached), _array("q", tiers)
        bulk = [Bulk(share_id, outcome, count, nbytes, _array("I", indexes))
                for share_id, outcome, count, nbytes, indexes in raw[2]]
        counters, unfollowed, unfollowed_bytes, counts, latency_sum, queue, verdicts = raw[3:]
        return Done(settled, looked, bulk, counters, unfollowed, unfollowed_bytes, counts,
                    latency_sum, queue, [Verdict(index, verdict) for index, verdict in verdicts])
    return kind(*raw)


def encode(message: Message) -> bytes:
    body: bytes = msgpack.packb([message.KIND, *_fields(message)], use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode(payload: bytes) -> Message:
    raw = msgpack.unpackb(payload, raw=False)
    if not isinstance(raw, list) or not raw or raw[0] not in _KINDS:
        raise ValueError(f"not a channel message: {str(raw)[:80]}")
    try:
        return _message(_KINDS[raw[0]], raw[1:])
    except (TypeError, ValueError, IndexError) as error:  # fields missing or too many
        raise ValueError(f"{raw[0]}: not a channel message: {error}") from None


# ---- the socketpair ------------------------------------------------------------------------


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
