"""What a worker is told before it is forked: fixed by the supervisor, read by the child."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvprefetchd.channel import RootTier
from kvprefetchd.engines import EngineSpec
from kvprefetchd.engines.base import EngineSettings
from kvprefetchd.worker.holds import HoldBudget


@dataclass(frozen=True)
class WorkerPlan:
    """Everything a worker needs, fixed by the supervisor before it forks."""

    index: int
    roots: tuple[str, ...]
    # Each root's directory fd as the supervisor holds it (inherited across the fork;
    # -1 while a root is not open yet: its fd comes later in a Root message), and its
    # residency rule code (KVP_RES_*).
    root_fds: tuple[int, ...]
    rules: tuple[int, ...]
    # Warm mode ("read", "advise") -> the engines to try, best first. The first mode is
    # the configured one (built at boot); another is there only when a model profile
    # chooses it and an engine of that mode can run here (built on first use).
    engines: Mapping[str, tuple[EngineSpec, ...]]
    engine_settings: EngineSettings
    dedup_ttl: float
    dedup_entries: int
    dedup_bytes: int = 16 << 20
    nice: int = 0
    batch: bool = False  # SCHED_BATCH (config.worker_batch)
    tiers: tuple[RootTier, ...] = ()  # per root, beside rules (RootTier() when not open)
    holds: HoldBudget = field(default_factory=HoldBudget)
    # Off: the probe opens each file once beneath a root's nodev view (worker/probe.py).
    check_before_open: bool = False
    # On: a FUSE root's requests are judged by its connection's count (native/gauge.c).
    admit_by_tier_count: bool = True

    @property
    def warm_mode(self) -> str:
        return next(iter(self.engines))
