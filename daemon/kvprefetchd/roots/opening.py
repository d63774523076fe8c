"""Opening an allowed root once, so that nobody can swap it for another directory.

A root named by a path is only as safe as every directory on the way to it. If a root
does not exist yet (the default /tmp/shared-kv in world-writable /tmp, before the fs
connector first writes), any local user could create it as a symlink to /root, and a
daemon running as root that follows it reads there. So a root is opened by walking its
path one component at a time from "/", with O_NOFOLLOW at every step, checking who could
have put each component there, and the directory fd that results is what the workers
resolve beneath (openat2 RESOLVE_BENEATH): a respawned worker inherits the same fd
instead of resolving the path again. The same walk, repeated (rootset.py), is the only
way a root's directory changes: a directory removed and made again, or a file system
mounted over the path, is reopened through it with every check, while a symlink planted
at the path is refused and changes nothing.

The check (on unless `root_path_checks = false`): every directory that holds the next
component must be owned by root or by the daemon's user and writable by no one else,
unless it is sticky (like /tmp: then only the entry's owner, the directory's owner or
root may rename the entry), in which case the entry must be owned by root or the
daemon's user too. The root's own entry is the exception: in a sticky directory it may
belong to anyone (the fs connector's user creates /tmp/shared-kv), since whatever that
user puts there is a real directory (no symlink is followed) and what lies inside it is
held beneath it by openat2.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass


class RootRefused(Exception):
    """The root's path could be controlled by someone else; the message says where and how
    to fix it."""


class RootMissing(Exception):
    """The root does not exist (yet); the daemon looks again later."""


@dataclass(frozen=True)
class Trust:
    """Whose directories may lead to a root: root's and the daemon's own user's."""

    uids: frozenset[int]

    @classmethod
    def here(cls) -> Trust:
        return cls(frozenset({0, os.geteuid()}))


def open_root(path: str, *, checks: bool = True, trust: Trust | None = None) -> int:
    """An O_PATH directory fd of the root, reached without following any symlink.

    Raises RootMissing when a component does not exist, RootRefused when one is a symlink
    or not a directory, or (with checks) could have been placed by an untrusted user.
    """
    if not os.path.isabs(path):
        raise RootRefused(f"root {path}: not an absolute path")
    trust = trust or Trust.here()
    names = [name for name in path.split("/") if name and name != "."]
    if ".." in names:
        raise RootRefused(f"root {path}: has a '..' component")
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    where = "/"
    try:
        for position, name in enumerate(names):
            parent = os.fstat(fd)
            try:
                child = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                missing = os.path.join(where, name)
                raise RootMissing(f"root {path}: {missing} does not exist") from None
            except OSError as error:
                if error.errno == errno.ENOTDIR:
                    raise RootRefused(f"root {path}: {where} is not a directory") from None
                raise
            here = os.path.join(where, name)
            os.close(fd)
            fd = child
            info = os.fstat(fd)
            if stat.S_ISLNK(info.st_mode):
                raise RootRefused(
                    f"root {path}: {here} is a symlink; name the directory it leads to "
                    "(a symlink on the way to a root could be re-pointed)"
                )
            if not stat.S_ISDIR(info.st_mode):
                raise RootRefused(f"root {path}: {here} is not a directory")
            if checks:
                last = position == len(names) - 1
                problem = untrusted_entry(parent, info, trust, last=last)
                if problem:
                    raise RootRefused(
                        f"root {path}: {here} could be replaced by another user: {where} "
                        f"{problem} (give it to root, or set root_path_checks = false "
                        "to accept it)"
                    )
            where = here
        return fd
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def untrusted_entry(
    parent: os.stat_result, entry: os.stat_result, trust: Trust, *, last: bool = False
) -> str:
    """Why someone outside `trust` could rename or replace `entry` inside `parent`; ""
    when nobody can (`last`: the entry is the root itself, see the module's docstring)."""
    if parent.st_uid not in trust.uids:
        return f"is owned by uid {parent.st_uid}"
    if parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        if not parent.st_mode & stat.S_ISVTX:
            return "is writable by others and not sticky"
        if entry.st_uid not in trust.uids and not last:
            # In a sticky directory the entry's owner may still rename it (rename(2)).
            return f"is writable by others, and the entry is owned by uid {entry.st_uid}"
    return ""
