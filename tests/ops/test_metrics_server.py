"""MetricsServer driven by a selectors loop in the test, as the supervisor drives it.

Real sockets (loopback TCP, IPv6 when present, a Unix socket path), a real
selector, one thread: the test pumps the loop exactly like run_once() would.
"""

from __future__ import annotations

import os
import resource
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from stats_sample import realistic_stats

from kvprefetchd.config import MetricsAddress, MetricsAddressError, parse_metrics_address
from kvprefetchd.exposition import CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE, render
from kvprefetchd.listening import ACCEPT_REST
from kvprefetchd.metrics_http import MetricsServer, open_metrics_listener

BODY = b"# HELP kvprefetchd_up test\n# TYPE kvprefetchd_up gauge\nkvprefetchd_up 1.0\n"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Loop:
    """The supervisor's side: one selector; the server's keys are dispatched to it."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self.selector = selectors.DefaultSelector()
        server.attach(self.selector)

    def run_once(self, timeout: float = 0.02) -> None:
        for key, events in self.selector.select(timeout):
            key.data(events)
        self.server.expire(self.server.clock())

    def pump_until(self, done: Callable[[], bool], limit: float = 5.0) -> None:
        deadline = time.monotonic() + limit
        while not done():
            assert time.monotonic() < deadline, "the server never finished"
            self.run_once()

    def close(self) -> None:
        self.server.close()
        self.selector.close()


def connect(server: MetricsServer) -> socket.socket:
    address = server.listener.getsockname()
    client = socket.socket(server.listener.family, socket.SOCK_STREAM)
    client.connect(address)  # completes from the backlog: no accept needed yet
    client.setblocking(False)
    return client


def exchange(loop: Loop, request: bytes) -> bytes:
    """Send `request`, pump the loop until the server closes, return all it sent."""
    client = connect(loop.server)
    client.sendall(request)
    received = bytearray()
    closed = False

    def done() -> bool:
        nonlocal closed
        try:
            while chunk := client.recv(65536):
                received.extend(chunk)
            closed = True
        except BlockingIOError:
            pass
        return closed

    loop.pump_until(done)
    client.close()
    loop.pump_until(lambda: not loop.server.clients)  # the server sees our EOF and lets go
    return bytes(received)


def split(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, code, _ = lines[0].split(" ", 2)
    assert version == "HTTP/1.0"
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(code), headers, body


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tcp_loop(clock: Clock) -> Iterator[Loop]:
    server = MetricsServer(open_metrics_listener("127.0.0.1:0"), lambda _om: BODY, clock=clock)
    loop = Loop(server)
    yield loop
    loop.close()


# ---- answers ---------------------------------------------------------------------------------


def test_get_metrics_over_tcp_answers_200_with_the_body(tcp_loop: Loop) -> None:
    code, headers, body = split(exchange(tcp_loop, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert code == 200
    assert headers["content-type"] == CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    assert body == BODY
    assert tcp_loop.server.counts["served"] == 1
    assert not tcp_loop.server.clients


def test_a_real_render_is_served_and_parses(clock: Clock) -> None:
    server = MetricsServer(
        open_metrics_listener("127.0.0.1:0"),
        lambda openmetrics: render(realistic_stats(), openmetrics=openmetrics),
        clock=clock,
    )
    loop = Loop(server)
    try:
        code, _, body = split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))
    finally:
        loop.close()
    assert code == 200
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"kvprefetchd_requests", "kvprefetchd_queue_depth", "kvprefetchd_wait_seconds"} <= names
    # The supervisor's figures are Prometheus's standard process metrics, not home-made names;
    # and a dropped file is counted once, as files{outcome="dropped"}.
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds"} <= names
    assert not {n for n in names if n.startswith("kvprefetchd_supervisor_")}
    assert "kvprefetchd_dropped" not in names


def test_openmetrics_is_served_when_the_scraper_asks_for_it(clock: Clock) -> None:
    server = MetricsServer(
        open_metrics_listener("127.0.0.1:0"),
        lambda openmetrics: render(realistic_stats(), openmetrics=openmetrics),
        clock=clock,
    )
    loop = Loop(server)
    asks = (b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0;"
            b"q=0.5,text/plain;version=0.0.4;q=0.4\r\n\r\n")
    try:
        code, headers, body = split(exchange(loop, asks))
        plain_code, plain_headers, plain = split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))
    finally:
        loop.close()
    assert code == 200 and headers["content-type"] == OPENMETRICS_CONTENT_TYPE
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")  # OpenMetrics' terminator; the text format has none
    names = {f.name for f in openmetrics_families(body.decode())}
    assert {"kvprefetchd_requests", "kvprefetchd_files"} <= names
    assert plain_code == 200 and plain_headers["content-type"] == CONTENT_TYPE
    assert not plain.endswith(b"# EOF\n")


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /metrics?name[]=kvprefetchd_up HTTP/1.1\r\n\r\n",
        b"GET http://localhost:9464/metrics HTTP/1.1\r\n\r\n",  # absolute form
        b"GET /metrics HTTP/1.0\n\n",  # bare LF
    ],
)
def test_query_strings_absolute_form_and_bare_lf_are_understood(
    tcp_loop: Loop, request_bytes: bytes
) -> None:
    code, _, body = split(exchange(tcp_loop, request_bytes))
    assert code == 200 and body == BODY


def test_head_gets_the_headers_only(tcp_loop: Loop) -> None:
    code, headers, body = split(exchange(tcp_loop, b"HEAD /metrics HTTP/1.1\r\n\r\n"))
    assert code == 200
    assert int(headers["content-length"]) == len(BODY)
    assert body == b""


@pytest.mark.parametrize("path", [b"/", b"/other", b"/metrics/", b"/metricsx"])
def test_other_paths_are_404(tcp_loop: Loop, path: bytes) -> None:
    code, _, _ = split(exchange(tcp_loop, b"GET " + path + b" HTTP/1.1\r\n\r\n"))
    assert code == 404
    assert tcp_loop.server.counts["not_found"] == 1


@pytest.mark.parametrize("method", [b"POST", b"PUT", b"DELETE", b"OPTIONS"])
def test_other_methods_are_405_with_allow(tcp_loop: Loop, method: bytes) -> None:
    request = method + b" /metrics HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000
    code, headers, _ = split(exchange(tcp_loop, request))
    # The unread request body must not turn the close into a reset that eats the answer.
    assert code == 405
    assert headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize(
    "request_bytes", [b"HELLO\r\n\r\n", b"GET /metrics\r\n\r\n", b"GET /metrics SPDY/3\r\n\r\n"]
)
def test_garbage_is_400(tcp_loop: Loop, request_bytes: bytes) -> None:
    code, _, _ = split(exchange(tcp_loop, request_bytes))
    assert code == 400


def test_a_header_over_8_kib_is_431(tcp_loop: Loop) -> None:
    request = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 9000
    code, _, _ = split(exchange(tcp_loop, request))
    assert code == 431


def test_a_failing_body_costs_one_500_not_the_server(clock: Clock) -> None:
    calls = []

    def body(_openmetrics: bool) -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the figures")
        return BODY

    loop = Loop(MetricsServer(open_metrics_listener("127.0.0.1:0"), body, clock=clock))
    try:
        assert split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))[0] == 500
        assert split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))[0] == 200
    finally:
        loop.close()


def test_a_large_body_is_written_across_many_writable_events(clock: Clock) -> None:
    big = b"kvprefetchd_x 1\n" * 200_000  # 3.2 MB: more than one socket buffer
    loop = Loop(MetricsServer(open_metrics_listener("127.0.0.1:0"), lambda _om: big, clock=clock))
    try:
        code, headers, body = split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))
    finally:
        loop.close()
    assert code == 200 and body == big and int(headers["content-length"]) == len(big)


# ---- bounds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sent", [b"", b"GET /metr"])
def test_a_slow_or_silent_client_is_closed_at_its_deadline(
    tcp_loop: Loop, clock: Clock, sent: bytes
) -> None:
    client = connect(tcp_loop.server)
    client.sendall(sent)
    tcp_loop.pump_until(lambda: bool(tcp_loop.server.clients))
    for _ in range(5):
        tcp_loop.run_once()
    assert len(tcp_loop.server.clients) == 1
    assert tcp_loop.server.next_timeout(clock.now) == pytest.approx(2.0)
    clock.now += 1.9
    tcp_loop.run_once()
    assert len(tcp_loop.server.clients) == 1
    clock.now += 0.2
    tcp_loop.run_once()
    assert not tcp_loop.server.clients
    assert tcp_loop.server.counts["expired"] == 1
    assert tcp_loop.server.next_timeout(clock.now) is None
    client.setblocking(True)
    client.settimeout(2)
    assert client.recv(100) == b""  # closed without an answer
    client.close()


def test_clients_beyond_the_limit_are_closed_at_once(clock: Clock) -> None:
    server = MetricsServer(
        open_metrics_listener("127.0.0.1:0"), lambda _om: BODY, clock=clock, max_clients=1
    )
    loop = Loop(server)
    try:
        first = connect(server)
        loop.pump_until(lambda: len(server.clients) == 1)
        second = connect(server)
        loop.pump_until(lambda: server.counts["refused"] == 1)
        second.setblocking(True)
        second.settimeout(2)
        assert second.recv(100) == b""
        first.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        loop.pump_until(lambda: server.counts["served"] == 1)
        first.close()
        second.close()
    finally:
        loop.close()


def test_scrapes_leak_no_file_descriptors(tcp_loop: Loop) -> None:
    exchange(tcp_loop, b"GET /metrics HTTP/1.0\r\n\r\n")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        exchange(tcp_loop, b"GET /metrics HTTP/1.0\r\n\r\n")
        exchange(tcp_loop, b"GET /nope HTTP/1.0\r\n\r\n")
    assert len(os.listdir("/proc/self/fd")) == before
    assert not tcp_loop.server.clients


def test_serving_starts_no_thread(tcp_loop: Loop) -> None:
    before = threading.active_count()
    exchange(tcp_loop, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert threading.active_count() == before


# ---- listeners -------------------------------------------------------------------------------


def test_a_unix_socket_serves_and_is_removed_on_close(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "run" / "metrics.sock"
    server = MetricsServer.open(f"unix:{path}", lambda _openmetrics: BODY, clock=clock)
    loop = Loop(server)
    assert stat.S_IMODE(path.stat().st_mode) == 0o660
    assert split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))[2] == BODY
    assert split(exchange(loop, b"GET /x HTTP/1.0\r\n\r\n"))[0] == 404
    assert len(loop.selector.get_map()) == 1  # the listener only
    loop.server.close()
    assert len(loop.selector.get_map()) == 0
    assert not path.exists()
    loop.selector.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_loopback(clock: Clock) -> None:
    loop = Loop(MetricsServer.open("[::1]:0", lambda _openmetrics: BODY, clock=clock))
    try:
        assert loop.server.listener.family == socket.AF_INET6
        assert split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))[0] == 200
    finally:
        loop.close()


def test_a_port_in_use_is_an_error_not_a_silent_second_listener() -> None:
    first = open_metrics_listener("127.0.0.1:0")
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError):
            open_metrics_listener(f"127.0.0.1:{port}")
    finally:
        first.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9464", MetricsAddress(socket.AF_INET, host="127.0.0.1", port=9464)),
        ("localhost:9464", MetricsAddress(socket.AF_INET, host="127.0.0.1", port=9464)),
        ("0.0.0.0:9464", MetricsAddress(socket.AF_INET, host="0.0.0.0", port=9464)),
        ("[::1]:9464", MetricsAddress(socket.AF_INET6, host="::1", port=9464)),
        ("unix:/run/kvprefetchd/metrics.sock",
         MetricsAddress(socket.AF_UNIX, path="/run/kvprefetchd/metrics.sock")),
        ("/run/kvprefetchd/metrics.sock",
         MetricsAddress(socket.AF_UNIX, path="/run/kvprefetchd/metrics.sock")),
    ],
)
def test_metrics_addresses_parse(text: str, expected: MetricsAddress) -> None:
    assert parse_metrics_address(text) == expected
    assert parse_metrics_address(str(expected)) == expected


@pytest.mark.parametrize(
    "text",
    ["", ":9464", "9464", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", "example.com:9464",
     "::1:9464", "[::1]9464", "unix:relative.sock", "unix:/" + "x" * 200],
)
def test_bad_metrics_addresses_are_refused_with_the_forms(text: str) -> None:
    with pytest.raises(MetricsAddressError, match="metrics"):
        parse_metrics_address(text)


def test_every_key_it_registers_carries_a_callback(tcp_loop: Loop) -> None:
    """The supervisor's loop calls key.data(events) for every key: no dispatch by type."""
    client = connect(tcp_loop.server)
    tcp_loop.run_once()
    keys = list(tcp_loop.selector.get_map().values())
    assert len(keys) == 2 and all(callable(key.data) for key in keys)
    client.close()


