"""Issue 23, finding 4, through the real daemon: a FUSE mount beneath a root hangs workers.

The probe (native/probe.c) judged "local" by the root's file system alone and then walked
into whatever was mounted beneath it, reopening names through /proc on the worker's own
thread; `check` looked files up there too. A FUSE server hung in a subdirectory of an
ext4 root so held both workers: 0 healthy files served for 60 s, and each `check` of one
file there cost a worker, until the stuck-worker cap left none for any root. Now the
probe and `check` stay on the root's own mount (RESOLVE_NO_XDEV): warm-ups of such names
go to the queue, whose threads wait and time out (`file_timeout`) instead of the worker,
and `check` answers them `failed`/`other_mount` at once without asking the server.

The second test is the queue's side of it: many names under the hung mount at once (one
fire-and-forget request of 1,100) queued ahead of the root's own files in the root's one
FIFO, each taking a thread once the one before it stalled: 0 of 16 healthy files served in
5 s, 192 stuck threads per worker. Now such names leave the root's lane for the queue's
other-mount lane (a few threads of its own, native/queue.c), and once those are all stuck
the lane answers `failed`/`mount_unresponsive` at once.

The hung server is the slow-tier simulator (bench/tiersim) with its stat hang: LOOKUP
and GETATTR under /hung/ never answered. Its dentries and attributes are cached for an
hour first, so that 0.3.0's probe walks straight to the files and its reopen meets the
hang (FUSE's permission check sends GETATTR once the hang dropped the attributes).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharness.attack import ListedRouter, Watch, assert_stops_within
from kvharness.daemon import Daemon, start_config
from kvharness.files import write_all
from kvharness.fixtures import mount_tier

KiB = 1 << 10
HUNG = 6                 # files behind the hung mount; 6 names reach both workers' shards
HEALTHY_PER_ROUND = 8    # new cold files (the queue reads them) and as many already read
WORKER_TIMEOUT = 3.0     # a worker silent this long while it owes outcomes is killed
ATTACK_SECONDS = WORKER_TIMEOUT + 3  # long enough for a held worker to be killed, twice
ROUND_SECONDS = 0.15     # one round of requests at most this often: ~40 rounds
CALL_TIMEOUT = 10.0      # a reply later than this: the daemon was held


@pytest.fixture
def hung_tier(tmp_path: Path) -> Iterator[tuple[Path, Any, list[str]]]:
    """An ext4 (or tmpfs) root with the simulator mounted at root/tier, whose /hung/ files
    answer no stat until released: (root, tier, the hung files' paths under the root)."""
    root, backing = tmp_path / "root", tmp_path / "backing"
    (backing / "hung").mkdir(parents=True)
    for i in range(HUNG):
        (backing / "hung" / f"h{i:02d}.bin").write_bytes(os.urandom(16 * KiB))
    with mount_tier(backing, root / "tier", entry_timeout=3600, attr_timeout=3600) as tier:
        hung = [str(root / "tier" / "hung" / f"h{i:02d}.bin") for i in range(HUNG)]
        for path in hung:
            os.stat(path)  # dentries and attributes cached: a cached walk reaches them
        yield root, tier, hung


def healthy_files(root: Path, count: int) -> list[str]:
    """Files of the root's own file system, not in the page cache."""
    (root / "kv").mkdir()
    return write_all((root / "kv" / f"f{i:04d}.bin" for i in range(count)), 16 * KiB)


def call(daemon: Daemon, op: str, **fields: Any) -> dict[str, Any]:
    """One request on a fresh connection that gives up after CALL_TIMEOUT."""
    started = time.monotonic()
    try:
        with daemon.connect(timeout=CALL_TIMEOUT) as connection:
            return connection.call(op, **fields)
    except TimeoutError:
        took = time.monotonic() - started
        raise AssertionError(f"{op} not answered in {took:.1f} s: a worker is held") from None


def test_a_hung_fuse_mount_beneath_a_root_never_holds_a_worker(
    tmp_path: Path, hung_tier: tuple[Path, Any, list[str]], listed_router: ListedRouter,
) -> None:
    """Warm-ups (waited for and fire-and-forget) and checks of files behind a hung FUSE
    mount, again and again, while the root's own files are asked for: those are served
    every round, checks of the hung files answer at once (`other_mount`), their warm-ups
    time out in the queue (`ETIMEDOUT`, or `mount_unresponsive` once the queue's lane for
    them is stuck), no worker is killed, SIGTERM stops the daemon in time with the server
    still hung; a listed TLS router keeps connecting throughout."""
    root, tier, hung = hung_tier
    healthy = healthy_files(root, int(ATTACK_SECONDS / ROUND_SECONDS + 4) * HEALTHY_PER_ROUND)
    daemon = start_config(tmp_path, {"roots": [str(root)], "workers": 2, "read_bytes": 16 * KiB,
                                     "worker_timeout": WORKER_TIMEOUT, "file_timeout": 1,
                                     "log_level": "info", **listed_router.settings()})
    served: Counter[str] = Counter()
    checked: Counter[str] = Counter()
    rounds = 0
    try:
        tier.hold("stat", "/hung/")
        with Watch(daemon, router=listed_router) as watch, daemon.connect(timeout=30) as waiting:
            started = time.monotonic()
            while time.monotonic() - started < ATTACK_SECONDS:
                time.sleep(max(0.0, started + rounds * ROUND_SECONDS - time.monotonic()))
                assert call(daemon, "prefetch", paths=hung)["accepted"] == HUNG
                waiting.request("prefetch", paths=hung, wait=True, timeout_ms=20_000)
                reply = call(daemon, "check", paths=[*hung, healthy[0]], details=True)
                for result in reply["results"]:  # in the workers' order
                    if result["path"] == healthy[0]:
                        assert result["state"] in ("resident", "cold"), result
                    else:
                        checked[f"{result['state']} {result.get('reason')}"] += 1
                fresh = healthy[(rounds + 1) * HEALTHY_PER_ROUND:][:HEALTHY_PER_ROUND]
                again = healthy[:HEALTHY_PER_ROUND]  # read already: the probe's
                reply = call(daemon, "prefetch", paths=[*fresh, *again], wait=True,
                             timeout_ms=int(CALL_TIMEOUT * 1000))
                outcomes = reply["outcomes"]
                assert outcomes["read"] + outcomes["resident"] == 2 * HEALTHY_PER_ROUND, (
                    rounds, reply)
                served.update({k: v for k, v in outcomes.items() if v})
                rounds += 1
            timed_out: Counter[str] = Counter()
            for _ in range(rounds):
                reply = waiting.recv()
                assert reply["outcomes"]["failed"] == HUNG, reply
                timed_out.update(failure["reason"] for failure in reply["failures"])
        figures = watch.assert_held()
        print(f"rounds={rounds} served={dict(served)} checked={dict(checked)} "
              f"hung warm-ups={dict(timed_out)} ping p99={figures.ping_p99_ms:.1f} ms")
        assert checked == {"failed other_mount": HUNG * rounds}
        # Timed out in the queue's other-mount lane, or, once its few threads were all
        # stuck there, refused by it at once.
        assert sum(timed_out.values()) == HUNG * rounds, timed_out
        assert timed_out["ETIMEDOUT"] > 0, timed_out
        assert set(timed_out) <= {"ETIMEDOUT", "mount_unresponsive"}, timed_out
        stats = daemon.stats()
        assert stats["workers_killed_wedged"] == 0 and stats["stuck"] == [], stats
        # Both workers had hung files, and their queues, not they, waited on the server.
        assert all(w["queue"].get("timed_out", 0) > 0 for w in stats["workers"]), stats["workers"]
        print("queues:", [w["queue"] for w in stats["workers"]])
        assert tier.stats().held > 0  # the queue's threads wait on the server, not the workers
        assert_stops_within(daemon, 6.0)
    finally:
        tier.release()
        daemon.kill()


BURST = 1_100             # fire-and-forget names under the hung mount, in one request
HEALTHY_WAITED = 16       # the root's own cold files asked for (and waited on) each round
STARVE_SECONDS = 5.0      # rounds go on this long after the burst reached the mount
WAIT_MS = 5_000           # each round's wait: 0.3.0 served none of them within it
OTHER_MOUNT_THREADS = 4   # the other-mount lane's threads per worker (the default)
# A worker's threads at most, over its own before the attack: the root's lane reading the
# healthy files (up to twice the initial depth of 16 once it grows), the other-mount
# lane's, and a few spare. 0.3.0's stuck threads grew by 16 every 2 s, to 192 in 23 s.
THREADS_ABOVE_IDLE = 2 * 16 + OTHER_MOUNT_THREADS + 4


def threads_of(pid: int) -> int:
    """The thread count of a process, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for {pid}")


@pytest.mark.parametrize(("burst_size", "settings"), [
    (BURST, {}),                       # the defaults: max_in_flight 512, file_timeout 60 s
    (40, {"max_in_flight": 8}),        # 0.3.0 starved as well with a small thread cap
], ids=["defaults", "max_in_flight-8"])
def test_names_under_a_hung_mount_never_starve_the_roots_own_files(
    tmp_path: Path, hung_tier: tuple[Path, Any, list[str]], burst_size: int,
    settings: dict[str, Any], listed_router: ListedRouter,
) -> None:
    """1,100 names under a hung FUSE mount beneath the root, fire and forget, then the
    root's own cold files, waited for, round after round: each round is served within its
    wait (read or resident), the workers' threads stay bounded (the other-mount lane holds
    at most its few stuck threads), fresh names under the mount fail fast
    (`mount_unresponsive`) once that lane is stuck, and the daemon holds and stops in
    time, a listed TLS router connecting throughout. And 40 such names with
    max_in_flight 8."""
    root, tier, _ = hung_tier
    backing = tier.backing / "hung"
    names = [f"b{i:04d}.bin" for i in range(burst_size + 2 * HEALTHY_WAITED)]
    for name in names:
        (backing / name).write_bytes(b"x" * KiB)
    under = [str(root / "tier" / "hung" / name) for name in names]
    burst, fresh = under[:burst_size], under[burst_size:]
    rounds_at_most = int(STARVE_SECONDS / ROUND_SECONDS) + 2
    healthy = healthy_files(root, rounds_at_most * HEALTHY_WAITED)
    daemon = start_config(tmp_path, {"roots": [str(root)], "workers": 2, "read_bytes": 16 * KiB,
                                     "log_level": "info", **settings,
                                     **listed_router.settings()})
    served: Counter[str] = Counter()
    rounds = 0
    try:
        pids = daemon.worker_pids()
        before = {pid: threads_of(pid) for pid in pids}
        peak = dict(before)
        tier.hold("stat", "/hung/")
        with Watch(daemon, router=listed_router) as watch:
            assert call(daemon, "prefetch", paths=burst)["accepted"] == burst_size
            tier.wait_held(1)  # the burst has reached the mount
            started = time.monotonic()
            while time.monotonic() - started < STARVE_SECONDS:
                time.sleep(max(0.0, started + rounds * ROUND_SECONDS - time.monotonic()))
                batch = healthy[rounds * HEALTHY_WAITED:(rounds + 1) * HEALTHY_WAITED]
                reply = call(daemon, "prefetch", paths=batch, wait=True, timeout_ms=WAIT_MS)
                outcomes = reply["outcomes"]
                assert outcomes["read"] + outcomes["resident"] == HEALTHY_WAITED, (
                    f"round {rounds}, {time.monotonic() - started:.1f} s after the burst: "
                    f"{reply}")
                served.update({k: v for k, v in outcomes.items() if v})
                for pid in pids:
                    peak[pid] = max(peak[pid], threads_of(pid))
                rounds += 1
            # The lane's threads have been stuck for longer than its stall time: names
            # under the mount not already out are answered at once, not in file_timeout.
            reply = call(daemon, "prefetch", paths=fresh, wait=True,
                         timeout_ms=int(CALL_TIMEOUT * 1000))
            reasons = Counter(failure["reason"] for failure in reply["failures"])
            stats = daemon.stats()
        figures = watch.assert_held()
        queues = [w["queue"] for w in stats["workers"]]
        print(f"rounds={rounds} served={dict(served)} fresh={dict(reasons)} "
              f"threads before={before} peak={peak} held={tier.stats().held} "
              f"ping p99={figures.ping_p99_ms:.1f} ms queues={queues}")
        assert reasons == {"mount_unresponsive": len(fresh)}, reply
        for pid in pids:
            assert peak[pid] <= before[pid] + THREADS_ABOVE_IDLE, (pid, before, peak)
        for queue in queues:
            assert 0 < queue["other_mount_stuck"] <= OTHER_MOUNT_THREADS, queues
            assert queue["other_mount_refused"] > 0, queues
        assert tier.stats().held <= 2 * OTHER_MOUNT_THREADS  # only the lane's threads wait there
        assert stats["workers_killed_wedged"] == 0 and stats["stuck"] == [], stats
        assert_stops_within(daemon, 6.0)
    finally:
        tier.release()
        daemon.kill()
