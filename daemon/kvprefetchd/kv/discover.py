"""Find a profile's fingerprint folder on disk, and notice when a profile points at the wrong one.

The connector writes `<root_dir>/<safe_model>_<fp12>_r<rank>/...` and, once, the field
map it hashed into `<root_dir>/<safe_model>_<fp12>/config.json` (spec §5.1, §5.3).
Discovery lists root_dir (the only I/O in the kv package: a directory listing, a stat
per candidate and each candidate's small config.json), re-hashes every config.json to
check it names its own folder, and compares its fields with the profile's.

A wrong fingerprint is silent: every file is `missing`. `StaleDetector` (pure) watches
the outcomes per profile and, when files keep missing while sibling folders for the
same model exist, names the fingerprint most likely right.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvprefetch.stats import StaleProfile
from kvprefetchd.kv import layout
from kvprefetchd.kv.errors import DiscoveryError
from kvprefetchd.kv.profile import Profile

CONFIG_JSON_LIMIT = 1 << 20  # a config.json is a few KiB; refuse to read a huge one


@dataclass(frozen=True)
class Candidate:
    """One `<safe_model>_<fp12>` folder family found under root_dir.

    `differences` lists how its config.json disagrees with the profile: () when it
    agrees on every field the profile knows, None when there is no readable config.json.
    """

    fingerprint: str
    has_rank0: bool
    mtime_ns: int
    differences: tuple[str, ...] | None
    note: str = ""

    @property
    def agrees(self) -> bool:
        return self.differences == ()

    def describe(self) -> str:
        if self.differences is None:
            state = self.note or "no config.json to check"
        elif self.differences:
            state = "differs: " + "; ".join(self.differences)
        else:
            state = "config.json agrees with the profile"
        folder = "" if self.has_rank0 else ", no _r0 folder yet"
        return f"{self.fingerprint} ({state}{folder})"


@dataclass(frozen=True)
class Discovery:
    fingerprint: str
    how: str  # "computed", "config.json", "only candidate"
    candidates: tuple[Candidate, ...]


def scan(profile: Profile) -> list[Candidate]:
    """Every fingerprint folder of the profile's model under its root_dir, newest first."""
    root = profile.layout.root_dir
    safe = layout.safe_model_name(profile.layout.model_name)
    pattern = re.compile(re.escape(safe) + r"_([0-9a-f]{12})(_r0)?")
    found: dict[str, dict[str, Any]] = {}
    try:
        entries = list(os.scandir(root))
    except OSError as error:
        raise DiscoveryError(f"layout.root_dir {root!r} cannot be listed: {error}") from None
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or not _is_dir(entry):
            continue
        info = found.setdefault(match.group(1), {"rank0": False, "mtime": 0})
        if match.group(2):
            info["rank0"] = True
            info["mtime"] = max(info["mtime"], _mtime(entry))
    candidates = []
    for fingerprint, info in found.items():
        base = layout.base_path(root, profile.layout.model_name, fingerprint)
        differences, note = _check_config(profile, fingerprint, layout.config_json_path(base))
        candidates.append(Candidate(
            fingerprint=fingerprint, has_rank0=info["rank0"], mtime_ns=info["mtime"],
            differences=differences, note=note,
        ))
    candidates.sort(key=lambda c: (-c.mtime_ns, c.fingerprint))
    return candidates


def discover_fingerprint(profile: Profile) -> Discovery:
    """Choose the profile's folder, or raise DiscoveryError listing every candidate.

    1. the fingerprint the profile computes, when its folder exists;
    2. else the one folder whose config.json agrees with every known profile field;
    3. else the only folder there is, when it has no config.json to contradict it.
    Two agreeing folders (e.g. one per writer generation) are refused as ambiguous.
    """
    candidates = tuple(scan(profile))
    model = profile.layout.model_name
    root = profile.layout.root_dir
    if not candidates:
        safe = layout.safe_model_name(model)
        raise DiscoveryError(
            f"no '{safe}_<12 hex>_r0' folder under {root} for model {model!r}: nothing was "
            "offloaded yet, or layout.root_dir / layout.model_name (vLLM --model as given) "
            "differ from the connector's"
        )
    computed = profile.computed_fingerprint()
    for candidate in candidates:
        if candidate.fingerprint == computed:
            return Discovery(computed, "computed", candidates)
    agreeing = [c for c in candidates if c.agrees]
    if len(agreeing) == 1:
        return Discovery(agreeing[0].fingerprint, "config.json", candidates)
    listing = "; ".join(c.describe() for c in candidates)
    if len(agreeing) > 1:
        raise DiscoveryError(
            f"{len(agreeing)} folders under {root} match model {model!r} equally well; set "
            f"layout.fingerprint to one of them: {listing}"
        )
    if len(candidates) == 1 and candidates[0].differences is None:
        return Discovery(candidates[0].fingerprint, "only candidate", candidates)
    raise DiscoveryError(
        f"no folder under {root} matches the profile of model {model!r}; candidates: "
        f"{listing}. Fix the profile, or set layout.fingerprint"
    )


