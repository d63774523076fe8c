"""The ack-latency measurement: who sends, what, and one size's timed blocks.

Two path sets, both laid out as the fs connector would write them under the daemon's
root: `absent` paths do not exist (the workers settle them as `missing`, a few us each),
`resident` ones are real files whose heads are in the page cache (each worker probes
them natively right after the ack, ~11 us a file here: the work that may delay the ack).
Each (target, client) pair is a Sender: a closed loop, one request in flight.
"""

from __future__ import annotations

import hashlib
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from percentiles import cdf, nearest_rank
from warmup_daemon import EngineDaemon

from kvharness.wire import RawConnection

# paths -> the ack's {"accepted", "dropped"}
Sender = Callable[[list[str]], dict[str, int]]


def fake_paths(root: Path, count: int, seed: int) -> list[str]:
    """Paths in the fs connector's layout under root that do not exist (nothing to read)."""
    base = root / "Qwen_Qwen3-8B_000000000000_r0"
    out = []
    for index in range(count):
        h = hashlib.sha256(f"ack:{seed}:{index}".encode()).hexdigest()
        out.append(str(base / h[0:3] / f"{h[3:5]}_g0" / f"{h}.bin"))
    return out


def resident_files(root: Path, count: int, size: int, seed: int) -> list[str]:
    """`count` real files of `size` bytes in the fs connector's layout under root."""
    base = root / "Qwen_Qwen3-8B_000000000000_r1"
    block = os.urandom(size)
    out = []
    for index in range(count):
        h = hashlib.sha256(f"resident:{seed}:{index}".encode()).hexdigest()
        path = base / h[0:3] / f"{h[3:5]}_g0" / f"{h}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(block)
        out.append(str(path))
    return out


def make_resident(paths: Sequence[str], tries: int = 5) -> int:
    """Read every file whole, then check it is all in the page cache (as the daemon's own
    kvp_resident_bytes sees it), reading again what the host's reclaimer took meanwhile.
    Returns how many reads that took beyond the first (0: all stayed). Raises when files
    will not stay resident: the set would measure reads, not the probe."""
    from kvharness.pagecache import residency

    left, again = list(paths), -len(paths)
    for _ in range(tries):
        for path in left:
            with open(path, "rb") as f:
                while f.read(1 << 20):
                    pass
        again += len(left)
        left = [p for p in left if (got := residency(p))[0] < got[1]]
        if not left:
            return again
    raise RuntimeError(f"{len(left)} of {len(paths)} files not resident after {tries} reads")


