"""The fields of a warm (prefetch, prefetch_blocks) or inspect (check, evict) request,
read and bounded at the protocol's edge: docs/protocol.md, "Numeric fields".

Each is checked here, before the request reaches the books or a worker: no value a peer
chose may reach arithmetic or a native field that cannot hold it. (0.3.0 checked only the
sign: `deadline_ms` = 2**44 became a deadline in ns past int64 in the worker that met a
cold file, and killed it, issue 23.) A value out of its range is `bad_request`, naming
the field and the range.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvprefetchd.protocol import BAD_REQUEST, DEFAULT_MAX_FAILURES, Request, RequestError


@dataclass(frozen=True)
class WarmOptions:
    """How a prefetch or prefetch_blocks request wants its files warmed and answered."""

    wait: bool
    read_bytes: int
    timeout_ms: int | None
    deadline: float = 0.0  # CLOCK_MONOTONIC seconds past which no read is issued; 0: none
    max_failures: int = DEFAULT_MAX_FAILURES  # files listed in `failures`


@dataclass(frozen=True)
class InspectOptions:
    """How a check or evict request wants its files looked at and answered."""

    read_bytes: int
    timeout_ms: int | None
    details: bool
    whole: bool  # evict: the whole file, not only the head


# The range of every numeric field a request may carry (docs/protocol.md, "Numeric fields").
DAY_MS = 86_400_000
MAX_TIMEOUT_MS = DAY_MS  # a `wait` or a check's timeout
MAX_DEADLINE_MS = DAY_MS  # the config's default_deadline_ms has the same ceiling
# deadline_unix_ms lies within this of the daemon's CLOCK_REALTIME, either side: past is
# allowed (a router's deadline that passed in transit, a skewed host's clock: every file
# expires); beyond a day back it is a unit mistake (seconds, not ms), and so is the future.
DEADLINE_UNIX_SLACK_MS = DAY_MS
# How many failures a reply may be asked to list: more than any request's paths, and cut
# to the configured max_failures_listed anyway.
MAX_FAILURES_ASKED = (1 << 32) - 1


def _shown(value: Any) -> str:
    """A refused value for the error message, short whatever the peer sent (a str field
    may be megabytes): integers as they are, other values by their msgpack type."""
    if type(value) is int:
        return str(value)
    if type(value) is float:
        return f"the float {value!r}"
    if type(value) is bool:
        return "true" if value else "false"
    kinds: dict[type, str] = {str: "a string", bytes: "a bin", list: "an array", dict: "a map"}
    return kinds.get(type(value), type(value).__name__)


def _flag(body: dict[str, Any], key: str, rid: int) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(BAD_REQUEST, f"{key}: expected a boolean, got {_shown(value)}", rid)
    return value


def _integer(body: dict[str, Any], key: str, rid: int, low: int, high: int,
             unit: str = "") -> int | None:
    """The field's value if present (None if absent or nil): an integer (not a bool, not a
    float) in [low, high], else `bad_request` naming the field and its range."""
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise RequestError(
            BAD_REQUEST, f"{key}: expected an integer in [{low}, {high}]{unit}, "
            f"got {_shown(value)}", rid)
    return value


def _read_bytes(body: dict[str, Any], rid: int, default: int, maximum: int) -> int:
    """At most the configured max_read_bytes (itself at most 2**40)."""
    read_bytes = _integer(body, "read_bytes", rid, 1, maximum, " (max_read_bytes)")
    return default if read_bytes is None else read_bytes


def _timeout_ms(body: dict[str, Any], rid: int) -> int | None:
    return _integer(body, "timeout_ms", rid, 0, MAX_TIMEOUT_MS, " ms (24 h)")


def deadline_of(body: dict[str, Any], rid: int, default_ms: int, arrived: float) -> float:
    """The request's deadline on the monotonic clock the workers read (0.0: none).

    `deadline_unix_ms` is converted once, here: past it, a worker compares monotonic
    times only, so a wall-clock step later changes nothing. Both forms are bounded to
    a day from now, so the result is a time a worker's int64 nanoseconds can hold."""
    relative = _integer(body, "deadline_ms", rid, 0, MAX_DEADLINE_MS, " ms (24 h)")
    if body.get("deadline_unix_ms") is not None:
        if relative is not None:
            raise RequestError(BAD_REQUEST, "deadline_ms and deadline_unix_ms: give one", rid)
        wall_ms = time.time() * 1000.0
        now_ms = int(wall_ms)
        absolute = _integer(
            body, "deadline_unix_ms", rid, now_ms - DEADLINE_UNIX_SLACK_MS,
            now_ms + DEADLINE_UNIX_SLACK_MS, " (CLOCK_REALTIME ms within 24 h of the "
            f"daemon's clock, now {now_ms})")
        assert absolute is not None
        return max(arrived + (absolute - wall_ms) / 1000.0, 1e-9)
    milliseconds = default_ms if relative is None else relative
    return arrived + milliseconds / 1000.0 if milliseconds else 0.0


def parse_warm_options(
    request: Request, default_read_bytes: int, max_read_bytes: int, *,
    default_deadline_ms: int = 0, max_failures_listed: int = DEFAULT_MAX_FAILURES,
) -> WarmOptions:
    body, rid = request.body, request.request_id
    wait = _flag(body, "wait", rid)
    read_bytes = _read_bytes(body, rid, default_read_bytes, max_read_bytes)
    timeout_ms = _timeout_ms(body, rid)
    deadline = deadline_of(body, rid, default_deadline_ms, time.monotonic())
    max_failures = _integer(body, "max_failures", rid, 0, MAX_FAILURES_ASKED)
    if max_failures is None:
        max_failures = DEFAULT_MAX_FAILURES
    return WarmOptions(wait, read_bytes, timeout_ms, deadline,
                       min(max_failures, max_failures_listed))


def parse_inspect_options(
    request: Request, default_read_bytes: int, max_read_bytes: int
) -> InspectOptions:
    body, rid = request.body, request.request_id
    return InspectOptions(
        _read_bytes(body, rid, default_read_bytes, max_read_bytes),
        _timeout_ms(body, rid),
        _flag(body, "details", rid),
        _flag(body, "whole", rid),
    )


def parse_paths(request: Request) -> list[Any]:
    paths = request.body.get("paths")
    if not isinstance(paths, list):
        raise RequestError(
            BAD_REQUEST, "paths: expected an array of absolute paths", request.request_id
        )
    return paths
