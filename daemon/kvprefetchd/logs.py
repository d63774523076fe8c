"""Logging to stderr that never stalls the event loop and keeps its levels in the journal.

Two things the standard StreamHandler gets wrong for a daemon:
- It blocks. A stderr pipe nobody drains (a wrapper that stopped reading, a full
  `journalctl` buffer) fills in 64 KiB and then every log call, on the supervisor's only
  thread, sleeps until someone reads. Here a line that cannot be written now waits in a
  small bounded buffer, later lines are dropped (and counted) while the sink is full, and
  the count is reported once it drains.
- It loses priorities. Under systemd, stderr is a stream into journald, which stores
  every line at the unit's default level (6, info) unless the line starts with a
  sd-daemon(3) prefix: "<3>" error, "<4>" warning, "<6>" info, "<7>" debug. Each line of
  a multi-line record (a traceback) gets its own prefix, since journald splits on
  newlines.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import sys

from kvprefetchd import systemd

# Bytes held while the sink is full; beyond this whole lines are dropped and counted.
PENDING_LIMIT = 256 * 1024

# sd-daemon(3) priorities (syslog's numbers) for Python's levels.
_PRIORITY = {
    logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
    logging.DEBUG: 7,
}


def journal_priority(levelno: int) -> int:
    for level in sorted(_PRIORITY, reverse=True):
        if levelno >= level:
            return _PRIORITY[level]
    return 7


class JournalFormatter(logging.Formatter):
    """Prefixes every line of a record with its sd-daemon(3) priority."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{journal_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


class NonBlockingStderr(logging.Handler):
    """A handler whose writes never block: pipes are reopened non-blocking (a file
    description of our own, so the shell's terminal or a shared pipe keeps its flags),
    sockets (the journal) are sent with MSG_DONTWAIT, files and terminals are written
    as they are (they do not fill up)."""

    def __init__(self, fd: int | None = None) -> None:
        super().__init__()
        fd = sys.stderr.fileno() if fd is None else fd
        self.sock: socket.socket | None = None
        self.fd = fd
        self.owned = False
        mode = os.fstat(fd).st_mode
        if stat.S_ISSOCK(mode):
            self.sock = socket.socket(fileno=os.dup(fd))
        elif stat.S_ISFIFO(mode):
            with contextlib.suppress(OSError):
                self.fd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK
                                  | os.O_CLOEXEC)
                self.owned = True
        self.pending = bytearray()
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "replace")
        except Exception:
            self.handleError(record)
            return
        self.flush()
        if self.pending:  # still full: keep what fits, count the rest
            if len(self.pending) + len(line) <= PENDING_LIMIT:
                self.pending += line
            else:
                self.dropped += 1
            return
        self.pending += line
        self.flush()

    def flush(self) -> None:
        """Write what the sink takes now; report dropped lines once it drains."""
        while self.pending:
            try:
                written = self._write(self.pending)
            except BlockingIOError:
                return
            except OSError as error:
                if error.errno in (errno.EPIPE, errno.EBADF, errno.ECONNRESET):
                    self.pending.clear()  # nobody will ever read it
                    return
                raise
            del self.pending[:written]
            if not self.pending and self.dropped:
                note = f"<4>{self.dropped} log lines dropped: stderr was not being read\n"
                if self.sock is None:
                    note = note[3:]
                self.dropped = 0
                self.pending += note.encode()

    def fileno(self) -> int:
        """What to poll for writability while lines are held back."""
        return self.sock.fileno() if self.sock is not None else self.fd

    def _write(self, data: bytearray) -> int:
        if self.sock is not None:
            return self.sock.send(data, socket.MSG_DONTWAIT)
        return os.write(self.fd, data)

    def close(self) -> None:
        if self.owned:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.owned = False
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        super().close()


def setup_logging(level: str) -> NonBlockingStderr:
    """One line per event on stderr; under systemd no timestamps (the journal adds its
    own) and sd-daemon priority prefixes when stderr is the journal."""
    handler = NonBlockingStderr()
    fmt = "%(levelname)s %(name)s: %(message)s"
    if systemd.stderr_is_journal():
        handler.setFormatter(JournalFormatter(fmt))
    else:
        if not systemd.under_systemd():
            fmt = "%(asctime)s " + fmt
        handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def stderr_handler() -> NonBlockingStderr | None:
    """The handler setup_logging installed, for the loop to flush when stderr drains."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, NonBlockingStderr):
            return handler
    return None
