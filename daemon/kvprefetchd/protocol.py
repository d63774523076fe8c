"""Wire protocol v1: frames, limits, request schemas and error replies.

Knows bytes and ops, nothing about engines or workers. The contract is
docs/protocol.md: a 4-byte big-endian length, then one msgpack map. The fields of the
warm and inspect ops, each number with its range, are read in request_fields.py.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")

# Error codes (docs/protocol.md, "Errors").
BAD_REQUEST = "bad_request"
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_OP = "unknown_op"
TOO_LARGE = "too_large"
FORBIDDEN = "forbidden"
OVERLOADED = "overloaded"
INTERNAL = "internal"
ERROR_CODES = (
    BAD_REQUEST, UNSUPPORTED_VERSION, UNKNOWN_OP, TOO_LARGE, FORBIDDEN, OVERLOADED, INTERNAL
)

OPS = ("ping", "prefetch", "prefetch_blocks", "check", "evict", "resolve", "stats", "doctor")

# The outcomes of accepted files, in the order the books and the `outcomes` map list them
# (docs/protocol.md, "Per-file outcomes"; tests/unit/test_protocol_conformance.py holds the
# daemon, both clients and that table to the same names).
OUTCOMES = ("read", "resident", "missing", "rejected", "failed", "expired", "futile")
# The states of a check's or evict's files (docs/protocol.md, "Check states").
CHECK_STATES = ("resident", "cold", "missing", "rejected", "failed", "dropped", "expired",
                "futile")
# How a warm-up warms (the config's `warm_mode`, a model profile's, the `stats` reply's):
# reading the head, or advising the kernel to (posix_fadvise WILLNEED). The one list: the
# config's choices, the engine table and the worker's check all import it.
WARM_MODES = ("read", "advise")
# How many files a warm reply lists in `failures` when the request does not say
# (docs/protocol.md, "Requests"); the clients are held to it by
# tests/unit/test_protocol_conformance.py, as they cannot import the daemon.
DEFAULT_MAX_FAILURES = 100


class RequestError(Exception):
    """A request that gets an error reply; the connection and the daemon go on serving."""

    def __init__(self, code: str, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may make us decode; never the library's permissive defaults."""

    max_frame_bytes: int
    max_paths: int
    max_path_bytes: int
    # A KV request's prompt is an array of token ids, bounded by max_tokens (which the KV
    # parser enforces per request), not by max_paths: a 128k-token prompt is ordinary.
    max_tokens: int = 0
    # The deepest a request may nest arrays and maps (the top map is 1). The deepest
    # well-formed request is 5 or 6 (a prompt's mm_features, a layout's layer_names);
    # msgpack's own C stack stops at 1024 whatever this says.
    max_nesting_depth: int = 16
    # Arrays and maps in one request, and their elements plus entries: what decoding may
    # build, whatever the frame's size. One byte of msgpack can be a whole empty array,
    # so a 14 MB frame of nested arrays decoded into 14 million lists (14.5 s, +1 GiB).
    max_containers: int = 1 << 17
    max_items: int = 1 << 21


@dataclass(frozen=True)
class Frame:
    """One complete frame from the stream, or the news that one was too large and skipped."""

    payload: bytes | None
    skipped_bytes: int = 0


class FrameReader:
    """Splits a byte stream into frames; an oversized frame is skipped, not fatal.

    Skipping (rather than closing) is what the contract asks: the client gets a
    `too_large` error and may keep using the connection.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._skip = 0

    def feed(self, data: bytes) -> Iterator[Frame]:
        self.append(data)
        return self.take()

    def append(self, data: bytes) -> None:
        self._buffer += data

    def take(self) -> Iterator[Frame]:
        """The frames buffered now, one at a time: a caller may stop between two (its
        client is backlogged) and take the rest later; nothing is lost or parsed twice."""
        while True:
            if self._skip:
                taken = min(self._skip, len(self._buffer))
                del self._buffer[:taken]
                self._skip -= taken
                if self._skip:
                    return
                continue
            if len(self._buffer) < HEADER.size:
                return
            (length,) = HEADER.unpack_from(self._buffer)
            if length > self.max_frame_bytes:
                del self._buffer[: HEADER.size]
                self._skip = length
                yield Frame(None, length)
                continue
            end = HEADER.size + length
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[HEADER.size : end])
            del self._buffer[:end]
            yield Frame(payload)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def head_bytes(self) -> int | None:
        """The whole size (header included) of the frame at the head of the buffer, once
        its header is in and it is one to keep (None while skipping or unknown)."""
        if self._skip or len(self._buffer) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buffer)
        return None if length > self.max_frame_bytes else HEADER.size + length

    @property
    def partial(self) -> bool:
        """Bytes of a frame not yet whole are buffered (and no whole frame waits)."""
        if not self._buffer:
            return False
        head = self.head_bytes()
        return head is None or len(self._buffer) < head


def encode_frame(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def _unpack(payload: bytes, limits: Limits, budget: DecodeBudget | None) -> Any:
    # The longest array any op takes; each op checks its own bound after decoding (too
    # many paths or tokens is `too_large`, with the limit named).
    longest = max(limits.max_paths, limits.max_tokens)
    if budget is None:  # two calls rather than **kwargs: this is every request's path
        return msgpack.unpackb(
            payload, raw=False, max_str_len=limits.max_frame_bytes,
            max_bin_len=limits.max_frame_bytes, max_array_len=longest, max_map_len=1024,
            max_ext_len=0,
        )
    return msgpack.unpackb(
        payload, raw=False, max_str_len=limits.max_frame_bytes,
        max_bin_len=limits.max_frame_bytes, max_array_len=longest, max_map_len=1024,
        max_ext_len=0, list_hook=budget.count, object_hook=budget.count,
    )


class _TooMany(Exception):
    """Raised from inside msgpack's hooks: decoding stops at once, nothing more is built."""


