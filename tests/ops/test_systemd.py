"""kvprefetchd.systemd against real sockets: sd_notify datagrams, passed fds, the watchdog.

A bound AF_UNIX datagram socket stands in for systemd's notify socket (by path
and in the abstract namespace); socket activation is exercised in a child
process that really receives a listening socket as fd 3 with LISTEN_PID set to
its own pid, exactly what systemd (or systemd-socket-activate) does.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvprefetchd import systemd


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket bound at a path, named in $NOTIFY_SOCKET."""
    path = str(tmp_path / "notify")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield receiver
    receiver.close()


@pytest.fixture
def abstract_notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """The same in the abstract namespace: $NOTIFY_SOCKET starts with '@'."""
    name = f"kvprefetchd-test-{uuid.uuid4().hex}"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind("\0" + name)
    receiver.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    yield receiver
    receiver.close()


# ---- sd_notify -------------------------------------------------------------------------------


def test_notify_sends_one_datagram_of_newline_terminated_assignments(
    notify_socket: socket.socket,
) -> None:
    assert systemd.notify("READY=1", "STATUS=serving on /run/kvprefetchd/kvprefetchd.sock")
    assert notify_socket.recv(4096) == (
        b"READY=1\nSTATUS=serving on /run/kvprefetchd/kvprefetchd.sock\n"
    )


def test_notify_reaches_an_abstract_namespace_socket(
    abstract_notify_socket: socket.socket,
) -> None:
    assert systemd.notify("WATCHDOG=1")
    assert abstract_notify_socket.recv(4096) == b"WATCHDOG=1\n"


def test_helpers_send_the_documented_assignments(notify_socket: socket.socket) -> None:
    assert systemd.ready("up\nwith 2 workers")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=up with 2 workers\n"
    assert systemd.status("draining")
    assert notify_socket.recv(4096) == b"STATUS=draining\n"
    assert systemd.stopping()
    assert notify_socket.recv(4096) == b"STOPPING=1\n"
    assert systemd.watchdog_ping()
    assert notify_socket.recv(4096) == b"WATCHDOG=1\n"
    assert systemd.extend_timeout(2.5)
    assert notify_socket.recv(4096) == b"EXTEND_TIMEOUT_USEC=2500000\n"
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert systemd.reloading()
    lines = notify_socket.recv(4096).decode().splitlines()
    assert lines[0] == "RELOADING=1"
    stamp = int(lines[1].removeprefix("MONOTONIC_USEC="))
    assert before <= stamp <= before + 5_000_000


def test_notify_is_false_without_a_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert systemd.ready() is False


