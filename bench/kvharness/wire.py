"""Protocol v1 spoken raw: a 4-byte big-endian length, then one msgpack value (docs/protocol.md).

Kept deliberately small and separate from the daemon's FrameReader and the client's
framing: a framing bug in either cannot hide behind the same bug here.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

HEADER = struct.Struct(">I")


def frame(body: bytes) -> bytes:
    """body behind its length header: one frame, whatever body holds."""
    return HEADER.pack(len(body)) + body


def pack(message: Any) -> bytes:
    """One message as a frame (msgpack with bin types, as the protocol asks)."""
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return frame(body)


def unpack(body: bytes) -> Any:
    """A frame's body decoded; map keys of any type survive (a peer may send integer keys)."""
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


class FrameSplitter:
    """Frames out of a byte stream as it arrives, however it is cut.

    With max_frame, a length above it is reported at once as None and its body
    skipped as it arrives, as the daemon answers `too_large` on the header alone
    and discards the rest (docs/protocol.md, "Framing").
    """

    def __init__(self, max_frame: int | None = None) -> None:
        self.max_frame = max_frame
        self.buffer = bytearray()
        self.skip = 0  # bytes of an oversized frame still to discard

    def feed(self, data: bytes) -> list[bytes | None]:
        self.buffer += data
        out: list[bytes | None] = []
        while True:
            if self.skip:
                dropped = min(self.skip, len(self.buffer))
                del self.buffer[:dropped]
                self.skip -= dropped
                if self.skip:
                    return out
            if len(self.buffer) < HEADER.size:
                return out
            (length,) = HEADER.unpack_from(self.buffer)
            if self.max_frame is not None and length > self.max_frame:
                del self.buffer[: HEADER.size]
                self.skip = length
                out.append(None)
                continue
            if len(self.buffer) < HEADER.size + length:
                return out
            out.append(bytes(self.buffer[HEADER.size : HEADER.size + length]))
            del self.buffer[: HEADER.size + length]

    def bodies(self, data: bytes) -> list[bytes]:
        """feed, for a stream without max_frame, where every frame comes whole."""
        return [body for body in self.feed(data) if body is not None]


def split_frames(stream: bytes, max_frame: int | None = None) -> list[bytes | None]:
    """Every frame a complete stream holds (None for each oversized one); a tail is left."""
    return FrameSplitter(max_frame).feed(stream)


class RawConnection:
    """One blocking connection with nothing in between: `call` for a round trip,
    `request`/`recv` to pipeline, `send`/`send_frame`/`sock` to send anything at all."""

    def __init__(self, path: str, timeout: float | None = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self._frames = FrameSplitter()
        self._ready: list[bytes] = []
        self._last_id = 0

    def send_frame(self, body: bytes) -> None:
        self.sock.sendall(frame(body))

    def send(self, message: Any) -> None:
        self.sock.sendall(pack(message))

    def request(self, op: str, **fields: Any) -> int:
        """Send a v1 request with the next id; the id."""
        self._last_id += 1
        self.send({"v": 1, "id": self._last_id, "op": op, **fields})
        return self._last_id

    def recv(self) -> dict[str, Any]:
        """The next reply, whatever it says."""
        while not self._ready:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the daemon closed the connection")
            self._ready += self._frames.bodies(data)
        reply: dict[str, Any] = unpack(self._ready.pop(0))
        return reply

    def recv_ok(self) -> dict[str, Any]:
        """The next reply, which must be a success."""
        reply = self.recv()
        if reply.get("ok") is not True:
            raise RuntimeError(f"daemon error: {reply.get('error')!r}")
        return reply

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One round trip; the reply (an error reply too), checked to carry our id."""
        sent = self.request(op, **fields)
        reply = self.recv()
        if reply.get("id") != sent:
            raise RuntimeError(f"reply id {reply.get('id')!r} to request {sent}: {reply!r}")
        return reply

    def call_ok(self, op: str, **fields: Any) -> dict[str, Any]:
        """One round trip that must succeed."""
        reply = self.call(op, **fields)
        if reply.get("ok") is not True:
            raise RuntimeError(f"daemon error: {reply.get('error')!r}")
        return reply

    def prefetch_wait(
        self, paths: Sequence[str], read_bytes: int, chunk: int = 0
    ) -> list[dict[str, Any]]:
        """Pipeline `paths` in requests of `chunk` paths (0: one request), all with `wait`."""
        step = chunk or max(1, len(paths))
        count = 0
        for start in range(0, len(paths), step):
            self.request("prefetch", paths=list(paths[start : start + step]), wait=True,
                         read_bytes=read_bytes)
            count += 1
        return [self.recv_ok() for _ in range(count)]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
