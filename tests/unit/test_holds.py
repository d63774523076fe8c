"""Held files: let go when another process opens them, when their time is up, or for room;
never more than the budget (holds.py, native/watch.c). Real files, real inotify, a real
second process as the consumer."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvprefetchd.native import load_native
from kvprefetchd.worker.closer import Closer
from kvprefetchd.worker.holds import Holds


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def files(tmp_path: Path, count: int) -> list[Path]:
    made = []
    for index in range(count):
        path = tmp_path / f"f{index}"
        path.write_bytes(b"x" * 4096)
        made.append(path)
    return made


def hold_all(holds: Holds, paths: list[Path]) -> None:
    for path in paths:
        holds.hold(path.name, os.open(path, os.O_RDONLY), path.stat().st_size)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_held_file_is_let_go_when_another_process_opens_it(tmp_path: Path) -> None:
    paths = files(tmp_path, 3)
    before = open_fds()
    holds = Holds(load_native(), max_files=10, max_bytes=1 << 20, seconds=60)
    assert holds.fileno() >= 0
    hold_all(holds, paths)
    assert len(holds) == 3 and open_fds() == before + 4  # and the inotify fd
    subprocess.run([sys.executable, "-c", f"open({str(paths[1])!r}, 'rb').read(1)"], check=True)

    def released() -> bool:
        holds.read_events()
        return paths[1].name not in holds

    wait_until(released, "the consumer's open let the file go")
    assert paths[0].name in holds and paths[2].name in holds
    assert holds.report() == {"hold_released_opened": 1, "held_total": 3}
    holds.close()
    assert open_fds() == before


def test_holds_expire_oldest_first_and_the_budget_lets_the_oldest_go(tmp_path: Path) -> None:
    now = [0.0]
    holds = Holds(load_native(), max_files=3, max_bytes=3 * 4096, seconds=10,
                  clock=lambda: now[0])
    paths = files(tmp_path, 5)
    hold_all(holds, paths[:3])
    now[0] = 5.0
    hold_all(holds, paths[3:])  # room for two more: the two oldest go
    assert [p.name in holds for p in paths] == [False, False, True, True, True]
    assert holds.next_due() == 5.0  # the oldest left was held at 0, for 10 s
    now[0] = 10.0
    holds.expire()
    assert [p.name in holds for p in paths] == [False, False, False, True, True]
    report = holds.report()
    assert report["hold_released_budget"] == 2 and report["hold_released_expired"] == 1
    # A file larger than the whole byte budget is refused, its fd closed.
    big = tmp_path / "big"
    big.write_bytes(b"y" * (4 * 4096))
    holds.settled()  # the three let go above are closed
    before = open_fds()
    assert not holds.hold("big", os.open(big, os.O_RDONLY), 4 * 4096)
    holds.settled()
    assert open_fds() == before and holds.report() == {"hold_refused": 1}
    holds.close()


def test_holding_again_replaces_and_no_budget_holds_nothing(tmp_path: Path) -> None:
    (path,) = files(tmp_path, 1)
    before = open_fds()
    holds = Holds(load_native(), max_files=4, max_bytes=1 << 20, seconds=60)
    hold_all(holds, [path, path])
    holds.settled()
    assert len(holds) == 1 and open_fds() == before + 2
    assert holds.report()["hold_released_replaced"] == 1
    holds.close()
    off = Holds(load_native(), max_files=0, max_bytes=0, seconds=60)
    assert not off.enabled and off.fileno() == -1
    assert not off.hold("x", os.open(path, os.O_RDONLY), 4096)
    off.settled()
    assert open_fds() == before



def test_a_close_that_blocks_holds_the_closer_not_its_caller() -> None:
    """Held fds are closed on the closer's thread (closer.py: a close on FUSE waits for the
    file system). A close that really blocks: a TCP socket lingering (SO_LINGER) over data
    its peer has not read. The caller gets on at once; the close ends when the peer reads."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        client.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                client.send(b"x" * 65536)
        client.setblocking(True)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 3))
        closer = Closer()
        closer.close(client.detach())
        assert closer.pending() == 1  # still in close(2), on the closer's thread
        with peer:
            while peer.recv(1 << 20):
                pass
        closer.wait()
        assert closer.pending() == 0
        closer.stop(5.0)
