"""Who may take the metrics endpoint's slots and the supervisor's time, and how much.

The endpoint is unauthenticated and served by the supervisor's one thread, so an
attacker who can reach it must not be able to blind it (hold every client slot so no
scrape is served) or saturate it (make the supervisor render a page per connection).
Issue 23, finding 7: 40 partial requests kept 0 of 50 scrapes from being served, and a
scrape flood took 100% of the supervisor. The limits, each counted when it refuses:

- a reading client must send its whole request header within `header_timeout` of its
  accept (a real scraper sends it at once);
- when every slot is taken, a new connection evicts the oldest client that has already
  been answered (draining), else the oldest one still reading: the newcomer, if it is a
  scraper, sends its request at once and is served;
- an address holds at most `max_clients_per_address` slots (IPv6 by /64);
- new connections per address pass a token bucket (`rate_per_address` a second, bursts
  of twice that), and all addresses together another (`rate` a second): beyond them a
  connection is closed at once, which costs an accept and a close, never a render.
  Addresses that were served a scrape recently (KNOWN_SECONDS) skip the shared bucket,
  so strangers flooding it from many addresses cannot lock the usual scraper out.

The page itself is rendered at most once per `cache_seconds` (per format): scrapes
within it get the same bytes.
"""

from __future__ import annotations

import socket
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvprefetchd.listeners.tokenbucket import TokenBucket

if TYPE_CHECKING:
    from kvprefetchd.config import Config

# What the endpoint counts (MetricsServer.counts, the `metrics_*` events of `stats`), by
# the label of the family each is a series of (exposition.py, docs/metrics.md): a scrape's
# result, and why a connection was closed unserved. Admission.refusal names the last three.
SCRAPE_RESULTS = ("served", "not_found", "bad")
REFUSED_ADDRESS = "refused_address"
REFUSED_ADDRESS_RATE = "refused_address_rate"
REFUSED_RATE = "refused_rate"
CLOSE_REASONS = ("expired", "evicted", "refused", REFUSED_ADDRESS, REFUSED_ADDRESS_RATE,
                 REFUSED_RATE)
# The counts with no label of their own: scrapes served from the cache, accept pauses.
OTHER_COUNTS = ("cached", "accept_paused")

# Per-address token buckets remembered at most (least recently seen forgotten first: a
# forgotten address starts with a full bucket, and the shared bucket still applies).
MAX_ADDRESSES = 4096
# Addresses recently served a scrape, exempt from the shared bucket: how many, how long.
MAX_KNOWN = 64
KNOWN_SECONDS = 900.0


@dataclass(frozen=True)
class MetricsLimits:
    """The endpoint's bounds (config keys metrics_*; see systemd/config.example.toml)."""

    header_timeout: float = 0.5  # accept to the end of the request header
    deadline: float = 2.0  # accept to close, whatever the client does
    max_clients: int = 32
    max_clients_per_address: int = 4
    rate: float = 200.0  # new connections a second, all addresses
    rate_per_address: float = 10.0  # new connections a second, one address (bursts 2x)
    cache_seconds: float = 0.5  # a rendered page is reused this long

    @classmethod
    def from_config(cls, config: Config) -> MetricsLimits:
        return cls(
            header_timeout=config.metrics_header_timeout,
            max_clients_per_address=config.metrics_max_clients_per_address,
            rate=float(config.metrics_rate),
            rate_per_address=float(config.metrics_rate_per_address),
            cache_seconds=config.metrics_cache_seconds,
        )


def address_key(sock: socket.socket, family: int) -> str | None:
    """Whose connection this is for the per-address limits: the IPv4 address, the IPv6
    /64 (one host commonly holds a whole /64), None for a Unix socket (no address: the
    file's mode decides who connects) or a peer already gone. `family` is the listener's
    (asked once: the socket's own property builds an enum per call). Cheap on purpose:
    a flood pays this for every connection it opens."""
    if family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        host = sock.getpeername()[0]
        if family == socket.AF_INET:
            return str(host)
        packed = socket.inet_pton(socket.AF_INET6, host.partition("%")[0])
    except (OSError, ValueError):
        return None
    if packed[:12] == _V4_MAPPED:
        return socket.inet_ntop(socket.AF_INET, packed[12:])
    return packed[:8].hex() + "::/64"


_V4_MAPPED = bytes(10) + b"\xff\xff"


class Admission:
    """The per-address and shared limits on new connections (not the slots: the server
    keeps those). `refusal` names the counter of a refused connection, or None."""

    def __init__(self, limits: MetricsLimits, now: float) -> None:
        self.limits = limits
        self.shared = TokenBucket(limits.rate, limits.rate, now)
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.known: OrderedDict[str, float] = OrderedDict()  # address -> last served
        self.open: dict[str, int] = {}  # address -> clients held

    def refusal(self, key: str | None, now: float) -> str | None:
        if key is not None:
            if self.open.get(key, 0) >= self.limits.max_clients_per_address:
                return REFUSED_ADDRESS
            if not self._bucket(key, now).take(now):
                return REFUSED_ADDRESS_RATE
            if self._known(key, now):
                return None
        if not self.shared.take(now):
            return REFUSED_RATE
        return None

    def opened(self, key: str | None) -> None:
        if key is not None:
            self.open[key] = self.open.get(key, 0) + 1

    def closed(self, key: str | None) -> None:
        if key is None:
            return
        left = self.open.get(key, 0) - 1
        if left > 0:
            self.open[key] = left
        else:
            self.open.pop(key, None)

    def served(self, key: str | None, now: float) -> None:
        """A scrape was answered 200: the address is a known scraper for a while."""
        if key is None:
            return
        self.known[key] = now
        self.known.move_to_end(key)
        while len(self.known) > MAX_KNOWN:
            self.known.popitem(last=False)

    def _known(self, key: str, now: float) -> bool:
        seen = self.known.get(key)
        return seen is not None and now - seen < KNOWN_SECONDS

    def _bucket(self, key: str, now: float) -> TokenBucket:
        bucket = self.buckets.get(key)
        if bucket is None:
            rate = self.limits.rate_per_address
            bucket = self.buckets[key] = TokenBucket(rate, 2 * rate, now)
            while len(self.buckets) > MAX_ADDRESSES:
                self.buckets.popitem(last=False)
        else:
            self.buckets.move_to_end(key)
        return bucket
