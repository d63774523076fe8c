"""The warm-up methods by name, what each needs for a run, and the one call that runs one.

Methods: kvprefetchd-<engine> (and kvprefetchd-<engine>-<n>w for other worker
counts), the tools and pools of warmup_tools.py, and `none`, the baseline that does
nothing (the consumer alone reads the cold set).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import warmup_tools as tools
from warmup_daemon import EngineDaemon, Prefetch, warm_daemon

ENGINES = ("io_uring", "fadvise", "pread")
DAEMON_PREFIX = "kvprefetchd-"
BASELINE = "none"


def daemon_method(engine: str, workers: int, primary: int) -> str:
    """kvprefetchd-<engine> with the primary worker count, kvprefetchd-<engine>-<n>w else."""
    return DAEMON_PREFIX + engine + ("" if workers == primary else f"-{workers}w")


def all_methods(engines: Sequence[str], workers: Sequence[int] = (2,)) -> list[str]:
    daemons = [daemon_method(e, w, workers[0]) for w in workers for e in engines]
    return daemons + list(tools.TOOL_METHODS) + list(tools.POOL_METHODS) + [BASELINE]


def chosen_methods(known: list[str], asked: str) -> list[str]:
    """`asked` (comma-separated) in `known`'s order; "all" is every warmer, the device's
    ceiling (not a warmer) only by name."""
    if asked == "all":
        return [m for m in known if m != tools.DEVICE_REFERENCE]
    wanted = {m for m in asked.split(",") if m}
    return [m for m in known if m in wanted]


def kind(method: str) -> str:
    """daemon, baseline, python (a pool in this process) or tool (a child process)."""
    if method.startswith(DAEMON_PREFIX):
        return "daemon"
    if method == BASELINE:
        return "baseline"
    return "python" if tools.pool_threads(method) is not None else "tool"


@dataclass
class Env:
    """Everything a method needs, fixed for the whole run."""

    paths: list[str]
    head: int
    workdir: Path
    list_file: Path
    fio_job: Path | None
    fio_direct_job: Path | None
    uring_heads: Path | None
    daemons: dict[str, EngineDaemon]
    prefetch: Prefetch
    chunk_paths: int
    state: str = "cold"
    vmtouch_whole: bool = False  # vmtouch -t of whole files instead of [0, head)
    uring_depth: int = 128  # uring_heads -q


def warm(env: Env, method: str) -> dict[str, Any]:
    """One warm-up by `method`: {seconds, cpu_s, detail, ok}."""
    files = len(env.paths)
    if method.startswith(DAEMON_PREFIX):
        return warm_daemon(env.daemons[method], env.prefetch, env.paths, env.head,
                           env.chunk_paths, env.state)
    if method == "vmtouch":
        return tools.warm_vmtouch(env.list_file, None if env.vmtouch_whole else env.head)
    if method == "fio":
        assert env.fio_job is not None
        return tools.warm_fio(env.fio_job, files, env.head)
    if method == tools.DEVICE_REFERENCE:
        assert env.fio_direct_job is not None
        return tools.warm_fio(env.fio_direct_job, files, env.head)
    if method == "uring_heads":
        assert env.uring_heads is not None
        return tools.warm_uring_heads(env.uring_heads, env.list_file, files, env.head,
                                      env.uring_depth)
    if (threads := tools.pool_threads(method)) is not None:
        return tools.warm_pool(env.paths, env.head, threads)
    raise ValueError(method)
