"""The operator's knobs for metrics, through the real daemon: --metrics, KVPREFETCHD_METRICS
(the flag wins), the startup line naming the engine chosen and the metrics address, and a
scrape of what they opened."""

from __future__ import annotations

import socket
from pathlib import Path

from kvharness.daemon import start_cli


def scrape_unix(path: Path, accept: str | None = None) -> tuple[str, str]:
    """(head, body) of GET /metrics over a Unix socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        extra = f"Accept: {accept}\r\n" if accept else ""
        sock.sendall(f"GET /metrics HTTP/1.0\r\n{extra}\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.decode().partition("\r\n\r\n")
    return head, body


def test_the_metrics_flag_opens_the_listener_and_the_log_says_where(tmp_path: Path) -> None:
    address = tmp_path / "metrics.sock"
    daemon = start_cli(tmp_path, "--metrics", f"unix:{address}", "--engine", "auto")
    try:
        head, body = scrape_unix(address)
        om_head, om_body = scrape_unix(address, "application/openmetrics-text;version=1.0.0")
    finally:
        daemon.stop()
    assert head.startswith("HTTP/1.0 200") and "kvprefetchd_files_total" in body
    assert "process_resident_memory_bytes" in body  # the standard process metrics
    assert "application/openmetrics-text" in om_head and om_body.endswith("# EOF\n")
    serving = next(line for line in daemon.log().splitlines() if "serving on" in line)
    # auto resolved to the engine the workers run, not "auto"
    assert "engine pread" in serving and f"metrics on unix:{address}" in serving, serving


def test_the_environment_sets_metrics_and_the_flag_wins_over_it(tmp_path: Path) -> None:
    from_env, from_flag = tmp_path / "env.sock", tmp_path / "flag.sock"
    first = start_cli(tmp_path / "a", env={"KVPREFETCHD_METRICS": f"unix:{from_env}"})
    try:
        head, _ = scrape_unix(from_env)
    finally:
        first.stop()
    assert head.startswith("HTTP/1.0 200")
    second = start_cli(tmp_path / "b", "--metrics", f"unix:{from_flag}",
                       env={"KVPREFETCHD_METRICS": f"unix:{from_env}"})
    try:
        head, _ = scrape_unix(from_flag)
    finally:
        second.stop()
    assert head.startswith("HTTP/1.0 200") and not from_env.exists()


def test_without_metrics_the_log_says_off(tmp_path: Path) -> None:
    daemon = start_cli(tmp_path)
    daemon.stop()
    serving = next(line for line in daemon.log().splitlines() if "serving on" in line)
    assert "metrics off" in serving, serving
