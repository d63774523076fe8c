"""What a scout is asked to do, and what it answers: the tasks that touch file systems.

Each task runs in a scout (scout.py), never in the supervisor: opening or checking a root
(a no-follow walk, then its residency rule), a KV profile's fingerprint discovery and the
stale-profile scan. The answers are Passed (a root opened, its fd beside it), Unchanged (a
check found the very directory held) or Failed (why not, by kind). Both ends are this
program, forked, so tasks and answers are pickled (scout_child.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvprefetchd import kv
from kvprefetchd.roots.opening import RootMissing, RootRefused, Trust, open_root
from kvprefetchd.roots.residency import RootRule, rule_for_fd


@dataclass(frozen=True)
class OpenRoot:
    """Open an allowed root without following symlinks (opening.py) and choose its rule.

    Given the fd the daemon holds for the root (passed with the task), it is a check:
    Unchanged while the path still leads to that very directory, else the directory the
    path leads to now, with why the held one is no longer it (Passed.replaced)."""

    path: str
    rule: str  # the residency rule configured: auto, tier, pagecache or off
    checks: bool = True
    extent: str = "auto"  # warm_extent configured: auto, head or whole

    def run(self, fds: Sequence[int] = ()) -> Any:
        held = fds[0] if fds else -1
        try:
            fd = open_root(self.path, checks=self.checks, trust=Trust.here())
        except RootMissing as missing:
            return Failed("missing", str(missing))
        except RootRefused as refused:
            return Failed("refused", str(refused))
        except OSError as error:
            return Failed("error", f"root {self.path}: {error.strerror}")
        try:
            replaced = replaced_because(fd, held) if held >= 0 else ""
            if held >= 0 and not replaced:
                os.close(fd)
                return Unchanged()
            return Passed(rule_for_fd(fd, self.path, self.rule, self.extent), fd, replaced)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise


def replaced_because(fd: int, held: int) -> str:
    """Why the directory `held` is no longer the one the path leads to now (`fd`, just
    opened); "" while it still is.

    A removed directory lives on while an fd holds it, with no links left, and ext4 may
    give its inode number to the next directory made: the link count is looked at before
    the identity. A FUSE mount whose server went away answers ENOTCONN (and a file
    system torn down, ENODEV) to the fstat or the fstatfs of what it held.
    """
    now = os.fstat(fd)
    try:
        was = os.fstat(held)
        if was.st_nlink == 0:
            return "the directory held was removed"
        if (was.st_dev, was.st_ino) != (now.st_dev, now.st_ino):
            return (f"the path leads to another directory now, device "
                    f"{os.major(now.st_dev)}:{os.minor(now.st_dev)} inode {now.st_ino}, "
                    f"not {os.major(was.st_dev)}:{os.minor(was.st_dev)} inode {was.st_ino}")
        os.fstatvfs(held)
    except OSError as error:
        return f"the file system held is gone ({error.strerror})"
    return ""


@dataclass(frozen=True)
class ProfileTask:
    """A task over a profile's root_dir: refused unless that folder is beneath a root."""

    profile: kv.Profile
    roots: tuple[str, ...]

    def run(self, fds: Sequence[int] = ()) -> Any:
        if not real_path_beneath(self.profile.layout.root_dir, self.roots):
            return Failed("refused", not_beneath(self.profile))
        try:
            return self.work()
        except kv.DiscoveryError as error:
            return Failed("error", f"{self.what}: {error}")

    what = "profile task"

    def work(self) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Discover(ProfileTask):
    """Find a `discover` profile's fingerprint folder under its root_dir."""

    what = "fingerprint discovery"

    def work(self) -> Any:
        return kv.discover_fingerprint(self.profile).fingerprint


@dataclass(frozen=True)
class Scan(ProfileTask):
    """Every fingerprint folder of a profile's model, for the stale-profile detector."""

    what = "fingerprint scan"

    def work(self) -> Any:
        return kv.scan(self.profile)


Task = OpenRoot | Discover | Scan


@dataclass(frozen=True)
class Failed:
    """A task's honest failure; `kind` "timeout" when the scout did not answer in time,
    "unavailable" when no scout could be asked (the supervisor is out of fds or
    processes: nothing was looked at)."""

    kind: str
    message: str


@dataclass(frozen=True)
class Passed:
    """A root opened: its rule, and its fd (passed over the socket with SCM_RIGHTS);
    `replaced`: why the directory held until now is no longer the root (a check)."""

    rule: RootRule
    fd: int = -1
    replaced: str = ""


@dataclass(frozen=True)
class Unchanged:
    """A check found the root's path leading to the very directory held."""


def real_path_beneath(path: str, roots: tuple[str, ...]) -> bool:
    """`path` lies beneath a root once symlinks are resolved (a stat of every component:
    the scout's business, never the supervisor's)."""
    real = os.path.realpath(path)
    return any(beneath(real, os.path.realpath(root)) for root in roots)


def beneath(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def not_beneath(profile: kv.Profile) -> str:
    return (f"layout.root_dir {profile.layout.root_dir!r} is not under an allowed root: an "
            'inline layout may "discover" only beneath the daemon\'s roots (or give '
            "layout.fingerprint)")
