"""Interleaved cold-cache runs of shell commands; medians of each.

  python3 bench/c/cold_matrix.py REPS 'label::command' ...

Before every run: sync; echo 3 > /proc/sys/vm/drop_caches; sleep 4 (this kind
of VM hands freed pages back to the host 2-3 s after drop_caches, and the
first touch of such a page pays a fault).  "seconds" is the last JSON line's
"seconds" (uring_heads.c, native_heads.py) or, for fio's JSON output, its
job_runtime; "wall" is the whole process.  Needs root.
"""

import json
import statistics
import subprocess
import sys
import time


def seconds(stdout: str) -> float | None:
    try:
        doc = json.loads(stdout[stdout.index("{"):])
        return doc["jobs"][0]["job_runtime"] / 1000.0
    except (ValueError, KeyError, IndexError):
        pass
    for line in reversed(stdout.splitlines()):
        try:
            return float(json.loads(line)["seconds"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def main() -> None:
    reps = int(sys.argv[1])
    cases = [a.split("::", 1) for a in sys.argv[2:]]
    res: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in cases}
    for r in range(reps):
        for label, cmd in cases:
            subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
            time.sleep(4)
            t0 = time.monotonic()
            out = subprocess.run(cmd, shell=True, capture_output=True, text=True)
            wall = time.monotonic() - t0
            if out.returncode:
                print(f"FAIL {label}: {out.stderr[-300:]}", flush=True)
            secs = seconds(out.stdout)
            res[label].append((wall if secs is None else secs, wall))
            print(f"rep{r} {label}: {res[label][-1][0]:.3f} (wall {wall:.3f})", flush=True)
    print(f"\nmedians over {reps} runs (seconds / wall):")
    for label, v in res.items():
        s = statistics.median(x for x, _ in v)
        w = statistics.median(y for _, y in v)
        runs = " ".join(f"{x:.2f}" for x, _ in v)
        print(f"  {label:34s} {s:7.3f} / {w:7.3f}   runs: {runs}")


if __name__ == "__main__":
    main()
