"""Wire protocol v1 of kvprefetchd, from the client's side (see docs/protocol.md).

Knows frames, request shapes and reply envelopes; knows nothing of sockets, so the sync and
the asyncio clients share every byte-level decision made here.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack

from kvprefetch import errors
from kvprefetch.errors import *  # noqa: F403 -- re-exported: callers of this module catch them
from kvprefetch.errors import ProtocolError, ServerError

__all__ = [
    "DEFAULT_SOCKET",
    "HEADER",
    "MAX_BIN_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_STR_BYTES",
    "PROTOCOL_VERSION",
    "READ_CHUNK_BYTES",
    "ErrorCode",
    "FrameBuffer",
    "Outcome",
    "Path",
    "Reply",
    "answers",
    "check_reply",
    "decode_frame",
    "decode_payload",
    "default_socket",
    "encode_frame",
    "ping_request",
    "prefetch_blocks_request",
    "prefetch_request",
    "resolve_request",
    "stamp",
    "stats_request",
    "wait_allowance_s",
    "wire_path",
]
__all__ += errors.__all__

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/kvprefetchd/kvprefetchd.sock"  # where the systemd unit puts it


@dataclass(frozen=True)
class Endpoint:
    """Where a daemon listens: a Unix socket path, or a TCP host and port (`tls://HOST:PORT`,
    mutual TLS; `tcp://HOST:PORT`, plaintext, which a daemon serves on loopback only)."""

    kind: str  # "unix", "tls" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0


def parse_endpoint(address: str) -> Endpoint:
    """A socket path (optionally `unix://PATH`), `tls://HOST:PORT` or `tcp://HOST:PORT`."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        return Endpoint("unix", address)
    if scheme == "unix":
        return Endpoint("unix", rest)
    if scheme in ("tls", "tcp"):
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{address!r}: expected {scheme}://HOST:PORT")
        return Endpoint(scheme, host=host.strip("[]"), port=int(port))
    raise ValueError(f"{address!r}: unknown scheme {scheme!r} (unix, tls or tcp)")


def default_socket(systemd_socket: str = DEFAULT_SOCKET) -> str:
    """The daemon's socket when nobody names one: the daemon's own chain (its
    addresses.default_socket_path; docs/configuration.md, "The default socket"), which
    clients/go/testdata/default_socket.json holds the daemon and both clients to.

    $KVPREFETCHD_SOCKET if set; else the systemd path if a daemon is there; else
    kvprefetchd.sock in $RUNTIME_DIRECTORY, then $XDG_RUNTIME_DIR (the first entry, when
    absolute); else /tmp/kvprefetchd.sock (a daemon started by hand).
    """
    explicit = os.environ.get("KVPREFETCHD_SOCKET")
    if explicit:
        return explicit
    if os.path.exists(systemd_socket):
        return systemd_socket
    for env in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        base = os.environ.get(env, "").split(":")[0]
        if base.startswith("/"):
            return os.path.join(base, "kvprefetchd.sock")
    return "/tmp/kvprefetchd.sock"


HEADER = struct.Struct(">I")
# The daemon's default request limit; the client holds replies to the same bound so one
# runaway reply cannot make it buffer without end.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# The longest strings a v1 reply carries are paths (PATH_MAX is 4096 on Linux) and error
# messages; 1 MiB leaves room for both while refusing a hostile length prefix early.
MAX_STR_BYTES = 1024 * 1024
MAX_BIN_BYTES = 1024 * 1024
# What a client asks of its socket per read: replies are small but for stats and resolve.
READ_CHUNK_BYTES = 256 * 1024
# Envelope keys the client owns; a caller-supplied KV field of the same name would silently
# change which request the reply is matched to.
RESERVED_KEYS = frozenset({"v", "id", "op"})

Reply = dict[str, Any]
Path = str | bytes
PathLike = str | bytes | os.PathLike[str] | os.PathLike[bytes]


class Outcome(StrEnum):
    """Per-file outcome names (protocol.md, "Per-file outcomes")."""

    READ = "read"
    RESIDENT = "resident"
    MISSING = "missing"
    DROPPED = "dropped"
    REJECTED = "rejected"
    FAILED = "failed"
    EXPIRED = "expired"
    FUTILE = "futile"  # read, but the root's file system drops it at the next open


class ErrorCode(StrEnum):
    """Error codes of `ok: false` replies (protocol.md, "Errors")."""

    BAD_REQUEST = "bad_request"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_OP = "unknown_op"
    TOO_LARGE = "too_large"
    FORBIDDEN = "forbidden"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"


# --- frames -------------------------------------------------------------------------------


