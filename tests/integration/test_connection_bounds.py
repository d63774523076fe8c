"""Issue 14, item 7 (its last two findings): who may hold a connection, and for how long.

1,024 idle connections of one user locked everyone out (no per-peer cap, no idle
timeout), and a uid taken out of `allowed_uids` by a reload kept its open connections.
Other users are played by child processes that drop to their uid (root only).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bounds_attacks import frame, read_reply
from kvharness.daemon import Daemon
from kvharness.daemon import start_cli as start_daemon

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
NOBODY = pwd.getpwnam("nobody")

# Runs as argv[2]:argv[3]; opens argv[4] connections and pings on each; prints how many
# it holds and why the others were refused; then, per line read from stdin, pings on
# every held connection again and prints the replies' codes; EOF ends it.
HOLDER = r"""
import os, socket, struct, sys, msgpack
os.setgroups([int(g) for g in sys.argv[5].split(",") if g])
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[2]))
BODY = msgpack.packb({"v": 1, "id": 1, "op": "ping"})

def ping(s):
    try:
        s.sendall(struct.pack(">I", len(BODY)) + BODY)
        data = b""
        while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
            chunk = s.recv(65536)
            if not chunk:
                return "closed"
            data += chunk
    except OSError:
        return "closed"
    reply = msgpack.unpackb(data[4:])
    return "ok" if reply["ok"] else reply["error"]["code"]

held, refused = [], {}
for _ in range(int(sys.argv[4])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sys.argv[1])
    answer = ping(s)
    if answer == "ok":
        held.append(s)
    else:
        refused[answer] = refused.get(answer, 0) + 1
        s.close()
print(repr((len(held), refused)), flush=True)
for _ in sys.stdin:
    answers = {}
    for s in held:
        answer = ping(s)
        answers[answer] = answers.get(answer, 0) + 1
    print(repr(answers), flush=True)
"""


class Holder:
    """A child process of another user holding connections to the daemon."""

    def __init__(self, daemon: Daemon, uid: int, gid: int, count: int,
                 groups: tuple[int, ...] = ()) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, daemon.socket_path, str(uid), str(gid), str(count),
             ",".join(map(str, groups))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        held, self.refused = self.answer()
        self.held: int = held

    def answer(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, "the holder died"
        return eval(line)  # a repr printed by the test's own child

    def ping_again(self) -> dict[str, int]:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        answers: dict[str, int] = self.answer()
        return answers

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(30)


@pytest.fixture
def open_daemon() -> Iterator[Callable[[str], Daemon]]:
    """A daemon whose socket anyone may reach (as in test_peers.py): only the peer checks
    and the connection caps stand between other users and it."""
    base = Path(tempfile.mkdtemp(prefix="kvprefetchd-conns-", dir="/tmp"))
    os.chmod(base, 0o755)
    started: list[Daemon] = []
    holders: list[Holder] = []

    def start(extra: str = "") -> Daemon:
        config = base / "conns.toml"
        config.write_text(f"socket_mode = 0o666\n{extra}")
        daemon = start_daemon(base, "--config", str(config))
        os.chmod(Path(daemon.socket_path).parent, 0o755)
        started.append(daemon)
        return daemon

    start.holders = holders  # type: ignore[attr-defined]
    yield start
    for holder in holders:
        holder.close()
    for daemon in started:
        daemon.stop()
    shutil.rmtree(base, ignore_errors=True)


def hold(start: Any, daemon: Daemon, uid: int, count: int, **kwargs: Any) -> Holder:
    holder = Holder(daemon, uid, uid if uid != NOBODY.pw_uid else NOBODY.pw_gid, count, **kwargs)
    start.holders.append(holder)
    return holder


@as_root
def test_one_users_idle_connections_do_not_lock_out_the_others(
    open_daemon: Callable[[str], Daemon],
) -> None:
    d = open_daemon(f"allowed_uids = [{NOBODY.pw_uid}, 4243]\n")
    hog = hold(open_daemon, d, NOBODY.pw_uid, 1100)
    # Before: 1,024 held, and nobody else got a connection at all. (A refused peer whose
    # ping the daemon never read may see a reset before the `overloaded` reply: "closed".)
    assert hog.held == 128, (hog.held, hog.refused)
    assert sum(hog.refused.values()) == 1100 - 128 and "overloaded" in hog.refused, hog.refused
    assert set(hog.refused) <= {"overloaded", "closed"}, hog.refused
    assert d.call("ping")["ok"]  # root
    other = hold(open_daemon, d, 4243, 3)
    assert other.held == 3, other.refused
    stats = d.call("stats")["stats"]
    assert stats["connections"] == 128 + 3 + 1  # and the one asking
    assert stats["events"]["connections_refused"] == 1100 - 128


@as_root
def test_root_gets_a_ping_through_when_every_slot_is_taken(
    open_daemon: Callable[[str], Daemon],
) -> None:
    d = open_daemon("allowed_gids = [4242]\nmax_connections = 32\n"
                    "max_connections_per_uid = 8\n")
    for uid in range(4243, 4247):
        assert hold(open_daemon, d, uid, 8, groups=(4242,)).held == 8
    late = hold(open_daemon, d, 4247, 4, groups=(4242,))
    assert late.held == 0 and set(late.refused) <= {"overloaded", "closed"}, late.refused
    for _ in range(3):
        assert d.call("ping")["ok"]  # the reserve is root's and the daemon user's


@as_root
def test_a_reload_that_removes_a_uid_cuts_its_open_connections(
    open_daemon: Callable[[str], Daemon],
) -> None:
    d = open_daemon(f"allowed_uids = [{NOBODY.pw_uid}]\n")
    holder = hold(open_daemon, d, NOBODY.pw_uid, 3)
    assert holder.held == 3 and holder.ping_again() == {"ok": 3}
    config = Path(d.socket_path).parent.parent / "conns.toml"
    config.write_text("socket_mode = 0o666\n")
    d.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.log().count("configuration reloaded") < 1:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    answers = holder.ping_again()
    assert set(answers) <= {"forbidden", "closed"} and sum(answers.values()) == 3, answers
    assert d.call("stats")["stats"]["events"]["peers_revoked"] == 3
    assert d.call("ping")["ok"]


def test_an_idle_connection_is_closed_and_the_client_comes_back(
    daemon_factory: Any, tmp_path: Path
) -> None:
    config = tmp_path / "idle.toml"
    config.write_text("idle_timeout = 1\n")
    d: Daemon = daemon_factory("--config", str(config))
    from kvprefetch import Client

    with Client(d.socket_path) as client:
        assert client.ping()
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.settimeout(30)
        idle.connect(d.socket_path)
        idle.sendall(frame({"v": 1, "id": 1, "op": "ping"}))
        assert read_reply(idle)["ok"]
        assert idle.recv(1) == b""  # closed by the daemon once idle
        idle.close()
        assert client.ping()  # the client's own idle connection was closed too: it reconnects
    assert d.call("stats")["stats"]["events"]["connections_closed_idle"] >= 2
