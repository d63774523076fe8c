"""`kvprefetch doctor`: can each root be warmed usefully, and if not, why and how to fix it.

The daemon's `doctor` op (kvprefetch.diagnosis) says what it knows without touching a
file: the file-system type, the tier profile, the FUSE connection's limits, the mount
options that defeat warming. What it cannot say is whether a warm-up reaches a consumer
here, now: a FUSE file system without keep_cache drops at each open what a warmer left
(docs/tiers.md), and the daemon finds out only after warming files. So this command
adds one live probe per root, done the way a consumer meets a warm-up: the daemon evicts
a sample file, warms it (timed), checks it, and then THIS process (another process, as
the inference engine is) opens and reads the extent the root warms (timed). A consumer
read much faster than the warm-up means the warm-up reached it; as slow means it did not.

The consumer read comes last: on a root whose warm-ups are held open (keep = hold) the
consumer's open is what releases the hold, and the check must see the hold first.

Exit status: 0 every root useful; 1 a root cannot be warmed usefully (the daemon says so,
or the probe found the warm-up did not reach the consumer); 2 usage; 3 no daemon (the
CLI's usual codes, kvprefetch.cli).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvprefetch.diagnosis import DoctorReport, DoctorRoot
from kvprefetch.errors import ServerError
from kvprefetch.statsview import size_text

if TYPE_CHECKING:
    from kvprefetch.client import Client

T = TypeVar("T")

EXIT_OK = 0
EXIT_NOT_USEFUL = 1

# The sample file is found by a bounded walk: a tier's listing can cost a round trip per
# directory (and s3fs a HEAD per entry stat'ed), so at most this many entries, this deep,
# for this long; a root with no file found within them is not probed.
WALK_ENTRIES = 200
WALK_DEPTH = 4
WALK_SECONDS = 5.0
# The probe's head when the daemon does not say its read_bytes: the daemon's default.
DEFAULT_READ_BYTES = 1 << 20
CONSUMER_CHUNK = 1 << 20  # the consumer reads in 1 MiB calls, as a KV connector does
PROBE_TIMEOUT_S = 60.0
# The verdict: a warm-up reached the consumer when its read took less than half the
# warm-up, or under 5 ms (a local head from the page cache; the warm-up itself may be that
# fast when the file was resident already).
USEFUL_RATIO = 0.5
USEFUL_FLOOR_MS = 5.0
RULE = (f"a root's live probe is useful when the warm-up's outcome is `read` or `resident` and "
        f"the consumer's read then takes less than {USEFUL_RATIO:.0%} of the warm-up's time, "
        f"or under {USEFUL_FLOOR_MS:g} ms: the consumer found what the warm-up fetched")
JUDGED = ("read", "resident")
NOT_USEFUL = ("futile", "failed", "expired")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser],
               parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """The `doctor` subcommand, on the CLI's subparsers; `run` is its entry point."""
    doctor = commands.add_parser(
        "doctor", parents=list(parents),
        help="say per root whether warming it reaches the consumer, why not and the fix "
             "(exit 1 if a root cannot be warmed usefully)",
        description="Per root: its file system, residency rule, warm extent, near tier, "
                    "FUSE limits, every problem the daemon sees with its fix, and a live "
                    "probe: the daemon evicts a sample file and warms it, then this process "
                    f"reads it as a consumer would. {RULE[0].upper()}{RULE[1:]}. Exit 1 if a "
                    "root cannot be warmed usefully.",
    )
    doctor.add_argument("--no-probe", action="store_true",
                        help="only the daemon's report: warm, check and read nothing")
    doctor.add_argument("--probe", action="append", default=[], metavar="PATH",
                        help="probe this file for its root (repeatable); other roots get a "
                             f"sample file (a walk of at most {WALK_ENTRIES} entries, "
                             f"{WALK_DEPTH} levels deep)")
    doctor.add_argument("--read-bytes", type=_positive, metavar="N",
                        help="the head to warm and read on a `head` root (default: the "
                             "daemon's read_bytes if it says, else 1 MiB)")
    doctor.add_argument("--probe-timeout", type=_timeout, default=PROBE_TIMEOUT_S, metavar="S",
                        help=f"bound on each probe's warm-up and read (default "
                             f"{PROBE_TIMEOUT_S:g} s)")
    doctor.set_defaults(doctor=run)
    return doctor


