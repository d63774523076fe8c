"""The router replay's tiers: bench/tiersim, and s3fs-fuse with kernel_cache over a local S3.

Each is a replay_run.Tier: `path` names a population file on the mount, `cold` makes the whole
tier cold, `resident` says how many bytes of a file's head a consumer would read without a
fetch, `counters` what the tier fetched.

- tiersim (as bench/tier.py mounts it, with a finite number of fetch slots): cold is
  `evict-all`, which drops the mount's page cache too, with the backing files kept in the
  page cache (tier_measure.py says why); a file's near bytes are its fetched chunks, which
  its st_blocks count exactly (tiersim/README.md).
- s3fs with `kernel_cache` (kvharness.realtier: the one of its configurations that keeps
  the page cache across opens, so a warm-up reaches the consumer; bench/realtier.py runs it
  as `s3fs/kernel_cache`): the population is uploaded as flat objects (s3rver behind the
  delay proxy), file i of the population is object i; cold is `Mount.cold()` (unmount,
  drop_caches, settle, remount); near bytes are the page cache's (mincore: pages whose read
  completed), and the counters are the object GETs that crossed the proxy.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import replay_stream
from tier_measure import keep_backing_warm

import tiersim
from kvharness import realtier
from kvharness.pagecache import fd_residency

BLOCK = 512  # st_blocks' unit (stat(2))
TIERS = ("tiersim", "s3fs")


class SimTier:
    """bench/tiersim (module docstring)."""

    def __init__(self, tier: tiersim.Tier, backing: list[str]) -> None:
        self.tier, self.backing, self.root = tier, backing, tier.mountpoint

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def cold(self) -> None:
        keep_backing_warm(self.backing)
        self.tier.evict_all()

    def reset(self) -> None:
        self.tier.reset_stats()

    def resident(self, fd: int, head: int) -> int:
        st = os.fstat(fd)
        return int(min(st.st_blocks * BLOCK, st.st_size, head))

    def counters(self) -> dict[str, int]:
        s = self.tier.stats()
        return {"fetches": s.fetches, "reads": s.reads, "read_errors": s.read_errors,
                "peak_in_flight": s.peak_in_flight}


class S3fsTier:
    """s3fs kernel_cache (module docstring)."""

    def __init__(self, fs: realtier.Mount, proxy: realtier.DelayProxy, keys: dict[str, str]):
        self.fs, self.proxy, self.keys, self.root = fs, proxy, keys, fs.path

    def path(self, name: str) -> str:
        return os.path.join(self.root, self.keys[name])

    def cold(self) -> None:
        self.fs.cold()

    def reset(self) -> None:
        pass

    def resident(self, fd: int, head: int) -> int:
        return fd_residency(fd, 0, head, uptodate=True)[0]

    def counters(self) -> dict[str, int]:
        counts = self.proxy.counts()
        return {"fetches": counts["GET"], "heads": counts["HEAD"], "lists": counts["LIST"]}


@contextmanager
def mounted(kind: str, spec: replay_stream.StreamSpec, base: Path, workdir: Path,
            latency_ms: float, slots: int, delay_ms: float) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The tier of `kind` holding the spec's population, and what describes it."""
    files = replay_stream.Population.of(spec).files()
    if kind == "tiersim":
        root = replay_stream.ensure_backing(spec, base)
        with tiersim.mount(root, workdir / "mnt", latency_ms=latency_ms, slots=slots) as tier:
            # fusectl as systemd mounts it: the daemon judges admission by its count
            counted = (realtier.fuse_connection(workdir / "mnt") / "waiting").exists()
            yield SimTier(tier, replay_stream.paths_under(root, files)), {
                "kind": kind, "latency_ms": latency_ms, "slots": slots,
                "ideal_files_per_s": slots / (latency_ms / 1000) if slots else None,
                "fusectl": counted}
        return
    if kind != "s3fs":
        raise ValueError(f"no tier {kind!r}: {TIERS}")
    with realtier.endpoint(workdir / "endpoint", len(files), spec.file_bytes,
                           delay_ms) as (server, proxy), \
            realtier.mount("s3fs", "kernel_cache", proxy.url, workdir / "fs",
                           files=len(files)) as fs:
        keys = dict(zip(files, server.dataset.keys, strict=True))
        yield S3fsTier(fs, proxy, keys), {"kind": "s3fs/kernel_cache", "delay_ms": delay_ms,
                                          **fs.settings()}
