"""systemd's daemon protocols, spoken directly: no libsystemd, no threads.

Four small things the supervisor needs from its service manager, each the
documented wire protocol that libsystemd's own helpers implement:

- `notify()`: sd_notify(3). One AF_UNIX datagram of newline-separated
  `KEY=VALUE` assignments to $NOTIFY_SOCKET (a path, or `@name` for the abstract
  namespace). `ready()`, `status()`, `stopping()`, `reloading()` and
  `watchdog_ping()` are the assignments a Type=notify service sends.
- `listen_fds()`: sd_listen_fds(3). Socket activation passes listening sockets
  as fds 3, 4, ... (SD_LISTEN_FDS_START) and says so in LISTEN_PID, LISTEN_FDS
  and LISTEN_FDNAMES; the variables are meant for exactly one process, so they
  are checked against getpid() and then unset, lest a forked worker believe
  they were its own.
- `watchdog_interval()` and `Watchdog`: sd_watchdog_enabled(3). WatchdogSec=
  arrives as WATCHDOG_USEC (and WATCHDOG_PID); sd_watchdog_enabled(3)
  recommends pinging at half the interval, which `Watchdog` does when the event
  loop asks it (`Watchdog.timeout(now)` bounds the loop's select timeout).
- `under_systemd()`: whether the process runs as a unit, which decides the log
  format (the journal timestamps lines itself).

Nothing here raises when systemd is absent or misconfigured: every function
answers "no" (False, [], None) and logs at debug, so the same daemon runs
unchanged from a shell, a container or a unit.

Integration in the supervisor (sketch)::

    from kvprefetchd import systemd

    passed = systemd.listen_fds()            # before any fork: unsets LISTEN_*
    listener = passed[0] if passed else None  # else listen_unix(config.socket, ...)
    watchdog = systemd.Watchdog.from_environment()
    ...                                      # workers booted
    systemd.ready(f"serving on {config.socket} with {n} workers")
    while not stopping:
        run_once(min_timeout(next_timeout(), watchdog.timeout(time.monotonic())))
        watchdog.tick(time.monotonic())
    systemd.stopping()
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import stat
import sys
import time
from collections.abc import Callable

log = logging.getLogger("kvprefetchd.systemd")

SD_LISTEN_FDS_START = 3  # sd-daemon.h: the first passed fd, after stdin, stdout and stderr
_LISTEN_ENV = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
_WATCHDOG_ENV = ("WATCHDOG_USEC", "WATCHDOG_PID")
# sd_listen_fds_with_names(3): a socket systemd did not name is called "unknown".
UNKNOWN_NAME = "unknown"


# ---- sd_notify(3) ----------------------------------------------------------------------------


def _notify_address(value: str) -> str | bytes | None:
    """The sockaddr for $NOTIFY_SOCKET: an absolute path, or '@' for the abstract namespace.

    sd_notify(3): "If the first character of $NOTIFY_SOCKET is '@', the string is
    understood as Linux abstract namespace socket." Newer systemd (v254+) also
    accepts "vsock:CID:PORT" for VMs; a host daemon never sees that, so it is
    refused here (logged) rather than half supported.
    """
    if value.startswith("@"):
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return value
    log.debug("NOTIFY_SOCKET=%r is neither a path nor an abstract name; not notifying", value)
    return None


def notify(*states: str) -> bool:
    """Send `states` (e.g. "READY=1", "STATUS=serving") to the service manager.

    False when $NOTIFY_SOCKET is unset (not under systemd, or not Type=notify) or
    the datagram could not be sent. Never raises on a send error and never blocks:
    a full notify queue must not stall the event loop (logged at debug).
    """
    target = os.environ.get("NOTIFY_SOCKET")
    if not target or not states:
        return False
    address = _notify_address(target)
    if address is None:
        return False
    text = "".join(state if state.endswith("\n") else state + "\n" for state in states)
    message = text.encode("utf-8", "surrogateescape")
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    except OSError as error:
        log.debug("cannot create a notify socket: %s", error)
        return False
    try:
        sock.setblocking(False)
        sent = sock.sendto(message, address)
    except OSError as error:
        log.debug("notify %r to %s failed: %s", text.strip(), target, error)
        return False
    finally:
        sock.close()
    return sent == len(message)


def _one_line(text: str) -> str:
    # A newline would start a new assignment: STATUS= is one line by definition.
    return " ".join(text.splitlines())


def ready(status: str | None = None) -> bool:
    """READY=1: start-up is finished (Type=notify units wait for this), optionally a status."""
    states = ["READY=1"]
    if status:
        states.append(f"STATUS={_one_line(status)}")
    return notify(*states)


def status(text: str) -> bool:
    """STATUS=...: free text shown by `systemctl status`."""
    return notify(f"STATUS={_one_line(text)}")


def stopping(status: str | None = None) -> bool:
    """STOPPING=1: shutdown has begun (systemd stops expecting watchdog pings)."""
    states = ["STOPPING=1"]
    if status:
        states.append(f"STATUS={_one_line(status)}")
    return notify(*states)


def reloading(status: str | None = None) -> bool:
    """RELOADING=1 with MONOTONIC_USEC (systemd 253+ wants it); send ready() when done.

    With Type=notify and ExecReload=kill -HUP, systemd 252 accepts RELOADING=1 and
    waits for READY=1; sending the pair makes `systemctl reload` wait for the
    reload to be applied rather than only for the signal to be sent.
    """
    now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    states = ["RELOADING=1", f"MONOTONIC_USEC={now_us}"]
    if status:
        states.append(f"STATUS={_one_line(status)}")
    return notify(*states)


def watchdog_ping() -> bool:
    """WATCHDOG=1: "still alive" for WatchdogSec=."""
    return notify("WATCHDOG=1")


def extend_timeout(seconds: float) -> bool:
    """EXTEND_TIMEOUT_USEC=: ask for more time to start or stop, from now."""
    return notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1e6))}")


# ---- sd_listen_fds(3) ------------------------------------------------------------------------


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value, 10)
    except ValueError:
        log.warning("ignoring %s=%r: not a decimal integer", name, value)
        return None


def _passed_fd_count(unset_environment: bool) -> int:
    """How many fds systemd passed to *this* process (sd_listen_fds' own checks)."""
    try:
        pid = _env_int("LISTEN_PID")
        if pid is None:
            return 0
        if pid != os.getpid():
            # Meant for another process (we were forked or exec'ed past it).
            log.debug("LISTEN_PID=%d is not us (%d): no sockets passed", pid, os.getpid())
            return 0
        count = _env_int("LISTEN_FDS")
        if count is None or count <= 0:
            return 0
        return count
    finally:
        # sd_listen_fds(3): "unset ... before returning (regardless whether the
        # function call itself succeeded or not)".
        if unset_environment:
            for name in _LISTEN_ENV:
                os.environ.pop(name, None)


def listen_fds_with_names(unset_environment: bool = True) -> list[tuple[str, socket.socket]]:
    """The sockets systemd passed, with their FileDescriptorName= (or "unknown").

    Each fd gets FD_CLOEXEC, as sd_listen_fds(3) sets it, so nothing exec'ed
    later inherits a listening socket. An fd that is not a socket (ListenFIFO=,
    a misconfigured unit) is logged and skipped, not wrapped.
    """
    names_env = os.environ.get("LISTEN_FDNAMES")
    count = _passed_fd_count(unset_environment)
    if count == 0:
        return []
    names = names_env.split(":") if names_env else []
    if len(names) != count:
        if names_env is not None:
            log.warning(
                "LISTEN_FDNAMES has %d names for %d fds; calling them all %r",
                len(names), count, UNKNOWN_NAME,
            )
        names = [UNKNOWN_NAME] * count
    passed: list[tuple[str, socket.socket]] = []
    for offset, name in enumerate(names):
        fd = SD_LISTEN_FDS_START + offset
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                log.warning("passed fd %d (%s) is not a socket; ignoring it", fd, name)
                continue
            # socket.socket(fileno=) reads family, type and protocol back from the fd.
            passed.append((name, socket.socket(fileno=fd)))
        except OSError as error:
            log.warning("passed fd %d (%s) is unusable: %s", fd, name, error)
    return passed


def listen_fds(unset_environment: bool = True) -> list[socket.socket]:
    """The listening sockets systemd passed (fds 3...), in the unit's order; [] when none."""
    return [sock for _, sock in listen_fds_with_names(unset_environment)]


def is_unix_stream_listener(sock: socket.socket) -> bool:
    """sd_is_socket_unix(fd, SOCK_STREAM, listening=1): the kind of socket kvprefetchd serves."""
    try:
        accepting = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    return sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM and bool(accepting)


# ---- sd_watchdog_enabled(3) ------------------------------------------------------------------


def watchdog_interval(unset_environment: bool = False) -> float | None:
    """WatchdogSec= in seconds, or None when no watchdog is expected from this process.

    WATCHDOG_PID, when set, must be our pid (sd_watchdog_enabled(3)), so a forked
    worker that inherited the environment never takes the supervisor's watchdog
    for its own. Ping at half of it at least (`Watchdog` does).
    """
    try:
        usec = _env_int("WATCHDOG_USEC")
        if usec is None or usec <= 0:
            return None
        if "WATCHDOG_PID" in os.environ:
            pid = _env_int("WATCHDOG_PID")
            if pid != os.getpid():
                return None
        return usec / 1e6
    finally:
        if unset_environment:
            for name in _WATCHDOG_ENV:
                os.environ.pop(name, None)


class Watchdog:
    """Pings WATCHDOG=1 at half the interval, driven by the event loop (no timer thread).

    `timeout(now)` is how long the loop may sleep before the next ping is due
    (None when disabled); `tick(now)` pings when due. A loop that blocks longer
    than the whole interval is exactly what the watchdog exists to catch.
    """

    def __init__(
        self,
        interval: float | None,
        send: Callable[[], bool] = watchdog_ping,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.period = interval / 2 if interval else None
        self._send = send
        self.next_due = clock() if self.period else float("inf")
        self.pings = 0

    @classmethod
    def from_environment(cls) -> Watchdog:
        return cls(watchdog_interval())

    @property
    def enabled(self) -> bool:
        return self.period is not None

    def timeout(self, now: float) -> float | None:
        if self.period is None:
            return None
        return max(0.0, self.next_due - now)

    def tick(self, now: float) -> bool:
        """Ping if due; returns whether it pinged."""
        if self.period is None or now < self.next_due:
            return False
        self._send()
        self.pings += 1
        self.next_due = now + self.period
        return True


# ---- environment -----------------------------------------------------------------------------


def under_systemd() -> bool:
    """Started by systemd (INVOCATION_ID, systemd 232+) or logging into the journal."""
    return bool(os.environ.get("INVOCATION_ID") or os.environ.get("JOURNAL_STREAM"))


def stderr_is_journal() -> bool:
    """JOURNAL_STREAM names stderr's device:inode (systemd.exec(5), "Environment variables").

    Stricter than under_systemd(): a child started from a unit with its stderr
    redirected elsewhere inherits JOURNAL_STREAM but fails this check.
    """
    value = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    with contextlib.suppress(OSError, ValueError):
        info = os.fstat(sys.stderr.fileno())
        return (info.st_dev, info.st_ino) == (int(device), int(inode))
    return False