def run(client: Client, args: argparse.Namespace) -> int:
    """Print the report (or --json it); the exit status says whether every root is useful."""
    report = diagnose(client, probe=not args.no_probe, chosen=args.probe,
                      read_bytes=args.read_bytes, timeout_s=args.probe_timeout)
    if getattr(args, "json", False):
        print(json.dumps(report, sort_keys=True))
    else:
        print(render(report))
    return EXIT_OK if report["useful"] else EXIT_NOT_USEFUL


# --- the report -------------------------------------------------------------------------


def diagnose(client: Client, *, probe: bool = True, chosen: Sequence[str] = (),
             read_bytes: int | None = None, timeout_s: float = PROBE_TIMEOUT_S
             ) -> dict[str, Any]:
    """The daemon's report, each root with its probe, and the verdict over all of them.

    After the probes the daemon is asked again: its workers' reopen of the files just
    warmed may have changed what it knows (a root found futile)."""
    first = client.doctor()
    roots: list[dict[str, Any]] = [dict(r) for r in first["roots"]]
    targets = _assign(roots, chosen)
    probes: dict[int, dict[str, Any]] = {}
    if probe:
        head = read_bytes or _int(first["host"].get("read_bytes")) or DEFAULT_READ_BYTES
        for index, root in enumerate(roots):
            probes[index] = probe_root(client, root, targets.get(index), head, timeout_s)
        again: DoctorReport = client.doctor()
        if len(again["roots"]) == len(roots):  # unchanged set of roots (no reload between)
            first, roots = again, [dict(r) for r in again["roots"]]
    for index, root in enumerate(roots):
        root["probe"] = probes.get(index, {"skipped": "--no-probe"})
        root["daemon_useful"] = bool(root.get("useful"))
        root["useful"] = root["daemon_useful"] and root["probe"].get("useful") is not False
    return {"host": dict(first["host"]), "roots": roots, "rule": RULE,
            "daemon_useful": first["useful"],
            "useful": all(r["useful"] for r in roots)}


def _assign(roots: list[dict[str, Any]], chosen: Sequence[str]) -> dict[int, str]:
    """Each --probe PATH to the root it lies under (the deepest one)."""
    targets: dict[int, str] = {}
    for path in chosen:
        absolute = os.path.abspath(path)
        under = [(len(r["root"]), i) for i, r in enumerate(roots)
                 if _within(absolute, r["root"])]
        if not under:
            raise ValueError(f"--probe {path}: not under any of the daemon's roots "
                             f"({', '.join(r['root'] for r in roots)})")
        targets[max(under)[1]] = absolute
    return targets


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# --- the live probe ---------------------------------------------------------------------


def probe_root(client: Client, root: DoctorRoot | dict[str, Any], path: str | None,
               read_bytes: int, timeout_s: float) -> dict[str, Any]:
    """Evict a file, warm it through the daemon, check it, read it as a consumer; judge."""
    if root.get("status") != "open":
        return {"skipped": f"the root is {root.get('status', 'not open')}"}
    if path is None:
        try:
            path = _bounded(lambda: sample_file(root["root"]), WALK_SECONDS + 1, "the walk")
        except (OSError, TimeoutError) as error:
            return {"skipped": f"no sample file: {error}"}
        if path is None:
            return {"skipped": f"no non-empty file within {WALK_ENTRIES} entries, "
                               f"{WALK_DEPTH} levels deep (name one with --probe PATH)"}
    whole = root.get("extent") == "whole"
    probe: dict[str, Any] = {"path": path, "extent": "whole" if whole else "head"}
    probe["evicted"] = _evict(client, path, read_bytes)

    started = time.monotonic()
    warmed = client.prefetch([path], wait=True, read_bytes=read_bytes,
                             timeout_ms=int(timeout_s * 1000))
    probe["warm_ms"] = _ms(time.monotonic() - started)
    if warmed.elapsed_us is not None:
        probe["daemon_ms"] = round(warmed.elapsed_us / 1000, 3)
    outcomes = {k: v for k, v in (warmed.outcomes or {}).items() if v}
    probe["outcome"] = next(iter(outcomes), "dropped" if warmed.dropped else "rejected")
    if warmed.failures:
        probe["reason"] = warmed.failures[0].reason

    checked = client.check([path], read_bytes=read_bytes, details=True)
    probe["check"] = checked.results[0].state if checked.results else "unknown"

    extent = None if whole else read_bytes
    try:
        seconds, count = _bounded(lambda: consumer_read(path, extent), timeout_s,
                                  "the consumer's read")
    except (OSError, TimeoutError) as error:
        probe["consumer_error"] = str(error)
    else:
        probe["consumer_ms"], probe["consumer_bytes"] = _ms(seconds), count
    probe["useful"], probe["why"] = judge(probe)
    return probe


