"""The slow tier's warm-up methods by name, the daemons behind them, and their environment.

Names (every one reads the same files through the same mount):
- kvprefetchd-<engine>: the daemon with `engine = "<engine>"` (auto: its default choice,
  whatever that is when the run happens), read mode; kvprefetchd-<engine>-advise: the same
  engine in advise mode (warm_mode = "advise"). Each has its own daemon, started once on
  the mount and reused for every point and repetition, otherwise at its defaults but for:
  - residency = "tier": the rule a tiered root is configured with (issue 13 item 3: `auto`
    picks it for the FUSE subtypes of tiered stores). It costs nothing more here: the
    native code fstats every file under every rule (native/prefetch.c), and the tier rule
    only compares that stat's st_blocks. On the simulator st_blocks counts fetched chunks
    and every file of an evicted tier has 0 blocks, so every file must come back `read`:
    a file left fetched by a broken eviction would say `resident`, and the run fails.
    (`off` would hide such a run; `pagecache`, what `auto` picks for fuse.tiersim
    today, asks cachestat for pages the eviction also dropped: the same answers here.)
  - dedup_ttl_ms = 0: the same files are asked for again, evicted, seconds later; the
    daemon's memory of what it warmed within the last second must not answer for them.
- pypool-N: N Python threads of open + FADV_RANDOM + pread of the head (warmup_tools.py).
- fio: io_uring, exactly the heads, iodepth `fio_depth` (1024: not what limits it).
- vmtouch: `vmtouch -t` of whole files (what an operator would run on a tier).
- uring_heads: bench/c/uring_heads.c at depth `fio_depth` (not in the default list).
- none: nothing runs: the control that the tier was cold and nobody else fetched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from warmup_daemon import EngineDaemon, Prefetch, start_engine_daemon
from warmup_methods import BASELINE, DAEMON_PREFIX, Env
from warmup_tools import availability, fio_jobfile, pool_threads

from kvprefetchd.config import ENGINES

DEFAULT = "kvprefetchd-auto"  # the daemon with no tuning flags: what the targets measure
TARGET_POOLS = ("pypool-64", "pypool-256", "pypool-1024")  # issue 13's "best of" set
METHODS = (DEFAULT, "kvprefetchd-pread", "kvprefetchd-io_uring", "kvprefetchd-fadvise-advise",
           "pypool-16", *TARGET_POOLS, "fio", "vmtouch", BASELINE)
TOOLS = ("fio", "vmtouch", "uring_heads")
ADVISE = "-advise"
MAX_POOL_THREADS = 4096


def daemon_spec(method: str) -> tuple[str, str] | None:
    """(engine, warm mode) of a daemon method, None for any other method."""
    if not method.startswith(DAEMON_PREFIX):
        return None
    engine = method.removeprefix(DAEMON_PREFIX)
    if engine.endswith(ADVISE):
        return engine.removesuffix(ADVISE), "advise"
    return engine, "read"


def unknown(method: str) -> str | None:
    """Why a name is not a tier method, or None when it is one."""
    spec = daemon_spec(method)
    if spec is not None:
        return None if spec[0] in ENGINES else f"{method}: no engine {spec[0]!r} in {ENGINES}"
    threads = pool_threads(method)
    if threads is not None:
        return None if 1 <= threads <= MAX_POOL_THREADS else f"{method}: 1-{MAX_POOL_THREADS}"
    if method in (*TOOLS, BASELINE):
        return None
    return f"{method}: not a method; use kvprefetchd-<engine>[-advise], pypool-N, " \
           f"{', '.join(TOOLS)} or {BASELINE}"


def reads_whole_files(method: str) -> bool:
    return method == "vmtouch"


def start_daemons(methods: Sequence[str], root: Path, head: int, files: int, workers: int,
                  workdir: Path, logdir: Path) -> dict[str, EngineDaemon]:
    """One daemon per daemon method, rooted at the mount; stopped by the caller."""
    daemons: dict[str, EngineDaemon] = {}
    try:
        for method in methods:
            if (spec := daemon_spec(method)) is None:
                continue
            engine, mode = spec
            daemons[method] = start_engine_daemon(
                engine, root, head, files, workers, workdir, logdir, dedup=False,
                name=f"tier-{method.removeprefix(DAEMON_PREFIX)}",
                extra={"warm_mode": mode, "residency": "tier"})
    except BaseException:
        for daemon in daemons.values():
            daemon.stop()
        raise
    return daemons


def daemon_settings(daemons: dict[str, EngineDaemon]) -> dict[str, Any]:
    """What each daemon ran: the engine asked for and the one it reports running."""
    return {method: {"engine": d.engine, "running": d.running, "workers": d.workers,
                     "warm_mode": (daemon_spec(method) or ("", ""))[1], "residency": "tier",
                     "dedup_ttl_ms": 0} for method, d in daemons.items()}


def skipped(methods: Sequence[str]) -> dict[str, str]:
    """The methods that cannot run here, with the reason (a tool not installed)."""
    return {m: why for m in methods if m in TOOLS and (why := availability(m)) is not None}


def environment(paths: list[str], head: int, workdir: Path, fio_dir: Path, fio_depth: int,
                daemons: dict[str, EngineDaemon], prefetch: Prefetch, chunk_paths: int,
                uring_heads: Path | None) -> Env:
    """The local-disk suite's Env, pointed at the mount: the same calls run each method."""
    list_file = workdir / "tier-paths.txt"
    list_file.write_text("\n".join(paths) + "\n")
    return Env(paths=paths, head=head, workdir=workdir, list_file=list_file,
               fio_job=fio_jobfile(paths, head, fio_dir, workdir / "tier-heads.fio", fio_depth),
               fio_direct_job=None,
               uring_heads=uring_heads, daemons=daemons, prefetch=prefetch,
               chunk_paths=chunk_paths, state="cold", vmtouch_whole=True,
               uring_depth=fio_depth)
