"""The real daemon speaking systemd's protocols and serving metrics, end to end.

READY/STOPPING/RELOADING notifications, watchdog pings, a socket passed by
systemd, and GET /metrics, all against the real daemon in a child process.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvharness.daemon import Daemon, command, start_cli
from kvprefetch import Client
from kvprefetch.errors import KVPrefetchError


def notify_receiver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> socket.socket:
    """A real datagram socket standing in for systemd's NOTIFY_SOCKET."""
    path = str(tmp_path / "notify")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    return receiver


def test_the_daemon_notifies_ready_once_its_workers_booted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = notify_receiver(tmp_path, monkeypatch)
    daemon = start_cli(tmp_path)
    try:
        messages = []
        while not any(b"READY=1" in m for m in messages):
            messages.append(receiver.recv(4096))
        assert daemon.stop() == 0
        while not any(b"STOPPING=1" in m for m in messages):
            messages.append(receiver.recv(4096))
    finally:
        daemon.stop()
        receiver.close()


def test_the_daemon_pings_the_watchdog_at_half_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = notify_receiver(tmp_path, monkeypatch)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")  # 1 s: a ping at least every 0.5 s
    daemon = start_cli(tmp_path)  # WATCHDOG_PID unset: the daemon is the one meant
    try:
        started = time.monotonic()
        pings = 0
        while time.monotonic() - started < 2.2:
            if b"WATCHDOG=1" in receiver.recv(4096):
                pings += 1
        assert pings >= 4
    finally:
        daemon.stop()
        receiver.close()


@pytest.mark.skipif(
    shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate not installed"
)
def test_the_daemon_serves_the_socket_systemd_passes(tmp_path: Path) -> None:
    socket_path = str(tmp_path / "run" / "kvprefetchd.sock")
    (tmp_path / "run").mkdir()
    (tmp_path / "kv").mkdir()
    # systemd-socket-activate passes on only the variables it is told to (-E).
    passed_env = [f"-E{name}" for name in ("PYTHONPATH",) if name in os.environ]
    process = subprocess.Popen(
        ["systemd-socket-activate", "-l", socket_path, "--fdname=kvprefetchd", *passed_env,
         *command("--socket", socket_path, "--root", str(tmp_path / "kv"), "--workers", "1")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 10
        while not Path(socket_path).exists():
            assert time.monotonic() < deadline, "systemd-socket-activate did not listen"
            time.sleep(0.02)
        with Client(socket_path) as client:
            assert client.ping().workers == 1
        # systemd-socket-activate exec'ed the daemon: this is its pid. systemd owns the
        # socket file, so the daemon must not unlink it on the way out.
        process.terminate()
        assert process.wait(15) == 0
        assert Path(socket_path).exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def scrape_unix(path: Path) -> str:
    """GET /metrics over a Unix socket; the body, after checking the status line."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(10)
    client.connect(str(path))
    client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    response = b""
    while chunk := client.recv(65536):
        response += chunk
    client.close()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    return body.decode()


def start_with_metrics(tmp_path: Path) -> tuple[Daemon, Path]:
    metrics_path = tmp_path / "run" / "metrics.sock"
    config = tmp_path / "config.toml"
    config.write_text(f'metrics = "unix:{metrics_path}"\n')
    return start_cli(tmp_path, "--config", str(config)), metrics_path


def test_the_daemon_serves_metrics_on_a_unix_socket(tmp_path: Path) -> None:
    daemon, metrics_path = start_with_metrics(tmp_path)
    try:
        names = {f.name for f in text_string_to_metric_families(scrape_unix(metrics_path))}
        assert "kvprefetchd_requests" in names
        assert "kvprefetchd_worker_rss_bytes" in names
    finally:
        daemon.stop()
    assert not metrics_path.exists()


def test_metrics_carry_request_results_and_latency_histograms(tmp_path: Path) -> None:
    daemon, metrics_path = start_with_metrics(tmp_path)
    try:
        with Client(daemon.socket_path) as client:
            client.ping()
            client.prefetch([str(tmp_path / "kv" / "x.bin")], wait=True)
            with pytest.raises(KVPrefetchError):
                client.prefetch(["/kv/x"], read_bytes=1 << 50)
        families = {f.name: f for f in text_string_to_metric_families(scrape_unix(metrics_path))}
        results = {(s.labels["op"], s.labels["result"]): s.value
                   for s in families["kvprefetchd_requests"].samples}
        assert results[("ping", "ok")] == 2  # the harness pings once to see the daemon up
        assert results[("prefetch", "ok")] == 1
        assert results[("prefetch", "bad_request")] == 1
        ack = families["kvprefetchd_request_ack_seconds"]
        counts = {s.labels["op"]: s.value for s in ack.samples if s.name.endswith("_count")}
        assert counts["ping"] == 2 and counts["prefetch"] == 2
        files = families["kvprefetchd_file_seconds"]
        assert [s.value for s in files.samples if s.name.endswith("_count")] == [1]
    finally:
        daemon.stop()