def test_out_of_fds_the_listener_rests_instead_of_spinning(
    tcp_loop: Loop, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """accept(2) failing with EMFILE leaves the connection queued and the listener readable:
    the server takes its listener out of the selector for ACCEPT_REST instead of trying
    again at once, logs once, and lets the connection in when fds are back (real EMFILE:
    this process's own RLIMIT_NOFILE, lowered to its lowest free fd number)."""
    server = tcp_loop.server
    client = connect(server)
    client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)  # the kernel hands out the lowest free number
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        for _ in range(5):
            tcp_loop.run_once(0.01)
        watched = [key.fileobj for key in tcp_loop.selector.get_map().values()]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert server.listener not in watched and not server.clients
    assert server.resting.until == clock.now + ACCEPT_REST
    assert server.next_timeout(clock.now) == ACCEPT_REST
    assert [r.getMessage() for r in caplog.records].count(
        "metrics: cannot accept connections: Too many open files; they wait in the backlog "
        f"(pausing accept {ACCEPT_REST:.1f} s at a time)"
    ) == 1
    clock.now += ACCEPT_REST
    received = bytearray()

    def answered() -> bool:
        try:
            while chunk := client.recv(65536):
                received.extend(chunk)
            return True
        except BlockingIOError:
            return False

    tcp_loop.pump_until(answered)
    assert split(bytes(received))[0] == 200 and server.resting.until is None
    client.close()
