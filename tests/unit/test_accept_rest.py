"""AcceptRest: the one rule every listener follows when it runs out of fds."""

from __future__ import annotations

import errno
import logging

import pytest

from kvprefetchd.listeners.listening import ACCEPT_REST, AcceptRest


def test_an_episode_is_logged_once_at_its_start_and_once_at_its_end(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    rest = AcceptRest("tcp", logging.getLogger("test.accept"), lambda: now[0])
    error = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # three rests in a row: one episode
            rest.begin(error)
            assert rest.until == now[0] + ACCEPT_REST
            assert not rest.over(now[0])
            now[0] += ACCEPT_REST
            assert rest.over(now[0]) and not rest.over(now[0])  # true once per rest
        rest.accepted()
        rest.accepted()  # no episode: nothing more to say
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "tcp: cannot accept connections: Too many open files; they wait in the backlog "
        f"(pausing accept {ACCEPT_REST:.1f} s at a time)",
        f"tcp: accepting connections again after {3 * ACCEPT_REST:.1f} s out of file "
        "descriptors",
    ]
