"""Issue 23, finding 2 and the CLI half of finding 9, through the real daemon and the real CLI.

Finding 2: a `deadline_ms` of 2**44 or more (or a `deadline_unix_ms` as far) was accepted,
and the worker that met a cold file of it died converting it to int64 nanoseconds; ten
such 150-byte requests a second cost 189 worker restarts in 10 s and another client 30%
of its files as `worker_lost`. Now every numeric field of every op is bounded where the
request is parsed: `bad_request` naming the field and its range, and no worker sees it.

Finding 9 (CLI): a list line over 16 MiB was dropped with exit 0, and `kvprefetch warm -f
/dev/zero` grew without bound. Now a line is at most PATH_MAX bytes (exit 2, naming the
line), read in chunks, so memory stays flat whatever the input.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvharness.attack import ListedRouter, Watch, assert_stops_within
from kvharness.daemon import Daemon, start_config
from kvharness.files import evict, make_file
from kvharness.pagecache import resident_bytes

KiB = 1 << 10
DAY_MS = 86_400_000
HASH = {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
        "vllm_version": "0.23.0"}
# The real console script of this venv (the daemon's and the CLI's PYTHONPATH is inherited,
# so a run against /tmp/base runs that tree's CLI).
CLI = str(Path(sys.executable).with_name("kvprefetch"))


def start(tmp_path: Path, **settings: Any) -> tuple[Daemon, Path]:
    root = tmp_path / "kv"
    root.mkdir()
    daemon = start_config(tmp_path, {"roots": [str(root)], "workers": 2, "read_bytes": 4 * KiB,
                                     "allow_evict": True, **settings})
    return daemon, root


def cold(root: Path, name: str, count: int, size: int = 64 * KiB) -> list[str]:
    """Files on disk that are not in the page cache: a worker's engine must read them."""
    return [str(make_file(root / name / f"{i:04d}.bin", size)) for i in range(count)]


def inline_layout(root: Path, **extra: Any) -> dict[str, Any]:
    return {"root_dir": str(root), "model_name": "org/model", "fingerprint": "0123456789ab",
            "kv_cache_groups": [{"block_size": 16}], "connector_block_size_tokens": 16,
            **extra}


def now_ms() -> int:
    return int(time.time() * 1000)


def assert_refused(reply: dict[str, Any], field: str, *words: str) -> None:
    assert reply["ok"] is False, f"{field}: served: {reply}"
    error = reply["error"]
    assert error["code"] == "bad_request", (field, error)
    assert error["message"].startswith(f"{field}:"), (field, error)
    for word in words:
        assert word in error["message"], (field, word, error)


# ---- (a) every numeric field of every op, refused at the edge -------------------------------

HUGE = [2**44, 2**63 - 1, 2**64 - 1]
WRONG_TYPE = [-1, 1.5, True, "7"]
RANGE = "expected an integer in ["


