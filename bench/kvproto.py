"""Protocol v1 spoken raw: a 4-byte big-endian length, then one msgpack map (docs/protocol.md).

The benchmarks measure the daemon, not a client library, so they carry their own
~40-line speaker: it is the floor any client can reach, it keeps working while the
`kvprefetch` package is being changed, and the ack-latency echo server uses the
same framing code, so daemon and floor differ only in what sits behind the socket.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

HEADER = struct.Struct(">I")


def pack_frame(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks: list[bytes] = []
    while count:
        chunk = sock.recv(min(count, 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection mid-frame")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (length,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    message: dict[str, Any] = msgpack.unpackb(recv_exact(sock, length), raw=False)
    return message


class RawClient:
    """One blocking connection; `call` for a round trip, `send`/`recv` to pipeline."""

    def __init__(self, path: str, timeout: float | None = 600.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self._next_id = 0

    def send(self, op: str, **fields: Any) -> int:
        self._next_id += 1
        self.sock.sendall(pack_frame({"v": 1, "id": self._next_id, "op": op, **fields}))
        return self._next_id

    def recv(self) -> dict[str, Any]:
        reply = recv_frame(self.sock)
        if reply.get("ok") is not True:
            raise RuntimeError(f"daemon error: {reply.get('error')!r}")
        return reply

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        sent = self.send(op, **fields)
        reply = self.recv()
        if reply.get("id") != sent:
            raise RuntimeError(f"reply id {reply.get('id')} for request {sent}")
        return reply

    def prefetch_wait(
        self, paths: Sequence[str], read_bytes: int, chunk: int = 0
    ) -> list[dict[str, Any]]:
        """Pipeline `paths` in requests of `chunk` paths (0: one request), all with `wait`."""
        step = chunk or max(1, len(paths))
        count = 0
        for start in range(0, len(paths), step):
            self.send("prefetch", paths=list(paths[start : start + step]), wait=True,
                      read_bytes=read_bytes)
            count += 1
        return [self.recv() for _ in range(count)]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
