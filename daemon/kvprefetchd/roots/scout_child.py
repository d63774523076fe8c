"""The scout's own side: the loop of the forked child, and the frames both sides speak.

A frame is a 4-byte big-endian length and a pickled (number, task) or (number, result);
an fd travels beside it (SCM_RIGHTS): the root a revalidation compares with, the root an
OpenRoot opened. The child runs one task at a time, in order, and answers each; it exits
when the supervisor closes its end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvprefetchd.channel import close_other_fds
from kvprefetchd.roots.tasks import Passed

log = logging.getLogger("kvprefetchd.scout")

HEADER = struct.Struct(">I")
MAX_REPLY_BYTES = 64 << 20  # a listing of a huge root_dir; anything larger is a bug
MAX_FDS = 4  # fds one message may carry (a task or a result carries at most one)


def send_message(sock: socket.socket, payload: Any, fds: Sequence[int] = ()) -> None:
    body = pickle.dumps(payload)
    data = HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_exact(sock: socket.socket, count: int, fds: list[int]) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk, got, _, _ = socket.recv_fds(sock, count - len(data), MAX_FDS)
        if not chunk:
            raise EOFError("the other end closed")
        fds.extend(got)
        data += chunk
    return bytes(data)


def scout_main(sock: socket.socket, title: str) -> NoReturn:
    """The child: run each task in turn, answer with its result (and an fd if it made one)."""
    status = 0
    try:
        close_other_fds({0, 1, 2, sock.fileno()})
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.setproctitle(title)
        sock.setblocking(True)
        while True:
            fds: list[int] = []  # the fds a task came with: its own, closed after it ran
            (length,) = HEADER.unpack(recv_exact(sock, HEADER.size, fds))
            number, task = pickle.loads(recv_exact(sock, length, fds))
            try:
                result = task.run(fds)
            finally:
                for fd in fds:
                    os.close(fd)
            if isinstance(result, Passed) and result.fd >= 0:
                send_message(sock, (number, result), (result.fd,))
                os.close(result.fd)
            else:
                send_message(sock, (number, result))
    except (EOFError, ConnectionResetError):
        pass  # the supervisor is gone (a reset: it closed with our answer unread)
    except BaseException:
        log.exception("the scout crashed")
        status = 1
    finally:
        sys.stderr.flush()
    os._exit(status)
