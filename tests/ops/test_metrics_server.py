"""MetricsServer driven by a selectors loop in the test, as the supervisor drives it.

Real sockets (loopback TCP, IPv6 when present, a Unix socket path), a real
selector, one thread: the test pumps the loop exactly like run_once() would.
"""

from __future__ import annotations

import dataclasses
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

from kvprefetchd.addresses import MetricsAddress, MetricsAddressError, parse_metrics_address
from kvprefetchd.config import ConfigError, build_config
from kvprefetchd.listeners.listening import ACCEPT_REST
from kvprefetchd.listeners.tokenbucket import TokenBucket
from kvprefetchd.metrics.exposition import CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE, render
from kvprefetchd.metrics.limits import Admission, MetricsLimits
from kvprefetchd.metrics.server import ACCEPTS_PER_EVENT, MetricsServer, open_metrics_listener

BODY = b"# HELP kvprefetchd_up test\n# TYPE kvprefetchd_up gauge\nkvprefetchd_up 1.0\n"
# The tests of answers pump many exchanges on a frozen clock: no rate limit, no cache.
UNLIMITED = MetricsLimits(rate=1e9, rate_per_address=1e9, max_clients_per_address=32,
                          cache_seconds=0)


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


def limited_server(clock: Clock, **limits: float) -> MetricsServer:
    """A server on a free loopback port with UNLIMITED but for `limits`, on `clock`."""
    return MetricsServer(open_metrics_listener("127.0.0.1:0"), lambda _om: BODY,
                         clock=clock, limits=dataclasses.replace(UNLIMITED, **limits))


def connect(server: MetricsServer, source: str | None = None) -> socket.socket:
    address = server.listener.getsockname()
    client = socket.socket(server.listener.family, socket.SOCK_STREAM)
    if source is not None:  # another loopback address: another peer to the per-address caps
        client.bind((source, 0))
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
    server = MetricsServer(open_metrics_listener("127.0.0.1:0"), lambda _om: BODY, clock=clock,
                           limits=UNLIMITED)
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

    loop = Loop(MetricsServer(open_metrics_listener("127.0.0.1:0"), body, clock=clock,
                              limits=UNLIMITED))
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
def test_a_slow_or_silent_client_is_closed_at_its_header_deadline(
    tcp_loop: Loop, clock: Clock, sent: bytes
) -> None:
    client = connect(tcp_loop.server)
    client.sendall(sent)
    tcp_loop.pump_until(lambda: bool(tcp_loop.server.clients))
    for _ in range(5):
        tcp_loop.run_once()
    assert len(tcp_loop.server.clients) == 1
    # The whole header must be in within metrics_header_timeout (0.5 s), not the 2 s a
    # client may take in all: a slot held by a silent peer is freed 4 times sooner.
    assert tcp_loop.server.next_timeout(clock.now) == pytest.approx(0.5)
    clock.now += 0.45
    tcp_loop.run_once()
    assert len(tcp_loop.server.clients) == 1
    clock.now += 0.1
    tcp_loop.run_once()
    assert not tcp_loop.server.clients
    assert tcp_loop.server.counts["expired"] == 1
    assert tcp_loop.server.next_timeout(clock.now) is None
    client.setblocking(True)
    client.settimeout(2)
    assert client.recv(100) == b""  # closed without an answer
    client.close()


def test_an_answered_client_that_never_closes_is_let_go_at_two_seconds(
    tcp_loop: Loop, clock: Clock
) -> None:
    client = connect(tcp_loop.server)
    client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    tcp_loop.pump_until(lambda: tcp_loop.server.counts["served"] == 1)
    assert len(tcp_loop.server.clients) == 1  # draining: waiting for our close
    assert tcp_loop.server.next_timeout(clock.now) == pytest.approx(2.0)
    clock.now += 2.0
    tcp_loop.run_once()
    assert not tcp_loop.server.clients and tcp_loop.server.counts["expired"] == 0
    client.close()


def test_a_newcomer_evicts_the_oldest_reading_client_when_every_slot_is_taken(
    clock: Clock,
) -> None:
    """40 partial requests once held all 32 slots and 0 of 50 scrapes were served
    (issue 23): now a newcomer takes the slot of the oldest client still reading."""
    server = limited_server(clock, max_clients=2)
    loop = Loop(server)
    try:
        first, second = connect(server), connect(server)
        first.sendall(b"GET /me")
        loop.pump_until(lambda: len(server.clients) == 2)
        scraper = connect(server)
        scraper.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        loop.pump_until(lambda: server.counts["served"] == 1)
        assert server.counts["evicted"] == 1 and server.counts["refused"] == 0
        assert closed_unanswered(first)  # the oldest was let go
        for sock in (first, second, scraper):
            sock.close()
    finally:
        loop.close()


