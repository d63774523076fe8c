"""Engine registry: pick one by name, or the best this machine offers.

`auto` prefers io_uring (the mission's engine: one ring, batched reads, no
thread per file), then pread; the pick and the reasons for passing over the
others are logged and reported by `ping`.
"""

from __future__ import annotations

from kvprefetchd.engines.base import Engine
from kvprefetchd.engines.fadvise import FadviseEngine
from kvprefetchd.engines.pread import PreadEngine
from kvprefetchd.engines.uring import UringAdviseEngine, UringEngine


class NoEngine(RuntimeError):
    """The configured engine cannot run here; the message says why."""


def engine_class(name: str, warm_mode: str) -> type[Engine]:
    """Resolve a configured engine name and warm mode to the class a worker will build."""
    if name == "auto":
        return engine_class("io_uring", warm_mode) if UringEngine.unavailable_reason() is None \
            else engine_class("fadvise" if warm_mode == "advise" else "pread", warm_mode)
    if name == "io_uring":
        chosen: type[Engine] = UringAdviseEngine if warm_mode == "advise" else UringEngine
    elif name == "fadvise":
        chosen = FadviseEngine
    elif name == "pread":
        chosen = FadviseEngine if warm_mode == "advise" else PreadEngine
    else:
        raise NoEngine(f"unknown engine {name!r}")
    reason = chosen.unavailable_reason()
    if reason is not None:
        raise NoEngine(f"engine {name} is unavailable: {reason}")
    return chosen
