"""The test harness: a real daemon in a temp dir, a raw protocol connection, page-cache helpers.

Nothing here is mocked: the daemon is the real console entry point in a child
process with real forked workers, and residency is the kernel's page cache.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest

HEADER = struct.Struct(">I")
PAGE = os.sysconf("SC_PAGE_SIZE")


def native() -> Any:
    """The cffi module, or a skip: tests of residency need its cachestat/mincore wrapper."""
    try:
        from kvprefetchd._native import lib
    except ImportError as error:  # pragma: no cover - the build is part of ./dev test
        pytest.skip(f"native extension not built: {error}")
    return lib


def resident_bytes(path: str | Path, length: int, *, uptodate: bool = True) -> int:
    """Bytes of [0, length) in the page cache. uptodate: mincore, which ignores reads in flight."""
    fd = os.open(path, os.O_RDONLY)
    try:
        result = native().kvp_resident_bytes(fd, 0, length, 1 if uptodate else 0)
    finally:
        os.close(fd)
    assert result >= 0, os.strerror(-result)
    return int(min(result, length))


def evict(path: str | Path) -> None:
    """Drop a file's pages (DONTNEED) so the next test starts cold; dirty pages are synced first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def make_file(path: Path, size: int) -> Path:
    """A file with real allocated data (not sparse), evicted from the page cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(min(size, 1 << 20)) if size else b""
    with open(path, "wb") as handle:
        written = 0
        while written < size:
            chunk = block[: size - written]
            handle.write(chunk)
            written += len(chunk)
    evict(path)
    return path


class RawConnection:
    """A protocol connection with no client library in between, to send anything at all."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self._next_id = 1
        self._buffer = b""

    def send_frame(self, body: bytes) -> None:
        self.sock.sendall(HEADER.pack(len(body)) + body)

    def send(self, message: Any) -> None:
        self.send_frame(msgpack.packb(message, use_bin_type=True))

    def recv(self) -> dict[str, Any]:
        while True:
            if len(self._buffer) >= 4:
                (length,) = HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= 4 + length:
                    body = self._buffer[4 : 4 + length]
                    self._buffer = self._buffer[4 + length :]
                    reply: dict[str, Any] = msgpack.unpackb(body, raw=False)
                    return reply
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("daemon closed the connection")
            self._buffer += data

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        request_id = self._next_id
        self._next_id += 1
        self.send({"v": 1, "id": request_id, "op": op, **fields})
        reply = self.recv()
        assert reply["id"] == request_id, reply
        return reply

    def close(self) -> None:
        self.sock.close()


@dataclass
class Daemon:
    socket_path: str
    root: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    extra: list[str] = field(default_factory=list)

    def connect(self) -> RawConnection:
        return RawConnection(self.socket_path)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        connection = self.connect()
        try:
            return connection.call(op, **fields)
        finally:
            connection.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.call("stats")["stats"]["workers"]]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def start_daemon(
    tmp_path: Path, *args: str, root: Path | None = None, wait: bool = True
) -> Daemon:
    root = root or tmp_path / "kv"
    root.mkdir(parents=True, exist_ok=True)
    socket_path = str(tmp_path / "run" / "kvprefetchd.sock")
    log_path = tmp_path / "daemon.log"
    command = [
        sys.executable, "-m", "kvprefetchd",
        "--socket", socket_path, "--root", str(root), "--log-level", "debug", *args,
    ]
    if "--workers" not in args:
        command += ["--workers", "2"]
    log_handle = open(log_path, "wb")  # noqa: SIM115 - lives as long as the daemon
    process = subprocess.Popen(command, stdout=log_handle, stderr=subprocess.STDOUT)
    daemon = Daemon(socket_path, root, process, log_path, list(args))
    if wait:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"daemon exited with {process.returncode}:\n{daemon.log()}")
            with contextlib.suppress(OSError):
                if daemon.call("ping")["ok"]:
                    break
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"daemon did not come up:\n{daemon.log()}")
            time.sleep(0.05)
    return daemon