class DecodeBudget:
    """Counts what decoding builds, from msgpack's per-container hooks, and stops it.

    The hooks run once per array and per map as each is completed (innermost first), so
    a request is stopped after at most `max_containers` containers and `max_items`
    elements plus one array of at most max_array_len: its cost is bounded before the
    rest of the frame is looked at. The usual request (a map and one array) costs two
    calls.
    """

    __slots__ = ("containers", "items", "limits")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.containers = 0
        self.items = 0

    def count(self, container: Any) -> Any:
        self.containers += 1
        self.items += len(container)
        if self.containers > self.limits.max_containers or self.items > self.limits.max_items:
            raise _TooMany
        return container

    def refusal(self) -> RequestError:
        limits = self.limits
        if self.containers > limits.max_containers:
            what = f"more than max_request_containers ({limits.max_containers}) arrays and maps"
        else:
            what = f"more than max_request_items ({limits.max_items}) elements and entries"
        return RequestError(TOO_LARGE, f"the request holds {what}")


def decode_payload(payload: bytes, limits: Limits) -> dict[str, Any]:
    """Unpack one frame's body with explicit limits; anything but a map is a bad request.

    Every container and every element takes at least a byte, so a frame no longer than
    both budgets cannot exceed them: only larger frames are decoded with the counting hooks.
    """
    size = len(payload)
    budget = (
        None if size <= limits.max_containers and size <= limits.max_items
        else DecodeBudget(limits)
    )
    try:
        message = _unpack(payload, limits, budget)
    except _TooMany:
        assert budget is not None
        raise budget.refusal() from None
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData, TypeError) as error:
        raise RequestError(BAD_REQUEST, f"not one msgpack value: {error}") from error
    except RecursionError as error:
        raise RequestError(BAD_REQUEST, "msgpack nesting too deep") from error
    if not isinstance(message, dict):
        raise RequestError(BAD_REQUEST, f"a request is a map, not {type(message).__name__}")
    if nests_deeper_than(message, limits.max_nesting_depth):
        raise RequestError(
            TOO_LARGE,
            f"arrays and maps nested deeper than max_nesting_depth ({limits.max_nesting_depth})",
            request_id_of(message),
        )
    return message


def request_id_of(message: dict[str, Any]) -> int | None:
    """The request's id if it is a usable one (an unsigned integer, not a bool), else None:
    the one test of an id, so every error reply echoes the same ids."""
    request_id = message.get("id")
    return request_id if type(request_id) is int and request_id >= 0 else None


def nests_deeper_than(value: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether containers nest more than `limit` levels (value itself is level 1).

    Level by level, without recursion. Each container's element types are gathered
    with set(map(type, ...)), which runs in C: the usual request (a map of scalars and
    one array of path strings) costs one quick pass over its paths and no descent.
    """
    level: list[Any] = [value]
    depth = 1
    while level:
        if depth > limit:
            return True
        deeper: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            kinds = set(map(type, items))
            if list in kinds or dict in kinds:
                deeper.extend(x for x in items if type(x) is list or type(x) is dict)
        level = deeper
        depth += 1
    return False


@dataclass(frozen=True)
class Request:
    request_id: int
    op: str
    body: dict[str, Any]


def parse_request(message: dict[str, Any]) -> Request:
    """Check the envelope (v, id, op); op-specific fields are checked by the op itself."""
    request_id = request_id_of(message)
    if request_id is None:
        raise RequestError(BAD_REQUEST, "id: expected an unsigned integer")
    version = message.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        raise RequestError(BAD_REQUEST, "v: expected the protocol version (1)", request_id)
    if version != PROTOCOL_VERSION:
        raise RequestError(
            UNSUPPORTED_VERSION,
            f"protocol version {version} is not served; this daemon speaks {PROTOCOL_VERSION}",
            request_id,
        )
    op = message.get("op")
    if not isinstance(op, str):
        raise RequestError(BAD_REQUEST, "op: expected a string", request_id)
    if op not in OPS:
        raise RequestError(UNKNOWN_OP, f"unknown op {op!r}", request_id)
    return Request(request_id, op, message)


def ok_reply(request_id: int, **fields: Any) -> dict[str, Any]:
    return {"id": request_id, "ok": True, **fields}


def error_reply(request_id: int | None, code: str, message: str) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": {"code": code, "message": message}}