def encode_frame(message: Mapping[Any, Any], max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """Frame one map. Refusing oversize frames here turns the daemon's `too_large` reply
    (which cannot name the request it refused) into a local error naming the caller."""
    payload: bytes = msgpack.packb(message, use_bin_type=True)
    if len(payload) > max_frame:
        raise ValueError(
            f"request is {len(payload)} bytes, above the {max_frame}-byte frame limit; "
            "split the paths over several requests"
        )
    return HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes, max_frame: int = MAX_FRAME_BYTES) -> dict[Any, Any]:
    """Decode a frame body into its one map, with every msgpack limit set explicitly so a
    length prefix inside the payload can never make the client allocate beyond the frame."""
    unpacker = msgpack.Unpacker(
        None,
        raw=False,
        strict_map_key=False,  # stats may key per-worker figures by integer
        max_buffer_size=max_frame,
        max_str_len=min(max_frame, MAX_STR_BYTES),
        max_bin_len=min(max_frame, MAX_BIN_BYTES),
        # Every msgpack element takes at least one byte, so no longer container fits a frame.
        max_array_len=max_frame,
        max_map_len=max_frame // 2,
        max_ext_len=0,  # v1 has no ext types; refuse them rather than guess
    )
    try:
        unpacker.feed(payload)
        message = unpacker.unpack()
    except msgpack.OutOfData:
        raise ProtocolError("frame payload ends inside a msgpack value") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # ValueError covers msgpack's FormatError, StackError and limit overruns; TypeError an
        # unhashable map key.
        raise ProtocolError(f"undecodable frame payload: {exc}") from exc
    if unpacker.tell() != len(payload):
        raise ProtocolError("frame holds more than one msgpack value")
    if not isinstance(message, dict):
        raise ProtocolError(f"frame holds a {type(message).__name__}, not a map")
    return message


def decode_frame(frame: bytes, max_frame: int = MAX_FRAME_BYTES) -> dict[Any, Any]:
    """Decode exactly one complete frame; for tests, tools and corpus files."""
    buffer = FrameBuffer(max_frame)
    buffer.feed(frame)
    message = buffer.pop()
    if message is None:
        raise ProtocolError(f"truncated frame: {len(frame)} bytes")
    if buffer.pending:
        raise ProtocolError(f"{buffer.pending} bytes after the frame")
    return message


class FrameBuffer:
    """Reassembles frames from whatever chunks the socket delivers.

    Partial frames stay buffered across reads, so a timeout in the middle of a frame never
    desynchronises the stream: the next read continues where this one stopped.
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        self._buf += data

    def pop(self) -> dict[Any, Any] | None:
        """The next complete message, or None until more bytes arrive."""
        if len(self._buf) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buf)
        if length > self.max_frame:
            raise ProtocolError(f"frame of {length} bytes is above the {self.max_frame} limit")
        end = HEADER.size + length
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[HEADER.size : end])
        del self._buf[:end]
        return decode_payload(payload, self.max_frame)

    def clear(self) -> None:
        self._buf.clear()


# --- requests -----------------------------------------------------------------------------


def stamp(request: Mapping[str, Any], request_id: int) -> dict[str, Any]:
    """Add the envelope at send time, so builders stay free of connection state."""
    if "op" not in request:
        raise ValueError("a request needs an 'op'")
    clash = RESERVED_KEYS.intersection(request) - {"op"}
    if clash:
        raise ValueError(f"the client sets {sorted(clash)} itself")
    return {"v": PROTOCOL_VERSION, "id": request_id, **request}


def wire_path(path: PathLike) -> Path:
    """A path as the wire wants it: str when it is valid UTF-8, else bin.

    Python hands non-UTF-8 names (from argv, os.listdir) as str with surrogate escapes;
    those cannot be msgpack str, so they go back to their original bytes.
    """
    path = os.fspath(path)
    if isinstance(path, str):
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            return os.fsencode(path)
    return path


def ping_request() -> dict[str, Any]:
    return {"op": "ping"}


def stats_request() -> dict[str, Any]:
    return {"op": "stats"}


def prefetch_request(
    paths: Iterable[PathLike],
    *,
    wait: bool = False,
    read_bytes: int | None = None,
    timeout_ms: int | None = None,
    deadline: float | None = None,
    max_failures: int | None = None,
) -> dict[str, Any]:
    request = {"op": "prefetch", "paths": _paths(paths)}
    request.update(_io_options(wait, read_bytes, timeout_ms, deadline, max_failures))
    return request


def prefetch_blocks_request(
    kv: Mapping[str, Any],
    *,
    wait: bool = False,
    read_bytes: int | None = None,
    timeout_ms: int | None = None,
    deadline: float | None = None,
    max_failures: int | None = None,
) -> dict[str, Any]:
    """A `prefetch_blocks` request. The KV fields pass through untouched so a golden
    vector's `inputs` can be sent as they are (protocol.md, "KV requests")."""
    request = {**_kv_fields(kv), "op": "prefetch_blocks"}
    request.update(_io_options(wait, read_bytes, timeout_ms, deadline, max_failures))
    return request


