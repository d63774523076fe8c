"""The hot path: what saying "resident" costs the daemon (issue 16's scenario).

In production most files a router asks for are already warm, so the daemon's CPU per
resident file decides how many requests a gateway host serves. On a set of files whose
heads are resident (read just before, every head verified), with 2 workers and
dedup_ttl_ms = 0 (so every file pays the real residency check), under each residency rule:

- wait: requests of --wait-paths paths with `wait`, the whole set --reps times: wall time
  and daemon CPU (supervisor and workers, from /proc) per file. Its peer in the same run
  (issue 25: judged against vmtouch, not in microseconds): after each of the daemon's
  passes (before it, every other pass), `vmtouch -q -p 0-HEAD -b LIST` over the same
  files (open, fstat, mmap, mincore, munmap, close each: the same question for the same
  head), and its whole-file default `vmtouch -q -b LIST`, user + system CPU of the
  vmtouch process (wait4) per file; `vs_vmtouch` = daemon CPU per file / head vmtouch's.
  And the attribution: the worker's native probe alone (kvprefetchd.probe.Prober, the
  call a worker makes, in this process on the same requests' names): the rest of the
  workers' CPU is Python and the channel. With --syscalls, the workers' syscalls per
  file in one more pass (perf stat), a figure the host's load does not move;
- sustained: fire-and-forget requests of --chunk paths offered at --rate files/s for
  --seconds, paced by the clock on one connection: files accepted and dropped (from the
  acks), the rate the daemon settled them at (from its stats, until nothing is in flight),
  and CPU per file.

- memory (--distinct N, 0: skipped): N distinct paths streamed through a daemon at its
  default dedup settings in fire-and-forget requests of --chunk paths, as fast as the
  acks' room allows: one in 100 a real file of --memory-files 4 KiB files (each once, so
  the workers' memory of recent reads passes its bound, dedup_entries = 4,096 here, within
  the warm-up), the rest names
  not written yet (under 1,000 absent folders). The RSS of the supervisor and of each
  worker is sampled twice a second; after the first 10% of the paths (warm-up), its
  least and largest values against the sample at the end of the warm-up.

Figures, never verdicts: the targets of issue 16 (<= 8 us of daemon CPU per file,
>= 150,000 files/s with 0 dropped, supervisor <= 3 us per path, RSS within +-5% under
10^7 distinct paths) and issue 25's (daemon CPU per file <= 0.6 x vmtouch's, same run, on
the page-cache rule) are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from kvharness.daemon import Daemon, start_config
from kvharness.pagecache import pinned

TARGETS = {"daemon_cpu_us_per_file": 8.0, "supervisor_cpu_us_per_path": 3.0,
           "sustained_files_per_s": 150_000, "rss_band": 0.05, "vs_vmtouch": 0.6}
WARMUP_SHARE = 0.1  # of the memory phase's paths, before RSS is judged
DEDUP_ENTRIES = 4096  # per worker, in the memory phase
RULES = ("pagecache", "tier")
PERF_ACK_TIMEOUT = 10.0  # seconds for perf to attach and acknowledge a control command


def make_set(base: Path, files: int, size: int) -> list[str]:
    """`files` files of `size` bytes under base/hot-FILESxSIZE (made once, then reused)."""
    root = base / f"hot-{files}x{size}"
    paths = [str(root / f"{i % 64:02x}" / f"{i:07d}.bin") for i in range(files)]
    if not (root / ".complete").exists():
        block = os.urandom(size)
        for path in paths:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(block)
        (root / ".complete").write_text("ok\n")
    return paths


def cpu_now(daemon: Daemon, pids: Sequence[int]) -> tuple[float, float]:
    workers, supervisor = daemon.cpu(pids)
    return supervisor, workers


def vmtouch_cpu(list_file: Path, head: int | None, log: Path) -> float:
    """User + system CPU seconds of one `vmtouch -q` over the NUL-separated list (head:
    only its first `head` bytes of each file, `-p 0-HEAD`), from wait4's rusage."""
    argv = ["vmtouch", "-q", "-0", "-b", str(list_file)]
    if head is not None:
        argv[2:2] = ["-p", f"0-{head}"]
    with log.open("ab") as errors:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {process.returncode} (see {log})")
    return float(usage.ru_utime + usage.ru_stime)


