"""The supervisor's request path, in-process: bytes on a socket in, replies out.

Fuzzing through the daemon's listening socket costs a process switch per example;
this drives the same objects instead (the server's connection read path, so FrameReader,
decode_payload, parse_request, the ops' dispatch, each op's validation, confinement, the KV
parser and hasher, the books) on a real Connection over a socketpair. Nothing is
mocked. The supervisor has no workers, so an accepted path finds no room in any
queue and is counted `dropped`: what is fuzzed is everything before the disk.

Shared by the hypothesis properties (test_protocol_properties.py) and the atheris
target (fuzz_protocol.py), so both check the same contract:
- every complete frame gets exactly one reply, in order, and a frame whose length
  alone is too large gets one `too_large` reply;
- a reply is `{id, ok: true, ...}` or `{id, ok: false, error: {code, message}}` with
  `code` from the documented set (docs/protocol.md, "Errors"), and never `internal`,
  which is what handle_frame answers when an op raised something unexpected: a bug;
- `id` is echoed whenever the request carried a usable one.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from kvharness.wire import FrameSplitter, frame, split_frames, unpack
from kvprefetchd.config import Config
from kvprefetchd.protocol import RequestError, decode_payload
from kvprefetchd.supervisor.loop import Supervisor

# docs/protocol.md, "Errors"; `internal` is documented but is a bug when a request causes it.
CODES = frozenset({"bad_request", "unsupported_version", "unknown_op", "too_large",
                   "forbidden", "overloaded", "internal"})
# A root that does not exist: nothing the fuzzer sends can make the supervisor touch a file.
ROOT = "/nonexistent-kvfuzz/kv"
SMALL_LIMITS: dict[str, Any] = {
    # Small enough that generated requests cross every limit, at both sides of it.
    "max_frame_bytes": 64 * 1024,
    "max_paths_per_request": 64,
    "max_path_bytes": 256,
    "max_read_bytes": 1 << 20,
    "read_bytes": 4096,
    "max_prompts": 4,
    "max_tokens": 256,
}


class ContractError(AssertionError):
    """A reply broke the protocol's contract: the finding a fuzzer reports."""


@dataclass(frozen=True)
class Expected:
    """What the reference framing says a byte stream holds: frames, then too-large headers."""

    payloads: list[bytes | None]  # None: a frame whose length alone is too large


def reference_frames(stream: bytes, max_frame_bytes: int) -> list[bytes | None]:
    """The frames a stream holds, by the contract alone: the test harness's framing (a
    second implementation, kvharness.wire), not the daemon's FrameReader.

    A length above the limit is answered at once and its N bytes skipped, even when
    they have not all arrived yet.
    """
    return split_frames(stream, max_frame_bytes)


def chunked(data: bytes, cuts: Iterable[int]) -> Iterator[bytes]:
    """data split at the given offsets (any order, any repeats, out-of-range ignored)."""
    previous = 0
    for cut in sorted({c for c in cuts if 0 < c < len(data)}):
        yield data[previous:cut]
        previous = cut
    yield data[previous:]


def usable_id(message: Any) -> int | None:
    """The id a reply must echo: the request's, when it is an unsigned integer."""
    if isinstance(message, dict):
        raw = message.get("id")
        if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
            return raw
    return None


def check_reply(reply: Any, want_id: int | None = None, *, check_id: bool = True) -> None:
    """The shape every reply must have; raises ContractError naming what is wrong."""
    if not isinstance(reply, dict) or "ok" not in reply or "id" not in reply:
        raise ContractError(f"not a reply: {reply!r}")
    if check_id and reply["id"] != want_id:
        raise ContractError(f"reply id {reply['id']!r}, the request's {want_id!r}: {reply!r}")
    if reply["ok"] is True:
        return
    if reply["ok"] is not False:
        raise ContractError(f"ok is neither true nor false: {reply!r}")
    error = reply.get("error")
    if not isinstance(error, dict) or error.get("code") not in CODES:
        raise ContractError(f"undocumented error: {reply!r}")
    if error["code"] == "internal":
        raise ContractError(f"an op raised an unexpected exception: {error['message']}")
    if not isinstance(error.get("message"), str) or not error["message"]:
        raise ContractError(f"error without a message: {reply!r}")


