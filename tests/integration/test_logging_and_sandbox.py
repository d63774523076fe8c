"""The daemon's log and its sandbox, as a service manager or a careless wrapper leaves them.

- Under systemd, stderr is a stream into the journal, which keeps a line's level only
  when the line starts with a sd-daemon(3) prefix: every line must carry one.
- A stderr pipe nobody reads fills in 64 KiB; the supervisor must keep serving (lines
  are held, then dropped and counted), never sleep in write(2).
- A seccomp filter that refuses setpriority (systemd's ~@resources) must not kill the
  workers: they serve unreniced, and the daemon says so once.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvharness.daemon
from kvharness.daemon import Daemon
from kvharness.wire import RawConnection

SECCOMP = ctypes.util.find_library("seccomp")
# Runs its arguments with setpriority refused (ENOSYS), through libseccomp: a real
# kernel filter, as systemd's SystemCallFilter installs one.
DENY_SETPRIORITY = """
import ctypes, errno, os, sys
lib = ctypes.CDLL(sys.argv[1], use_errno=True)
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW
number = lib.seccomp_syscall_resolve_name(b"setpriority")
assert lib.seccomp_rule_add(ctx, 0x00050000 | errno.ENOSYS, number, 0) == 0
assert lib.seccomp_load(ctx) == 0
os.execv(sys.argv[2], sys.argv[2:])
"""


@contextlib.contextmanager
def daemon(tmp_path: Path, *args: str, **launch: Any) -> Iterator[Daemon]:
    """The real daemon, its stderr or its command line as the test arranges them."""
    (tmp_path / "kv").mkdir(exist_ok=True)
    socket_path = tmp_path / "run" / "kvprefetchd.sock"
    started = kvharness.daemon.launch(
        ["--socket", str(socket_path), "--root", str(tmp_path / "kv"), "--workers", "2", *args],
        socket_path=socket_path, root=tmp_path / "kv", log_path=tmp_path / "daemon.log",
        **launch,
    )
    try:
        yield started
    finally:
        started.kill()


def test_every_line_carries_its_journal_priority_when_stderr_is_the_journal(
    tmp_path: Path,
) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    info = os.fstat(theirs.fileno())
    env = {**os.environ, "JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}"}
    with daemon(tmp_path, "--root", str(tmp_path / "absent"), stderr=theirs.fileno(),
                env=env, wait=False) as started:
        theirs.close()
        started.wait_ready()
        assert started.stop() == 0
    ours.settimeout(5)
    text = b"".join(iter(lambda: ours.recv(65536), b"")).decode()
    ours.close()
    lines = [line for line in text.splitlines() if line]
    assert lines and all(line[:3] in ("<3>", "<4>", "<6>", "<7>") for line in lines), lines
    assert any(line.startswith("<4>WARNING") and "does not exist" in line for line in lines)
    assert any(line.startswith("<6>INFO") and "serving on" in line for line in lines)


def test_a_stderr_pipe_nobody_reads_never_stalls_the_supervisor(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    with daemon(tmp_path, "--log-level", "debug", stderr=write_end, wait=False) as started:
        os.close(write_end)
        started.wait_ready()
        socket_path = started.socket_path
        connection = RawConnection(socket_path)
        connection.sock.settimeout(5)  # a supervisor asleep in write(2) fails this
        # Each refused path is one debug line of ~100 bytes: 200 requests write ~2 MB,
        # thirty times what the pipe holds.
        refused = [f"/outside/{i:06d}/{'x' * 40}.bin" for i in range(100)]
        for _ in range(200):
            reply = connection.call("prefetch", paths=refused)
            assert reply["ok"] and reply["rejected"] == 100
        started = time.monotonic()
        assert connection.call("ping")["ok"]
        assert time.monotonic() - started < 2.0
        connection.close()
        # Once someone reads, the held lines go out, then the count of those dropped.
        os.set_blocking(read_end, False)
        out = b""
        deadline = time.monotonic() + 10
        while b"log lines dropped" not in out and time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                out += os.read(read_end, 1 << 16)
            time.sleep(0.01)
        assert len(out) >= 64 * 1024  # the pipe was full, and more was held
        assert b"log lines dropped: stderr was not being read" in out
    os.close(read_end)


@pytest.mark.skipif(SECCOMP is None, reason="libseccomp is not installed")
def test_workers_that_may_not_renice_serve_and_say_so_once(tmp_path: Path) -> None:
    wrapper = [sys.executable, "-c", DENY_SETPRIORITY, str(SECCOMP)]
    with daemon(tmp_path, wrapper=wrapper) as started:
        socket_path = started.socket_path
        (tmp_path / "kv" / "a.bin").write_bytes(b"x" * 4096)
        connection = RawConnection(socket_path)
        reply = connection.call("prefetch", paths=[str(tmp_path / "kv" / "a.bin")], wait=True)
        assert reply["ok"] and reply["outcomes"]["read"] + reply["outcomes"]["resident"] == 1
        stats = connection.call("stats")["stats"]
        connection.close()
        assert stats["worker_restarts"] == 0 and all(w["ready"] for w in stats["workers"])
    text = started.log()
    assert text.count("cannot renice workers by 19: Function not implemented") == 1, text
