"""Which socket errors a peer can cause, in one place for every listener.

A peer decides when to close, reset, or abandon a TLS session without close_notify;
the errors that follow (EPIPE, ECONNRESET, ssl.SSLEOFError under TLS 1.3, a protocol
violation in a record) end that peer's connection and nothing else. Every listener of
the supervisor's loop (the request socket, the TCP/TLS listener, the metrics endpoint)
asks here instead of listing errnos of its own: a list kept in one module cannot miss
in one listener what another already handles (issue 23: SSLEOFError escaped the
Unix socket's list and stopped the daemon).
"""

from __future__ import annotations

import errno
import ssl

# What a send or recv meets when the other end went away or the path to it did.
PEER_ERRNOS = frozenset({
    errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNABORTED, errno.ECONNREFUSED,
    errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
    errno.EHOSTDOWN, errno.ESHUTDOWN,
})

# What accept(2) may return for a connection that failed before we took it: Linux passes
# the new socket's pending network errors back from accept, and for TCP/IP says to treat
# these like EAGAIN and retry (accept(2), NOTES and ERRORS: EPERM is a firewall rule's).
ACCEPT_ERRNOS = frozenset({
    errno.ECONNABORTED, errno.ENETDOWN, errno.EPROTO, errno.ENOPROTOOPT, errno.EHOSTDOWN,
    errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH, errno.EPERM,
})


def would_block(error: BaseException) -> bool:
    """Nothing wrong: try again when the selector says so (TLS may want the other way)."""
    return isinstance(error, BlockingIOError | InterruptedError | ssl.SSLWantReadError
                      | ssl.SSLWantWriteError)


def caused_by_peer(error: BaseException) -> bool:
    """The connection is over because of its peer (or the network to it): close it only.

    Every ssl.SSLError is the peer's doing once the handshake succeeded (an EOF without
    close_notify, a bad record, a renegotiation we refuse); so are the errnos above.
    Other errors (EBADF, ENOMEM, EMFILE) are ours and the caller decides.
    """
    if would_block(error):
        return False
    if isinstance(error, ssl.SSLError):
        return True
    return isinstance(error, OSError) and error.errno in PEER_ERRNOS


def describe(error: BaseException) -> str:
    """A short reason for a log line: the SSL library's reason, else the strerror."""
    if isinstance(error, ssl.SSLError):
        return str(getattr(error, "reason", None) or error)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {error}"


def accept_failed_by_peer(error: BaseException) -> bool:
    """accept(2) failed for that one connection (gone, or refused on its way): take the
    next. Out of fds (EMFILE, ENFILE) and the rest are the listener's own."""
    return isinstance(error, OSError) and error.errno in ACCEPT_ERRNOS
