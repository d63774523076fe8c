"""Run inside the container: connect and ping over and over for a while; print what happened.

    python ping_through_restarts.py SOCKET SECONDS

A raw protocol-v1 client (docs/protocol.md: a 4-byte big-endian length, then one msgpack
map), one connection per ping, one at a time, so that nothing a client library does
(reconnecting, retrying) can hide a refused connection. Prints one JSON object:
connected, answered, refused (connect() failed: what socket activation exists to
prevent), interrupted (connected, then the connection broke before the answer: at most
one per restart, since one connection is in flight at a time), errors (an error reply)
and the errno names of refusals and interruptions.
"""

from __future__ import annotations

import errno
import json
import socket
import struct
import sys
import time
from collections import Counter

import msgpack

HEADER = struct.Struct(">I")
ANSWER_TIMEOUT = 30.0  # a restart's stop and start, with room
# Between pings: hundreds of connects still land in each restart's gap (about a second),
# without one client taking a whole CPU of the machine for the test's length.
PAUSE = 0.002


def receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("closed by the daemon")
        data += chunk
    return data


def main() -> None:
    path, seconds = sys.argv[1], float(sys.argv[2])
    counts: Counter[str] = Counter()
    why: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    request_id = 0
    while time.monotonic() < deadline:
        request_id += 1
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(ANSWER_TIMEOUT)
        try:
            try:
                sock.connect(path)
            except OSError as error:
                counts["refused"] += 1
                why["connect: " + errno.errorcode.get(error.errno or 0, str(error))] += 1
                time.sleep(0.01)
                continue
            counts["connected"] += 1
            body = msgpack.packb({"v": 1, "id": request_id, "op": "ping"})
            try:
                sock.sendall(HEADER.pack(len(body)) + body)
                (length,) = HEADER.unpack(receive(sock, HEADER.size))
                reply = msgpack.unpackb(receive(sock, length))
            except (OSError, EOFError) as error:
                counts["interrupted"] += 1
                why["answer: " + (type(error).__name__ if isinstance(error, EOFError) else
                                  errno.errorcode.get(getattr(error, "errno", 0) or 0,
                                                      str(error)))] += 1
                continue
            if reply.get("ok") is True and reply.get("id") == request_id:
                counts["answered"] += 1
            else:
                counts["errors"] += 1
                why["reply: " + str(reply.get("error", reply))] += 1
        finally:
            sock.close()
        time.sleep(PAUSE)
    print(json.dumps({**{k: counts[k] for k in
                         ("connected", "answered", "refused", "interrupted", "errors")},
                      "why": dict(why)}))


if __name__ == "__main__":
    main()