def run_delay_ns() -> int:
    """Nanoseconds this thread has waited on a run queue so far (schedstat's 2nd field),
    or -1 where /proc does not say: how long the client, woken by the reply, waited for
    a CPU."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def raw_sender(sock: str) -> tuple[Sender, Callable[[], None]]:
    client = RawConnection(sock, timeout=30)

    def send(paths: list[str]) -> dict[str, int]:
        reply = client.call_ok("prefetch", paths=paths)
        return {"accepted": reply["accepted"], "dropped": reply["dropped"]}

    return send, client.close


def kvprefetch_sender(sock: str) -> tuple[Sender, Callable[[], None]]:
    from kvprefetch import Client

    client = Client(sock, timeout=30)

    def send(paths: list[str]) -> dict[str, int]:
        ack = client.prefetch(paths)
        return {"accepted": ack.accepted, "dropped": ack.dropped}

    return send, client.close


SENDERS = {"raw": raw_sender, "kvprefetch": kvprefetch_sender}


def summarize(samples_ns: list[int]) -> dict[str, Any]:
    """Percentiles (nearest rank, µs), and the CDF at percentiles.CDF_POINTS for plots."""
    us = sorted(s / 1000 for s in samples_ns)
    return {"n": len(us), "p50_us": nearest_rank(us, 50), "p99_us": nearest_rank(us, 99),
            "p999_us": nearest_rank(us, 99.9), "mean_us": statistics.fmean(us),
            "max_us": us[-1], "cdf_us": [[q, round(v, 1)] for q, v in cdf(us)]}


def drain(daemon: EngineDaemon, limit: float = 120.0) -> float:
    """Wait until the daemon has settled every queued file; returns the seconds waited."""
    started = time.monotonic()
    while daemon.stats()["files"]["in_flight"] > 0:
        if time.monotonic() - started > limit:
            raise RuntimeError(f"the daemon did not drain its queues in {limit:.0f} s")
        time.sleep(0.02)
    return time.monotonic() - started


def apply_worker_sched(daemon: EngineDaemon, policy: str) -> None:
    """An experiment, not a daemon setting: how much of the ack's cost is the workers
    taking the CPU the supervisor and the client need? "nice0/10/19": SCHED_OTHER at that
    nice; "batch": SCHED_BATCH at nice 19 (never preempts on wake-up, sched(7)); "idle":
    SCHED_IDLE; "default": as the daemon set them. Every thread of each worker is changed
    (the queue engine's threads exist already); lowering nice needs CAP_SYS_NICE."""
    if policy == "default":
        return
    kind = {"batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}.get(policy, os.SCHED_OTHER)
    nice = 19 if policy == "batch" else int(policy[4:]) if policy.startswith("nice") else 0
    for pid in daemon.worker_pids:
        for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
            os.sched_setscheduler(tid, kind, os.sched_param(0))
            if kind != os.SCHED_IDLE:
                os.setpriority(os.PRIO_PROCESS, tid, nice)


@dataclass
class Blocks:
    """One size's timed requests, split into blocks the pairs take turns on."""

    senders: dict[tuple[str, str], Sender]  # (target, client) -> sender
    daemon: EngineDaemon
    pool: Sequence[str]  # the paths requests draw from, in turn
    warmup: int  # untimed requests before each block
    idle_gap: float  # idle mode: seconds of pause before each request
    idle_now: Callable[[], None]  # idle mode: returns once the daemon's queues are empty
    rng: random.Random
    # before each pair's turn, once the queues are drained (the resident set: read and
    # verified resident); returns the extra reads it took
    prepare: Callable[[], int] | None = None
    cursor: int = 0
    dropped: int = 0
    drained_s: float = 0.0
    reread: int = 0  # files read again by prepare because the host reclaimed them
    # (target, client) -> per timed request, ns the client waited for a CPU meanwhile
    run_delay: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def run(self, mode: str, size: int, count: int, blocks: int
            ) -> dict[tuple[str, str], list[int]]:
        """count timed requests of size paths per pair, in `blocks` shuffled turns: ns each."""
        samples: dict[tuple[str, str], list[int]] = {pair: [] for pair in self.senders}
        self.run_delay = {pair: [] for pair in self.senders}
        self.cursor = 0  # every size draws from the start of the pool
        per_block = [count // blocks + (i < count % blocks) for i in range(blocks)]
        for block in per_block:
            order = list(self.senders)
            self.rng.shuffle(order)
            for pair in order:
                self.drained_s += drain(self.daemon)
                if self.prepare is not None:
                    self.reread += self.prepare()
                for index in range(self.warmup + block):
                    elapsed, waited = self.one(pair, mode, size)
                    if index >= self.warmup:
                        samples[pair].append(elapsed)
                        self.run_delay[pair].append(waited)
        return samples

    def one(self, pair: tuple[str, str], mode: str, size: int) -> tuple[int, int]:
        """One request of size paths by this pair, its ack checked: (ns it took, ns the
        client waited for a CPU meanwhile, or < 0 unknown)."""
        batch = [self.pool[(self.cursor + k) % len(self.pool)] for k in range(size)]
        self.cursor += size
        if mode == "idle":
            self.idle_now()  # the daemon's workers asleep, for either target
            time.sleep(self.idle_gap)  # and so is the target itself
        d0 = run_delay_ns()
        t0 = time.perf_counter_ns()
        ack = self.senders[pair](batch)
        elapsed = time.perf_counter_ns() - t0
        waited = run_delay_ns() - d0 if d0 >= 0 else -1
        if ack["accepted"] + ack["dropped"] != size:
            raise RuntimeError(f"{pair}: ack {ack} for {size} paths")
        self.dropped += ack["dropped"]
        return elapsed, waited
