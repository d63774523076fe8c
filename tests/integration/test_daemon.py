"""The real daemon, end to end: real socket, forked workers, real files, real page cache."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvharness.daemon import Daemon, cpu_seconds, start_cli, write_config
from kvharness.files import evict, make_file
from kvharness.fixtures import balanced, until
from kvharness.pagecache import assert_warmed, drops, pinned, resident_bytes
from kvharness.wire import HEADER
from kvprefetchd.protocol import OUTCOMES as PROTOCOL_OUTCOMES
from open_audit import OpenAudit

MIB = 1 << 20
OUTCOMES = set(PROTOCOL_OUTCOMES)  # every outcome name, zeros included


def test_ping_reports_engine_and_workers(daemon: Daemon) -> None:
    reply = daemon.call("ping")
    assert reply["ok"] and reply["protocol"] == 1 and reply["workers"] == 2
    assert reply["engine"] in {"io_uring", "fadvise", "pread"}
    for index, pid in enumerate(daemon.worker_pids()):
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
        assert title.decode() == f"kvprefetchd: worker {index}"


def test_socket_is_created_with_mode_0660(daemon: Daemon) -> None:
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o660


@pytest.mark.parametrize("engine", ["pread", "fadvise", "io_uring"])
def test_wait_warms_cold_heads_then_reports_them_resident(
    daemon_factory: Any, tmp_path: Path, engine: str
) -> None:
    if engine == "io_uring" and (why := uring_unavailable()):
        pytest.skip(f"io_uring unavailable here: {why}")
    d: Daemon = daemon_factory("--engine", engine)
    head = 1 * MIB
    sizes = [4 * MIB] * 40 + [300 * 1024, 5000, 1, 0, head, head + 1]
    files = [make_file(d.root / f"m_r0/{i:03x}/{i:02x}_g0/{i:064x}.bin", s)
             for i, s in enumerate(sizes)]
    assert sum(resident_bytes(f, min(f.stat().st_size, head)) for f in files) == 0

    paths = [str(f) for f in files]
    since = drops()
    reply = d.call("prefetch", paths=paths, wait=True, read_bytes=head, timeout_ms=60_000)
    assert reply["ok"], reply
    assert reply["accepted"] == len(files) and reply["dropped"] == reply["rejected"] == 0
    assert set(reply["outcomes"]) == OUTCOMES and balanced(reply)
    assert reply["outcomes"]["read"] + reply["outcomes"]["resident"] == len(files)
    assert reply["outcomes"]["read"] >= len(files) - 1  # the empty file may count as resident
    # Every head page up to date (mincore), or taken by the host's reclaimer since.
    assert_warmed(paths, head, since=since)

    with pinned(paths, head) as pin:  # what the reclaimer took is read back, then held
        before = d.call("stats")["stats"]["bytes_read"]
        pin.require_all()
        again = d.call("prefetch", paths=paths, wait=True, read_bytes=head)
        read_again = d.call("stats")["stats"]["bytes_read"] - before
    assert again["outcomes"]["resident"] == len(files), again
    assert read_again <= 2 * head  # ~nothing read again


def test_resident_check_uses_the_page_cache_not_recent_memory(
    daemon_factory: Any, tmp_path: Path
) -> None:
    # No dedup memory (dedup_ttl_ms 0): the next answer comes from cachestat.
    d: Daemon = daemon_factory("--engine", "pread", settings={"dedup_ttl_ms": 0})
    files = [make_file(d.root / f"f{i}.bin", 2 * MIB) for i in range(8)]
    paths = [str(f) for f in files]
    assert d.call("prefetch", paths=paths, wait=True)["outcomes"]["read"] == 8
    for f in files:
        evict(f)
    reply = d.call("prefetch", paths=paths, wait=True)
    assert reply["outcomes"]["read"] == 8, reply


def test_missing_files_are_missing(daemon: Daemon) -> None:
    reply = daemon.call(
        "prefetch",
        paths=[str(daemon.root / "nope.bin"), str(daemon.root / "no/such/dir/x.bin")],
        wait=True,
    )
    assert reply["outcomes"]["missing"] == 2 and balanced(reply)


def test_escapes_and_special_files_are_rejected_and_no_device_opened(
    daemon: Daemon, tmp_path: Path
) -> None:
    root = daemon.root
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = make_file(outside / "secret.bin", 8192)
    (root / "abs-link.bin").symlink_to(secret)
    (root / "sub").mkdir()
    (root / "sub" / "rel-link.bin").symlink_to("../../outside/secret.bin")
    (root / "dir-link").symlink_to(outside)
    (root / "proc-link").symlink_to("/proc/self/root" + str(secret))
    os.mkfifo(root / "fifo")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(root / "sock"))
    specials = ["fifo", "sock"]
    if os.geteuid() == 0:
        os.mknod(root / "null-dev", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        specials.append("null-dev")
    inside = make_file(root / "real.bin", 8192)
    (root / "inner-link.bin").symlink_to("real.bin")

    audit = OpenAudit(outside, root)
    try:
        escapes = [
            str(root / "abs-link.bin"),
            str(root / "sub" / "rel-link.bin"),
            str(root / "dir-link" / "secret.bin"),
            str(root / "proc-link"),
            str(root / "sub"),
            *[str(root / name) for name in specials],
        ]
        lexical = [
            str(secret),
            "relative/path.bin",
            str(root) + "/a/../../outside/secret.bin",
            str(root / ".." / "outside" / "secret.bin"),
        ]
        reply = daemon.call("prefetch", paths=escapes + lexical, wait=True, timeout_ms=10_000)
        assert reply["rejected"] == len(lexical), reply
        assert reply["outcomes"]["rejected"] == len(escapes), reply
        assert balanced(reply)
        follow = daemon.call("prefetch", paths=[str(root / "inner-link.bin")], wait=True)
        assert follow["outcomes"]["read"] == 1, follow
        opened = audit.events()
    finally:
        audit.close()
        listener.close()
    assert secret not in opened
    for name in specials:
        # The probe, beneath the root's nodev view, may open the FIFO without waiting and
        # close it unread (check_before_open; test_path_attacks.py runs both ways); no
        # device is ever opened, and a socket cannot be.
        assert root / name not in opened or name == "fifo"
    assert inside in opened  # the audit does see real opens


def test_malformed_frames_get_errors_and_the_connection_lives(daemon: Daemon) -> None:
    pids = daemon.worker_pids()
    connection = daemon.connect()
    cases: list[tuple[bytes, str]] = [
        (b"\xc1", "bad_request"),
        (b"\x93\x01", "bad_request"),
        (msgpack.packb([1, 2, 3]), "bad_request"),
        (msgpack.packb({"v": 1, "op": "ping"}), "bad_request"),
        (msgpack.packb({"v": 1, "id": 5, "op": "prefetch", "paths": "/x"}), "bad_request"),
        (msgpack.packb({"v": 1, "id": 6, "op": "prefetch", "paths": [], "wait": "yes"}),
         "bad_request"),
        (msgpack.packb({"v": 1, "id": 7, "op": "defrag"}), "unknown_op"),
        (msgpack.packb({"v": 9, "id": 8, "op": "ping"}), "unsupported_version"),
        (msgpack.packb({"v": 1, "id": 9, "op": "prefetch", "paths": [], "read_bytes": 1 << 40}),
         "bad_request"),
    ]
    for body, code in cases:
        connection.send_frame(body)
        reply = connection.recv()
        assert reply["ok"] is False and reply["error"]["code"] == code, (body, reply)
        assert reply["error"]["message"]
        assert connection.call("ping")["ok"]
    # An oversized frame: refused by its header, its body skipped, the connection kept.
    connection.sock.sendall(HEADER.pack(17 << 20))
    chunk = b"\0" * (1 << 20)
    for _ in range(17):
        connection.sock.sendall(chunk)
    reply = connection.recv()
    assert reply["error"]["code"] == "too_large"
    assert connection.call("ping")["ok"]
    connection.close()
    assert daemon.worker_pids() == pids


def test_pipelined_requests_are_answered_by_id(daemon: Daemon) -> None:
    connection = daemon.connect()
    for request_id in range(100, 110):
        connection.send({"v": 1, "id": request_id, "op": "ping"})
    assert sorted(connection.recv()["id"] for _ in range(10)) == list(range(100, 110))
    connection.close()


def test_ack_of_1000_paths_waits_for_no_io(daemon: Daemon) -> None:
    pids = daemon.worker_pids()
    paths = [str(daemon.root / f"{i:064x}.bin") for i in range(1000)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # no worker can do any I/O now
    try:
        reply = daemon.call("prefetch", paths=paths)
        assert reply.pop("room") > 0
        assert reply == {"id": 1, "ok": True, "accepted": 1000, "dropped": 0, "rejected": 0}
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def test_a_full_queue_drops_instead_of_blocking(daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text("queue_limit = 10\n")
    d: Daemon = daemon_factory("--config", str(config), "--workers", "1")
    (pid,) = d.worker_pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        reply = d.call("prefetch", paths=[str(d.root / f"{i}.bin") for i in range(25)])
        assert (reply["accepted"], reply["dropped"]) == (10, 15)
        assert d.call("stats")["stats"]["workers"][0]["queue_depth"] == 10
    finally:
        os.kill(pid, signal.SIGCONT)


def test_kill_9_of_a_worker_fails_its_files_and_it_comes_back(daemon_factory: Any) -> None:
    # No dedup memory (dedup_ttl_ms 0): the files are read again at the end.
    daemon: Daemon = daemon_factory(settings={"dedup_ttl_ms": 0})
    files = [make_file(daemon.root / f"k{i}.bin", 64 * 1024) for i in range(40)]
    pids = daemon.worker_pids()
    victim = pids[0]
    os.kill(victim, signal.SIGSTOP)  # its files stay outstanding until it dies
    connection = daemon.connect()
    connection.send({"v": 1, "id": 1, "op": "prefetch", "paths": [str(f) for f in files],
                     "wait": True, "timeout_ms": 30_000})
    until(lambda: daemon.stats()["files"]["accepted"] == len(files), "the request accepted")
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    reply = connection.recv()
    assert reply["ok"] and balanced(reply), reply
    assert reply["outcomes"]["failed"] > 0
    assert reply["outcomes"]["failed"] + reply["outcomes"]["read"] == len(files)
    while True:
        stats = daemon.call("stats")["stats"]
        workers = stats["workers"]
        if all(w["ready"] for w in workers) and victim not in [w["pid"] for w in workers]:
            break
        assert time.monotonic() - killed_at < 2.0, stats
        time.sleep(0.02)
    assert stats["worker_restarts"] == 1
    for f in files:
        evict(f)
    later = daemon.call("prefetch", paths=[str(f) for f in files], wait=True)
    assert later["outcomes"]["read"] + later["outcomes"]["resident"] == len(files), later
    connection.close()


def test_wait_timeout_expires_what_is_not_done(daemon: Daemon) -> None:
    files = [make_file(daemon.root / f"t{i}.bin", 4096) for i in range(10)]
    pids = daemon.worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        reply = daemon.call("prefetch", paths=[str(f) for f in files], wait=True, timeout_ms=200)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert reply["outcomes"]["expired"] == 10 and balanced(reply)
    assert reply["elapsed_us"] >= 200_000


def test_sigterm_answers_waiting_requests_exits_0_and_removes_the_socket(
    daemon: Daemon,
) -> None:
    pids = daemon.worker_pids()
    os.kill(pids[0], signal.SIGSTOP)
    paths = [str(make_file(daemon.root / f"s{i}.bin", 4096)) for i in range(20)]
    with daemon.connect() as connection:
        connection.send({"v": 1, "id": 3, "op": "prefetch", "paths": paths, "wait": True})
        until(lambda: daemon.stats()["files"]["accepted"] == len(paths), "the request accepted")
        started = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        reply = connection.recv()
    assert reply["id"] == 3 and balanced(reply)
    assert daemon.process.wait(5) == 0
    assert time.monotonic() - started < 5
    assert not os.path.exists(daemon.socket_path)
    for pid in pids:
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text()


def test_stale_socket_is_replaced_and_a_live_one_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(run / "kvprefetchd.sock"))
    stale.close()  # bound, never listening: a leftover from a crash
    first = start_cli(tmp_path)
    try:
        second = start_cli(tmp_path, wait=False)
        assert second.process.wait(30) == 1
        assert "another kvprefetchd is serving" in second.log()
        assert first.call("ping")["ok"]
    finally:
        assert first.stop() == 0


def test_a_worker_that_cannot_boot_halts_the_daemon(tmp_path: Path) -> None:
    d = start_cli(tmp_path, wait=False, env={"KVPREFETCHD_FAULTS": "worker_boot_fails"})
    assert d.process.wait(30) == 1
    assert "could not boot" in d.log() and "boot failure injected" in d.log()
    assert not os.path.exists(d.socket_path)


def test_stats_books_balance_after_mixed_traffic(daemon: Daemon) -> None:
    good = [str(make_file(daemon.root / f"b{i}.bin", 8192)) for i in range(5)]
    daemon.call("prefetch", paths=[*good, "/etc/passwd", str(daemon.root / "gone.bin")],
                wait=True)
    files = daemon.call("stats")["stats"]["files"]
    settled = sum(files[k] for k in ("read", "resident", "missing", "rejected", "failed"))
    assert files["accepted"] == settled + files["in_flight"]
    assert files["rejected_by_supervisor"] == 1


def uring_unavailable() -> str | None:
    from kvprefetchd.engines import URING_READ

    return URING_READ.unavailable_reason()


@pytest.mark.parametrize(("engine", "expected"), [("io_uring", "io_uring"),
                                                  ("pread", "pread"), ("fadvise", "fadvise")])
def test_ping_reports_the_engine_in_use(daemon_factory: Any, engine: str, expected: str) -> None:
    if engine == "io_uring" and (why := uring_unavailable()):
        pytest.skip(f"io_uring unavailable here: {why}")
    d: Daemon = daemon_factory("--engine", engine)
    assert d.call("ping")["engine"] == expected


def test_auto_picks_the_engine_that_measured_fastest(daemon_factory: Any) -> None:
    # bench/run: the queue's threads, whose depth follows the file system, beat io_uring
    # on the local disk and on the slow tier, in both warm modes (engines/__init__.py).
    reads: Daemon = daemon_factory()
    assert reads.call("ping")["engine"] == "pread"
    reads.stop()
    advice: Daemon = daemon_factory("--warm-mode", "advise")
    assert advice.call("ping")["engine"] == "fadvise"


def test_advise_mode_confirms_heads_resident(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory("--engine", "auto", "--warm-mode", "advise")
    files = [make_file(d.root / f"a{i}.bin", 3 * MIB) for i in range(20)]
    since = drops()
    reply = d.call("prefetch", paths=[str(f) for f in files], wait=True)
    assert reply["outcomes"]["read"] == 20, reply
    assert_warmed(files, MIB, since=since)  # up to date, or reclaimed since


def test_stats_carry_process_figures_per_worker(daemon_factory: Any, tmp_path: Path) -> None:
    # Without its dedup memory a worker reads a file every time it is asked to; CPU time
    # is counted in clock ticks (proc(5) utime, stime), so it works until every worker
    # has been charged some, or the figure could not tell work from none.
    config = write_config(tmp_path / "no-dedup.toml", {"dedup_ttl_ms": 0})
    d: Daemon = daemon_factory("--config", str(config))
    files = [make_file(d.root / f"c{i}.bin", MIB) for i in range(32)]
    pids = d.worker_pids()
    for _ in range(100):
        if all(cpu_seconds(pid) > 0 for pid in pids):
            break
        for f in files:
            evict(f)
        reply = d.call("prefetch", paths=[str(f) for f in files], wait=True)
        assert reply["outcomes"]["read"] == len(files), reply
    before = {pid: cpu_seconds(pid) for pid in pids}
    assert all(before.values()), f"100 rounds of reads and a worker was charged no CPU: {before}"
    stats = d.call("stats")["stats"]
    after = {pid: cpu_seconds(pid) for pid in pids}
    assert [w["pid"] for w in stats["workers"]] == pids
    for worker in stats["workers"]:
        assert worker["rss_bytes"] > 1 << 20 and worker["open_fds"] >= 3
        # The worker's own CPU time, read between our two readings (rounded to 1 ms).
        pid = worker["pid"]
        assert before[pid] - 0.001 <= worker["cpu_seconds"] <= after[pid] + 0.001, (
            worker, before[pid], after[pid])
    assert stats["supervisor"]["pid"] == d.process.pid
    assert stats["supervisor"]["open_fds"] >= 4
    assert 0 < stats["supervisor"]["cpu_seconds"] <= cpu_seconds(d.process.pid) + 0.001


def test_an_exiting_daemon_leaves_a_later_daemons_socket_alone(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """The socket's directory removed under a running daemon, a second one binds the same
    path: when the first exits it must not unlink the second's socket."""
    first: Daemon = daemon_factory()
    run_dir = Path(first.socket_path).parent
    shutil.rmtree(run_dir)
    second: Daemon = daemon_factory(root=tmp_path / "kv2")
    assert second.socket_path == first.socket_path
    assert first.stop() == 0
    assert os.path.exists(second.socket_path) and second.call("ping")["ok"]
