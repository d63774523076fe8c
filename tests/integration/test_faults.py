"""Faults, end to end: a wedged worker, kill -9 under load, EIO, EMFILE, ENOSPC.

The real daemon, real forked workers, real signals and real errors from the kernel
wherever one can be had: EIO from a sysfs attribute, EMFILE from a lowered
RLIMIT_NOFILE, ENOSPC from a tmpfs out of inodes. Only a worker stuck in I/O is
simulated (KVPREFETCHD_FAULTS, kvprefetchd/faults.py): a hung tier cannot be
summoned on demand. In every case the books balance: accepted = read + resident +
missing + rejected + failed + expired, per request and in total.

Figures for the record (kills injected, requests answered, detection time) are
written to figures.json in each test's tmp dir and printed (pytest -s shows them).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvharness.daemon import Daemon, start_cli
from kvharness.files import evict, make_file
from kvharness.fixtures import balanced, until
from kvharness.wire import RawConnection
from kvprefetchd.engines import URING_READ
from kvprefetchd.listeners.listening import ACCEPT_REST
from real_eio import real_eio

KIB = 1024
SETTLED = ("read", "resident", "missing", "rejected", "failed")


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "faults.toml"
    path.write_text(text)
    return str(path)


def record(tmp_path: Path, name: str, **figures: Any) -> None:
    """Keep a test's figures beside it (figures.json) and print them."""
    path = tmp_path / "figures.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    known[name] = figures
    path.write_text(json.dumps(known, indent=2, sort_keys=True))
    print(f"\n{name}: {json.dumps(figures, sort_keys=True)}")


def settled_stats(daemon: Daemon) -> dict[str, Any]:
    """Stats once every worker is up and nothing is in flight (fire-and-forget included)."""

    slots = daemon.call("ping")["workers"]

    def quiet() -> dict[str, Any] | None:
        stats: dict[str, Any] = daemon.call("stats")["stats"]
        workers = stats["workers"]
        ready = len(workers) == slots and all(w["ready"] for w in workers)
        return stats if ready and stats["files"]["in_flight"] == 0 else None

    stats: dict[str, Any] = until(quiet, "workers ready and nothing in flight")
    return stats


def no_fd_left(process: psutil.Process) -> None:
    """Lower RLIMIT_NOFILE (soft) to the process's lowest free fd number: its next open,
    accept or socketpair fails with EMFILE (the limit bounds fd numbers, not their count,
    so a hole below it would still be handed out)."""
    used = {int(name) for name in os.listdir(f"/proc/{process.pid}/fd")}
    lowest_free = min(set(range(len(used) + 1)) - used)
    process.rlimit(psutil.RLIMIT_NOFILE, (lowest_free, process.rlimit(psutil.RLIMIT_NOFILE)[1]))


def books_balance(stats: dict[str, Any]) -> bool:
    files = stats["files"]
    return bool(files["accepted"] == sum(files[k] for k in SETTLED) + files["in_flight"])


# ---- a worker wedged in I/O --------------------------------------------------------------------