def probe_cpu(paths: Sequence[str], args: argparse.Namespace, rule: str) -> tuple[float, int]:
    """CPU seconds of the worker's native probe alone over the set, once, in this
    process: the same Prober and the same call a worker makes per message (a request's
    share: half of --wait-paths names, as 2 workers each get); and how many it found
    resident (all of them, or the figure is not only the hot path's)."""
    from kvprefetchd.native import load_native
    from kvprefetchd.worker.probe import Prober

    native = load_native()
    root = os.open(args.base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        prober = Prober(native, [root], [native.rule_codes[rule]],
                        check_before_open=getattr(args, "check_before_open", False))
        if not prober.useful:
            prober.close()
            return float("nan"), 0
        prefix = len(str(args.base)) + 1
        share = max(1, args.wait_paths // 2)
        batches = [paths[at:at + share] for at in range(0, len(paths), share)]
        blobs = [(b"".join(p[prefix:].encode() + b"\0" for p in batch),
                  bytes(2 * len(batch)), len(batch)) for batch in batches]
        resident = 0
        started = time.process_time()
        for blob, roots, count in blobs:
            found, _, _ = prober.probe(roots, blob, count, args.size)
            resident += len(found) // 4
        spent = time.process_time() - started
        prober.close()
    finally:
        os.close(root)
    return spent, resident


def syscalls_per_file(daemon: Daemon, pids: Sequence[int], paths: Sequence[str],
                      args: argparse.Namespace) -> float | None:
    """Syscalls the workers make per file in one more wait pass, counted by `perf stat`
    (raw_syscalls:sys_enter) on the worker processes: a figure the host's load does not
    move, unlike CPU time (issue 25). An extra pass, outside the CPU figures: the
    tracepoint costs the workers CPU. perf starts with its events off and is switched on
    and off through its control fifo, each command acknowledged, so the count holds that
    pass exactly. None without --syscalls, or where perf is missing or may not attach."""
    if not args.syscalls or shutil.which("perf") is None:
        return None
    ctl, ack, out = args.out / "perf-ctl", args.out / "perf-ack", args.out / "perf-syscalls.csv"
    for fifo in (ctl, ack):
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
    perf = subprocess.Popen(["perf", "stat", "-x", ",", "-e", "raw_syscalls:sys_enter", "-D",
                             "-1", "--control", f"fifo:{ctl},{ack}", "-p",
                             ",".join(map(str, pids)), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # O_RDWR: opening a FIFO so never blocks, even if perf never opens its end.
    control, acked = os.open(ctl, os.O_RDWR), os.open(ack, os.O_RDWR)

    def command(word: str) -> bool:
        os.write(control, word.encode() + b"\n")
        if not select.select([acked], [], [], PERF_ACK_TIMEOUT)[0]:
            return False  # perf could not attach, or exited
        return os.read(acked, 64).strip(b"\0\n ") == b"ack"  # perf 6.1 sends "ack\n\0"

    try:
        if not command("enable"):
            return None
        with daemon.connect(120) as connection:
            for at in range(0, len(paths), args.wait_paths):
                connection.call_ok("prefetch", paths=list(paths[at:at + args.wait_paths]),
                                   wait=True)
        if not command("disable"):
            return None
    finally:
        os.close(control)
        os.close(acked)
        perf.send_signal(signal.SIGINT)  # perf writes its counts and exits
        perf.wait(30)
    for line in out.read_text().splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2] == "raw_syscalls:sys_enter" and fields[0].isdigit():
            return round(int(fields[0]) / len(paths), 2)
    return None


def per_file(seconds: float, files: int) -> float:
    return round(seconds / files * 1e6, 2)


def phase_wait(daemon: Daemon, pids: Sequence[int], paths: Sequence[str],
               args: argparse.Namespace, rule: str) -> dict[str, Any]:
    """The daemon's passes, each next to vmtouch's over the same files (alternately before
    and after it, so neither always runs on caches the other warmed)."""
    outcomes: dict[str, int] = {}
    peer = shutil.which("vmtouch") is not None
    list_file = args.out / "vmtouch-list"
    list_file.write_bytes(b"".join(p.encode() + b"\0" for p in paths))
    log = args.out / "vmtouch.log"
    sup = wrk = wall = head = whole = 0.0
    with daemon.connect(120) as connection:
        for rep in range(args.reps):
            if peer and rep % 2:
                head += vmtouch_cpu(list_file, args.size, log)
                whole += vmtouch_cpu(list_file, None, log)
            sup0, wrk0 = cpu_now(daemon, pids)
            started = time.perf_counter()
            for at in range(0, len(paths), args.wait_paths):
                reply = connection.call_ok("prefetch", paths=list(paths[at:at + args.wait_paths]),
                                           wait=True)
                for name, count in reply["outcomes"].items():
                    outcomes[name] = outcomes.get(name, 0) + count
            wall += time.perf_counter() - started
            sup1, wrk1 = cpu_now(daemon, pids)
            sup, wrk = sup + sup1 - sup0, wrk + wrk1 - wrk0
            if peer and not rep % 2:
                head += vmtouch_cpu(list_file, args.size, log)
                whole += vmtouch_cpu(list_file, None, log)
    syscalls = syscalls_per_file(daemon, pids, paths, args)
    probe, probe_found = probe_cpu(paths, args, rule)
    files = len(paths) * args.reps
    daemon_us = per_file(sup + wrk, files)
    vmtouch_us = per_file(head, files) if peer else None
    return {
        "files": files, "wall_s": round(wall, 3),
        "wall_us_per_file": per_file(wall, files),
        "supervisor_cpu_us_per_file": per_file(sup, files),
        "workers_cpu_us_per_file": per_file(wrk, files),
        "daemon_cpu_us_per_file": daemon_us,
        "probe_alone_cpu_us_per_file": per_file(probe, len(paths)),
        "probe_alone_resident": probe_found,
        "vmtouch_head_cpu_us_per_file": vmtouch_us,
        "vmtouch_whole_cpu_us_per_file": per_file(whole, files) if peer else None,
        "vs_vmtouch": round(daemon_us / vmtouch_us, 3) if vmtouch_us else None,
        "workers_syscalls_per_file": syscalls,
        "outcomes": {k: v for k, v in outcomes.items() if v},
    }


def phase_sustained(daemon: Daemon, pids: Sequence[int], paths: Sequence[str],
                    args: argparse.Namespace) -> dict[str, Any]:
    before = daemon.stats()["files"]
    sup0, wrk0 = cpu_now(daemon, pids)
    accepted = dropped = offered = 0
    started = time.perf_counter()
    at = 0
    with daemon.connect(60) as connection:
        while (now := time.perf_counter() - started) < args.seconds:
            due = int(now * args.rate)
            if offered >= due:
                time.sleep(min(0.001, (offered - due + 1) / args.rate))
                continue
            chunk = [paths[(at + i) % len(paths)] for i in range(args.chunk)]
            at = (at + args.chunk) % len(paths)
            ack = connection.call_ok("prefetch", paths=chunk)
            offered += len(chunk)
            accepted += ack["accepted"]
            dropped += ack["dropped"]
    sent_s = time.perf_counter() - started
    while daemon.stats()["files"]["in_flight"] > 0:
        time.sleep(0.01)
    drained_s = time.perf_counter() - started
    sup1, wrk1 = cpu_now(daemon, pids)
    after = daemon.stats()["files"]
    settled = sum(after[k] - before[k] for k in ("read", "resident", "missing", "failed"))
    return {
        "offered_files_per_s": args.rate, "offered": offered,
        "achieved_offer_per_s": round(offered / sent_s),
        "accepted": accepted, "dropped": dropped, "settled": settled,
        "settled_files_per_s": round(settled / drained_s),
        "supervisor_cpu_us_per_file": round((sup1 - sup0) / max(1, offered) * 1e6, 2),
        "daemon_cpu_us_per_file": round((sup1 - sup0 + wrk1 - wrk0) / max(1, settled) * 1e6, 2),
        "resident": after["resident"] - before["resident"],
    }


def distinct_paths(base: Path, real: Sequence[str], count: int) -> Iterator[str]:
    """`count` distinct paths: every 100th a real file (each once, while they last), the
    rest names not written yet, under 1,000 absent folders."""
    absent = base / "distinct-absent"
    for i in range(count):
        if i % 100 == 0 and i // 100 < len(real):
            yield real[i // 100]
        else:
            yield f"{absent}/d{i % 1000:03d}/{i:012x}.bin"


def rss_of(pids: Sequence[int]) -> list[int]:
    return [psutil.Process(pid).memory_info().rss for pid in pids]


def phase_memory(args: argparse.Namespace, on_step: Callable[[str], None]) -> dict[str, Any]:
    real = make_set(args.base, args.memory_files, 4096)
    # dedup_entries is lowered so its bound is reached within the warm-up (at the default
    # 65,536 per worker it takes 131,072 distinct warmed files): the run then shows the
    # memory of recent reads forgetting as fast as it learns.
    daemon = start_config(args.out / "daemon-memory", {"roots": [str(args.base)], "workers": 2,
                                                       "dedup_entries": DEDUP_ENTRIES})
    try:
        pids = [daemon.process.pid, *daemon.worker_pids()]
        names = ["supervisor", *(f"worker {i}" for i in range(len(pids) - 1))]
        samples: list[tuple[int, list[int]]] = []
        sent = dropped = 0
        next_sample = time.perf_counter()
        started = next_sample
        chunk: list[str] = []
        with daemon.connect(60) as connection:
            for path in distinct_paths(args.base, real, args.distinct):
                chunk.append(path)
                if len(chunk) < args.chunk:
                    continue
                ack = connection.call_ok("prefetch", paths=chunk)
                sent += len(chunk)
                dropped += ack["dropped"]
                chunk = []
                while ack["room"] < args.chunk:  # the workers are behind: let them catch up
                    time.sleep(0.002)
                    ack = connection.call_ok("prefetch", paths=[])
                if time.perf_counter() >= next_sample:
                    samples.append((sent, rss_of(pids)))
                    next_sample += 0.5
                    if len(samples) % 20 == 0:
                        on_step(f"hot: memory {sent:,} paths")
            if chunk:
                dropped += connection.call_ok("prefetch", paths=chunk)["dropped"]
                sent += len(chunk)
        while daemon.stats()["files"]["in_flight"] > 0:
            time.sleep(0.01)
        seconds = time.perf_counter() - started
        samples.append((sent, rss_of(pids)))
        workers = daemon.stats()["workers"]
    finally:
        daemon.stop()
    warm = next((k for k, (at, _) in enumerate(samples) if at >= WARMUP_SHARE * sent),
                len(samples) - 1)
    processes = {}
    for column, name in enumerate(names):
        after = [rss[column] for _, rss in samples[warm:]]
        base_rss = after[0]
        processes[name] = {
            "rss_at_warmup_mib": round(base_rss / 2**20, 2),
            "rss_min_mib": round(min(after) / 2**20, 2),
            "rss_max_mib": round(max(after) / 2**20, 2),
            "rss_last_mib": round(after[-1] / 2**20, 2),
            "band": [round(min(after) / base_rss - 1, 4), round(max(after) / base_rss - 1, 4)],
        }
    return {"paths": sent, "distinct": args.distinct, "real_files": len(real),
            "dedup_entries": DEDUP_ENTRIES,
            "dropped": dropped, "seconds": round(seconds, 1),
            "paths_per_s": round(sent / seconds), "samples": len(samples),
            "warmup_paths": samples[warm][0], "processes": processes,
            "probed": {"resident": sum(w["probed_resident"] for w in workers),
                       "missing": sum(w["probed_missing"] for w in workers)}}


def run(args: argparse.Namespace,
        on_step: Callable[[str], None] = lambda _step: None) -> dict[str, Any]:
    paths = make_set(args.base, args.files, args.size)
    results: dict[str, Any] = {"files": args.files, "file_bytes": args.size, "rules": {},
                               "targets": TARGETS, "settings": vars(args) | {
                                   "base": str(args.base), "out": str(args.out)}}
    for rule in RULES:
        daemon = start_config(args.out / f"daemon-{rule}", {
            "roots": [str(args.base)], "workers": 2, "dedup_ttl_ms": 0,
            "read_bytes": args.size, "residency_by_root": {str(args.base): rule},
            "check_before_open": bool(getattr(args, "check_before_open", False)),
        })
        try:
            pids = daemon.worker_pids()
            on_step(f"hot: {rule} wait")
            # Every head read and mlocked for both phases (pagecache.pinned): the host's
            # reclaimer and others' drop_caches cannot make the daemon read one. Where mlock
            # is refused they are only mapped: `resident_before` counts the ones still whole.
            with pinned(paths, args.size) as pin:
                resident = len(pin.kept())
                wait = phase_wait(daemon, pids, paths, args, rule)
                on_step(f"hot: {rule} sustained")
                sustained = phase_sustained(daemon, pids, paths, args)
        finally:
            daemon.stop()
        results["rules"][rule] = {"resident_before": resident, "mlocked": len(pin.locked),
                                  "wait": wait, "sustained": sustained}
    if args.distinct:
        on_step("hot: memory")
        results["memory"] = phase_memory(args, on_step)
    return results


def summary(results: dict[str, Any]) -> list[str]:
    """Markdown lines: per rule, the figures beside issue 16's targets."""
    lines = [f"**Hot path**: {results['files']} resident files of {results['file_bytes']} bytes, "
             "2 workers, dedup off. Targets (issue 16): daemon CPU <= 8 us/file, supervisor "
             "<= 3 us/path, >= 150,000 files/s sustained with 0 dropped; issue 25: daemon "
             "CPU per file <= 0.6 x vmtouch's (head, same files, same run; page-cache rule).",
             "",
             "| rule | wait: daemon CPU us/file | supervisor | workers | probe alone "
             "| vmtouch head | whole | x vmtouch | syscalls/file | wall us/file "
             "| sustained: offered/s | dropped | settled/s | CPU us/file |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rule, figures in results["rules"].items():
        wait, sus = figures["wait"], figures["sustained"]
        lines.append(f"| {rule} | {wait['daemon_cpu_us_per_file']} | "
                     f"{wait['supervisor_cpu_us_per_file']} | {wait['workers_cpu_us_per_file']} | "
                     f"{wait.get('probe_alone_cpu_us_per_file', '')} | "
                     f"{wait.get('vmtouch_head_cpu_us_per_file', '')} | "
                     f"{wait.get('vmtouch_whole_cpu_us_per_file', '')} | "
                     f"{wait.get('vs_vmtouch', '')} | "
                     f"{wait.get('workers_syscalls_per_file') or ''} | "
                     f"{wait['wall_us_per_file']} | {sus['achieved_offer_per_s']} | "
                     f"{sus['dropped']} | {sus['settled_files_per_s']} | "
                     f"{sus['daemon_cpu_us_per_file']} |")
    memory = results.get("memory")
    if memory:
        lines += ["", f"**Memory**: {memory['paths']:,} distinct paths ({memory['real_files']:,} "
                  f"real files among them) in {memory['seconds']} s, {memory['dropped']} "
                  f"dropped; RSS after the first {memory['warmup_paths']:,} paths (target: "
                  "within +-5%):", "",
                  "| process | at warm-up MiB | min | max | last | band |",
                  "|---|---|---|---|---|---|"]
        for name, p in memory["processes"].items():
            lines.append(f"| {name} | {p['rss_at_warmup_mib']} | {p['rss_min_mib']} | "
                         f"{p['rss_max_mib']} | {p['rss_last_mib']} | "
                         f"{p['band'][0]:+.1%} .. {p['band'][1]:+.1%} |")
    return lines


def scenario(results: dict[str, Any], raw_path: Path) -> dict[str, Any]:
    """The suite's entry: the figures per rule, and whether anything was dropped or not
    served resident (a resident set must come back resident: every mlocked head)."""
    return {"kind": "hot", "name": "hot", "raw": str(raw_path), "files": results["files"],
            "file_bytes": results["file_bytes"], "targets": results["targets"],
            "rules": results["rules"], "memory": results.get("memory")}


def ok(entry: dict[str, Any]) -> bool:
    """Nothing dropped, and every mlocked head found resident every time it was asked
    for (the wait phase asks for the whole set `reps` times)."""
    return all(f["sustained"]["dropped"] == 0 and f["wait"]["outcomes"].get("resident", 0)
               >= f["wait"]["files"] // entry["files"] * f.get("mlocked", 0)
               for f in entry["rules"].values())


def argv_of(table: dict[str, Any], base: Path, out: Path) -> list[str]:
    """hot.py's command line from a scenario file's [hot] table (keys = its flags)."""
    unknown = set(table) - HOT_KEYS
    if unknown:
        raise ValueError(f"[hot] has unknown keys {sorted(unknown)}")
    argv = ["--base", str(base), "--out", str(out)]
    for key, value in table.items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):  # a switch: present or not
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


HOT_KEYS = {"files", "size", "reps", "wait_paths", "rate", "chunk", "seconds", "distinct",
            "memory_files", "syscalls"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=64 << 10, help="bytes per file (= the head)")
    parser.add_argument("--reps", type=int, default=3, help="passes over the set with wait")
    parser.add_argument("--wait-paths", type=int, default=5000)
    parser.add_argument("--rate", type=int, default=150_000, help="files/s offered")
    parser.add_argument("--chunk", type=int, default=1000, help="paths per request")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to offer")
    parser.add_argument("--distinct", type=int, default=0,
                        help="distinct paths for the memory phase (0: no memory phase)")
    parser.add_argument("--memory-files", type=int, default=100_000,
                        help="real 4 KiB files among them (each once)")
    parser.add_argument("--syscalls", action="store_true",
                        help="count the workers' syscalls per file in one more pass (perf)")
    parser.add_argument("--check-before-open", action="store_true",
                        help="the daemon's check_before_open: two opens per file in the probe")
    parser.add_argument("--base", type=Path, default=Path("/var/tmp/kvbench"))
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args, lambda step: print(step, file=sys.stderr))
    (args.out / "hot.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
