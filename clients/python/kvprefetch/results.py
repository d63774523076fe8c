"""Typed views of successful replies.

Parsing checks the fields a caller relies on, so a daemon that drifts from protocol.md fails
here with the field's name instead of later as a KeyError in the caller's code. Unknown reply
keys are ignored, as protocol.md asks of requests, so a newer daemon can add figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
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
class Failure:
    """A file that was not warmed, and why (protocol.md, "Failures")."""

    path: Path
    outcome: str  # missing, rejected, failed, expired, dropped
    reason: str  # e.g. ENOENT, outside_roots, symlink_escape, deadline, dropped_queue_full


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """Counts for one prefetch; `outcomes` and `elapsed_us` only come with `wait`, `files`
    only from `prefetch_blocks`, `room` only in acks. `failures` lists files not warmed
    (an ack: those turned away at once), at most the request's max_failures; the rest are
    counted in `failures_truncated`."""

    accepted: int
    dropped: int
    rejected: int
    outcomes: dict[str, int] | None = None
    elapsed_us: int | None = None
    files: int | None = None
    failures: list[Failure] = field(default_factory=list)
    failures_truncated: int = 0
    room: int | None = None


@dataclass(frozen=True, slots=True)
class FileState:
    """One file of a check or evict with details."""

    path: Path
    state: str  # resident, cold, missing, rejected, failed, dropped
    size: int
    resident_bytes: int
    tier_bytes: int
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class CheckResult:
    """What a check (or an evict, after eviction) found: counts by state, bytes, and with
    details each file's figures."""

    files: int
    resident_files: int
    size_bytes: int
    resident_bytes: int
    states: dict[str, int]
    elapsed_us: int
    evicted_files: int | None = None
    results: list[FileState] | None = None


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
    if outcomes is not None:
        outcomes = _counts(reply, "outcomes")
    return PrefetchResult(
        accepted=_int(reply, "accepted"),
        dropped=_int(reply, "dropped"),
        rejected=_int(reply, "rejected"),
        outcomes=outcomes,
        elapsed_us=_optional_int(reply, "elapsed_us"),
        files=_optional_int(reply, "files"),
        failures=_failures(reply),
        failures_truncated=_optional_int(reply, "failures_truncated") or 0,
        room=_optional_int(reply, "room"),
    )


def _failures(reply: Reply) -> list[Failure]:
    raw = reply.get("failures")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ProtocolError(f"'failures' is not an array: {raw!r}")
    failures = []
    for entry in raw:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str | bytes)
                and isinstance(entry.get("outcome"), str) and isinstance(entry.get("reason"), str)):
            raise ProtocolError(f"not a failure (path, outcome, reason): {entry!r}")
        failures.append(Failure(entry["path"], entry["outcome"], entry["reason"]))
    return failures


def parse_check(reply: Reply) -> CheckResult:
    states = _counts(reply, "states")
    results = None
    if reply.get("results") is not None:
        results = []
        for entry in _get(reply, "results", list):
            if not isinstance(entry, dict) or not isinstance(entry.get("path"), str | bytes):
                raise ProtocolError(f"not a file's check result: {entry!r}")
            reason = entry.get("reason")
            results.append(FileState(
                path=entry["path"], state=_get(entry, "state", str), size=_int(entry, "size"),
                resident_bytes=_int(entry, "resident_bytes"),
                tier_bytes=_int(entry, "tier_bytes"),
                reason=reason if isinstance(reason, str) else None,
            ))
    return CheckResult(
        files=_int(reply, "files"),
        resident_files=_int(reply, "resident_files"),
        size_bytes=_int(reply, "size_bytes"),
        resident_bytes=_int(reply, "resident_bytes"),
        states=states,
        elapsed_us=_int(reply, "elapsed_us"),
        evicted_files=_optional_int(reply, "evicted_files"),
        results=results,
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
    rooms = [r.room for r in results if r.room is not None]
    return PrefetchResult(
        accepted=sum(r.accepted for r in results),
        dropped=sum(r.dropped for r in results),
        rejected=sum(r.rejected for r in results),
        outcomes=outcomes,
        elapsed_us=max(elapsed) if elapsed else None,
        files=sum(files) if files else None,
        failures=[f for r in results for f in r.failures],
        failures_truncated=sum(r.failures_truncated for r in results),
        room=rooms[-1] if rooms else None,
    )


def _counts(reply: Reply, key: str) -> dict[str, int]:
    """A reply's map of name to count (outcomes, states)."""
    value = reply.get(key)
    if not (isinstance(value, dict)
            and all(isinstance(k, str) and _is_int(v) for k, v in value.items())):
        raise ProtocolError(f"{key!r} is not a map of name to count: {value!r}")
    return value


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
