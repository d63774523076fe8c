"""A token bucket: how the listeners bound what strangers may make the one loop do.

Shared by the TLS handshake admission (handshakes.py) and the metrics endpoint's accept
and scrape rates (metrics_limits.py, metrics_http.py): `rate` tokens a second, at most
`burst` saved, one taken per admitted unit of work. Time is passed in (the caller's
clock), so a test drives it without sleeping.
"""

from __future__ import annotations


class TokenBucket:
    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def refill(self, now: float) -> float:
        """The tokens held at `now` (a clock that went back adds none)."""
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.tokens

    def take(self, now: float) -> bool:
        """One token if there is one at `now`: True when taken."""
        if self.refill(now) < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def reshape(self, rate: float, burst: float) -> None:
        """New figures (a reload) from now on: the tokens held are kept, capped."""
        self.rate, self.burst = rate, burst
        self.tokens = min(self.tokens, burst)

    @property
    def full(self) -> bool:
        """Holds all it may: a new bucket would be the same (the caller refilled first)."""
        return self.tokens >= self.burst
