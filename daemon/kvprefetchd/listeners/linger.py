"""Refused TCP peers, told why and then let go: the listener's last word must be read.

A peer refused after its handshake (an identity not listed, a CA revoked, no slot) is sent
one error frame and our side is shut. Closing at once would lose the frame: a close with
the peer's request unread sends a reset, and the reset discards what the peer had not
read yet. So the socket is kept open, whatever the peer sends discarded, until it closes
or LINGER_S passes.
"""

from __future__ import annotations

import contextlib
import functools
import selectors
import socket
import ssl
import time
from collections.abc import Callable

from kvprefetchd.listeners.listening import Unforeseen
from kvprefetchd.listeners.peer_errors import caused_by_peer, would_block

LINGER_S = 2.0  # how long a refused peer is given to read why and close


class Lingering:
    """The refused peers still open, by fd: (socket, until when, address). `release`
    is told each address whose peer is let go (the listener's per-address count)."""

    def __init__(self, selector: selectors.BaseSelector, release: Callable[[str], None],
                 unforeseen: Unforeseen) -> None:
        self.selector = selector
        self.release = release
        self.unforeseen = unforeseen
        self.peers: dict[int, tuple[ssl.SSLSocket, float, str]] = {}

    def __len__(self) -> int:
        return len(self.peers)

    def linger(self, sock: ssl.SSLSocket, address: str, farewell: bytes) -> None:
        """Send one last frame, end our side, and wait for the peer to close."""
        with contextlib.suppress(OSError):
            sock.send(farewell)  # a few hundred bytes: the socket buffer takes them
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_WR)
        fd = sock.fileno()
        self.peers[fd] = (sock, time.monotonic() + LINGER_S, address)
        self.selector.register(sock, selectors.EVENT_READ, functools.partial(self.on_event, fd))

    def on_event(self, fd: int, _events: int) -> None:
        """Discard what a refused peer still sends until it closes; whatever this throws
        ends that linger only."""
        if fd not in self.peers:
            return
        sock, _, address = self.peers[fd]
        try:
            if socket.socket.recv(sock, 4096):
                return  # discarded; wait for the close
        except OSError as error:
            if would_block(error):
                return
            if not caused_by_peer(error):
                self.unforeseen.happened(f"{address} (refused, lingering)", error)
        except Exception as error:
            self.unforeseen.happened(f"{address} (refused, lingering)", error)
        self.end(fd)

    def end(self, fd: int) -> None:
        sock, _, address = self.peers.pop(fd)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)
        self.release(address)
        with contextlib.suppress(OSError):
            sock.close()

    def sweep(self, now: float) -> None:
        """Let go of the peers that had their LINGER_S."""
        for fd, (_, until, _) in list(self.peers.items()):
            if now >= until:
                self.end(fd)

    def close(self) -> None:
        for fd in list(self.peers):
            self.end(fd)