def judge(probe: dict[str, Any]) -> tuple[bool | None, str]:
    """The verdict on one probe (RULE): True, False, or None when it cannot tell."""
    outcome = probe.get("outcome")
    if outcome in NOT_USEFUL:
        reason = f" ({probe['reason']})" if probe.get("reason") else ""
        return False, f"the warm-up's outcome is `{outcome}`{reason}"
    if outcome not in JUDGED:
        return None, f"inconclusive: the warm-up's outcome is `{outcome}`"
    if "consumer_ms" not in probe:
        if "did not finish" in probe.get("consumer_error", ""):
            return False, f"the consumer's read {probe['consumer_error']}"
        return None, f"inconclusive: the consumer's read failed: {probe['consumer_error']}"
    consumer, warm = probe["consumer_ms"], probe["warm_ms"]
    if outcome == "resident" and consumer >= USEFUL_FLOOR_MS:
        # Nothing was fetched (evict could not make it cold: the near tier is the file
        # system's own cache, or the tier's disk), so the warm-up's time is no cold read
        # to compare with.
        return None, (f"inconclusive: the file was resident before the warm-up (evict could "
                      f"not make it cold), so its {warm:.1f} ms is no fetch to compare the "
                      f"consumer's {consumer:.1f} ms with")
    share = f"{consumer / warm:.0%} of the warm-up's {warm:.1f} ms" if warm else "no warm-up"
    if consumer < USEFUL_FLOOR_MS or consumer < USEFUL_RATIO * warm:
        return True, f"the consumer read it in {consumer:.1f} ms, {share}: the warm-up " \
                     "reached it"
    return False, (f"the consumer read it in {consumer:.1f} ms, {share}: as slow as a cold "
                   "read, so what the warm-up fetched did not reach the consumer")


def _evict(client: Client, path: str, read_bytes: int) -> str:
    """Make the sample cold: by the daemon (allow_evict), else here (POSIX_FADV_DONTNEED).

    Opening it here is a consumer's open: it also releases a file the daemon holds open,
    which is what cold means on such a root."""
    try:
        client.evict([path], whole=True, read_bytes=read_bytes)
        return "by the daemon"
    except ServerError as error:
        if error.code != "forbidden":
            raise
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError as error:
        return f"no: the daemon refuses evict (allow_evict = false) and here: {error}"
    return "here (the daemon refuses evict: allow_evict = false)"


def sample_file(root: str, entries: int = WALK_ENTRIES, depth: int = WALK_DEPTH,
                seconds: float = WALK_SECONDS) -> str | None:
    """The first non-empty regular file of a breadth-first walk within the bounds."""
    deadline = time.monotonic() + seconds
    pending: deque[tuple[str, int]] = deque([(root, 0)])
    seen = 0
    while pending:
        directory, level = pending.popleft()
        try:
            with os.scandir(directory) as listing:
                for entry in listing:
                    seen += 1
                    if seen > entries or time.monotonic() > deadline:
                        return None
                    if entry.is_dir(follow_symlinks=False):
                        if level + 1 < depth:
                            pending.append((entry.path, level + 1))
                    elif entry.is_file(follow_symlinks=False) and \
                            entry.stat(follow_symlinks=False).st_size > 0:
                        return entry.path
        except OSError:
            continue  # an unreadable directory: look elsewhere
    return None


def consumer_read(path: str, extent: int | None) -> tuple[float, int]:
    """Open and read `extent` bytes (None: the whole file) as a consumer: seconds, bytes."""
    buffer = bytearray(CONSUMER_CHUNK)
    view = memoryview(buffer)
    total = 0
    started = time.monotonic()
    with open(path, "rb", buffering=0) as handle:
        while extent is None or total < extent:
            want = CONSUMER_CHUNK if extent is None else min(CONSUMER_CHUNK, extent - total)
            count = handle.readinto(view[:want])
            if not count:
                break
            total += count
    return time.monotonic() - started, total


