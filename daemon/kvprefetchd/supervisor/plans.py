"""What each worker is told before it is forked (worker/plan.py), from the configuration
and the roots as they stand."""

from __future__ import annotations

import logging

from kvprefetchd.config import Config
from kvprefetchd.engines import EngineSpec, NoEngine, engine_candidates
from kvprefetchd.engines.base import EngineSettings
from kvprefetchd.roots.rootset import RootSet
from kvprefetchd.worker.holds import HoldBudget
from kvprefetchd.worker.plan import WorkerPlan

log = logging.getLogger("kvprefetchd")


def engines_by_mode(config: Config) -> dict[str, tuple[EngineSpec, ...]]:
    """The engines to try for each warm mode the workers may be asked for: the configured
    one (NoEngine if none can run), and the other one when a model profile chooses it."""
    choices = {config.warm_mode: engine_candidates(config.engine, config.warm_mode)}
    other = "advise" if config.warm_mode == "read" else "read"
    if other in config.model_warm_modes.values():
        try:
            choices[other] = engine_candidates(config.engine, other)
        except NoEngine as error:
            log.warning("%s mode for model profiles unavailable: %s", other, error)
    return choices


def worker_plan(config: Config, roots: RootSet, engines: dict[str, tuple[EngineSpec, ...]],
                index: int) -> WorkerPlan:
    return WorkerPlan(
        index=index,
        roots=config.roots,
        root_fds=roots.fds(),
        rules=roots.codes(),
        tiers=roots.tiers(),
        holds=HoldBudget(
            max_files=-(-config.hold_max_files // config.worker_count),
            max_bytes=config.hold_max_bytes // config.worker_count,
            seconds=config.hold_seconds,
        ),
        engines=engines,
        engine_settings=EngineSettings(
            chunk_bytes=config.chunk_bytes,
            queue_depth=config.queue_depth,
            pread_threads=config.pread_threads,
            fadv_random=config.fadv_random,
            batch_files=config.batch_files,
            max_open_files=config.max_open_files,
            initial_depth=config.initial_depth,
            max_in_flight=config.max_in_flight,
            file_timeout=config.file_timeout,
            other_mount_threads=config.other_mount_threads,
        ),
        check_before_open=config.check_before_open,
        admit_by_tier_count=config.admit_by_tier_count,
        dedup_ttl=config.dedup_ttl_ms / 1000.0,
        dedup_entries=config.dedup_entries,
        dedup_bytes=config.dedup_bytes,
        nice=config.worker_nice,
        batch=config.worker_batch,
    )
