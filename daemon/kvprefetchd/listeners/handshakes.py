"""Who may start a TLS handshake, and how fast: strangers cannot take the routers' way in.

A handshake is the only thing the TCP listener does for a peer it knows nothing about,
and it costs a slot (until it ends or `tls_handshake_timeout`) and CPU (a key exchange
and a signature, ~1.4 ms of the supervisor's one thread). In 0.3.0 handshakes shared
`max_connections` with established connections: 17 addresses x 64 silent handshakes
locked every router out, and a certificate-less full-handshake flood took 71% of the
supervisor (issue 23, finding 3). Here:

- Slots: at most `max_tls_handshakes` handshakes at once, apart from established
  connections (which only a listed identity can hold, so strangers never take them).
  When every slot is taken, a newcomer displaces the oldest handshake of the address
  that holds the most, if that address holds more than the newcomer's own (`displaced`):
  a flood from N addresses holds about 1/N of the slots each, and a router's handshake
  (one at a time, done in a round trip) always finds one. A newcomer from the busiest
  address is refused instead: an address cannot churn its way in.
- Rate: a token bucket per address (`tls_handshake_rate_per_address` a second), taken
  at accept, and one for every address not seen before (`tls_handshake_rate`), taken
  when the handshake's first message arrives and the work would begin, so handshake CPU
  is bounded however many addresses a flood comes from, while silent connections (a
  slot, no CPU) never spend what a router needs.
- A reserve for routers already seen: an address from which a listed identity completed
  a handshake (the last KNOWN_ADDRESSES of them) skips the global bucket, so a flood
  that empties it leaves those routers their own per-address rate. (Identity is only
  known once a handshake ends, so what is remembered is where it came from.)

A router never seen before (since the daemon started) may be refused while a flood of
full handshakes from many addresses holds the shared bucket empty: it is closed at once,
and its retry gets in once a token is free or the flood stops.
"""

from __future__ import annotations

import itertools
import ssl
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvprefetchd.listeners.tokenbucket import TokenBucket

# Addresses remembered as routers' (the reserve) and per-address buckets kept: both
# bounded, least recently used forgotten first. A forgotten bucket comes back full,
# which the global bucket still bounds for addresses not seen before.
KNOWN_ADDRESSES = 4096
MAX_BUCKETS = 16384
SWEEP_BUCKETS = 1024


@dataclass(eq=False)
class Handshake:
    """A TLS handshake in progress on the selector."""

    sock: ssl.SSLSocket
    address: str
    started: float
    handler: Any = None
    watched: int = 0
    charged: bool = False  # its token of the shared bucket taken (HandshakeGate.charge)


def displaced(handshakes: Iterable[Handshake], address: str) -> Handshake | None:
    """Every slot is taken and a newcomer from `address` asks for one: the handshake it
    displaces (the oldest of the address holding the most, when that address holds more
    than `address` does), or None: the newcomer is refused."""
    held: dict[str, list[Handshake]] = {}
    for handshake in handshakes:
        held.setdefault(handshake.address, []).append(handshake)
    if not held:
        return None
    busiest = max(held.values(), key=lambda group: (len(group), -min(h.started for h in group)))
    if len(busiest) <= len(held.get(address, ())):
        return None
    return min(busiest, key=lambda h: h.started)


class HandshakeGate:
    """The rate half: per-address and global token buckets, and the addresses seen."""

    def __init__(self, rate: int, rate_per_address: int,
                 clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.rate_per_address = float(rate_per_address)
        self.everyone = TokenBucket(rate, rate, clock())
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.known: OrderedDict[str, None] = OrderedDict()

    def configure(self, rate: int, rate_per_address: int) -> None:
        """A reload: new rates apply from now on (tokens held are kept, capped)."""
        self.everyone.reshape(float(rate), float(rate))
        self.rate_per_address = float(rate_per_address)
        for bucket in self.buckets.values():
            bucket.reshape(self.rate_per_address, self.rate_per_address)

    def admit(self, address: str) -> str | None:
        """Take a token of `address`'s own bucket for one new connection, or say why it
        may not have one."""
        now = self.clock()
        bucket = self.buckets.get(address)
        if bucket is None:
            bucket = TokenBucket(self.rate_per_address, self.rate_per_address, now)
            self.buckets[address] = bucket
            if len(self.buckets) > MAX_BUCKETS:
                self.buckets.popitem(last=False)
        else:
            self.buckets.move_to_end(address)
        if not bucket.take(now):
            return ("handshakes from this address come faster than "
                    "tls_handshake_rate_per_address")
        return None

    def charge(self, address: str) -> str | None:
        """The handshake's first message came: the work begins (a key exchange and a
        signature). Take a token of the shared bucket, unless a router came from
        `address` before; or say why it may not. (Charged here and not at accept, so
        silent connections, which cost a slot but no CPU, never spend it.)"""
        if address in self.known:
            return None
        if not self.everyone.take(self.clock()):
            return "handshakes from new addresses come faster than tls_handshake_rate"
        return None

    def seen(self, address: str) -> None:
        """A listed identity completed a handshake from `address`: it joins the reserve."""
        self.known[address] = None
        self.known.move_to_end(address)
        if len(self.known) > KNOWN_ADDRESSES:
            self.known.popitem(last=False)

    def forget_seen(self) -> None:
        """The identities or CAs allowed changed: nobody is known any more."""
        self.known.clear()

    def sweep(self) -> None:
        """Forget buckets that refilled: they hold nothing a new one would not. The least
        recently used come first, at most SWEEP_BUCKETS a call (a flood from many
        addresses must not make the sweep itself a stall)."""
        now = self.clock()
        for address in list(itertools.islice(self.buckets, SWEEP_BUCKETS)):
            bucket = self.buckets[address]
            bucket.refill(now)
            if bucket.full:
                del self.buckets[address]