def _bounded(work: Callable[[], T], seconds: float, what: str) -> T:
    """`work()` on a thread, waited for `seconds`: a file system that stops answering
    strands that thread (a daemon thread: it dies with the command), not the command."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, work()))
        except BaseException as error:  # handed to the caller
            box.append((False, error))

    thread = threading.Thread(target=target, name=f"doctor: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if not box:
        raise TimeoutError(f"did not finish in {seconds:g} s")
    done, value = box[0]
    if not done:
        raise value
    result: T = value
    return result


# --- printing ---------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    """The report for a person: each root, its problems with their fixes, its probe."""
    lines: list[str] = []
    for root in report["roots"]:
        lines.extend(_render_root(root))
        lines.append("")
    lines.append(_render_host(report["host"]))
    lines.append(f"rule: {report['rule']}.")
    useful = sum(1 for r in report["roots"] if r["useful"])
    total = len(report["roots"])
    lines.append(f"{useful} of {total} root{'s' if total != 1 else ''} can be warmed usefully"
                 + ("." if useful == total else ": see the problems and fixes above."))
    return "\n".join(lines)


def _render_root(root: dict[str, Any]) -> list[str]:
    where = f" at {root['mount_point']}" if root.get("mount_point") else ""
    lines = [f"{root['root']}: {root.get('fstype', 'unknown type')}{where} "
             f"({root.get('status', 'unknown')})"]
    if "rule" in root:
        lines.append(f"  residency rule: {root['rule']} ({root.get('why', '')})")
        lines.append(f"  warm extent: {root.get('extent')}; a warm-up survives by: "
                     f"{root.get('keep')}; near tier: {root.get('near')}; a read promotes: "
                     f"{root.get('promotes')}")
        lines.append(f"  reopen verdict: {root.get('verdict')}; read-ahead: "
                     f"{root.get('read_ahead_kb')} KiB; source: {root.get('source')}")
    fuse = root.get("fuse")
    if fuse:
        options = ", ".join(k if v == "" else f"{k}={v}"
                            for k, v in (fuse.get("options") or {}).items())
        lines.append(f"  FUSE: server {fuse.get('server')}; max_background "
                     f"{fuse.get('max_background')}, congestion_threshold "
                     f"{fuse.get('congestion_threshold')} ({fuse.get('connection')})")
        lines.append(f"  FUSE options: {options or 'none seen'}")
    for problem in root.get("problems", []):
        lines.append(f"  {problem.get('severity', 'error')}: {problem.get('problem')}")
        if problem.get("fix"):
            lines.append(f"      fix: {problem['fix']}")
    lines.extend(_render_probe(root))
    verdict = "yes" if root["useful"] else "NO"
    if not root["useful"] and root["daemon_useful"]:
        verdict += " (the live probe)"
    lines.append(f"  useful: {verdict}")
    return lines


def _render_probe(root: dict[str, Any]) -> list[str]:
    probe = root["probe"]
    if "skipped" in probe:
        return [f"  live probe: skipped ({probe['skipped']})"]
    lines = [f"  live probe: {probe['path']} ({probe['extent']})",
             f"    evicted {probe['evicted']}; warm-up {probe['warm_ms']:.1f} ms, outcome "
             f"{probe['outcome']}" + (f" ({probe['reason']})" if probe.get("reason") else "")
             + f"; check right after: {probe['check']}"]
    if "consumer_ms" in probe:
        lines.append(f"    consumer read (this process): {size_text(probe['consumer_bytes'])} in "
                     f"{probe['consumer_ms']:.1f} ms")
    else:
        lines.append(f"    consumer read (this process): {probe.get('consumer_error')}")
    mark = {True: "useful", False: "NOT USEFUL", None: "inconclusive"}[probe["useful"]]
    lines.append(f"    {mark}: {probe['why']}")
    if probe["useful"] is False:
        fixes = [p["fix"] for p in root.get("problems", []) if p.get("fix")
                 and "max_background" not in p["fix"]]
        lines.extend(f"      fix: {fix}" for fix in dict.fromkeys(fixes))
    return lines


def _render_host(host: dict[str, Any]) -> str:
    hold = host.get("hold") or {}
    parts = [f"engine {host.get('engine')}", f"io_uring {host.get('io_uring')}",
             f"cachestat {'yes' if host.get('cachestat') else 'no'}",
             f"preserve_atime {'on' if host.get('preserve_atime') else 'off'} "
             f"({host.get('noatime_fallbacks', 0)} O_NOATIME fallbacks)",
             f"fusectl {'mounted' if host.get('fusectl') else 'not mounted'}"]
    if hold:
        parts.append(f"hold-open budget {hold.get('seconds')} s, {hold.get('max_files')} "
                     f"files, {size_text(hold.get('max_bytes', 0))}")
    return "host: " + "; ".join(parts)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 3600:  # also refuses nan
        raise argparse.ArgumentTypeError(f"seconds above 0, at most 3600: {text}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value