def differences(profile: Profile, fields: Mapping[str, Any]) -> tuple[str, ...]:
    """How a written field map (any field set, §5.3) disagrees with the profile, on the
    fields the profile knows."""
    ls = profile.layout
    found: list[str] = []

    def check(key: str, want: Any, accepted: Sequence[Any] | None = None) -> None:
        got = fields.get(key)
        if got not in (accepted if accepted is not None else (want,)):
            found.append(f"{key} is {got!r}, the profile's {want!r}")

    check("model_name", ls.model_name)
    check("dtype", ls.dtype)
    agnostic = ls.parallel_agnostic
    for key in ("tp_size", "pp_size", "pcp_size", "dcp_size"):
        check(key, 1 if agnostic else getattr(ls, key))
    if "hash_block_size" in fields:  # v1
        check("hash_block_size", profile.hash.block_size)
        check("gpu_blocks_per_file", profile.blocks_per_file)
        group_size_key = "block_size"
    elif "tokens_per_hash" in fields:  # v2a / v2b
        # v2's tokens_per_hash may or may not include dcp x pcp (unverified, §5.3)
        sizes = (profile.hash.block_size, profile.hash_block_size)
        check("tokens_per_hash", sizes[0], sizes)
        check("blocks_per_file", profile.blocks_per_file)
        group_size_key = "tokens_per_block"
        if fields.get("replicated_layout", False) != ls.replicated_layout:
            found.append(f"replicated_layout is {fields.get('replicated_layout', False)!r}, "
                         f"the profile's {ls.replicated_layout!r}")
    else:
        return (*found, "an unknown field set (neither hash_block_size nor tokens_per_hash)")
    groups = fields.get("kv_cache_groups")
    if not isinstance(groups, list) or len(groups) != len(ls.kv_cache_groups):
        count = len(groups) if isinstance(groups, list) else groups
        found.append(f"kv_cache_groups has {count!r} groups, the profile {len(ls.kv_cache_groups)}")
        return tuple(found)
    for index, (written, group) in enumerate(zip(groups, ls.kv_cache_groups, strict=True)):
        if not isinstance(written, Mapping):
            found.append(f"kv_cache_groups[{index}] is not a map")
            continue
        if written.get(group_size_key) != group.block_size:
            found.append(f"kv_cache_groups[{index}].{group_size_key} is "
                         f"{written.get(group_size_key)!r}, the profile's {group.block_size}")
        if group.layer_names is not None and written.get("layer_names") != list(group.layer_names):
            found.append(f"kv_cache_groups[{index}].layer_names differ")
    return tuple(found)


