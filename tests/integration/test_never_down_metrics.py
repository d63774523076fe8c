"""Never down through the metrics endpoint (issue 23, finding 7), through the real daemon.

0.3.0 kept every metrics client for 2 s whatever it sent, refused newcomers once 32 were
held, and rendered the whole page for every scrape on the supervisor's one thread:
- 40 partial requests, reconnecting as the daemon closes them, served 0 of 50 scrapes;
- a scrape flood took 100% of the supervisor.
Now a request header must arrive within 0.5 s, a newcomer evicts the oldest client still
reading when the slots are full, an address holds at most 4 slots, new connections pass
per-address and shared token buckets (closed at once beyond them), and the page is
rendered at most once per 0.5 s (metrics_limits.py).

Inside attack.Watch: the Unix socket keeps answering pings (p99 < 50 ms), a listed TLS
router keeps connecting (>= 99%), no worker dies, and SIGTERM still ends the daemon within
6 s. Attackers are forked processes (started
before the Watch's threads exist) using loopback addresses 127.0.0.2 and up; the
scraper is 127.0.0.1, a Prometheus the attackers cannot impersonate.
"""

from __future__ import annotations

import multiprocessing
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvharness import attack
from kvharness.daemon import Daemon, cpu_seconds, start_cli

FORK = multiprocessing.get_context("fork")
HOLDERS, HOLDER_ADDRESSES = 40, 10  # partial requests, from this many addresses (4 each)
SCRAPES, SCRAPE_INTERVAL = 50, 0.12
FLOOD_SECONDS, FLOOD_THREADS = 3.0, 4
SCRAPE = b"GET /metrics HTTP/1.0\r\n\r\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_with_metrics(tmp_path: Path, router: attack.ListedRouter) -> tuple[Daemon, int]:
    """The daemon with its metrics endpoint (its port returned) and `router`'s TLS
    listener, so that the attack is also held to the routers' bar."""
    port = free_port()
    daemon = start_cli(tmp_path, "--metrics", f"127.0.0.1:{port}", "--log-level", "warning",
                       *router.args())
    return daemon, port


def scrape(port: int, source: str = "127.0.0.1", timeout: float = 2.0) -> int | None:
    """One scrape: its HTTP status, None when closed unanswered or too slow."""
    try:
        with socket.socket() as sock:
            sock.settimeout(timeout)
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", port))
            sock.sendall(SCRAPE)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return None
    head = data.split(b"\r\n", 1)[0].split()
    return int(head[1]) if len(head) >= 2 and head[0].startswith(b"HTTP/") else None


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "condition never held"
        time.sleep(0.02)


# ---- blinding: partial requests holding the slots ------------------------------------------


def hold_partial_requests(port: int, go: Any, stop: Any, opened: Any) -> None:
    """HOLDERS connections from HOLDER_ADDRESSES addresses, each sending the start of a
    request and nothing more; every one the daemon closes is opened again (20 ms later:
    at once would only burn this machine's CPU), until `stop`."""
    sources = [f"127.0.0.{2 + i % HOLDER_ADDRESSES}" for i in range(HOLDERS)]
    chooser = selectors.DefaultSelector()
    again: list[tuple[float, str]] = []

    def open_one(source: str) -> None:
        sock = attack.connect_from(source, port)
        if sock is None:
            again.append((time.monotonic() + 0.02, source))
            return
        chooser.register(sock, selectors.EVENT_WRITE, [source, False])
        opened.value += 1

    go.wait()
    for source in sources:
        open_one(source)
    while not stop.is_set():
        for key, _events in chooser.select(0.01):
            sock, (source, sent) = key.fileobj, key.data
            assert isinstance(sock, socket.socket)
            if not sent:  # connected (or refused): the partial request, then wait
                try:
                    sock.send(b"GET /metr")
                    chooser.modify(sock, selectors.EVENT_READ, [source, True])
                    continue
                except OSError:
                    pass
            chooser.unregister(sock)  # closed by the daemon (or refused): reopen
            sock.close()
            again.append((time.monotonic() + 0.02, source))
        now = time.monotonic()
        due = [entry for entry in again if entry[0] <= now]
        again[:] = [entry for entry in again if entry[0] > now]
        for _, source in due:
            open_one(source)
    for key in list(chooser.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]


