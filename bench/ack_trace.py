"""Where an ack's time goes: bench/ack_latency.py under a scheduler trace, each request cut
into what the server and the client waited for.

ack_latency.py says how long a fire-and-forget ack takes against an echo server; this says
why a slow one was slow. It runs ack_latency.py (its arguments after `--`) under
`perf record -a` (sched_switch, sched_wakeup, and the client's and servers' sendto and
recvfrom), learns who is who from the run ($KVBENCH_ACK_PIDS), and cuts every request of at
least --min-bytes (the stats polls of the idle mode are smaller) into:

- wake: the client's send to the server running (the server's wake-up; a halted vCPU's too);
- work: the server running to its reply's send (decode, admission, the reply; preemptions);
- resume: the reply's send to the client running (the client's wake-up, its run-queue wait);
- read: the client running to the reply read.

Per server: p50 and p99 of each, the share of replies that woke the client on the server's
own CPU (a "sync" wake-up lets it run there once the server sleeps), and for the slowest
requests what held the CPU the client was woken on (`swapper`: an idle vCPU the host had
to wake; a kernel thread; a worker). Needs root and perf.

    .venv/bin/python bench/ack_trace.py --out /tmp/ack-trace -- --sizes 1000 --modes idle \\
        --requests 400 --paths resident
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from bisect import bisect_left
from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from percentiles import nearest_rank

EVENTS = ("sched:sched_switch", "sched:sched_wakeup", "syscalls:sys_enter_sendto",
          "syscalls:sys_exit_recvfrom")
SEGMENTS = ("wake", "work", "resume", "read")
LINE = re.compile(r"^\s*(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<time>[\d.]+):\s+(?P<event>\S+):"
                  r"\s*(?P<trace>.*)$")
SWITCH = re.compile(r"prev_comm=(?P<prev>.*?) prev_pid=(?P<prev_pid>\d+) .*"
                    r"next_pid=(?P<next>\d+) ")
WAKEUP = re.compile(r"pid=(?P<pid>\d+) .*target_cpu=(?P<cpu>\d+)")
LENGTH = re.compile(r"len: (0x[0-9a-f]+)")


@dataclass(frozen=True)
class Event:
    time: float
    tid: int
    cpu: int
    kind: str  # switch, wakeup, send, received
    trace: str


def parse(lines: Sequence[str]) -> list[Event]:
    """`perf script -F tid,cpu,time,event,trace` lines as events, in time order."""
    kinds = {"sched:sched_switch": "switch", "sched:sched_wakeup": "wakeup",
             "syscalls:sys_enter_sendto": "send", "syscalls:sys_exit_recvfrom": "received"}
    events = []
    for line in lines:
        match = LINE.match(line)
        if match and match["event"] in kinds:
            events.append(Event(float(match["time"]), int(match["tid"]), int(match["cpu"]),
                                kinds[match["event"]], match["trace"]))
    events.sort(key=lambda e: e.time)
    return events


class Trace:
    """The events, with lookups forward in time."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events
        self.times = [e.time for e in events]

    def next(self, after: float, kind: str, by: Container[int] | None = None,
             woken: int | None = None) -> Event | None:
        """The first event of `kind` at or after `after`: by one of the tids `by`, or
        switching to or waking `woken`."""
        for index in range(bisect_left(self.times, after), len(self.events)):
            event = self.events[index]
            if event.kind != kind or (by is not None and event.tid not in by):
                continue
            if woken is not None and woken_tid(event) != woken:
                continue
            return event
        return None

    def last_switch_to(self, tid: int, after: float, before: float) -> Event | None:
        """The last switch to `tid` in (after, before]."""
        for event in reversed(self.events[bisect_left(self.times, after):
                                          bisect_left(self.times, before) + 1]):
            if event.kind == "switch" and woken_tid(event) == tid and event.time <= before:
                return event
        return None


def woken_tid(event: Event) -> int | None:
    """The task a switch runs next, or a wake-up wakes."""
    if event.kind == "switch":
        match = SWITCH.search(event.trace)
        return int(match["next"]) if match else None
    if event.kind == "wakeup":
        match = WAKEUP.search(event.trace)
        return int(match["pid"]) if match else None
    return None


def requests(trace: Trace, client: int, servers: dict[int, str],
             min_bytes: int) -> list[dict[str, Any]]:
    """Every request the client sent one of `servers` (pid -> name), cut into SEGMENTS."""
    out = []
    for sent in (e for e in trace.events if e.kind == "send" and e.tid == client):
        length = LENGTH.search(sent.trace)
        if length is None or int(length.group(1), 16) < min_bytes:
            continue
        got = trace.next(sent.time, "received", by=servers)
        if got is None:
            continue
        server = got.tid
        began = trace.last_switch_to(server, sent.time, got.time)
        running = began.time if began is not None else sent.time  # it was already running
        reply = trace.next(got.time, "send", by={server})
        if reply is None:
            continue
        woke = trace.next(reply.time, "wakeup", woken=client)
        ran = trace.next(reply.time, "switch", woken=client)
        if ran is None:
            continue
        read = trace.next(ran.time, "received", by={client})
        if read is None:
            continue
        target = WAKEUP.search(woke.trace) if woke is not None else None
        switch = SWITCH.search(ran.trace)
        out.append({
            "server": servers[server],
            "total_us": (read.time - sent.time) * 1e6,
            "wake_us": (running - sent.time) * 1e6,
            "work_us": (reply.time - running) * 1e6,
            "resume_us": (ran.time - reply.time) * 1e6,
            "read_us": (read.time - ran.time) * 1e6,
            "same_cpu": target is not None and int(target["cpu"]) == reply.cpu,
            "held_by": switch["prev"] if switch else "?",
        })
    return out


