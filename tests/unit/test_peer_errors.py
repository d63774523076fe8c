"""peer_errors: which socket errors close one peer, and which are the daemon's own.

Issue 23, finding 1: ssl.SSLEOFError (a TLS 1.3 peer gone without close_notify) was not
in the Unix socket's list of peer errors and stopped the daemon. The SSL errors here are
made by the ssl module itself (in-memory BIOs), not constructed by hand where it matters.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import ssl
import struct
from collections import Counter

import pytest

from kvprefetchd.config import Config
from kvprefetchd.listeners.connection import Connection
from kvprefetchd.listeners.peer_errors import (
    accept_failed_by_peer,
    caused_by_peer,
    describe,
    would_block,
)
from kvprefetchd.listeners.peers import Peer
from kvprefetchd.listeners.server import Server


def real_ssl_eof() -> ssl.SSLError:
    """The error a TLS peer that vanished mid-session gives: the ssl module's own."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    incoming.write_eof()
    with pytest.raises(ssl.SSLError) as raised:
        tls.do_handshake()
    return raised.value


def test_a_tls_eof_without_close_notify_is_the_peers_doing() -> None:
    error = real_ssl_eof()
    assert isinstance(error, ssl.SSLEOFError)
    assert caused_by_peer(error) and not would_block(error)
    assert "EOF" in describe(error)


@pytest.mark.parametrize("error", [
    BrokenPipeError(errno.EPIPE, "Broken pipe"),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    OSError(errno.ENOTCONN, "not connected"),
    OSError(errno.ETIMEDOUT, "timed out"),
    OSError(errno.EHOSTUNREACH, "no route"),
    ssl.SSLZeroReturnError(6, "TLS/SSL connection has been closed"),
    ssl.SSLError(1, "[SSL: DECRYPTION_FAILED_OR_BAD_RECORD_MAC]"),
    ssl.SSLCertVerificationError(1, "certificate verify failed"),
], ids=lambda e: type(e).__name__ + str(getattr(e, "errno", "")))
def test_what_a_peer_can_cause_closes_that_peer(error: BaseException) -> None:
    assert caused_by_peer(error)
    assert not would_block(error)


@pytest.mark.parametrize("error", [
    OSError(errno.EBADF, "Bad file descriptor"),
    OSError(errno.EMFILE, "Too many open files"),
    OSError(errno.ENOMEM, "Cannot allocate memory"),
    ValueError("I/O operation on closed socket"),
    MemoryError(),
], ids=lambda e: type(e).__name__ + str(getattr(e, "errno", "")))
def test_the_daemons_own_errors_are_not_blamed_on_a_peer(error: BaseException) -> None:
    assert not caused_by_peer(error)


@pytest.mark.parametrize("error", [
    BlockingIOError(errno.EAGAIN, "again"), InterruptedError(errno.EINTR, "interrupted"),
    ssl.SSLWantReadError(2, "want read"), ssl.SSLWantWriteError(3, "want write"),
])
def test_would_block_is_neither_an_error_nor_the_peers(error: BaseException) -> None:
    assert would_block(error) and not caused_by_peer(error)


def test_accept_skips_a_connection_that_failed_but_not_running_out_of_fds() -> None:
    for code in (errno.ECONNABORTED, errno.EPROTO, errno.ENETDOWN, errno.EPERM):
        assert accept_failed_by_peer(OSError(code, "x"))
    for code in (errno.EMFILE, errno.ENFILE, errno.EBADF, errno.EINVAL, errno.ENOBUFS):
        assert not accept_failed_by_peer(OSError(code, "x"))


def test_describe_says_why_in_a_few_words() -> None:
    assert describe(ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")) == (
        "Connection reset by peer")
    assert describe(ValueError("odd")) == "ValueError: odd"


# ---- what one connection throws costs that connection only (server.py) ---------------------


def test_an_unexpected_error_in_one_connection_closes_it_and_no_other(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real Server on a real selector, two real socket pairs: the frame handler fails
    for one peer's frames (a bug no rule foresaw); that peer is logged, counted and
    closed, and the other one is served as if nothing happened."""
    selector = selectors.DefaultSelector()
    events: Counter[str] = Counter()

    def on_frame(connection: Connection, payload: bytes) -> None:
        if payload == b"boom":
            raise KeyError("a bug")
        connection.send({"id": 1, "ok": True})

    server = Server(Config(), selector, on_frame, events, Counter())
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        for ours, _ in pairs:
            ours.setblocking(False)
            server.add_connection(ours, Peer(pid=4242, uid=os.getuid(), gids=frozenset()))
        pairs[0][1].sendall(struct.pack(">I", 4) + b"boom")
        pairs[1][1].sendall(struct.pack(">I", 4) + b"fine")
        for _ in range(2):
            for key, mask in selector.select(1.0):
                key.data(mask)
        assert events["connection_errors"] == 1
        assert len(server.connections) == 1
        pairs[0][1].settimeout(2)
        assert pairs[0][1].recv(1) == b""  # closed
        pairs[1][1].settimeout(2)
        assert pairs[1][1].recv(4096)  # answered
        logged = [r.getMessage() for r in caplog.records if "unexpected error" in r.getMessage()]
        assert logged and f"uid {os.getuid()} pid 4242" in logged[0] and "KeyError" in logged[0]
    finally:
        server.drop_all()
        for _, theirs in pairs:
            theirs.close()
        selector.close()