@pytest.mark.parametrize("value", ["relative/notify", "vsock:2:1234"])
def test_notify_refuses_addresses_it_does_not_speak(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert systemd.notify("READY=1") is False


def test_notify_to_a_missing_socket_is_false_not_an_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert systemd.notify("READY=1") is False


def test_notify_never_blocks_when_nobody_reads(notify_socket: socket.socket) -> None:
    # net.unix.max_dgram_qlen (default 10) bounds the receiver's queue: a blocking
    # sender would hang here; ours gets EAGAIN and answers False.
    started = time.monotonic()
    results = [systemd.notify("WATCHDOG=1") for _ in range(2000)]
    assert time.monotonic() - started < 5
    assert results[0] is True
    assert False in results


# ---- sd_listen_fds ---------------------------------------------------------------------------


def test_listen_fds_is_empty_without_socket_activation(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        monkeypatch.delenv(name, raising=False)
    assert systemd.listen_fds() == []


@pytest.mark.parametrize(
    ("pid", "fds"), [("1", "1"), ("not-a-pid", "1"), ("SELF", "zero"), ("SELF", "0")]
)
def test_listen_fds_ignores_variables_meant_for_another_process_and_unsets_them(
    monkeypatch: pytest.MonkeyPatch, pid: str, fds: str
) -> None:
    monkeypatch.setenv("LISTEN_PID", str(os.getpid()) if pid == "SELF" else pid)
    monkeypatch.setenv("LISTEN_FDS", fds)
    monkeypatch.setenv("LISTEN_FDNAMES", "kvprefetchd")
    assert systemd.listen_fds() == []
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        assert name not in os.environ


def test_listen_fds_can_leave_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LISTEN_PID", "1")
    monkeypatch.setenv("LISTEN_FDS", "1")
    assert systemd.listen_fds(unset_environment=False) == []
    assert os.environ["LISTEN_PID"] == "1"


# The child: takes the passed sockets, checks them, serves one connection.
CHILD = r"""
import fcntl, json, os, sys
from kvprefetchd import systemd
env_before = {k: os.environ.get(k) for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")}
passed = systemd.listen_fds_with_names()
report = {
    "env_before": env_before,
    "env_after": [k for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES") if k in os.environ],
    "names": [name for name, _ in passed],
    "fds": [s.fileno() for _, s in passed],
    "cloexec": [bool(fcntl.fcntl(s.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC) for _, s in passed],
    "listeners": [systemd.is_unix_stream_listener(s) for _, s in passed],
}
print(json.dumps(report), flush=True)
sock = passed[0][1]
sock.setblocking(True)
connection, _ = sock.accept()
connection.sendall(b"served by the passed socket")
connection.close()
"""

# What systemd does between fork and exec: the socket at fd 3, LISTEN_PID = the pid
# that will exec the daemon (exec keeps the pid).
ACTIVATE = r"""
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)  # dup2 makes the new fd inheritable
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_FDNAMES"] = "kvprefetchd"
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2]])
"""


def _serve_and_connect(
    command: list[str], path: str, pass_fds: tuple[int, ...] = ()
) -> tuple[dict[str, object], bytes]:
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds
    )
    try:
        assert child.stdout is not None
        if not pass_fds:  # systemd-socket-activate spawns the child on the first connection
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(20)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.connect(path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            report = json.loads(child.stdout.readline())
        else:
            report = json.loads(child.stdout.readline())
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(20)
            client.connect(path)
        with client:
            data = b""
            while chunk := client.recv(4096):
                data += chunk
        assert child.wait(20) == 0, child.stderr.read() if child.stderr else b""
        return report, data
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_passed_listening_socket_arrives_as_fd_3_and_serves(tmp_path: Path) -> None:
    path = str(tmp_path / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    with listener:
        report, data = _serve_and_connect(
            [sys.executable, "-c", ACTIVATE, str(listener.fileno()), CHILD],
            path,
            pass_fds=(listener.fileno(),),
        )
    assert report["env_before"]["LISTEN_FDS"] == "1"  # type: ignore[index]
    assert report["env_after"] == []  # unset, so workers forked later never see them
    assert report["names"] == ["kvprefetchd"]
    assert report["fds"] == [systemd.SD_LISTEN_FDS_START]
    assert report["cloexec"] == [True]
    assert report["listeners"] == [True]
    assert data == b"served by the passed socket"


@pytest.mark.skipif(
    shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate not installed"
)
def test_systemd_socket_activate_hands_over_its_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "activated.sock")
    report, data = _serve_and_connect(
        ["systemd-socket-activate", "-l", path, "--fdname=kvprefetchd",
         sys.executable, "-c", CHILD],
        path,
    )
    assert report["names"] == ["kvprefetchd"]
    assert report["fds"] == [3]
    assert report["listeners"] == [True]
    assert data == b"served by the passed socket"


def test_a_passed_fd_that_is_not_a_socket_is_skipped(tmp_path: Path) -> None:
    script = r"""
import json, os
from kvprefetchd import systemd
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = "2"
os.environ["LISTEN_FDNAMES"] = "only-one-name"
print(json.dumps([(n, s.fileno()) for n, s in systemd.listen_fds_with_names()]))
"""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen(1)
    pipe_r, pipe_w = os.pipe()
    activate = (
        "import os, sys\n"
        "a, b = int(sys.argv[1]), int(sys.argv[2])\n"
        "os.dup2(a, 10); os.dup2(b, 11)\n"
        "os.dup2(10, 3); os.dup2(11, 4)\n"
        "os.execv(sys.executable, [sys.executable, '-c', sys.argv[3]])\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", activate, str(listener.fileno()), str(pipe_r), script],
            pass_fds=(listener.fileno(), pipe_r), capture_output=True, text=True, timeout=30,
            check=True,
        )
    finally:
        listener.close()
        os.close(pipe_r)
        os.close(pipe_w)
    # Two names expected, one given: both "unknown"; fd 4 (a pipe) is not a socket.
    assert json.loads(out.stdout) == [["unknown", 3]]
    assert "not a socket" in out.stderr


# ---- sd_watchdog_enabled ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 30.0),
        ("30000000", "SELF", 30.0),
        ("30000000", "1", None),  # meant for the supervisor, seen by a forked worker
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(os.getpid()) if value == "SELF" else value)
    assert systemd.watchdog_interval() == expected


def test_watchdog_interval_can_unset_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval(unset_environment=True) == 1.0
    assert "WATCHDOG_USEC" not in os.environ and "WATCHDOG_PID" not in os.environ


def test_watchdog_pings_at_half_the_interval_when_the_loop_asks() -> None:
    now = [100.0]
    pings: list[float] = []

    def send() -> bool:
        pings.append(now[0])
        return True

    watchdog = systemd.Watchdog(30.0, send=send, clock=lambda: now[0])
    assert watchdog.enabled and watchdog.period == 15.0
    assert watchdog.timeout(now[0]) == 0.0  # the first ping is due at once
    assert watchdog.tick(now[0])
    assert not watchdog.tick(now[0] + 14.9)
    assert watchdog.timeout(now[0] + 10) == pytest.approx(5.0)
    now[0] += 15.0
    assert watchdog.tick(now[0])
    assert pings == [100.0, 115.0]
    assert watchdog.pings == 2


def test_a_disabled_watchdog_never_pings_nor_bounds_the_loop() -> None:
    watchdog = systemd.Watchdog(None, send=lambda: pytest.fail("pinged"))  # type: ignore[arg-type]
    assert not watchdog.enabled
    assert watchdog.timeout(0.0) is None
    assert not watchdog.tick(1e9)


def test_watchdog_from_environment_pings_the_notify_socket(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    watchdog = systemd.Watchdog.from_environment()
    assert watchdog.interval == 2.0
    assert watchdog.tick(time.monotonic())
    assert notify_socket.recv(4096) == b"WATCHDOG=1\n"


# ---- environment -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("invocation", "journal", "expected"),
    [(None, None, False), ("0123abcd", None, True), (None, "8:1234", True), ("", "", False)],
)
def test_under_systemd(
    monkeypatch: pytest.MonkeyPatch, invocation: str | None, journal: str | None, expected: bool
) -> None:
    for name, value in (("INVOCATION_ID", invocation), ("JOURNAL_STREAM", journal)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert systemd.under_systemd() is expected


def test_stderr_is_journal_compares_device_and_inode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open(tmp_path / "stderr", "w") as fake_stderr:
        info = os.fstat(fake_stderr.fileno())
        monkeypatch.setattr(sys, "stderr", fake_stderr)
        monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino}")
        assert systemd.stderr_is_journal()
        monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino + 1}")
        assert not systemd.stderr_is_journal()
        monkeypatch.setenv("JOURNAL_STREAM", "garbage")
        assert not systemd.stderr_is_journal()

