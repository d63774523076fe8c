"""A Debian 12 root file system with systemd in it, built once by debootstrap and cached.

The system test boots this tree with systemd-nspawn (system_container.py). Building it takes
one to two minutes (mostly downloading and unpacking ~300 packages), so it is kept under
a directory named by the hash of the recipe: change the recipe and a new tree is built
beside the old one; keep it and every later run reuses the tree. The tree is never
written to after it is complete: containers boot it with --volatile=overlay (a tmpfs
over a read-only view), so every run starts from the same bytes.

Concurrent runs (several worktrees on one machine) serialise the build on a lock file;
a tree is only ever published whole, by rename(2) from a `.partial` directory.

The mirror is the one this machine's apt already uses (its sources list), never a name
written here: KVPREFETCH_SYSTEM_MIRROR overrides it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUITE = "bookworm"  # Debian 12: systemd 252, Python 3.11, liburing 2.3
VARIANT = "minbase"
# What the project needs to be built and run the way the README installs it: systemd and
# its bus (dbus) to be booted, Python with venv and pip, and the C toolchain and headers
# for the cffi extension (gcc, libc6-dev, python3-dev, libffi-dev, liburing-dev); procps
# for `ps` when a run must be debugged from inside.
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "python3-pip", "python3-dev",
    "gcc", "liburing-dev", "libc6-dev", "libffi-dev", "procps",
    # the .deb's dependencies (debian/control), so `apt-get install ./….deb` needs no network
    "python3-msgpack", "python3-cffi-backend", "python3-psutil", "python3-setproctitle",
    "python3-cbor2", "python3-prometheus-client", "liburing2",
)
# Bump when the steps after debootstrap (finish()) change: they are part of the recipe.
RECIPE_REVISION = 1
DEFAULT_CACHE = Path("/var/cache/kvprefetch-system")
CACHE_ENV = "KVPREFETCH_SYSTEM_CACHE"
MIRROR_ENV = "KVPREFETCH_SYSTEM_MIRROR"
COMPLETE_MARK = ".kvprefetch-recipe.json"
# debootstrap of this recipe measured 75-140 s on a 2-vCPU VM; 15 minutes means it is stuck.
BUILD_TIMEOUT = 900.0


class RootfsUnavailable(RuntimeError):
    """The tree cannot be built here; the message says why (a skip, or a failure in CI)."""


@dataclass(frozen=True)
class Rootfs:
    path: Path
    built: bool  # False: reused from the cache
    seconds: float  # time spent building (or waiting for another run's build)


def recipe() -> dict[str, object]:
    return {
        "suite": SUITE, "variant": VARIANT, "packages": sorted(PACKAGES),
        "arch": os.uname().machine, "revision": RECIPE_REVISION,
    }


def recipe_key() -> str:
    text = json.dumps(recipe(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


# ---- the mirror this machine already uses --------------------------------------------------


def find_mirror(suite: str = SUITE, sources: Path = Path("/etc/apt")) -> str | None:
    """The first `deb` source of `suite` itself (not -updates, not -security) in apt's lists."""
    override = os.environ.get(MIRROR_ENV)
    if override:
        return override
    files = [sources / "sources.list"]
    listing = sources / "sources.list.d"
    if listing.is_dir():
        files += sorted(listing.iterdir())
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":
            found = _from_deb822(text, suite)
        elif path.suffix == ".list" or path.name == "sources.list":
            found = _from_one_line(text, suite)
        else:
            found = None
        if found:
            return found
    return None


def _from_one_line(text: str, suite: str) -> str | None:
    """sources.list(5), one-line style: `deb [options] URI suite component...`."""
    for line in text.splitlines():
        line = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0])  # drop [arch=... signed-by=...]
        fields = line.split()
        if len(fields) >= 3 and fields[0] == "deb" and fields[2] == suite:
            return fields[1]
    return None


def _from_deb822(text: str, suite: str) -> str | None:
    """sources.list(5), deb822 style: paragraphs of Types:, URIs:, Suites:."""
    for paragraph in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in paragraph.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" in fields.get("types", "").split() and suite in fields.get("suites", "").split():
            uris = fields.get("uris", "").split()
            if uris:
                return uris[0]
    return None


# ---- building ------------------------------------------------------------------------------


def ensure_rootfs(log: Path) -> Rootfs:
    """The cached tree for this recipe, built first if absent (serialised across runs)."""
    cache = cache_dir()
    key = recipe_key()
    final = cache / f"rootfs-{key}"
    if (final / COMPLETE_MARK).is_file():
        return Rootfs(final, built=False, seconds=0.0)
    if shutil.which("debootstrap") is None:
        raise RootfsUnavailable("debootstrap is not installed (./dev test-system installs it)")
    mirror = find_mirror()
    if mirror is None:
        raise RootfsUnavailable(
            f"no apt source for Debian {SUITE} in /etc/apt to debootstrap from "
            f"(set {MIRROR_ENV})"
        )
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    started = time.monotonic()
    with _locked(cache / "build.lock"):
        if (final / COMPLETE_MARK).is_file():  # another run built it while we waited
            return Rootfs(final, built=False, seconds=time.monotonic() - started)
        partial = cache / f"rootfs-{key}.partial"
        _remove_tree(partial)  # a build that was killed: we hold the lock, nobody uses it
        try:
            _debootstrap(partial, mirror, log)
            _finish(partial)
        except BaseException:
            _remove_tree(partial)
            raise
        os.rename(partial, final)
    return Rootfs(final, built=True, seconds=time.monotonic() - started)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _debootstrap(target: Path, mirror: str, log: Path) -> None:
    command = [
        "debootstrap", f"--variant={VARIANT}", "--include=" + ",".join(PACKAGES),
        SUITE, str(target), mirror,
    ]
    with open(log, "ab") as output:
        output.write(f"$ {' '.join(command)}\n".encode())
        output.flush()
        # Its own session: on Ctrl-C or a timeout the whole tree (dpkg, apt) is killed.
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            status = process.wait(BUILD_TIMEOUT)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    if status != 0:
        # Most often the mirror is unreachable: a reason to skip here, a failure in CI.
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RootfsUnavailable(f"debootstrap from {mirror} failed (status {status}); "
                                f"end of {log}:\n" + "\n".join(tail))


def _finish(root: Path) -> None:
    """Make the tree small and neutral; then mark it complete (the last write to it)."""
    # The .deb files debootstrap leaves in apt's cache are ~150 MB nobody needs.
    archives = root / "var/cache/apt/archives"
    for deb in archives.glob("*.deb"):
        deb.unlink()
    # The build host's name; nspawn sets the container's own (--machine).
    (root / "etc/hostname").unlink(missing_ok=True)
    (root / COMPLETE_MARK).write_text(json.dumps(recipe(), sort_keys=True) + "\n")


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this mount namespace, deepest first."""
    prefix = str(path)
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            # proc(5): field 5 is the mount point, with spaces etc. escaped as octal.
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def _remove_tree(path: Path) -> None:
    """Remove a (partial) tree, first unmounting what a killed debootstrap left mounted
    in it (it mounts proc and sys into the target while packages configure)."""
    if not path.exists():
        return
    for point in _mounts_under(path):
        subprocess.run(["umount", "--lazy", point], check=False)
    if _mounts_under(path):
        raise RuntimeError(f"cannot unmount everything under {path}; not removing it")
    shutil.rmtree(path)
