"""What any warmer could reach on the replay's tier: its stream through a model of the tier.

bench/replay.py measures warmers on tiersim with S fetch slots of L seconds each, served
first come, first served, and every consumer fetching what is cold through the same
slots. That tier is simple enough to model exactly, so this script asks the question the
measurement cannot: at a given load, how many requests could *any* order of warming bring
fully warm to their consumer?

The model (no I/O, the same seeded stream as replay.py):
- a fetch takes L; the slots serve fetches in submission order; a file fetched once is
  warm; a reader of a file in flight waits for that fetch;
- every request's consumer reads its files one after another at arrival + delta,
  submitting each cold one and waiting for it (replay_methods' consumer);
- a warmer acts at each arrival. `pool`: submits the request's cold files at once (the
  FIFO pool of 256 threads). `oracle`: knows the tier's state exactly and submits a
  request's cold files only if every one of them would be back by its consumer's read,
  else submits nothing and leaves them to the consumer (so a doomed request takes no
  slot ahead of one that can still make it). `admit`: the same rule with only what a
  warmer can see: its own reads' latency (an average of the last ones back), and one
  request let through whenever none of its reads is out, so the average cannot stay
  stale. `none`: nothing.

With the tier's measured capacity it reproduces replay.md's pool figures (fully warm,
requests with a new file: 0.734 at 50%, 0.507 at 90% against 0.496 measured, 0.013 at
150%), so what it says of the oracle is a statement about the measured tier.

    .venv/bin/python bench/replay_bound.py --capacity 78.8 --seeds 1,2,3
"""

from __future__ import annotations

import argparse
import heapq
from dataclasses import dataclass

import replay_stream


@dataclass
class Tier:
    """S slots serving fetches in submission order; when each file is (or will be) back."""

    slots: list[float]
    fetch_s: float
    back: dict[str, float]

    @classmethod
    def cold(cls, slots: int, fetch_s: float, warm: list[str]) -> Tier:
        return cls([0.0] * slots, fetch_s, {path: -1.0 for path in warm})

    def submit(self, path: str, now: float) -> float:
        if path in self.back:
            return self.back[path]
        end = max(heapq.heappop(self.slots), now) + self.fetch_s
        heapq.heappush(self.slots, end)
        self.back[path] = end
        return end

    def would_be_back(self, paths: list[str], now: float) -> float:
        """When the last of `paths` would be back if submitted now (nothing submitted)."""
        trial = list(self.slots)
        last = now
        for _ in paths:
            last = max(heapq.heappop(trial), now) + self.fetch_s
            heapq.heappush(trial, last)
        return last


def fully_warm(stream: replay_stream.Stream, policy: str, slots: int,
               fetch_s: float) -> tuple[int, int, int]:
    """(requests fully warm at their consumer's read, of them bringing a new file, requests
    bringing a new file). Events in time order: an arrival (the warmer acts), a consumer's
    start (judged), and a consumer's next file (it submits the file when it gets to it, so
    a fetch it has not reached yet takes no slot ahead of anyone)."""
    tier = Tier.cold(slots, fetch_s, stream.warm)
    mine: list[tuple[float, float]] = []  # the warmer's reads out: (back, submitted)
    latency = fetch_s
    events = [(r.arrival_s, 0, r.index, 0) for r in stream.requests]
    events += [(r.arrival_s + r.delta_s, 1, r.index, 0) for r in stream.requests]
    heapq.heapify(events)
    full = full_new = with_new = 0
    while events:
        now, kind, index, at = heapq.heappop(events)
        request = stream.requests[index]
        due = request.arrival_s + request.delta_s
        while mine and mine[0][0] <= now:
            back, submitted = heapq.heappop(mine)
            latency = 0.7 * latency + 0.3 * (back - submitted)
        if kind == 0 and policy == "admit" and (now + latency <= due or not mine):
            for path in request.files:
                if path not in tier.back:
                    heapq.heappush(mine, (tier.submit(path, now), now))
        elif kind == 0 and policy == "pool":
            for path in request.files:
                tier.submit(path, now)
        elif kind == 0 and policy == "oracle":
            cold = [p for p in request.files if p not in tier.back]
            in_time = all(tier.back[p] <= due for p in request.files if p in tier.back)
            if in_time and tier.would_be_back(cold, now) <= due:
                for path in cold:
                    tier.submit(path, now)
        elif kind == 1:
            warm = all(tier.back.get(p, float("inf")) <= now for p in request.files)
            full += warm
            if request.new:
                with_new += 1
                full_new += warm
            heapq.heappush(events, (now, 2, index, 0))
        elif kind == 2 and at < len(request.files):  # the consumer reaches file `at`
            back = tier.submit(request.files[at], now)
            heapq.heappush(events, (max(back, now), 2, index, at + 1))
    return full, full_new, with_new


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity", type=float, default=78.8,
                   help="the tier's measured files/s (replay.py prints it)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--fetch-ms", type=float, default=100.0)
    p.add_argument("--duration-s", type=float, default=12.0)
    p.add_argument("--loads", default="0.5,0.9,1.5")
    p.add_argument("--seeds", default="1")
    args = p.parse_args()
    print("| seed | load | requests | with a new file | fully warm (with a new file): "
          "none | pool | admit | oracle | admit / pool | oracle / pool |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        for load in (float(x) for x in args.loads.split(",")):
            stream = replay_stream.stream(replay_stream.StreamSpec(seed=seed), load,
                                          args.capacity, args.duration_s)
            got = {policy: fully_warm(stream, policy, args.slots, args.fetch_ms / 1000)
                   for policy in ("none", "pool", "admit", "oracle")}
            with_new = got["pool"][2]
            cells = " | ".join(f"{got[p][1]} ({got[p][1] / max(with_new, 1):.3f})"
                               for p in ("none", "pool", "admit", "oracle"))
            ratios = " | ".join(f"{got[p][1] / got['pool'][1]:.2f}" if got["pool"][1] else "-"
                                for p in ("admit", "oracle"))
            print(f"| {seed} | {load:.0%} | {len(stream.requests)} | {with_new} | {cells} | "
                  f"{ratios} |")


if __name__ == "__main__":
    main()
