"""Who may talk to the daemon: the peer's credentials as the kernel vouches for them.

The socket file's mode is the first gate, but a mode can be widened by mistake
(or a socket passed in by a container runtime); SO_PEERCRED and SO_PEERGROUPS
say who is really on the other end, so the check holds whatever the file's mode.
A router is usually allowed through a supplementary group, hence SO_PEERGROUPS
(Linux 4.13) and not only the primary gid SO_PEERCRED carries.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import Counter
from dataclasses import dataclass

# Connections beyond max_connections that only root and the daemon's own user may open:
# an operator's ping gets through while other users hold every ordinary slot.
PRIVILEGED_RESERVE = 16

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # asm-generic/socket.h
_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gids: frozenset[int]  # primary and supplementary


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    gids = {gid}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
    except OSError:
        raw = b""  # ERANGE for a peer in more than 256 groups, or an old kernel
    gids.update(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    return Peer(pid, uid, frozenset(gids))


@dataclass(frozen=True)
class PeerPolicy:
    """Peers allowed by uid or by any of their groups."""

    uids: frozenset[int]
    gids: frozenset[int]

    @classmethod
    def default(
        cls, socket_path: str, extra_uids: tuple[int, ...], extra_gids: tuple[int, ...]
    ) -> PeerPolicy:
        """The daemon's own user and the socket file's group, plus what the config adds."""
        gids = set(extra_gids)
        try:
            gids.add(os.stat(socket_path).st_gid)
        except OSError:
            gids.add(os.getgid())
        return cls(frozenset({os.getuid(), *extra_uids}), frozenset(gids))

    def allows(self, peer: Peer) -> bool:
        return peer.uid in self.uids or not self.gids.isdisjoint(peer.gids)


class Seats:
    """How many connections each peer holds, and whether it may open one more: at most
    `per_uid` per user, `total` in all, plus PRIVILEGED_RESERVE for the privileged."""

    def __init__(self) -> None:
        self.per_uid: Counter[int] = Counter()
        self.privileged = frozenset({0, os.getuid()})

    def refusal(self, peer: Peer, open_now: int, total: int, per_uid: int) -> str | None:
        """Why `peer` may not open another connection, or None if it may."""
        held = self.per_uid[peer.uid]
        if held >= per_uid:
            return (f"uid {peer.uid} has {held} connections open, the most one user may "
                    "(max_connections_per_uid)")
        limit = total + (PRIVILEGED_RESERVE if peer.uid in self.privileged else 0)
        if open_now >= limit:
            return f"{open_now} connections are open, the most the daemon takes (max_connections)"
        return None

    def take(self, peer: Peer) -> None:
        self.per_uid[peer.uid] += 1

    def give_back(self, peer: Peer) -> None:
        self.per_uid[peer.uid] -= 1
        if self.per_uid[peer.uid] <= 0:
            del self.per_uid[peer.uid]
