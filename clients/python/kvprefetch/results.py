"""Typed views of successful replies.

Parsing checks the fields a caller relies on, so a daemon that drifts from protocol.md fails
here with the field's name instead of later as a KeyError in the caller's code. Unknown reply
keys are ignored, as protocol.md asks of requests, so a newer daemon can add figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar, cast

from kvprefetch.errors import ProtocolError
from kvprefetch.protocol import Path, Reply
from kvprefetch.stats import Stats

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PingResult:
    version: str
    protocol: int
    engine: str
    workers: int


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """Counts for one prefetch; `outcomes` and `elapsed_us` only come with `wait`, `files`
    only from `prefetch_blocks`."""

    accepted: int
    dropped: int
    rejected: int
    outcomes: dict[str, int] | None = None
    elapsed_us: int | None = None
    files: int | None = None


@dataclass(frozen=True, slots=True)
class ResolveResult:
    block_hashes: list[list[str]]
    # bin when the daemon had to send a non-UTF-8 path (protocol.md, "Transport and framing")
    paths: list[Path]
    fingerprint: str | None = None  # the 12-hex folder tag the daemon used


def parse_ping(reply: Reply) -> PingResult:
    return PingResult(
        version=_get(reply, "version", str),
        protocol=_int(reply, "protocol"),
        engine=_get(reply, "engine", str),
        workers=_int(reply, "workers"),
    )


def parse_prefetch(reply: Reply) -> PrefetchResult:
    outcomes = reply.get("outcomes")
    if outcomes is not None and not (
        isinstance(outcomes, dict)
        and all(isinstance(k, str) and _is_int(v) for k, v in outcomes.items())
    ):
        raise ProtocolError(f"'outcomes' is not a map of name to count: {outcomes!r}")
    return PrefetchResult(
        accepted=_int(reply, "accepted"),
        dropped=_int(reply, "dropped"),
        rejected=_int(reply, "rejected"),
        outcomes=outcomes,
        elapsed_us=_optional_int(reply, "elapsed_us"),
        files=_optional_int(reply, "files"),
    )


def parse_resolve(reply: Reply) -> ResolveResult:
    block_hashes = _get(reply, "block_hashes", list)
    if not all(isinstance(hs, list) and all(isinstance(h, str) for h in hs) for hs in block_hashes):
        raise ProtocolError("'block_hashes' is not an array of arrays of hex strings")
    paths = _get(reply, "paths", list)
    if not all(isinstance(p, str | bytes) for p in paths):
        raise ProtocolError("'paths' holds something other than paths")
    fingerprint = reply.get("fingerprint")
    return ResolveResult(
        block_hashes=block_hashes,
        paths=paths,
        fingerprint=fingerprint if isinstance(fingerprint, str) else None,
    )


def parse_stats(reply: Reply) -> Stats:
    """The `stats` map, typed by the schema of this version (kvprefetch.stats); only its
    being a map is checked, so a daemon of another version still answers."""
    return cast(Stats, _get(reply, "stats", dict))


def merge_prefetch(results: Iterable[PrefetchResult]) -> PrefetchResult:
    """One summary for a warm-up split over several requests.

    The requests ran concurrently on the daemon, so the elapsed time is the longest one, not
    the sum.
    """
    results = list(results)
    outcomes: dict[str, int] | None = None
    for r in results:
        if r.outcomes is not None:
            outcomes = outcomes or {}
            for name, count in r.outcomes.items():
                outcomes[name] = outcomes.get(name, 0) + count
    elapsed = [r.elapsed_us for r in results if r.elapsed_us is not None]
    files = [r.files for r in results if r.files is not None]
    return PrefetchResult(
        accepted=sum(r.accepted for r in results),
        dropped=sum(r.dropped for r in results),
        rejected=sum(r.rejected for r in results),
        outcomes=outcomes,
        elapsed_us=max(elapsed) if elapsed else None,
        files=sum(files) if files else None,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(reply: Reply, key: str, kind: type[T]) -> T:
    value = reply.get(key)
    if not isinstance(value, kind):
        raise ProtocolError(f"reply field {key!r} should be {kind.__name__}, got {value!r}")
    return value


def _int(reply: Reply, key: str) -> int:
    value = reply.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"reply field {key!r} should be an integer, got {value!r}")
    return value


def _optional_int(reply: Reply, key: str) -> int | None:
    return None if reply.get(key) is None else _int(reply, key)
