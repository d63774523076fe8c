"""The schema of a `doctor` reply: what the daemon knows about warming each of its roots.

Like kvprefetch.stats, the types live in the client package (the wire contract's Python
side); the daemon builds the map (daemon/kvprefetchd/doctor.py) and `kvprefetch doctor`
(kvprefetch.doctor) prints it with a live probe of its own. docs/protocol.md ("The
`doctor` reply") describes each field. A root that is not open carries only `root`,
`status`, `problems` and `useful`, hence `total=False` on the root's map.
"""

from __future__ import annotations

from typing import TypedDict, cast

from kvprefetch.errors import ProtocolError
from kvprefetch.protocol import Reply


class HoldBudget(TypedDict):
    seconds: float
    max_files: int
    max_bytes: int


class DoctorHost(TypedDict, total=False):
    engine: str
    io_uring: str  # "available", or "unavailable: why"
    cachestat: bool
    preserve_atime: bool
    noatime_fallbacks: int
    fusectl: bool  # whether FUSE connection limits can be read at all
    hold: HoldBudget


class Problem(TypedDict, total=False):
    severity: str  # error (the root cannot be warmed usefully), warning, info
    problem: str
    fix: str


class FuseFacts(TypedDict, total=False):
    server: str  # the FUSE server's program name, or why it is not known
    options: dict[str, str]  # its mount options, from its command line
    connection: str  # the fusectl directory of the mount's connection
    max_background: int | str  # an integer, or why it cannot be read
    congestion_threshold: int | str


class DoctorRoot(TypedDict, total=False):
    root: str
    status: str  # as in stats' roots: open, opening, missing, refused, unresponsive, error
    fstype: str
    mount_point: str
    rule: str  # the residency rule: tier, pagecache or off
    why: str
    extent: str  # head or whole: what a warm-up reads
    keep: str  # pagecache, hold, fs_cache or probe (docs/tiers.md)
    near: str
    promotes: str
    source: str
    verdict: str  # what the workers' reopens found: kept, dropped, "not yet looked"
    read_ahead_kb: int
    fuse: FuseFacts
    problems: list[Problem]
    useful: bool


class DoctorReport(TypedDict):
    host: DoctorHost
    roots: list[DoctorRoot]
    useful: bool  # every root can be warmed usefully


def parse_doctor(reply: Reply) -> DoctorReport:
    """The reply as a DoctorReport; the three top-level fields are checked, the rest is
    taken as it comes, so a daemon of another version still answers."""
    host, roots, useful = reply.get("host"), reply.get("roots"), reply.get("useful")
    if not isinstance(host, dict):
        raise ProtocolError(f"doctor reply field 'host' should be a map, got {host!r}")
    if not (isinstance(roots, list) and all(isinstance(r, dict) for r in roots)):
        raise ProtocolError(f"doctor reply field 'roots' should be an array of maps, got "
                            f"{roots!r}")
    if not isinstance(useful, bool):
        raise ProtocolError(f"doctor reply field 'useful' should be a bool, got {useful!r}")
    return cast(DoctorReport, {"host": host, "roots": roots, "useful": useful})
