"""Engine registry: pick one by name, or the best this machine offers.

`auto` picks by measurement, not by reputation (bench/warmup.py, same cold
files, same run; README "Performance"): in read mode the pread engine (16
threads per worker) beat io_uring reads by 0.86x on 2,000 1 MiB heads and
0.82x on 20,000 whole 256 KiB files, because with cold metadata the opens cost
more than the reads and the threads open in parallel where the ring's
submitter opens one file after another. In advise mode io_uring FADVISE beat
posix_fadvise (1.66 s against 2.00 s, bench/c/cold_matrix.py). So: read mode
tries pread first, advise mode io_uring first. On a high-latency tier, where
a deeper queue matters more than open cost, measure `engine = "io_uring"`.

The supervisor probes once and logs why an engine is passed over; each worker
then builds the first candidate that works for it, so a ring refused inside a
worker (seccomp, a memory limit) degrades to the fallback instead of failing
the boot.
"""

from __future__ import annotations

import logging

from kvprefetchd.engines.base import Engine
from kvprefetchd.engines.fadvise import FadviseEngine
from kvprefetchd.engines.pread import PreadEngine
from kvprefetchd.engines.uring import UringAdviseEngine, UringEngine

log = logging.getLogger("kvprefetchd.engines")


class NoEngine(RuntimeError):
    """The configured engine cannot run here; the message says why."""


def _named(name: str, warm_mode: str) -> type[Engine]:
    if name == "io_uring":
        return UringAdviseEngine if warm_mode == "advise" else UringEngine
    if name == "fadvise":
        return FadviseEngine
    if name == "pread":
        # pread has no advise form: posix_fadvise(WILLNEED) is the portable one.
        return FadviseEngine if warm_mode == "advise" else PreadEngine
    raise NoEngine(f"unknown engine {name!r}")


def engine_candidates(name: str, warm_mode: str) -> tuple[type[Engine], ...]:
    """The engines to try, best first; explicit names allow no fallback."""
    if name != "auto":
        chosen = _named(name, warm_mode)
        reason = chosen.unavailable_reason()
        if reason is not None:
            raise NoEngine(f"engine {name} is unavailable: {reason}")
        return (chosen,)
    candidates = []
    order = ("io_uring", "fadvise") if warm_mode == "advise" else ("pread", "io_uring")
    for option in order:
        engine = _named(option, warm_mode)
        reason = engine.unavailable_reason()
        if reason is None:
            candidates.append(engine)
        else:
            log.info("engine auto: passing over %s: %s", option, reason)
    if not candidates:
        raise NoEngine("no engine can run here (is the native extension built?)")
    return tuple(candidates)