def test_an_answered_client_is_evicted_before_one_still_reading(clock: Clock) -> None:
    server = limited_server(clock, max_clients=2)
    loop = Loop(server)
    try:
        reading = connect(server)
        loop.pump_until(lambda: len(server.clients) == 1)
        answered = connect(server)
        answered.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        loop.pump_until(lambda: server.counts["served"] == 1)
        newcomer = connect(server)
        loop.pump_until(lambda: server.counts["evicted"] == 1)
        states = sorted(c.state for c in server.clients.values())
        assert states == ["reading", "reading"]
        for sock in (reading, answered, newcomer):
            sock.close()
    finally:
        loop.close()


def test_an_address_holds_at_most_its_share_of_the_slots(clock: Clock) -> None:
    server = limited_server(clock, max_clients_per_address=2)
    loop = Loop(server)
    try:
        held = [connect(server, "127.0.0.2") for _ in range(3)]
        loop.pump_until(lambda: server.counts["refused_address"] == 1)
        assert len(server.clients) == 2 and server.counts["evicted"] == 0
        other = connect(server, "127.0.0.3")  # another address still gets in
        loop.pump_until(lambda: len(server.clients) == 3)
        for sock in [*held, other]:
            sock.close()
    finally:
        loop.close()


def test_new_connections_beyond_the_rates_are_closed_at_once_without_a_render(
    clock: Clock,
) -> None:
    renders = []

    def body(_openmetrics: bool) -> bytes:
        renders.append(1)
        return BODY

    limits = MetricsLimits(rate=3, rate_per_address=2, max_clients_per_address=32,
                           cache_seconds=0)
    server = MetricsServer(open_metrics_listener("127.0.0.1:0"), body, clock=clock,
                           limits=limits)
    loop = Loop(server)
    try:
        # One address: a burst of 2 x rate_per_address, then refused (its first scrape
        # took one of the shared tokens; served, it is a known scraper since).
        codes = [exchange_or_refused(loop, "127.0.0.2") for _ in range(6)]
        assert codes == [200] * 4 + [None] * 2
        assert server.counts["refused_address_rate"] == 2
        # Every address together: `rate` (3) a second; 2 tokens are left.
        codes = [exchange_or_refused(loop, f"127.0.0.{n}") for n in (3, 4, 5)]
        assert codes == [200, 200, None] and server.counts["refused_rate"] == 1
        # An address served before is a known scraper: the shared bucket does not hold it.
        assert exchange_or_refused(loop, "127.0.0.3") == 200
        assert len(renders) == 7
        clock.now += 1.0  # the buckets refill
        assert exchange_or_refused(loop, "127.0.0.5") == 200
    finally:
        loop.close()


def closed_unanswered(sock: socket.socket) -> bool:
    """The server closed it without a byte (a reset when our request bytes were unread)."""
    sock.setblocking(True)
    sock.settimeout(2)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def exchange_or_refused(loop: Loop, source: str) -> int | None:
    """A scrape from `source`: its status, or None when closed without an answer."""
    client = connect(loop.server, source)
    client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
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
        except ConnectionResetError:  # closed at once, the request unread: a reset
            closed = True
        return closed

    loop.pump_until(done)
    client.close()
    loop.pump_until(lambda: not loop.server.clients)
    return split(bytes(received))[0] if received else None


def test_the_page_is_rendered_at_most_once_per_cache_interval(clock: Clock) -> None:
    renders: list[bool] = []

    def body(openmetrics: bool) -> bytes:
        renders.append(openmetrics)
        return BODY + b"# %d\n" % len(renders)

    limits = dataclasses.replace(UNLIMITED, cache_seconds=0.5)
    loop = Loop(MetricsServer(open_metrics_listener("127.0.0.1:0"), body, clock=clock,
                              limits=limits))
    om = b"GET /metrics HTTP/1.0\r\nAccept: application/openmetrics-text\r\n\r\n"
    try:
        first = split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))[2]
        clock.now += 0.4
        again = split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))[2]
        other_format = split(exchange(loop, om))[2]
        clock.now += 0.2
        fresh = split(exchange(loop, b"GET /metrics HTTP/1.0\r\n\r\n"))[2]
        assert first == again != fresh and other_format.endswith(b"# 2\n")
        assert renders == [False, True, False]
        assert loop.server.counts["cached"] == 1 and loop.server.counts["served"] == 4
        assert loop.server.events() == {"metrics_served": 4, "metrics_cached": 1}
    finally:
        loop.close()