def _open_regular(path: str) -> int:
    """A read fd for path, only if it is a regular file and neither it nor its folder
    is a symlink.

    The supervisor runs discovery in its only thread: open() of a FIFO with no
    writer would block it (and every client) for ever, and open() of a device can
    have side effects. So, as native/open.c does: an O_PATH fd (which opens
    nothing), fstat, then reopen that very inode through /proc/self/fd; where /proc
    is missing, O_NONBLOCK (a FIFO never blocks) and the same check after the open.
    Raises OSError: EINVAL for what is not a regular file, ELOOP or ENOTDIR for a symlink.
    """
    base, name = os.path.split(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    folder = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        probe = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        try:
            if not stat.S_ISREG(os.fstat(probe).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            try:
                fd = os.open(f"/proc/self/fd/{probe}", flags)
            except FileNotFoundError:  # no /proc
                fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=folder)
        finally:
            os.close(probe)
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    # Some HSM file systems answer EAGAIN to a non-blocking read of an offline file.
    os.set_blocking(fd, True)
    return fd


def _check_config(
    profile: Profile, fingerprint: str, path: str
) -> tuple[tuple[str, ...] | None, str]:
    try:
        with os.fdopen(_open_regular(path), "rb") as handle:
            raw = handle.read(CONFIG_JSON_LIMIT + 1)
    except FileNotFoundError:
        return None, "no config.json"
    except OSError as error:
        return None, f"config.json unreadable: {error.strerror}"
    if len(raw) > CONFIG_JSON_LIMIT:
        return None, "config.json too large to be the connector's"
    try:
        fields = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, "config.json is not JSON"
    if not isinstance(fields, dict):
        return None, "config.json is not a JSON object"
    found = list(differences(profile, fields))
    hashed = layout.fingerprint_of(fields)
    if hashed != fingerprint:
        found.insert(0, f"config.json hashes to {hashed}, not to its folder's {fingerprint}")
    return tuple(found), ""


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _mtime(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat().st_mtime_ns
    except OSError:
        return 0


# --- staleness --------------------------------------------------------------------------

@dataclass
class _Watch:
    fingerprint: str
    missing: int = 0
    present: int = 0
    streak: int = 0  # files missing since the last one found
    next_scan_at: int = 0
    scanned: bool = False
    own_folder: bool | None = None
    siblings: list[Candidate] = field(default_factory=list)


# Sibling folders kept per watched profile: the likeliest first; the rest is noise in `stats`.
MAX_SIBLINGS = 8


class StaleDetector:
    """Per profile: are its files consistently missing while sibling folders exist?

    Pure. The supervisor feeds it the outcomes of each profile's files (`missing` vs
    found: `read` + `resident`; other outcomes say nothing about the path) and, when
    `record` answers True, a fresh `scan(profile)`. `report()` goes into `stats`.
    A cold deployment also misses everything, so a profile is called stale only when
    another fingerprint folder of the same model exists.

    At most `capacity` profiles are watched, the least recently fed forgotten first:
    every inline fingerprint is a profile of its own, and a client can send any number
    (125,000 of them grew the supervisor by 65 MiB and `stats` to 18 MB).
    """

    def __init__(self, *, streak: int = 256, capacity: int = 1024) -> None:
        if streak < 1:
            raise ValueError("streak must be >= 1")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.threshold = streak
        self.capacity = capacity
        self.forgotten = 0  # watches dropped to stay within capacity
        self._watches: OrderedDict[str, _Watch] = OrderedDict()

    def __len__(self) -> int:
        return len(self._watches)

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._shrink()

    def _shrink(self) -> None:
        while len(self._watches) > self.capacity:
            self._watches.popitem(last=False)
            self.forgotten += 1

    def record(self, profile: str, fingerprint: str, *, missing: int, present: int) -> bool:
        """Count one batch of outcomes. True: scan the folders now and call `observe`
        (asked once per `streak` further misses while the streak lasts)."""
        watch = self._watches.get(profile)
        if watch is None or watch.fingerprint != fingerprint:
            watch = self._watches[profile] = _Watch(fingerprint, next_scan_at=self.threshold)
        self._watches.move_to_end(profile)
        self._shrink()
        watch.missing += missing
        watch.present += present
        if present:
            watch.streak = 0
            watch.next_scan_at = self.threshold
            watch.scanned = False
            watch.own_folder = None
            watch.siblings = []
            return False
        watch.streak += missing
        if watch.streak >= watch.next_scan_at:
            watch.next_scan_at = watch.streak + self.threshold
            return True
        return False

    def observe(self, profile: str, candidates: Sequence[Candidate]) -> None:
        """The folders `scan` found for the profile's model (the profile's own included)."""
        watch = self._watches.get(profile)
        if watch is None:
            return
        watch.scanned = True
        watch.own_folder = any(
            c.fingerprint == watch.fingerprint and c.has_rank0 for c in candidates
        )
        others = [c for c in candidates if c.fingerprint != watch.fingerprint and c.has_rank0]
        # most likely first: config.json agrees, then unknown, then differs; newest first
        others.sort(key=lambda c: (0 if c.agrees else 1 if c.differences is None else 2,
                                   -c.mtime_ns, c.fingerprint))
        watch.siblings = others[:MAX_SIBLINGS]

    def stale(self, profile: str) -> bool:
        watch = self._watches.get(profile)
        return bool(watch and watch.streak >= self.threshold and watch.siblings)

    def likely_fingerprint(self, profile: str) -> str | None:
        watch = self._watches.get(profile)
        if watch is None or not self.stale(profile):
            return None
        return watch.siblings[0].fingerprint

    def report(self) -> dict[str, StaleProfile]:
        """{profile: {...}} for the `stats` reply: plain strings, integers, booleans."""
        out: dict[str, StaleProfile] = {}
        for name, watch in sorted(self._watches.items()):
            likely = self.likely_fingerprint(name)
            entry: StaleProfile = {
                "fingerprint": watch.fingerprint,
                "missing": watch.missing,
                "present": watch.present,
                "missing_streak": watch.streak,
                "stale": likely is not None,
                "likely_fingerprint": likely,
                "sibling_fingerprints": [c.fingerprint for c in watch.siblings],
                "own_folder": watch.own_folder,
                "hint": None,
            }
            if likely is not None:
                best = watch.siblings[0]
                own = "does not exist" if watch.own_folder is False else "exists"
                entry["hint"] = (
                    f"the last {watch.streak} files under {watch.fingerprint} were all "
                    f"missing (its _r0 folder {own}) while {len(watch.siblings)} other "
                    f"folder(s) of the model exist; likely {best.describe()}"
                )
            out[name] = entry
        return out
