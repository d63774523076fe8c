"""Messages between the supervisor and a worker over their socketpair.

The same length-prefixed msgpack framing as the public protocol, without its
request envelope: both ends are ours. Message shapes, as msgpack arrays:

  supervisor -> worker   ["warm", want, other_mode, [[ticket, root_index, relative], ...]]
  worker -> supervisor   ["ready", {"engine": name, "pid": pid}]
                         ["boot_failed", reason]
                         ["done", [[ticket, outcome, bytes], ...], {counter: delta},
                          {outcome: n} of fire-and-forget files (ticket 0), their bytes,
                          [file latency bucket counts, latency sum] since the last "done"]
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

import msgpack

from kvprefetchd.protocol import HEADER, FrameReader

WARM = "warm"
READY = "ready"
BOOT_FAILED = "boot_failed"
DONE = "done"

# A worker batch of 10^5 long paths stays well below this; anything larger is a bug.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def pack(message: list[Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(payload: bytes) -> list[Any]:
    message = msgpack.unpackb(payload, raw=False)
    if not isinstance(message, list) or not message:
        raise ValueError("channel message is not a non-empty array")
    return message


class ChannelReader:
    """Non-blocking reader of whole messages from one end of a socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._frames = FrameReader(MAX_MESSAGE_BYTES)
        self.closed = False

    def read_available(self) -> list[list[Any]]:
        messages: list[list[Any]] = []
        while True:
            try:
                data = self.sock.recv(1 << 20)
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
                    messages.append(unpack(frame.payload))
        return messages


def send_all_blocking(sock: socket.socket, data: bytes) -> None:
    """Worker side: write a whole message, waiting when the supervisor is behind."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            _wait_writable(sock)
            continue
        view = view[sent:]


def _wait_writable(sock: socket.socket) -> None:
    import select

    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    poller.poll(1000)


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