class InProcessSupervisor:
    """A Supervisor with no workers and one client connection over a socketpair."""

    def __init__(self, **config: Any) -> None:
        settings = {"roots": (ROOT,), "workers": 2, "socket": "/nonexistent-kvfuzz/s.sock",
                    **config}
        self.supervisor = Supervisor(Config(**settings))
        self.reset_stream()

    @property
    def max_frame_bytes(self) -> int:
        return self.supervisor.config.max_frame_bytes

    def exchange(self, data: bytes, cuts: Iterable[int] = ()) -> list[dict[str, Any]]:
        """Send data (split at cuts) through the supervisor's own read path; every reply."""
        got: list[dict[str, Any]] = []
        for piece in chunked(data, cuts):
            view = memoryview(piece)
            while view:
                with contextlib.suppress(BlockingIOError):
                    view = view[self.client.send(view) :]
                self._pump(got)
        self._pump(got)
        return got

    def _pump(self, got: list[dict[str, Any]]) -> None:
        """Let the supervisor read what is buffered, and collect what it wrote back."""
        while True:
            self.supervisor.server.on_connection_event(self.connection, selectors.EVENT_READ)
            self.connection.flush()
            progressed = False
            while True:
                try:
                    data = self.client.recv(1 << 20)
                except BlockingIOError:
                    break
                progressed = True
                got += [unpack(body) for body in self.replies.bodies(data)]
            if not progressed and not self.connection.output and not self._pending_input():
                return

    def _pending_input(self) -> bool:
        try:
            return bool(self.connection.sock.recv(1, socket.MSG_PEEK))
        except BlockingIOError:
            return False

    def request(self, message: Any) -> dict[str, Any]:
        """One message, one reply (checked for shape and id)."""
        body = msgpack.packb(message, use_bin_type=True)
        replies = self.exchange(frame(body))
        if len(replies) != 1:
            raise ContractError(f"{len(replies)} replies to one request: {replies!r}")
        check_reply(replies[0], self.expected_id(body, message))
        return replies[0]

    def expected_id(self, body: bytes, message: Any) -> int | None:
        """The request's id, unless the frame does not decode (then no id can be read)."""
        try:
            decode_payload(body, self.supervisor.ops.limits)
        except RequestError:
            return None
        return usable_id(message)

    def stream(self, data: bytes, cuts: Iterable[int] = ()) -> list[dict[str, Any]]:
        """Any bytes: one reply per frame the reference framing finds, each well formed."""
        expected = reference_frames(data, self.max_frame_bytes)
        replies = self.exchange(data, cuts)
        if len(replies) != len(expected):
            raise ContractError(f"{len(expected)} frames got {len(replies)} replies")
        for payload, reply in zip(expected, replies, strict=True):
            if payload is None:
                if reply.get("error", {}).get("code") != "too_large":
                    raise ContractError(f"an oversized frame got {reply!r}")
                check_reply(reply, None)
            else:
                check_reply(reply, check_id=False)
        return replies

    def reset_stream(self) -> None:
        """A fresh connection, registered as the server registers an accepted one.

        (Arbitrary bytes may leave the old one mid-frame or mid-skip for ever.)
        """
        if hasattr(self, "connection"):
            self.close_connection()
        server_end, self.client = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        server_end.setblocking(False)
        self.client.setblocking(False)
        self.connection = self.supervisor.server.add_connection(server_end)
        self.replies = FrameSplitter()  # the replies, read with the harness's framing

    def internal_errors(self) -> int:
        return sum(n for key, n in self.supervisor.ops.requests.items()
                   if key.endswith("_internal"))

    def close_connection(self) -> None:
        self.supervisor.server.drop(self.connection)
        self.client.close()

    def close(self) -> None:
        self.close_connection()
        self.supervisor.selector.close()
        self.supervisor._wakeup_r.close()
        self.supervisor._wakeup_w.close()
