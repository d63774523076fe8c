"""Peer checks: who is on the other end, as SO_PEERCRED and SO_PEERGROUPS say."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvharness
from kvharness.daemon import Daemon, start_cli

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")

NOBODY = pwd.getpwnam("nobody")
CLIENT = r"""
import os, socket, sys
sys.path.insert(0, sys.argv[5])  # the harness, imported before the privileges go
from kvharness.wire import FrameSplitter, pack, unpack
groups = [int(g) for g in sys.argv[2].split(",") if g]
os.setgroups(groups)
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[4]))
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
try:
    s.sendall(pack({"v": 1, "id": 7, "op": "ping"}))
except (BrokenPipeError, ConnectionResetError):
    pass  # a refused peer may be closed before it writes: its forbidden reply is queued
frames, replies = FrameSplitter(), []
while not replies:
    try:
        chunk = s.recv(65536)
    except ConnectionResetError:
        break
    if not chunk:
        break
    replies = frames.bodies(chunk)
reply = unpack(replies[0]) if replies else None
s.settimeout(1)
try:
    closed = s.recv(65536) == b""
except ConnectionResetError:  # closed with our request unread: a reset, still closed
    closed = True
except TimeoutError:
    closed = False
print(repr((reply, closed)))
"""


def ping_as(daemon: Daemon, uid: int, gid: int, groups: tuple[int, ...] = ()) -> Any:
    result = subprocess.run(
        [sys.executable, "-c", CLIENT, daemon.socket_path, ",".join(map(str, groups)),
         str(gid), str(uid), str(Path(kvharness.__file__).resolve().parents[1])],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert result.returncode == 0, result.stderr
    return eval(result.stdout)  # a repr printed by the test's own client


@pytest.fixture
def open_daemon() -> Iterator[Callable[[str], Daemon]]:
    """A daemon whose socket anyone may reach (mode 0666 in a 0755 directory outside
    pytest's private tmp): only the peer check stands between a stranger and it."""
    base = Path(tempfile.mkdtemp(prefix="kvprefetchd-peers-", dir="/tmp"))
    os.chmod(base, 0o755)
    started: list[Daemon] = []

    def start(extra: str = "") -> Daemon:
        config = base / "peers.toml"
        config.write_text(f"socket_mode = 0o666\n{extra}")
        daemon = start_cli(base, "--config", str(config))
        os.chmod(Path(daemon.socket_path).parent, 0o755)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
    shutil.rmtree(base, ignore_errors=True)


def test_a_stranger_is_forbidden_and_the_daemon_goes_on(
    open_daemon: Callable[[str], Daemon],
) -> None:
    d = open_daemon("")
    reply, closed = ping_as(d, NOBODY.pw_uid, NOBODY.pw_gid)
    assert reply["ok"] is False and reply["error"]["code"] == "forbidden", reply
    assert closed
    assert d.call("ping")["ok"]
    assert d.call("stats")["stats"]["events"]["peers_forbidden"] == 1


def test_allowed_uids_and_supplementary_groups_let_peers_in(
    open_daemon: Callable[[str], Daemon],
) -> None:
    d = open_daemon(f"allowed_uids = [{NOBODY.pw_uid}]\nallowed_gids = [4242]\n")
    reply, _ = ping_as(d, NOBODY.pw_uid, NOBODY.pw_gid)
    assert reply["ok"], reply
    # uid 4243 is named nowhere; its supplementary group 4242 is allowed.
    reply, _ = ping_as(d, 4243, 4243, groups=(4242,))
    assert reply["ok"], reply
    reply, _ = ping_as(d, 4243, 4243, groups=(4244,))
    assert reply["error"]["code"] == "forbidden"
