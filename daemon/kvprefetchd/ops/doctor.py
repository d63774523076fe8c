"""The `doctor` op: per root, what warming it means and what stands in its way.

No warmer we know of explains its tier; an operator whose warm-ups do not reach the
consumer has nothing to go on. The daemon knows the pieces: each root's file-system type
and tier profile (tiers.py), the FUSE server's options and the connection's limits (read by
the scout when the root opened), what the workers' reopens found (reopen.py), the engines
this kernel offers. `doctor` puts them in one reply, each problem with its fix, and says
per root whether warming it is useful: `kvprefetch doctor` prints it, adds a live probe
(warm a file, reopen it, time the consumer's read) and exits non-zero when a root cannot
be warmed usefully.

Nothing here touches a root's file system: the supervisor must never wait on one. The
facts come from the scout's look at open; only sysfs and fusectl are read here.
"""

from __future__ import annotations

from typing import Any

from kvprefetchd.config import Config
from kvprefetchd.native import load_native
from kvprefetchd.roots.rootset import RootState
from kvprefetchd.roots.tiers import FUSE_DEFAULT_MAX_BACKGROUND, FUSECTL, fuse_limits

QUEUE_ENGINES = ("pread", "fadvise")


def diagnose(states: list[RootState], config: Config, engine: str) -> dict[str, Any]:
    native = load_native()
    lib = native.lib
    uring = native.engine_unavailable("io_uring", "read")
    host = {
        "engine": engine,
        "read_bytes": config.read_bytes,  # a head warm-up's depth (extent `head`)
        "io_uring": "available" if uring is None else f"unavailable: {uring}",
        "cachestat": bool(lib.kvp_have_cachestat()),
        # O_NOATIME needs the file's owner or CAP_FOWNER; refusals are counted in stats
        "preserve_atime": config.preserve_atime,
        "noatime_fallbacks": int(lib.kvp_noatime_fallbacks()),
        "fusectl": _fusectl_mounted(),
        "hold": {"seconds": config.hold_seconds, "max_files": config.hold_max_files,
                 "max_bytes": config.hold_max_bytes},
    }
    roots = [diagnose_root(state, config, engine) for state in states]
    return {"host": host, "roots": roots, "useful": all(r["useful"] for r in roots)}


def diagnose_root(state: RootState, config: Config, engine: str) -> dict[str, Any]:
    rule = state.rule
    report: dict[str, Any] = {"root": state.path, "status": state.status}
    problems: list[dict[str, str]] = []
    if rule is None:
        problems.append({"severity": "error",
                         "problem": f"the root is not open ({state.status}): {state.message}",
                         "fix": "create the directory or mount the file system; the daemon "
                                "opens it by itself"})
        report.update(problems=problems, useful=False)
        return report
    profile, facts = rule.profile, rule.facts
    report.update(
        fstype=rule.fstype, mount_point=rule.mount_point, rule=rule.name, why=rule.why,
        extent=rule.extent, keep=rule.keep, near=profile.near, promotes=profile.promotes,
        source=profile.source, verdict=state.verdict or "not yet looked",
        read_ahead_kb=facts.read_ahead_kb, hold=rule.hold,
        fs_cache=rule.fs_cache or None,
    )
    if facts.connection:
        limits = fuse_limits(facts.connection)
        report["fuse"] = {
            "server": facts.server or "not found in this pid namespace",
            "options": dict(facts.options), "connection": facts.connection,
            "max_background": limits[0] or "unknown (fusectl not mounted)",
            "congestion_threshold": limits[1] or "unknown (fusectl not mounted)",
        }
        problems.extend(_fuse_problems(facts.connection, limits))
    problems.extend(_keep_problems(state, config, engine))
    report["problems"] = problems
    report["useful"] = not any(p.get("severity") == "error" for p in problems)
    return report


def _fuse_problems(connection: str, limits: tuple[int, int]) -> list[dict[str, str]]:
    max_background, _ = limits
    if not max_background:
        return [{"severity": "info",
                 "problem": "the FUSE connection's limits and count cannot be read: "
                            "requests are admitted by the root's own read times, which "
                            "lag the tier's queue (docs/protocol.md, Order)",
                 "fix": f"mount -t fusectl none {FUSECTL}"}]
    if max_background <= FUSE_DEFAULT_MAX_BACKGROUND:
        return [{"severity": "warning",
                 "problem": f"max_background is {max_background}: the kernel lets at most "
                            f"{max_background} reads of this mount run at once, whatever "
                            "the warmer (or the consumer) does",
                 "fix": f"raise it at runtime: echo 128 > {connection}/max_background (and "
                        f"congestion_threshold to 3/4 of it), or with the file system's own "
                        "option where it has one"}]
    return []


def _keep_problems(state: RootState, config: Config, engine: str) -> list[dict[str, str]]:
    rule = state.rule
    assert rule is not None
    fix = rule.profile.fix
    problems: list[dict[str, str]] = []
    if state.futile:
        problems.append({"severity": "error",
                         "problem": "a warmed file was cold when reopened: this file system "
                                    "drops what a warm-up leaves at the next open, so "
                                    "warm-ups are futile (files settle `futile`)",
                         "fix": fix or "mount it so it keeps data across opens (FUSE "
                                       "keep_cache, or a disk cache of its own)"})
    if rule.keep == "hold":
        if config.hold_max_files == 0:
            problems.append({"severity": "error",
                             "problem": "this file system keeps a file's data only while "
                                        "it is open, and holding is off (hold_max_files = 0)",
                             "fix": fix})
        elif engine not in QUEUE_ENGINES:
            problems.append({"severity": "error",
                             "problem": f"this file system keeps a file's data only while it "
                                        f"is open, and the {engine} engine cannot hold files",
                             "fix": "engine = \"auto\" (or pread / fadvise)"})
        else:
            problems.append({"severity": "info",
                             "problem": "the kernel drops this file system's cached pages at "
                                        "each open; the daemon holds warmed files open until "
                                        f"their consumer opens them (at most "
                                        f"{config.hold_seconds:g} s, {config.hold_max_files} "
                                        "files)",
                             "fix": fix})
    elif rule.hold and config.hold_max_files and engine in QUEUE_ENGINES:
        problems.append({"severity": "info",
                         "problem": "warmed files are held open until their consumer opens "
                                    "them: an open file keeps this file system's attributes "
                                    "and data, so the consumer's open fetches nothing",
                         "fix": ""})
    if rule.keep == "probe" and not state.verdict:
        problems.append({"severity": "info",
                         "problem": "no profile says whether a warm-up survives to the "
                                    "consumer here: the first warm-ups reopen a file to find "
                                    "out",
                         "fix": fix or "run `kvprefetch doctor` (its live probe warms a file)"})
    return problems


def _fusectl_mounted() -> bool:
    try:
        with open("/proc/self/mountinfo") as handle:
            return any(" - fusectl " in line for line in handle)
    except OSError:
        return False
