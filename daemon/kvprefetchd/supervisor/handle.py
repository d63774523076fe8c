"""One worker as the supervisor sees it: its process, its end of the channel, and the
bytes (and fds) waiting to go out on it without ever blocking the supervisor's loop."""

from __future__ import annotations

import errno
import os
import selectors
import socket
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvprefetchd.channel import ChannelReader, Message, encode


@dataclass
class WorkerHandle:
    index: int
    pid: int
    sock: socket.socket
    reader: ChannelReader
    output: bytearray = field(default_factory=bytearray)
    ready: bool = False
    engine: str = ""
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    # The heartbeat: when the worker last sent anything (every batch ends in a Done),
    # or was handed work while it owed nothing. A worker that owes outcomes and has
    # been silent for worker_timeout since then is wedged (murder_workers).
    heard: float = field(default_factory=time.monotonic)
    handler: Callable[[int], None] | None = None  # its selector callback
    # Root messages, each with an fd beside it (our own copy, closed once sent; -1 for
    # none), behind `output`.
    with_fds: deque[tuple[bytes, int]] = field(default_factory=deque)
    queue: dict[str, Any] = field(default_factory=dict)  # its queue engines, as last said
    watched: int = selectors.EVENT_READ  # the selector events registered for it now

    def send(self, message: Message, selector: selectors.BaseSelector) -> None:
        self.output += encode(message)
        self.flush(selector)

    def send_with_fd(self, message: Message, fd: int, selector: selectors.BaseSelector) -> None:
        """A message with an fd beside it (ours: closed once sent), in line behind what
        waits already."""
        self.with_fds.append((encode(message), fd))
        self.flush(selector)

    def flush(self, selector: selectors.BaseSelector) -> None:
        """Send what the socket takes now; watch for room when something is left."""
        while self.output or self.with_fds:
            try:
                if self.output:
                    sent = self.sock.send(self.output)
                    del self.output[:sent]
                    continue
                # A message with an fd starts only once what came before it is out, so
                # the fd goes with that message's first byte (SCM_RIGHTS), and the
                # worker's reader pairs it with the message those bytes start.
                data, fd = self.with_fds[0]
                sent = (socket.send_fds(self.sock, [data], [fd]) if fd >= 0
                        else self.sock.send(data))
                self.with_fds.popleft()
                if fd >= 0:
                    os.close(fd)
                self.output += data[sent:]
            except (BlockingIOError, InterruptedError):
                break
            except OSError as error:
                if error.errno in (errno.EPIPE, errno.ECONNRESET):
                    self.output.clear()  # it is dying; SIGCHLD fails what it owes
                    self.drop_fds()
                    break
                raise
        waiting = self.output or self.with_fds
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if waiting else 0)
        if events != self.watched:
            self.watched = events
            selector.modify(self.sock, events, self.handler)

    def drop_fds(self) -> None:
        """Close the fd copies still waiting to go to a worker that is gone or going."""
        while self.with_fds:
            fd = self.with_fds.popleft()[1]
            if fd >= 0:
                os.close(fd)
