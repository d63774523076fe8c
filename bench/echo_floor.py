"""The ack-latency floor: an echo server speaking the protocol's framing, and nothing else.

Same framing, a selector loop like the supervisor's, msgpack decode of the request
and a small reply with the same counts the daemon's ack carries: daemon/echo is what
the daemon's own work costs on top of Python + a Unix socket + msgpack.

    .venv/bin/python bench/echo_floor.py SOCKET      (ack_latency.py starts it)
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import cast

from kvharness.wire import FrameSplitter, pack, unpack


def serve_echo(path: str) -> None:
    """Answer every frame with {id, ok, accepted, dropped, rejected}: framing + msgpack only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    streams: dict[socket.socket, FrameSplitter] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ)
                streams[conn] = FrameSplitter()
                continue
            conn = cast(socket.socket, key.fileobj)
            try:
                data = conn.recv(256 * 1024)
            except BlockingIOError:
                continue
            if not data:
                selector.unregister(conn)
                conn.close()
                del streams[conn]
                continue
            out = bytearray()
            for body in streams[conn].bodies(data):
                message = unpack(body)
                paths = message.get("paths") or []
                out += pack({"id": message.get("id"), "ok": True,
                             "accepted": len(paths), "dropped": 0, "rejected": 0})
            if out:
                conn.setblocking(True)  # replies are small: block rather than buffer
                conn.sendall(out)
                conn.setblocking(False)


def start_echo(path: str) -> subprocess.Popen[bytes]:
    """The echo server in its own process (its own GIL, as the daemon's supervisor has)."""
    process = subprocess.Popen([sys.executable, __file__, path], start_new_session=True)
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the echo server did not start")
        time.sleep(0.01)
    return process


def stop_echo(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(5)


if __name__ == "__main__":
    serve_echo(sys.argv[1])
