"""Listening sockets: bind the Unix socket safely, accept without spinning, refuse politely,
and survive what one peer's connection throws.

Shared by every listener of the supervisor's loop: the request socket (server.py), the
TCP listener (tcp.py) and the metrics endpoint (metrics_http.py).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import socket
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterator

from kvprefetchd.listeners.peer_errors import accept_failed_by_peer
from kvprefetchd.protocol import encode_frame, error_reply

log = logging.getLogger("kvprefetchd.server")  # the socket's own messages, as before the move

# Out of file descriptors, accept(2) fails and leaves the connection in the
# backlog, so the listener stays readable: a level-triggered loop that simply
# tried again would spin (measured: 70% of a CPU and 80,000 log lines in 2 s).
# The listener is taken out of the selector for this long instead.
ACCEPT_REST = 0.5


class AcceptRest:
    """A listener out of fds: it leaves the selector for ACCEPT_REST s at a time instead of
    spinning (its connections wait in the backlog until a connection closes or the limit
    is raised). Each episode is logged once when it starts and once when accepting works
    again, never once per rest. The listener unregisters itself and calls `begin`; its
    loop calls `over` on each tick and registers again when it says so."""

    def __init__(self, what: str, logger: logging.Logger,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.log = logger
        self.clock = clock
        self.until: float | None = None  # resting (not watched) until then
        self.since: float | None = None  # out of fds since then: the episode

    def begin(self, error: OSError) -> None:
        now = self.clock()
        self.until = now + ACCEPT_REST
        if self.since is None:
            self.since = now
            self.log.warning("%s: cannot accept connections: %s; they wait in the backlog "
                             "(pausing accept %.1f s at a time)", self.what, error.strerror,
                             ACCEPT_REST)

    def over(self, now: float) -> bool:
        """True once, when a rest ends: the listener goes back in the selector."""
        if self.until is not None and now >= self.until:
            self.until = None
            return True
        return False

    def accepted(self) -> None:
        """An accept worked: the episode, if any, is over."""
        if self.since is not None:
            self.log.warning("%s: accepting connections again after %.1f s out of file "
                             "descriptors", self.what, self.clock() - self.since)
            self.since = None


class Unforeseen:
    """Errors no rule foresaw in one peer's callback (a bug, or a state nobody thought a
    peer could bring about): each is counted (`connection_errors`) and logged with the
    peer, and the caller closes that peer only, so the loop and every other peer go on
    (issue 23). The traceback is logged the first time per kind of error and place, then
    one line each: a peer that can trigger one at will must not flood the log."""

    KINDS = 64  # tracebacks told, at most (then one line each)

    def __init__(self, events: Counter[str], logger: logging.Logger) -> None:
        self.events = events
        self.log = logger
        self.told: set[tuple[str, str, int]] = set()

    def happened(self, who: str, error: Exception) -> None:
        self.events["connection_errors"] += 1
        frame = error.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        kind = (type(error).__name__, frame.tb_frame.f_code.co_filename if frame else "",
                frame.tb_lineno if frame else 0)
        first = kind not in self.told and len(self.told) < self.KINDS
        if first:
            self.told.add(kind)
        self.log.error("closed the connection of %s after an unexpected error: %s: %s",
                       who, type(error).__name__, error, exc_info=error if first else None)


class Hush:
    """Warnings about peers, at most LINES per WINDOW seconds per kind; the rest counted and
    told in one line when the window ends. Each refused peer is worth a line, but a flood
    of them (hundreds a second) must not become a flood of log lines that costs the loop
    more than the peers do (issue 23)."""

    LINES = 10
    WINDOW = 10.0

    def __init__(self, logger: logging.Logger,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = logger
        self.clock = clock
        self.windows: dict[str, tuple[float, int, int]] = {}  # kind: (start, told, hushed)

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = self.clock()
        start, told, hushed = self.windows.get(kind, (now, 0, 0))
        if now - start >= self.WINDOW:
            self.tell(kind, start, hushed)
            start, told, hushed = now, 0, 0
        if told < self.LINES:
            self.log.warning(message, *args)
            told += 1
        else:
            hushed += 1
        self.windows[kind] = (start, told, hushed)

    def tell(self, kind: str, start: float, hushed: int) -> None:
        if hushed:
            self.log.warning("%d more like the above (%s) in %.0f s were not logged; the "
                             "events counters have them all", hushed, kind,
                             self.clock() - start)

    def sweep(self) -> None:
        """Tell the hushed count of every window that ended (called once a second)."""
        now = self.clock()
        for kind, (start, _, hushed) in list(self.windows.items()):
            if now - start >= self.WINDOW:
                self.tell(kind, start, hushed)
                del self.windows[kind]


class SocketInUse(RuntimeError):
    """Another live daemon answers on the socket path: refuse rather than steal it."""


def _remove_stale(path: str) -> None:
    """Unlink a leftover socket file, but only if nothing listens on it and it is a socket."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: nobody accepts on it
        log.info("removed stale socket %s", path)
        return
    except OSError as error:
        raise SocketInUse(f"{path}: cannot tell whether it is in use ({error})") from error
    finally:
        probe.close()
    raise SocketInUse(f"another kvprefetchd is serving on {path}")


def listen_unix(path: str, mode: int, backlog: int = 512) -> socket.socket:
    """Bind with the umask set around bind(), so the socket is never briefly too open.

    (A chmod after bind leaves a window in which anyone may connect.)
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except OSError as error:
        sock.close()
        # bind's error names no file; the operator needs to know which socket (the
        # request socket or the metrics one) and where: ENOSPC on a tmpfs out of inodes.
        raise OSError(error.errno, error.strerror, path) from error
    finally:
        os.umask(old_umask)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def out_of_fds(error: OSError) -> bool:
    """EMFILE (this process) or ENFILE (the system): the listener must rest (ACCEPT_REST)."""
    return error.errno in (errno.EMFILE, errno.ENFILE)


def accept_ready(listener: socket.socket, what: str,
                 most: int | None = None) -> Iterator[socket.socket]:
    """Every connection waiting on a non-blocking listener (at most `most` this turn: the
    listener stays readable and the loop comes back after serving the others), as
    non-blocking sockets.

    A peer that gave up before we accepted it costs that connection, never the
    event loop that called us. Running out of fds raises the OSError (see
    `out_of_fds`) after yielding what was accepted before it.
    """
    for _ in itertools.repeat(None) if most is None else range(most):
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            if accept_failed_by_peer(error):
                continue
            if out_of_fds(error):
                log.debug("%s: accept: %s", what, error.strerror)
            raise
        sock.setblocking(False)
        yield sock


def refuse(sock: socket.socket, code: str, message: str) -> None:
    """One error reply, best effort (the kernel's buffer takes it), then closed."""
    with contextlib.suppress(OSError):
        sock.send(encode_frame(error_reply(None, code, message)))
    sock.close()