def test_a_flood_of_connects_is_taken_in_slices(clock: Clock) -> None:
    """At most ACCEPTS_PER_EVENT accepts per listener event: the loop gets a turn between."""
    server = MetricsServer(open_metrics_listener("127.0.0.1:0", backlog=2 * ACCEPTS_PER_EVENT),
                           lambda _om: BODY, clock=clock, limits=UNLIMITED)
    loop = Loop(server)
    flood = [connect(server) for _ in range(ACCEPTS_PER_EVENT + 10)]
    try:
        server.on_listener_event(0)
        closed = sum(n for name, n in server.counts.items() if name.startswith(("evicted", "ref")))
        assert len(server.clients) + closed == ACCEPTS_PER_EVENT
    finally:
        for sock in flood:
            sock.close()
        loop.close()


def test_over_the_accept_budget_the_listener_pauses_then_comes_back(clock: Clock) -> None:
    server = MetricsServer(open_metrics_listener("127.0.0.1:0"), lambda _om: BODY,
                           clock=clock, limits=UNLIMITED)
    server.accepts = TokenBucket(rate=100, burst=3, now=clock.now)
    loop = Loop(server)
    clients = [connect(server) for _ in range(5)]
    try:
        server.on_listener_event(0)
        assert len(server.clients) == 4 and server.counts["accept_paused"] == 1
        assert server.listener not in [k.fileobj for k in loop.selector.get_map().values()]
        pause = server.paused_until
        assert pause is not None and server.next_timeout(clock.now) == pause - clock.now
        clock.now = pause
        loop.run_once()  # expire() puts the listener back; the fifth gets in
        loop.pump_until(lambda: len(server.clients) == 5)
        assert server.paused_until is None
    finally:
        for sock in clients:
            sock.close()
        loop.close()


def test_a_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = TokenBucket(rate=2, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.5) and not bucket.take(0.5)
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]


def test_admission_counts_open_clients_per_address_and_forgets_them() -> None:
    admission = Admission(MetricsLimits(max_clients_per_address=1), now=0.0)
    assert admission.refusal("10.0.0.1", 0.0) is None
    admission.opened("10.0.0.1")
    assert admission.refusal("10.0.0.1", 0.0) == "refused_address"
    admission.closed("10.0.0.1")
    assert admission.refusal("10.0.0.1", 0.0) is None and admission.open == {}
    # Unix peers have no address: only the shared bucket applies.
    admission.opened(None)
    assert admission.refusal(None, 0.0) is None


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


# ---- its own counts, on the page ----------------------------------------------------------


def test_the_endpoints_and_the_log_sinks_counts_have_families_of_their_own() -> None:
    stats = realistic_stats()
    stats["events"] = {**stats["events"], "metrics_served": 7, "metrics_evicted": 3,
                       "metrics_refused_rate": 2, "log_write_errors": 5,
                       "log_lines_dropped": 40}
    families = {f.name: f for f in text_string_to_metric_families(render(stats).decode())}

    def value(family: str, **labels: str) -> float:
        return next(s.value for s in families[family].samples
                    if s.name.endswith("_total") and s.labels == labels)

    assert value("kvprefetchd_metrics_scrapes", result="served") == 7
    assert value("kvprefetchd_metrics_scrapes", result="bad") == 0  # known results from 0
    assert value("kvprefetchd_metrics_connections_closed", reason="evicted") == 3
    assert value("kvprefetchd_metrics_connections_closed", reason="refused_rate") == 2
    assert value("kvprefetchd_log_write_errors") == 5
    assert value("kvprefetchd_log_lines_dropped") == 40
    assert value("kvprefetchd_log_sink_replaced") == 0
    assert value("kvprefetchd_metrics_accept_pauses") == 0
    generic = {s.labels["event"] for s in families["kvprefetchd_events"].samples}
    assert generic == {"connections_refused", "reload_refused", "reloads"}


# ---- its configuration -------------------------------------------------------------------


def test_the_config_keys_give_the_limits_and_are_bounded() -> None:
    limits = MetricsLimits.from_config(build_config({}, {}))
    assert limits == MetricsLimits()  # the keys' defaults are the endpoint's
    config = build_config({"metrics_header_timeout": 0.2, "metrics_rate": 50,
                           "metrics_rate_per_address": 2, "metrics_cache_seconds": 0,
                           "metrics_max_clients_per_address": 1}, {})
    assert MetricsLimits.from_config(config) == MetricsLimits(
        header_timeout=0.2, rate=50, rate_per_address=2, cache_seconds=0,
        max_clients_per_address=1)
    for key, bad in (("metrics_header_timeout", 0), ("metrics_header_timeout", 11),
                     ("metrics_cache_seconds", -1), ("metrics_rate", 0),
                     ("metrics_rate_per_address", 0), ("metrics_max_clients_per_address", 33),
                     ("metrics_rate", True)):
        with pytest.raises(ConfigError, match=key):
            build_config({key: bad}, {})
