"""What a warmer could reach on the replay's tier, and what it must know to reach it.

bench/replay.py measures warmers on tiersim with S fetch slots of L seconds each, served
first come, first served, and every consumer fetching what is cold through the same
slots. That tier is simple enough to model exactly, so this asks what one measurement
cannot: over many seeded streams, how often does a rule for admitting a request's files
meet issue 25's targets (at 90% load a warm-hit ratio, for deltas of at least 2L, no
lower than the FIFO pool's; at 150% twice the pool's requests fully warm)?

The model (no I/O; replay_stream's streams):
- a fetch takes L; the slots serve fetches in submission order; a file fetched once is
  warm; a reader of a file in flight waits for that fetch;
- each request's consumer reads its files one after another from arrival + delta; a
  file is a hit when it is warm as the consumer gets to it (replay.py's look); a cold
  one it submits and waits for;
- a warmer acts at each arrival. Every warmer skips what is warm.

Warmers:
- `pool`: every file at once (the FIFO pool of 256 threads).
- `reads` (0.9.0's admission): a file goes when a read's time now (the warmer's own
  reads averaged, 0.7/0.3) has it back before its consumer gets to it, the consumer
  taking at least L for each file before it; everything goes when none of its reads is
  out.
- `gauge` (native/gauge.c and schedule.c): the tier's count of fetches not answered
  (a FUSE connection's `waiting`) and the rate it answers them, learned from the
  warmer's reads. The request goes whole when its last file would be back by the
  deadline. Otherwise its files that would be back before the consumer gets to them
  go, but only while the tier's queue is shorter than 2L and the consumer is 2L away
  or more: in overload those reads are the slots a request that can be warm whole
  needs.
- `standby` (0.11.0): the gauge's rule, and the files it refuses stand by instead of being
  dropped: one goes (oldest first) whenever the tier has a slot free (its count under the
  slots it serves at once, the learned rate times L), looked at on each arrival, each of
  the warmer's reads coming back and every TICK_S, until its consumer could have got to
  it (the deadline plus L for it and each file before it). At 90% load the refusals were
  what the gauge paid for overload; the tier's free slots take that back.
- `oracle`: the gauge's rule, knowing the slots' schedule exactly instead.

    .venv/bin/python bench/replay_bound.py --capacity 79.4 --seeds 1-30
"""

from __future__ import annotations

import argparse
import heapq
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import replay_stream

PARTIAL_FETCHES = 2  # schedule.c's: the queue and the lead, in fetches, for files of a partial
TICK_S = 0.1  # the worker's loop ticks its queue this often (worker/loop.py's TICK_SECONDS)


@dataclass
class Tier:
    """S slots serving fetches in submission order; when each file is (or will be) back."""

    slots: list[float]
    fetch_s: float
    back: dict[str, float]
    out: list[float] = field(default_factory=list)  # ends of fetches not back yet (a heap)

    @classmethod
    def cold(cls, slots: int, fetch_s: float, warm: list[str]) -> Tier:
        return cls([0.0] * slots, fetch_s, {path: -1.0 for path in warm})

    def submit(self, path: str, now: float) -> float:
        if path in self.back:
            return self.back[path]
        end = max(heapq.heappop(self.slots), now) + self.fetch_s
        heapq.heappush(self.slots, end)
        heapq.heappush(self.out, end)
        self.back[path] = end
        return end

    def waiting(self, now: float) -> int:
        """Fetches not answered at now: what fusectl's `waiting` says."""
        while self.out and self.out[0] <= now:
            heapq.heappop(self.out)
        return len(self.out)

    def warm(self, path: str, now: float) -> bool:
        return self.back.get(path, float("inf")) <= now


@dataclass
class View:
    """What a warmer has learned from its own reads so far."""

    fetch_s: float
    read_s: float = 0.0  # a read's time, averaged per read (0.7/0.3): `reads`
    rate: float = 0.0    # fetches a second the tier answers (gauge.c's): `gauge`
    mine: list[tuple[float, float, int]] = field(default_factory=list)  # (back, asked, ahead)

    def learn(self, now: float) -> None:
        while self.mine and self.mine[0][0] <= now:
            back, asked, ahead = heapq.heappop(self.mine)
            took = back - asked
            self.read_s = 0.7 * self.read_s + 0.3 * took if self.read_s else took
            if took < 0.8 * self.fetch_s:
                continue  # joined a fetch already out
            rate = (ahead + 1) / took
            if took > 1.25 * self.fetch_s:
                self.rate = 0.7 * self.rate + 0.3 * rate if self.rate else rate
            else:
                self.rate = max(self.rate, rate)