def test_partial_requests_holding_every_slot_do_not_blind_the_scraper(
    tmp_path: Path, listed_router: attack.ListedRouter,
) -> None:
    daemon, port = start_with_metrics(tmp_path, listed_router)
    go, stop, opened = FORK.Event(), FORK.Event(), FORK.Value("i", 0)
    holder = FORK.Process(target=hold_partial_requests, args=(port, go, stop, opened))
    holder.start()
    codes: list[int | None] = []
    try:
        with attack.Watch(daemon, router=listed_router) as watch:
            go.set()
            # Every slot taken and the attackers cycling: as many closed and reopened as
            # they hold.
            wait_for(lambda: opened.value >= 2 * HOLDERS)
            for _ in range(SCRAPES):
                codes.append(scrape(port))
                time.sleep(SCRAPE_INTERVAL)
            stop.set()
            holder.join(10)
    finally:
        stop.set()
        if holder.is_alive():
            holder.kill()
    events = daemon.stats()["events"]
    print(f"scrapes served {codes.count(200)}/{SCRAPES}; attackers opened {opened.value}; "
          f"events {events}")
    watch.assert_held()
    assert codes.count(200) >= SCRAPES - 1, codes
    assert events.get("metrics_evicted", 0) + events.get("metrics_expired", 0) >= HOLDERS
    attack.assert_stops_within(daemon)


# ---- saturation: a scrape flood ------------------------------------------------------------


def flood_scrapes(port: int, seconds: float, go: Any, done: Any) -> None:
    """FLOOD_THREADS threads scraping as fast as they can for `seconds`, each from its own
    loopback addresses in turn; counts the scrapes made and those served."""
    made, served = [0] * FLOOD_THREADS, [0] * FLOOD_THREADS

    def flood(index: int) -> None:
        sources = [f"127.0.0.{2 + index * 4 + n}" for n in range(4)]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            made[index] += 1
            if scrape(port, sources[made[index] % 4], timeout=1.0) == 200:
                served[index] += 1

    go.wait()
    threads = [threading.Thread(target=flood, args=(i,)) for i in range(FLOOD_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done[0], done[1] = sum(made), sum(served)


def test_a_scrape_flood_costs_the_supervisor_a_bounded_share(
    tmp_path: Path, listed_router: attack.ListedRouter,
) -> None:
    daemon, port = start_with_metrics(tmp_path, listed_router)
    assert scrape(port) == 200
    go, done = FORK.Event(), FORK.Array("i", 2)
    flooder = FORK.Process(target=flood_scrapes, args=(port, FLOOD_SECONDS, go, done))
    flooder.start()
    try:
        with attack.Watch(daemon, router=listed_router) as watch:
            cpu_before, wall_before = cpu_seconds(daemon.process.pid), time.monotonic()
            go.set()
            flooder.join(FLOOD_SECONDS + 30)
            cpu = cpu_seconds(daemon.process.pid) - cpu_before
            wall = time.monotonic() - wall_before
    finally:
        if flooder.is_alive():
            flooder.kill()
    share = cpu / wall
    events = daemon.stats()["events"]
    print(f"flood: {done[0]} scrapes made, {done[1]} served, in {wall:.1f} s; supervisor "
          f"CPU {share:.0%} of one core; events {events}")
    watch.assert_held()
    assert flooder.exitcode == 0 and done[0] > 0
    assert share < 0.5, f"the supervisor spent {share:.0%} of a core on the flood"
    assert scrape(port) == 200  # the usual scraper still served after it
    attack.assert_stops_within(daemon)