def test_a_worker_hung_in_io_is_killed_by_the_heartbeat_and_replaced(
    daemon_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPREFETCHD_FAULTS", "worker_hang_on=HANG")
    d: Daemon = daemon_factory("--config", write_config(tmp_path, "worker_timeout = 2\n"))
    files = [str(make_file(d.root / f"h{i:02d}.bin", 64 * KIB)) for i in range(30)]
    hang = str(make_file(d.root / "HANG.bin", 4 * KIB))
    before = d.worker_pids()
    connection = d.connect()
    # Fire and forget: the worker whose shard holds HANG.bin never comes back from it...
    ack = connection.call("prefetch", paths=[hang, *files[:10]])
    assert ack["accepted"] == 11
    # ...so a waiting request's files on that worker hang behind it, until the heartbeat.
    reply = connection.call("prefetch", paths=files, wait=True, timeout_ms=60_000)
    assert balanced(reply) and reply["accepted"] == len(files), reply
    outcomes = reply["outcomes"]
    assert outcomes["failed"] > 0 and outcomes["expired"] == 0, reply
    assert outcomes["failed"] + outcomes["read"] + outcomes["resident"] == len(files), reply

    stats = settled_stats(d)
    assert stats["workers_killed_wedged"] == 1 and stats["worker_restarts"] == 1, stats
    after = d.worker_pids()
    replaced = [pid for pid in before if pid not in after]
    assert len(replaced) == 1  # the other worker, idle all the while, was left alone
    assert books_balance(stats) and stats["files"]["failed"] >= outcomes["failed"] + 1
    wedged = [line for line in d.log().splitlines() if "WARNING" in line and "wedged" in line]
    assert len(wedged) == 1 and "killed" in wedged[0] and str(replaced[0]) in wedged[0]
    until(lambda: not psutil.pid_exists(replaced[0]), "the wedged worker reaped")

    # The new worker serves its shard (HANG.bin is not asked for again).
    again = connection.call("prefetch", paths=files, wait=True, timeout_ms=60_000)
    assert balanced(again) and again["outcomes"]["read"] + again["outcomes"]["resident"] == 30
    assert d.call("stats")["stats"]["workers_killed_wedged"] == 1
    connection.close()
    record(tmp_path, "hang", worker_timeout_s=2.0,
           detected_after_s=reply["elapsed_us"] / 1e6, failed_in_reply=outcomes["failed"])


def test_a_slow_worker_that_reports_between_batches_is_not_killed(
    daemon_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each batch (one file) takes 0.4 s; 12 batches outlast worker_timeout twice over,
    # but the worker reports after each one: progress, not wedged. A batch engine's
    # worker is the one a slow native call silences (the queue's thread never blocks).
    if URING_READ.unavailable_reason() is not None:
        pytest.skip(f"io_uring unavailable: {URING_READ.unavailable_reason()}")
    monkeypatch.setenv("KVPREFETCHD_FAULTS", "worker_batch_sleep=0.4")
    config = write_config(tmp_path, "worker_timeout = 2\nbatch_files = 1\n")
    d: Daemon = daemon_factory("--config", config, "--workers", "1", "--engine", "io_uring")
    files = [str(make_file(d.root / f"s{i:02d}.bin", 16 * KIB)) for i in range(12)]
    reply = d.call("prefetch", paths=files, wait=True, timeout_ms=120_000)
    assert balanced(reply) and reply["outcomes"]["read"] + reply["outcomes"]["resident"] == 12
    assert reply["elapsed_us"] > 2 * 2_000_000  # longer than worker_timeout, by construction
    stats = d.call("stats")["stats"]
    assert stats["workers_killed_wedged"] == 0 and stats["worker_restarts"] == 0
    record(tmp_path, "slow", worker_timeout_s=2.0, busy_s=reply["elapsed_us"] / 1e6)


# ---- kill -9 at random moments under load ------------------------------------------------------


def test_kill_9_at_random_moments_under_load_answers_every_request_and_balances(
    daemon_factory: Any, tmp_path: Path
) -> None:
    rng = random.Random(20261202)
    d: Daemon = daemon_factory()
    paths = [str(make_file(d.root / f"c{i:03d}.bin", 64 * KIB)) for i in range(200)]
    stop = threading.Event()
    errors: list[str] = []
    lock = threading.Lock()
    tally: Counter[str] = Counter()

    def client(seed: int, wait: bool) -> None:
        pick = random.Random(seed)
        connection = d.connect()
        try:
            while not stop.is_set():
                batch = pick.sample(paths, pick.randint(1, 60))
                if wait:
                    reply = connection.call(
                        "prefetch", paths=batch, wait=True, timeout_ms=60_000
                    )
                else:
                    reply = connection.call("prefetch", paths=batch)
                ok = reply["ok"] and reply["rejected"] == 0 and (
                    reply["accepted"] + reply["dropped"] == len(batch)
                )
                with lock:
                    tally["waits" if wait else "acks"] += 1
                    tally["accepted"] += reply.get("accepted", 0)
                    tally["dropped"] += reply.get("dropped", 0)
                    if wait:
                        ok = ok and balanced(reply)
                        tally.update({f"wait_{k}": v for k, v in reply["outcomes"].items()})
                    if not ok:
                        errors.append(f"unbalanced or refused: {reply}")
                if not wait:
                    time.sleep(0.002)
        except Exception as error:  # a lost reply ends up here (socket timeout)
            errors.append(f"{type(error).__name__}: {error}")
        finally:
            connection.close()

    def evictor() -> None:
        """Keep the workers reading, not answering `resident` from the page cache."""
        pick = random.Random(1)
        while not stop.is_set():
            # written and synced by make_file; racing the workers' reads: not verified
            evict(pick.choice(paths), sync=False, verify=False)
            time.sleep(0.001)

    threads = [threading.Thread(target=client, args=(seed, seed < 3)) for seed in range(5)]
    threads.append(threading.Thread(target=evictor))
    for thread in threads:
        thread.start()
    killed: list[int] = []
    supervisor = psutil.Process(d.process.pid)
    try:
        for _ in range(12):
            time.sleep(rng.uniform(0.05, 0.5))
            live = sorted(pid for pid in alive(supervisor.children()) if pid not in killed)
            if not live:
                continue
            victim = rng.choice(live)  # possibly one still booting: that must hold too
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(90)
    assert not any(thread.is_alive() for thread in threads), "a client never got its reply"
    assert errors == []
    assert d.process.poll() is None and d.call("ping")["ok"]

    stats = settled_stats(d)
    files = stats["files"]
    assert books_balance(stats), files
    assert files["accepted"] == tally["accepted"] and files["dropped"] == tally["dropped"]
    assert stats["worker_restarts"] == len(killed) and stats["workers_killed_wedged"] == 0
    assert not set(d.worker_pids()) & set(killed) and len(d.worker_pids()) == 2
    assert len(killed) >= 10
    record(
        tmp_path, "kill9",
        kills_injected=len(killed), wait_replies=tally["waits"], acks=tally["acks"],
        files_accepted=files["accepted"], files_failed=files["failed"],
        files_read=files["read"], files_resident=files["resident"],
        failed_in_wait_replies=tally["wait_failed"], dropped=files["dropped"],
        books_balanced=True,
    )


def alive(processes: list[psutil.Process]) -> list[int]:
    """The live workers among the supervisor's children (not its scout, scout.py)."""
    pids = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            worker = "worker" in " ".join(process.cmdline())
            if worker and process.status() != psutil.STATUS_ZOMBIE:
                pids.append(process.pid)
    return pids


# ---- EIO ----------------------------------------------------------------------------------------


def test_a_read_that_fails_with_eio_is_failed_and_the_worker_lives(daemon_factory: Any) -> None:
    base, rel = real_eio()
    eio = os.path.join(base, rel)
    d: Daemon = daemon_factory("--root", base)
    good = [str(make_file(d.root / f"e{i}.bin", 32 * KIB)) for i in range(8)]
    pids = d.worker_pids()
    for _ in range(2):  # a failure is not remembered as warm: the second try reads again
        reply = d.call("prefetch", paths=[eio, *good], wait=True, timeout_ms=30_000)
        assert balanced(reply) and reply["accepted"] == 9, reply
        assert reply["outcomes"]["failed"] == 1, reply
        assert reply["outcomes"]["read"] + reply["outcomes"]["resident"] == 8, reply
    assert d.call("prefetch", paths=[eio])["accepted"] == 1  # fire and forget, too
    stats = settled_stats(d)
    assert stats["files"]["failed"] == 3 and books_balance(stats)
    assert d.worker_pids() == pids and stats["worker_restarts"] == 0
    assert "Input/output error" in d.log()


# ---- EMFILE -------------------------------------------------------------------------------------


def test_a_worker_out_of_fds_fails_its_files_lives_and_serves_once_the_limit_is_back(
    daemon_factory: Any,
) -> None:
    d: Daemon = daemon_factory("--workers", "1")
    phases = {
        name: [str(make_file(d.root / f"{name}{i:03d}.bin", 16 * KIB)) for i in range(n)]
        for name, n in (("a", 20), ("b", 150), ("c", 20))
    }
    (pid,) = d.worker_pids()
    first = d.call("prefetch", paths=phases["a"], wait=True)
    assert first["outcomes"]["read"] + first["outcomes"]["resident"] == 20, first

    worker = psutil.Process(pid)
    soft, hard = worker.rlimit(psutil.RLIMIT_NOFILE)
    no_fd_left(worker)
    try:
        # Load: five waiting requests pipelined on one connection, and fire-and-forget.
        connection = d.connect()
        waits = [phases["b"][i::5] for i in range(5)]
        for request_id, batch in enumerate(waits, start=10):
            connection.send({"v": 1, "id": request_id, "op": "prefetch", "paths": batch,
                             "wait": True, "timeout_ms": 30_000})
        fire = d.call("prefetch", paths=phases["c"])
        assert fire["accepted"] == 20
        replies = [connection.recv() for _ in waits]
        connection.close()
        before_lift = settled_stats(d)
    finally:
        worker.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    for reply in replies:
        assert balanced(reply) and reply["accepted"] == 30, reply
        assert reply["outcomes"]["failed"] == 30, reply  # every open failed: EMFILE
    assert before_lift["files"]["failed"] == 150 + 20 and books_balance(before_lift)
    assert "Too many open files" in d.log()

    after = d.call("prefetch", paths=phases["b"] + phases["c"], wait=True, timeout_ms=30_000)
    assert balanced(after) and after["outcomes"]["read"] + after["outcomes"]["resident"] == 170
    assert d.worker_pids() == [pid]
    stats = settled_stats(d)
    assert stats["worker_restarts"] == 0 and books_balance(stats)


def test_a_supervisor_out_of_fds_neither_spins_nor_dies_and_recovers(
    daemon_factory: Any,
) -> None:
    """Out of fds, accept(2) fails and the listener stays readable: the supervisor rests
    it instead of spinning, and lets the connections in once fds are back. A worker that
    dies then cannot be respawned (socketpair needs two fds): its shard stays empty (files
    dropped, counted), the daemon lives, and the worker comes back with the limit."""
    d: Daemon = daemon_factory()
    files = [str(make_file(d.root / f"m{i:02d}.bin", 16 * KIB)) for i in range(20)]
    held = d.connect()
    supervisor = psutil.Process(d.process.pid)
    soft, hard = supervisor.rlimit(psutil.RLIMIT_NOFILE)

    def no_fd_to_spare() -> None:
        """Once `held` is the only connection left (the others' closes processed), allow
        the supervisor not one fd more."""
        until(lambda: held.call("stats")["stats"]["connections"] == 1, "one connection")
        no_fd_left(supervisor)

    no_fd_to_spare()
    try:
        waiting = [RawConnection(d.socket_path) for _ in range(3)]  # in the backlog
        for connection in waiting:
            connection.send({"v": 1, "id": 7, "op": "ping"})
        time.sleep(2 * ACCEPT_REST)  # out of fds for two rests of the listener, at least
        assert held.call("ping")["ok"]  # the connections it has are served meanwhile
    finally:
        supervisor.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    assert d.log().count("cannot accept connections") == 1, "logged once, not per attempt"
    for connection in waiting:
        assert connection.recv()["ok"]
        connection.close()
    until(lambda: "accepting connections again" in d.log(), "the recovery logged")

    victim = d.worker_pids()[0]
    no_fd_to_spare()
    try:
        os.kill(victim, signal.SIGKILL)
        until(lambda: "cannot respawn" in d.log(), "the failed respawn logged")
        reply = held.call("prefetch", paths=files, wait=True, timeout_ms=30_000)
        assert balanced(reply) and reply["dropped"] > 0, reply
        assert reply["accepted"] + reply["dropped"] == len(files)
    finally:
        supervisor.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    assert d.process.poll() is None
    stats = settled_stats(d)  # the worker is back once a retry finds the fds
    assert victim not in d.worker_pids() and stats["worker_restarts"] == 1
    assert stats["events"]["accept_paused"] >= 2 and books_balance(stats)
    later = held.call("prefetch", paths=files, wait=True, timeout_ms=30_000)
    assert balanced(later) and later["accepted"] == len(files) and later["dropped"] == 0
    held.close()


# ---- ENOSPC -------------------------------------------------------------------------------------


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Any:
    """A tmpfs with no inode left: bind(2) of a Unix socket there fails with ENOSPC.

    The daemon only reads files; the sockets it binds are all it ever creates, so this
    is where ENOSPC can reach it.
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=3", "tmpfs",
                           str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        for i in range(10):
            try:
                (mount / f"filler{i}").touch()
            except OSError as error:
                assert error.errno == errno.ENOSPC
                break
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_no_space_for_the_socket_is_a_clean_exit_naming_the_path(
    tmp_path: Path, full_tmpfs: Path
) -> None:
    socket_path = full_tmpfs / "kvprefetchd.sock"
    d = start_cli(tmp_path, "--socket", str(socket_path), wait=False)
    assert d.process.wait(30) == 1
    assert f"cannot serve on {socket_path}: No space left on device" in d.log(), d.log()
    assert "Traceback" not in d.log()


def test_no_space_for_the_metrics_socket_names_that_socket(
    tmp_path: Path, full_tmpfs: Path
) -> None:
    metrics_path = full_tmpfs / "metrics.sock"
    config = write_config(tmp_path, f'metrics = "unix:{metrics_path}"\n')
    d = start_cli(tmp_path, "--config", config, wait=False)
    assert d.process.wait(30) == 1
    assert f"cannot serve on {metrics_path}: No space left on device" in d.log(), d.log()
    assert not os.path.exists(d.socket_path)  # the request socket it did bind is removed


# ---- graceful lifecycle -------------------------------------------------------------------------


def test_sigterm_lets_requests_in_progress_finish_within_the_drain(
    daemon_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPREFETCHD_FAULTS", "worker_batch_sleep=0.5")
    config = write_config(tmp_path, "batch_files = 1\ndrain_seconds = 30\n")
    d: Daemon = daemon_factory("--config", config, "--workers", "1")
    files = [str(make_file(d.root / f"d{i}.bin", 16 * KIB)) for i in range(4)]
    connection = d.connect()
    connection.send({"v": 1, "id": 5, "op": "prefetch", "paths": files, "wait": True,
                     "timeout_ms": 60_000})
    until(lambda: d.call("stats")["stats"]["files"]["in_flight"] > 0, "work queued")
    d.process.send_signal(signal.SIGTERM)
    reply = connection.recv()
    assert reply["id"] == 5 and balanced(reply), reply
    assert reply["outcomes"]["read"] + reply["outcomes"]["resident"] == 4, reply  # not expired
    assert d.process.wait(60) == 0
    assert not os.path.exists(d.socket_path)
    connection.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_while_draining_new_requests_are_refused_with_a_reply(
    daemon_factory: Any, tmp_path: Path, signum: int
) -> None:
    d: Daemon = daemon_factory("--config", write_config(tmp_path, "drain_seconds = 30\n"))
    pids = d.worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # the waiting request stays open: the drain goes on
    try:
        connection = d.connect()
        connection.send({"v": 1, "id": 1, "op": "prefetch", "wait": True, "timeout_ms": 60_000,
                         "paths": [str(make_file(d.root / "w.bin", 4 * KIB))]})
        until(lambda: d.call("stats")["stats"]["files"]["in_flight"] == 1, "queued")
        d.process.send_signal(signum)
        # The drain begins by closing the listener (and removing the socket file).
        until(lambda: not os.path.exists(d.socket_path), "the socket removed")
        refused = connection.call("ping")
        assert refused["ok"] is False and refused["error"]["code"] == "overloaded", refused
        assert "shutting down" in refused["error"]["message"]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    reply = connection.recv()  # the worker is back: the held request finishes in the drain
    assert reply["id"] == 1 and balanced(reply), reply
    assert d.process.wait(60) == 0
    connection.close()