# A warmer: given the tier, what it learned, the request, now and the request's files not
# warm (in order), the files it reads.
Warmer = Callable[[Tier, View, replay_stream.Request, float, list[str]], list[str]]


def pool(tier: Tier, view: View, request: replay_stream.Request, now: float,
         cold: list[str]) -> list[str]:
    return cold


def reads(tier: Tier, view: View, request: replay_stream.Request, now: float,
          cold: list[str]) -> list[str]:
    due, step = request.arrival_s + request.delta_s, view.fetch_s
    return [path for k, path in enumerate(request.files)
            if path in cold and (not view.mine or now + view.read_s <= due + k * step)]


def judged(cold: list[str], due: float, now: float, back: Callable[[int], float],
           fetch_s: float) -> list[str]:
    """schedule.c's rule, given when the j-th file asked for now would be back."""
    if back(len(cold) - 1) <= due:
        return cold
    queue = back(0) - now - fetch_s
    if queue >= PARTIAL_FETCHES * fetch_s or due - now < PARTIAL_FETCHES * fetch_s:
        return []
    chosen: list[str] = []
    reach = due
    for path in cold:
        if back(len(chosen)) <= reach:
            chosen.append(path)
        else:
            reach += fetch_s  # left to its consumer, who fetches it first
    return chosen


def gauge(tier: Tier, view: View, request: replay_stream.Request, now: float,
          cold: list[str]) -> list[str]:
    if not view.rate:
        return cold
    waiting = tier.waiting(now)
    return judged(cold, request.arrival_s + request.delta_s, now,
                  lambda j: now + max(view.fetch_s, (waiting + j + 1) / view.rate),
                  view.fetch_s)


def oracle(tier: Tier, view: View, request: replay_stream.Request, now: float,
           cold: list[str]) -> list[str]:
    """The gauge's rule with the slots' schedule; a file in flight is back when its
    fetch is, and takes no slot."""
    fresh = [p for p in cold if p not in tier.back]
    flying = [tier.back[p] for p in cold if p in tier.back]

    def back(j: int) -> float:
        trial = list(tier.slots)
        last = now
        for _ in range(min(j, len(fresh) - 1) + 1):
            last = max(heapq.heappop(trial), now) + tier.fetch_s
            heapq.heappush(trial, last)
        return max([last, *flying]) if j >= len(fresh) - 1 else last
    return judged(fresh, request.arrival_s + request.delta_s, now, back, tier.fetch_s)


WARMERS: dict[str, Warmer] = {"pool": pool, "reads": reads, "gauge": gauge, "standby": gauge,
                              "oracle": oracle}
STANDING = {"standby"}  # warmers whose refused files stand by (schedule.c's standby)


@dataclass
class Standby:
    """Refused files, oldest first, each until its consumer could have got to it."""

    files: list[tuple[float, str]] = field(default_factory=list)

    def add(self, request: replay_stream.Request, asked: list[str], cold: list[str],
            fetch_s: float) -> None:
        due, taken = request.arrival_s + request.delta_s, set(asked)
        self.files += [(due + (k + 1) * fetch_s, path) for k, path in enumerate(request.files)
                       if path in cold and path not in taken]

    def take(self, tier: Tier, view: View, now: float) -> list[str]:
        """The files that go now: into the slots the tier has free."""
        slots = round(view.rate * tier.fetch_s)
        self.files = [(until, p) for until, p in self.files if until > now and p not in tier.back]
        taken: list[str] = []
        while self.files and tier.waiting(now) + len(taken) < slots:
            taken.append(self.files.pop(0)[1])
        return taken


LOOK = 2  # an event: a standby warmer looks at the tier's count


