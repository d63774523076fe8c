"""The ack-latency measurement: who sends, what, and one size's timed blocks.

The paths need not exist: they are laid out as the fs connector would write them
under the daemon's root, and the workers settle them as `missing` in the background.
Each (target, client) pair is a Sender: a closed loop, one request in flight.
"""

from __future__ import annotations

import hashlib
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    preempting the supervisor? SCHED_BATCH tasks never preempt on wake-up (sched(7));
    nice 10 or 19 gives them a smaller CPU share (their threads keep the niceness they
    were created with: only threads made after the change get it)."""
    for pid in daemon.worker_pids:
        if policy == "batch":
            os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))
        elif policy == "nice10":
            os.setpriority(os.PRIO_PROCESS, pid, 10)
        elif policy == "nice19":
            os.setpriority(os.PRIO_PROCESS, pid, 19)


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
    cursor: int = 0
    dropped: int = 0
    drained_s: float = 0.0

    def run(self, mode: str, size: int, count: int, blocks: int
            ) -> dict[tuple[str, str], list[int]]:
        """count timed requests of size paths per pair, in `blocks` shuffled turns: ns each."""
        samples: dict[tuple[str, str], list[int]] = {pair: [] for pair in self.senders}
        self.cursor = 0  # every size draws from the start of the pool
        per_block = [count // blocks + (i < count % blocks) for i in range(blocks)]
        for block in per_block:
            order = list(self.senders)
            self.rng.shuffle(order)
            for pair in order:
                self.drained_s += drain(self.daemon)
                for index in range(self.warmup + block):
                    elapsed = self.one(pair, mode, size)
                    if index >= self.warmup:
                        samples[pair].append(elapsed)
        return samples

    def one(self, pair: tuple[str, str], mode: str, size: int) -> int:
        """One request of size paths by this pair, timed (ns), its ack checked."""
        batch = [self.pool[(self.cursor + k) % len(self.pool)] for k in range(size)]
        self.cursor += size
        if mode == "idle":
            self.idle_now()  # the daemon's workers asleep, for either target
            time.sleep(self.idle_gap)  # and so is the target itself
        t0 = time.perf_counter_ns()
        ack = self.senders[pair](batch)
        elapsed = time.perf_counter_ns() - t0
        if ack["accepted"] + ack["dropped"] != size:
            raise RuntimeError(f"{pair}: ack {ack} for {size} paths")
        self.dropped += ack["dropped"]
        return elapsed