def warm_cases(root: Path, bait: str) -> list[tuple[str, str, Any, dict[str, Any]]]:
    """(op, field, value, the rest of the request) for the warm and inspect options."""
    kv = {"hash": HASH, "layout": inline_layout(root), "prompts": [{"token_ids": [1] * 16}]}
    cases: list[tuple[str, str, Any, dict[str, Any]]] = []
    for op, rest in (("prefetch", {"paths": [bait]}), ("prefetch_blocks", kv)):
        cases += [(op, "deadline_ms", v, rest) for v in [*HUGE, DAY_MS + 1, *WRONG_TYPE]]
        cases += [(op, "deadline_unix_ms", v, rest)
                  for v in [*HUGE, now_ms() + DAY_MS + 60_000, now_ms() // 1000, *WRONG_TYPE]]
        cases += [(op, "timeout_ms", v, {**rest, "wait": True})
                  for v in [*HUGE, DAY_MS + 1, *WRONG_TYPE]]
        cases += [(op, "max_failures", v, rest) for v in [2**32, 2**64 - 1, *WRONG_TYPE]]
        cases += [(op, "read_bytes", v, rest) for v in [0, 2**40 + 1, *HUGE, *WRONG_TYPE]]
    for op in ("check", "evict"):
        rest = {"paths": [bait]}
        cases += [(op, "timeout_ms", v, rest) for v in [*HUGE, DAY_MS + 1, *WRONG_TYPE]]
        cases += [(op, "read_bytes", v, rest) for v in [0, 2**40 + 1, *HUGE, *WRONG_TYPE]]
    return cases


def test_every_numeric_field_out_of_range_is_refused_naming_it_and_no_worker_dies(
    tmp_path: Path,
) -> None:
    daemon, root = start(tmp_path)
    try:
        bait, spare = cold(root, "bait", 2)
        workers = sorted(daemon.worker_pids())
        for op, field, value, rest in warm_cases(root, bait):
            reply = daemon.call(op, **rest, **{field: value})
            assert_refused(reply, field, RANGE)
        # The KV request's numbers: token counts and positions within 2**28.
        for where, request in [
            ("hash.block_size", {"hash": {**HASH, "block_size": 2**44},
                                 "layout": inline_layout(root)}),
            ("layout.connector_block_size_tokens",
             {"hash": HASH, "layout": inline_layout(root, connector_block_size_tokens=2**63)}),
            ("layout.kv_cache_groups[0].block_size",
             {"hash": HASH,
              "layout": inline_layout(root, kv_cache_groups=[{"block_size": 2**40}])}),
        ]:
            reply = daemon.call("resolve", **request, prompts=[{"token_ids": [1] * 16}])
            assert_refused(reply, where, "at most 268435456")
        feature = {"identifier": "img", "offset": 2**63, "length": 4}
        reply = daemon.call("resolve", hash=HASH, layout=inline_layout(root),
                            prompts=[{"token_ids": [1] * 16, "mm_features": [feature]}])
        assert_refused(reply, "prompts[0].mm_features[0].offset", "268435456")
        # The refused bait was never read, nor queued; the ends of the ranges are served.
        assert resident_bytes(bait, 4 * KiB) == 0
        stats = daemon.stats()
        assert stats["files"]["accepted"] == 0, stats["files"]
        served = daemon.call("prefetch", paths=[bait], wait=True, deadline_ms=DAY_MS,
                             timeout_ms=DAY_MS, max_failures=2**32 - 1)
        assert served["ok"] and served["outcomes"]["read"] == 1, served
        ahead = daemon.call("prefetch", paths=[spare], wait=True,
                            deadline_unix_ms=now_ms() + DAY_MS - 60_000)
        assert ahead["ok"] and ahead["outcomes"]["read"] == 1, ahead
        after = daemon.stats()
        assert sorted(daemon.worker_pids()) == workers
        assert after["worker_restarts"] == 0, after["worker_restarts"]
    finally:
        daemon.stop()


# ---- (b) the attack as found: ten a second, while another client warms with wait -----------

ATTACK_RATE = 10  # requests a second, as found
ATTACK_SECONDS = 3.0
ATTACKS = [{"deadline_ms": 2**44}, {"deadline_ms": 2**63 - 1},
           {"deadline_unix_ms": 2**63}, {"deadline_unix_ms": 2**64 - 1}]


class Victim(threading.Thread):
    """A router warming cold files with `wait`, ten at a time, until told to stop; each
    batch evicted again once answered, so every send goes to a worker's engine."""

    def __init__(self, daemon: Daemon, paths: list[str]) -> None:
        super().__init__(daemon=True)
        self.daemon_ = daemon
        self.paths = paths
        self.halt = threading.Event()
        self.sent = 0
        self.outcomes: Counter[str] = Counter()
        self.lost: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.daemon_.connect(timeout=60) as connection:
                index = 0
                while not self.halt.is_set() or self.sent == 0:
                    batch = [self.paths[(index + i) % len(self.paths)] for i in range(10)]
                    index += 10
                    reply = connection.call_ok("prefetch", paths=batch, wait=True,
                                               timeout_ms=30_000)
                    self.sent += len(batch)
                    self.outcomes.update(reply["outcomes"])
                    self.lost += [f for f in reply.get("failures", [])
                                  if f["reason"] == "worker_lost"]
                    for path in batch:
                        evict(path)
        except BaseException as error:  # reported by the test, not lost in the thread
            self.error = error


def test_a_flood_of_far_deadlines_costs_no_worker_and_no_file(
    tmp_path: Path, listed_router: ListedRouter,
) -> None:
    # No memory of recent reads: each of the victim's sends is read by an engine, where
    # a worker's death loses it. The daemon listens on TLS too: a listed router keeps
    # connecting throughout.
    daemon, root = start(tmp_path, dedup_ttl_ms=0, **listed_router.settings())
    try:
        count = int(ATTACK_RATE * ATTACK_SECONDS)
        bait = cold(root, "bait", count)
        victim = Victim(daemon, cold(root, "victim", 200))
        replies: list[dict[str, Any]] = []
        with Watch(daemon, router=listed_router) as watch:
            victim.start()
            started = time.monotonic()
            for i in range(count):
                time.sleep(max(0.0, started + i / ATTACK_RATE - time.monotonic()))  # the rate
                replies.append(daemon.call("prefetch", paths=[bait[i]],
                                           **ATTACKS[i % len(ATTACKS)]))
            victim.halt.set()
            victim.join(60)
        stats = daemon.stats()
        figures = watch.assert_held()
        assert victim.error is None, repr(victim.error)
        for reply, attack in zip(replies, ATTACKS * count, strict=False):
            (field,) = attack
            assert_refused(reply, field, RANGE)
        assert victim.lost == [], victim.lost[:5]
        assert victim.outcomes["read"] + victim.outcomes["resident"] == victim.sent > 0, \
            victim.outcomes
        assert stats["worker_restarts"] == 0
        assert stats["files"]["accepted"] == victim.sent  # no bait ever reached a worker
        assert all(resident_bytes(path, 4 * KiB) == 0 for path in bait)
        print(f"victim: {victim.sent} files, {dict(victim.outcomes)}; {figures.line()}")
        assert_stops_within(daemon)
    finally:
        daemon.kill()


# ---- (c) the CLI: a list line is at most PATH_MAX, read in bounded memory -------------------

# Runs the CLI as its only child, so RUSAGE_CHILDREN is the CLI's own peak RSS; a CLI
# still running after the timeout is killed (0.3.0's, on /dev/zero, never ends).
MEASURE = r"""
import json, resource, subprocess, sys, time
started = time.monotonic()
try:
    done = subprocess.run(sys.argv[2:], capture_output=True, timeout=float(sys.argv[1]))
    code, err = done.returncode, done.stderr.decode(errors="replace")
except subprocess.TimeoutExpired as timeout:
    code, err = "timeout", (timeout.stderr or b"").decode(errors="replace")
print(json.dumps({"code": code, "stderr": err[-2000:],
                  "seconds": time.monotonic() - started,
                  "peak_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def measured_cli(daemon: Daemon, *args: str, timeout: float = 20.0) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(timeout), CLI, "--socket", daemon.socket_path,
         *args], capture_output=True, text=True, timeout=timeout + 30, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def cli(daemon: Daemon, *args: str, stdin: bytes | None = None
        ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([CLI, "--socket", daemon.socket_path, *args], input=stdin,
                          capture_output=True, timeout=60, check=False)


def test_warm_from_dev_zero_exits_2_at_once_in_bounded_memory(tmp_path: Path) -> None:
    daemon, _ = start(tmp_path)
    try:
        result = measured_cli(daemon, "warm", "-f", "/dev/zero")
        nul = measured_cli(daemon, "check", "-0", "-f", "/dev/zero")  # only empty records
        stats = daemon.stats()
    finally:
        daemon.stop()
    print(f"kvprefetch warm -f /dev/zero: {result}; check -0: {nul}")
    assert result["code"] == 2, result
    assert "/dev/zero: line 1 is longer than 4096 bytes" in result["stderr"], result
    assert nul["code"] == 2 and "are empty" in nul["stderr"], nul
    for run in (result, nul):
        assert run["seconds"] < 10, run
        assert run["peak_mib"] < 100, run
    assert stats["files"]["accepted"] + stats["files"]["rejected_by_supervisor"] == 0


def test_a_list_line_past_path_max_exits_2_naming_it_and_sends_nothing(tmp_path: Path) -> None:
    daemon, root = start(tmp_path)
    try:
        good = str(make_file(root / "good.bin", 4 * KiB))
        huge = tmp_path / "huge.list"  # 0.3.0 dropped this 17 MiB line and exited 0
        with open(huge, "wb") as listing:
            listing.write(f"{good}\n/".encode() + b"x" * (17 << 20) + f"\n{good}\n".encode())
        over = tmp_path / "over.list"  # just past PATH_MAX: no name the kernel opens
        over.write_bytes(f"{good}\n{good}\n/{'y' * 4096}\n".encode())
        long_line = measured_cli(daemon, "warm", "--wait", "-f", str(huge))
        just_over = cli(daemon, "warm", "--wait", "-f", str(over))
        nul = cli(daemon, "warm", "--wait", "-0", "-",
                  stdin=f"{good}\0{good}\0".encode() + b"/" + b"z" * 5000 + b"\0")
        fine = cli(daemon, "warm", "--wait", "-0", "-", stdin=f"{good}\0{good}\0".encode())
        stats = daemon.stats()
    finally:
        daemon.stop()
    assert long_line["code"] == 2, long_line
    assert f"{huge}: line 2 is longer than 4096 bytes (PATH_MAX)" in long_line["stderr"]
    assert long_line["peak_mib"] < 100, long_line
    assert just_over.returncode == 2 and just_over.stdout == b"", just_over
    assert f"{over}: line 3 is longer than 4096 bytes".encode() in just_over.stderr
    assert nul.returncode == 2 and b"stdin: record 3 is longer than 4096 bytes" in nul.stderr
    assert fine.returncode == 0, fine.stderr
    # Only the good run's two files reached the daemon: a bad list stops before its batch.
    assert stats["files"]["accepted"] == 2 and stats["files"]["rejected_by_supervisor"] == 0


@pytest.mark.parametrize("flag", ["--deadline-ms", "--timeout-ms"])
def test_the_cli_refuses_a_wait_or_deadline_past_a_day_as_usage(tmp_path: Path, flag: str) -> None:
    daemon, root = start(tmp_path)
    try:
        good = str(make_file(root / "good.bin", 4 * KiB))
        refused = cli(daemon, "warm", "--wait", flag, str(DAY_MS + 1), good)
        served = cli(daemon, "warm", "--wait", flag, str(DAY_MS), good)
    finally:
        daemon.stop()
    assert refused.returncode == 2 and b"at most 86400000" in refused.stderr, refused.stderr
    assert served.returncode == 0, served.stderr