def replay(stream: replay_stream.Stream, warmer: Warmer, slots: int, fetch_s: float,
           standing: bool = False) -> tuple[float, int, int]:
    """(warm-hit ratio for deltas of at least 2L, requests with a new file fully warm,
    requests with a new file). Events in time order: an arrival (the warmer acts) and a
    consumer getting to its next file (it submits the file only then, so a fetch it has
    not reached takes no slot ahead of anyone)."""
    tier = Tier.cold(slots, fetch_s, stream.warm)
    view = View(fetch_s)
    standby = Standby() if standing else None
    events = [(r.arrival_s, 0, r.index, 0) for r in stream.requests]
    events += [(r.arrival_s + r.delta_s, 1, r.index, 0) for r in stream.requests]
    if standby:  # the ticks, and (LOOK) each of the warmer's reads coming back
        events += [(k * TICK_S, LOOK, -1, 0) for k in range(int(stream.requests[-1].arrival_s
                                                                / TICK_S) + 20)]
    heapq.heapify(events)
    hits: dict[int, list[bool]] = {}

    def read(paths: list[str], now: float) -> None:
        for ahead, path in enumerate(paths, start=tier.waiting(now)):
            back = tier.submit(path, now)
            if back > now:
                heapq.heappush(view.mine, (back, now, ahead))
                if standby:
                    heapq.heappush(events, (back, LOOK, -1, 0))

    while events:
        now, kind, index, at = heapq.heappop(events)
        view.learn(now)
        if kind == LOOK:
            if standby and view.rate:
                read(standby.take(tier, view, now), now)
            continue
        request = stream.requests[index]
        if kind == 0:
            cold = [p for p in request.files if not tier.warm(p, now)]
            asked = warmer(tier, view, request, now, cold) if cold else []
            read(asked, now)
            if standby and cold:
                standby.add(request, asked, cold, fetch_s)
                if view.rate:
                    read(standby.take(tier, view, now), now)
        elif at < len(request.files):
            path = request.files[at]
            hit = tier.warm(path, now)
            hits.setdefault(index, []).append(hit)
            back = now if hit else tier.submit(path, now)
            heapq.heappush(events, (max(back, now), 1, index, at + 1))
    long = [sum(h) / len(h) for i, h in hits.items()
            if stream.requests[i].delta_s >= 2 * fetch_s]
    new = [all(h) for i, h in hits.items() if stream.requests[i].new]
    return statistics.mean(long), sum(new), len(new)


def seeds_of(text: str) -> list[int]:
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity", type=float, default=79.4,
                   help="the tier's measured files/s (replay.py prints it)")
    p.add_argument("--warm-capacity", type=float, default=4239.0,
                   help="warm opens a second (replay.py prints it; the stream's load)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--fetch-ms", type=float, default=100.0)
    p.add_argument("--duration-s", type=float, default=12.0)
    p.add_argument("--seeds", default="1-30", help="1,2,3 or 1-30")
    p.add_argument("--warmers", default="reads,gauge,standby,oracle")
    args = p.parse_args()
    fetch_s = args.fetch_ms / 1000
    names = args.warmers.split(",")
    seeds = seeds_of(args.seeds)
    print(f"{len(seeds)} streams; against the FIFO pool in each")
    print("| load | warmer | warm-hit, delta >= 2L (mean) | at least the pool's | "
          "fully warm, requests with a new file (mean) | x pool (mean, min) | 2x the pool |")
    print("|---|---|---|---|---|---|---|")
    for load in (0.9, 1.5):
        got: dict[str, list[tuple[float, int, int]]] = {n: [] for n in ["pool", *names]}
        for seed in seeds:
            stream = replay_stream.stream(replay_stream.StreamSpec(seed=seed), load,
                                          args.capacity, args.duration_s, args.warm_capacity)
            for name in got:
                got[name].append(replay(stream, WARMERS[name], args.slots, fetch_s,
                                        name in STANDING))
        for name in got:
            runs, base = got[name], got["pool"]
            hit = statistics.mean(r[0] for r in runs)
            wins = sum(r[0] >= b[0] for r, b in zip(runs, base, strict=True))
            full = statistics.mean(r[1] / r[2] for r in runs)
            ratios = [r[1] / max(b[1], 1) for r, b in zip(runs, base, strict=True)]
            twice = sum(x >= 2 for x in ratios)
            print(f"| {load:.0%} | {name} | {hit:.4f} | {wins}/{len(runs)} | {full:.3f} | "
                  f"{statistics.mean(ratios):.2f}, {min(ratios):.2f} | {twice}/{len(runs)} |")


if __name__ == "__main__":
    main()
