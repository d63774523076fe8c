"""Why a file was not warmed: the `reason` of each entry of a reply's `failures`.

One vocabulary for both gates (docs/protocol.md, "Failures"): the supervisor's lexical
gate says its reason itself (confine.py); a worker reports an outcome and the errno behind
it, named here. An errno that means one thing at the second gate (EXDEV: a symlink led out
of the root under RESOLVE_BENEATH) gets that name; any other is its errno name, which an
operator can look up.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Iterator

DROPPED = "dropped_queue_full"
DEADLINE = "deadline"
WORKER_LOST = "worker_lost"
# check and evict: a name behind another mount beneath its root (a FUSE or NFS mount in
# a subdirectory), which a worker does not look at on its own thread (native/inspect.c).
OTHER_MOUNT = "other_mount"
# Warm-ups: a name behind another mount beneath its root, refused unread because every
# thread of the queue's lane for such names is stuck on a read (native/queue.c).
MOUNT_UNRESPONSIVE = "mount_unresponsive"
# Outcome `futile`: read, but its root's file system drops what a warm-up leaves at the
# next open (no keep_cache, no cache of its own, not held open: docs/tiers.md).
NOT_KEPT = "not_kept"

# Worker outcome `rejected`: the errno native/open.c settles it with -> reason.
_REJECTED = {
    errno.EXDEV: "symlink_escape",
    errno.ELOOP: "symlink_loop",
    errno.EISDIR: "not_regular",
    errno.ENODEV: "not_regular",
    errno.EINVAL: "bad_name",
    errno.ENAMETOOLONG: "bad_name",
    errno.ESTALE: "swapped",
}


def given_path(path: object) -> str | bytes:
    """A refused path as a reply names it: as sent when it is a path (str or bin), else
    its repr, cut short (a `not_a_path` may be any msgpack value)."""
    if isinstance(path, str | bytes):
        return path
    return repr(path)[:200]


def turned_away(rejected: Iterable[tuple[object, str]], dropped: Iterable[object],
             ) -> Iterator[tuple[str | bytes, str, str]]:
    """The files the supervisor turned away, as (path, outcome, reason), in the order
    every reply lists them: the rejected, then the dropped."""
    for path, reason in rejected:
        yield given_path(path), "rejected", reason
    for path in dropped:
        yield given_path(path), "dropped", DROPPED


def reason_of(outcome: str, err: int) -> str:
    """The reason for a file a worker settled with `outcome` and errno `err`."""
    if outcome == "expired":
        return DEADLINE
    if outcome == "futile":
        return NOT_KEPT
    if outcome == "rejected" and err in _REJECTED:
        return _REJECTED[err]
    if outcome == "failed" and err == errno.EXDEV:
        return OTHER_MOUNT
    if outcome == "failed" and err == errno.EHOSTDOWN:
        return MOUNT_UNRESPONSIVE
    if err:
        return errno.errorcode.get(err, f"errno_{err}")
    return WORKER_LOST if outcome == "failed" else outcome