def inspect_request(
    op: str,
    paths: Iterable[PathLike],
    *,
    read_bytes: int | None = None,
    details: bool = False,
    timeout_ms: int | None = None,
    whole: bool = False,
) -> dict[str, Any]:
    """A `check` or `evict` request (`whole`: evict whole files, not only heads)."""
    request: dict[str, Any] = {"op": op, "paths": _paths(paths), "details": bool(details)}
    if read_bytes is not None:
        request["read_bytes"] = _count("read_bytes", read_bytes)
    if timeout_ms is not None:
        request["timeout_ms"] = _count("timeout_ms", timeout_ms)
    if whole:
        request["whole"] = True
    return request


def _paths(paths: Iterable[PathLike]) -> list[Path]:
    if isinstance(paths, str | bytes | os.PathLike):
        # A lone path is iterable too, and would be sent one character per "path".
        raise TypeError("paths must be a collection of paths, not a single path")
    return [wire_path(p) for p in paths]


def deadline_ms(seconds: float) -> int:
    """A relative deadline on the wire: whole milliseconds, rounded up, at least 1 (0 would
    mean "no deadline")."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ValueError(f"deadline must be a non-negative number of seconds, not {seconds!r}")
    return max(1, math.ceil(seconds * 1000))


def resolve_request(kv: Mapping[str, Any]) -> dict[str, Any]:
    return {**_kv_fields(kv), "op": "resolve"}


def wait_allowance_s(request: Mapping[str, Any]) -> float:
    """How much longer than the client's own timeout a reply may fairly take: a `wait`
    request (or a check or evict) is answered only after its `timeout_ms` at worst."""
    timeout_ms = request.get("timeout_ms")
    waits = request.get("wait") is True or request.get("op") in ("check", "evict")
    if waits and isinstance(timeout_ms, int):
        return timeout_ms / 1000
    return 0.0


def _kv_fields(kv: Mapping[str, Any]) -> Mapping[str, Any]:
    clash = RESERVED_KEYS.intersection(kv)
    if clash:
        raise ValueError(f"KV request fields may not include {sorted(clash)}")
    return kv


def _io_options(wait: bool, read_bytes: int | None, timeout_ms: int | None,
                deadline: float | None = None, max_failures: int | None = None,
                ) -> dict[str, Any]:
    if not isinstance(wait, bool):
        raise TypeError("wait must be a bool")
    options: dict[str, Any] = {"wait": wait}
    if read_bytes is not None:
        options["read_bytes"] = _count("read_bytes", read_bytes)
    if timeout_ms is not None:
        if not wait:
            # protocol.md gives timeout_ms meaning only with wait; sending it alone would be
            # silently ignored, hiding the caller's mistake.
            raise ValueError("timeout_ms only applies with wait=True")
        options["timeout_ms"] = _count("timeout_ms", timeout_ms)
    if deadline is not None:
        options["deadline_ms"] = deadline_ms(deadline)
    if max_failures is not None:
        options["max_failures"] = _count("max_failures", max_failures)
    return options


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
    return value


# --- replies ------------------------------------------------------------------------------


def answers(reply: Reply, in_flight: Collection[int]) -> list[tuple[int, Reply]]:
    """Which requests in flight (ids in send order) `reply` answers, each with its own copy.

    A reply names its request by id. Two kinds of error cannot (protocol.md, "Errors"): a
    connection-level refusal, `forbidden` sent as the daemon accepts a peer it does not
    allow and then closes, which answers every request sent on that connection (the caller
    then treats the connection as closed); and an error for a frame whose id the daemon
    could not read (too_large skips the body unread), blamed on the oldest request in
    flight. A refusal with nothing in flight answers nobody; anything else is a
    ProtocolError.
    """
    request_id = reply.get("id")
    if isinstance(request_id, int) and request_id in in_flight:
        return [(request_id, reply)]
    if reply.get("ok") is False and not isinstance(request_id, int) and in_flight:
        blamed = list(in_flight) if is_refusal(reply) else [next(iter(in_flight))]
        return [(blamed_id, {**reply, "id": blamed_id}) for blamed_id in blamed]
    if is_refusal(reply):
        return []
    raise ProtocolError(f"reply for unknown request id {request_id!r}")


def is_refusal(reply: Reply) -> bool:
    """Whether `reply` is the daemon refusing this peer: the connection then ends."""
    error = reply.get("error")
    return (
        reply.get("ok") is False
        and not isinstance(reply.get("id"), int)
        and isinstance(error, dict)
        and error.get("code") == ErrorCode.FORBIDDEN
    )


def check_reply(reply: Reply) -> Reply:
    """Return a successful reply, raise ServerError for `ok: false`."""
    ok = reply.get("ok")
    if ok is True:
        return reply
    if ok is not False:
        raise ProtocolError(f"reply without a boolean 'ok': {reply!r}")
    error = reply.get("error")
    if not isinstance(error, dict):
        raise ProtocolError(f"error reply without an 'error' map: {reply!r}")
    request_id = reply.get("id")
    raise ServerError(
        str(error.get("code", "")),
        str(error.get("message", "")),
        request_id if isinstance(request_id, int) else None,
    )