def summary(rows: list[dict[str, Any]], slowest: int) -> dict[str, Any]:
    """p50/p99 of the total and each segment, the same-CPU share, the slowest requests."""
    def pct(key: str, q: float) -> float | None:
        value = nearest_rank(sorted(r[key] for r in rows), q)
        return None if value is None else round(value)

    ordered = sorted(rows, key=lambda r: r["total_us"])
    return {
        "requests": len(rows),
        **{f"{key}_p{q}_us": pct(f"{key}_us", q) for key in ("total", *SEGMENTS)
           for q in (50, 99)},
        "client_woken_on_server_cpu": round(sum(r["same_cpu"] for r in rows) / len(rows), 3)
        if rows else None,
        "resume_over_500us_behind": behind(rows),
        "slowest": [{k: (round(v) if isinstance(v, float) else v) for k, v in r.items()
                     if k != "server"} for r in (ordered[-slowest:] if slowest else [])],
    }


def behind(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Requests whose client waited over 0.5 ms to resume, by what held its CPU: a worker,
    an idle vCPU (swapper: the host had to wake it), anything else."""
    out = {"worker": 0, "idle vCPU": 0, "other": 0}
    for r in rows:
        if r["resume_us"] > 500:
            held = r["held_by"]
            out["worker" if held.startswith("kvprefetchd") else
                "idle vCPU" if held.startswith("swapper") else "other"] += 1
    return out


def analyse(perf_lines: Sequence[str], pids: list[dict[str, Any]], min_bytes: int,
            slowest: int) -> dict[str, Any]:
    trace = Trace(parse(perf_lines))
    servers: dict[int, dict[int, str]] = {}  # client -> its servers (the echo is shared)
    for entry in pids:
        mine = servers.setdefault(entry["client"], {})
        mine[entry["supervisor"]] = f"daemon ({entry['set']})"
        mine[entry["echo"]] = "echo"
    out: dict[str, list[dict[str, Any]]] = {}
    for client, named in servers.items():
        for row in requests(trace, client, named, min_bytes):
            out.setdefault(row["server"], []).append(row)
    return {name: summary(rows, slowest) for name, rows in out.items()}


def table(results: dict[str, Any]) -> str:
    head = ["server", "requests", "total p50", "p99", *(f"{s} p50/p99" for s in SEGMENTS),
            "on server's CPU", "resume > 0.5 ms behind"]
    lines = ["  ".join(f"{h:>16s}" for h in head)]  # the last column wider than its head
    for name, s in results.items():
        cells = [name, s["requests"], s["total_p50_us"], s["total_p99_us"],
                 *(f"{s[f'{k}_p50_us']}/{s[f'{k}_p99_us']}" for k in SEGMENTS),
                 s["client_woken_on_server_cpu"],
                 " ".join(f"{k}:{v}" for k, v in s["resume_over_500us_behind"].items())]
        lines.append("  ".join(f"{c!s:>16s}" for c in cells))
        for r in s["slowest"]:
            lines.append("    slow: " + " ".join(f"{k} {v}" for k, v in r.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--min-bytes", type=int, default=4096,
                        help="requests at least this long are cut (1,000 paths: ~80 KB)")
    parser.add_argument("--slowest", type=int, default=8, help="slow requests listed per server")
    parser.add_argument("ack_args", nargs=argparse.REMAINDER,
                        help="-- then bench/ack_latency.py's arguments (not --out)")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None or os.geteuid() != 0:
        print("ack_trace: needs root and perf", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    ack_args = [a for a in args.ack_args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="kvacktrace-") as scratch:
        pids_file, data = Path(scratch) / "pids.jsonl", Path(scratch) / "perf.data"
        env = {**os.environ, "KVBENCH_ACK_PIDS": str(pids_file)}
        here = Path(__file__).resolve().parent
        command = ["perf", "record", "-q", "-a", "-k", "CLOCK_MONOTONIC", "-o", str(data),
                   *(x for e in EVENTS for x in ("-e", e)), "--",
                   sys.executable, str(here / "ack_latency.py"), "--out", str(args.out),
                   *ack_args]
        subprocess.run(command, env=env, check=True)
        script = subprocess.run(["perf", "script", "-i", str(data), "-F",
                                 "tid,cpu,time,event,trace"], capture_output=True, text=True,
                                check=True)
        pids = [json.loads(line) for line in pids_file.read_text().splitlines()]
    results = analyse(script.stdout.splitlines(), pids, args.min_bytes, args.slowest)
    (args.out / "trace.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"\ntrace: {args.out / 'trace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
