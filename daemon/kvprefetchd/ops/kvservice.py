"""The supervisor's side of the KV ops: profiles, fingerprint memory, stale detection.

`kv/` is pure; this holds the state around it that lives as long as the daemon:
the configured model profiles, the fingerprints discovered on disk (a directory
listing is paid once per profile, not once per request), and the detector that
notices when a profile's files are all missing while a sibling fingerprint exists.

Listing a directory is a file-system touch, which the supervisor never makes itself:
discovery and the stale scan are the scout's tasks (scout.py). A request that needs a
fingerprint not yet known is parked (DiscoveryPending) and run again when the scout
answers; an answer that is an error, or no answer in time, is remembered a few
seconds, so a hung root costs one task per NEGATIVE_SECONDS, not one per request.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from kvprefetch.stats import KVStats
from kvprefetchd import kv
from kvprefetchd.config import Config
from kvprefetchd.protocol import BAD_REQUEST, OVERLOADED, TOO_LARGE, RequestError
from kvprefetchd.roots.scout import Scout
from kvprefetchd.roots.tasks import Discover, Failed, Scan, beneath, not_beneath

log = logging.getLogger("kvprefetchd.kv")

# A discovered fingerprint is looked up again after this long, so a model
# redeployed with a new fingerprint is picked up without a restart.
REDISCOVER_SECONDS = 60.0
# A discovery that failed (or got no answer) is not asked again for this long.
NEGATIVE_SECONDS = 5.0
# Requests parked for discoveries at once, in all; more are refused `overloaded`.
MAX_PARKED = 4096


class DiscoveryPending(Exception):
    """The profile's fingerprint is being looked for: park the request and run it again."""

    def __init__(self, profile: kv.Profile) -> None:
        super().__init__(profile.name)
        self.profile = profile


def kv_limits(config: Config) -> kv.Limits:
    """The KV request bounds of the configuration: a KV request may name no more files
    than a prefetch request may carry paths."""
    return kv.Limits(
        max_prompts=config.max_prompts, max_tokens=config.max_tokens,
        max_block_hashes=config.max_blocks, max_files=config.max_paths_per_request,
        max_plan_bytes=config.max_kv_path_bytes, max_ranks=config.max_ranks,
        max_kv_cache_groups=config.max_kv_cache_groups,
    )


# What a `resolve` reply holds besides its paths: per path a msgpack str header (at most
# 5 bytes), per block hash its 64 hex digits and header, and the envelope.
PATH_OVERHEAD_BYTES = 5
HEX_HASH_BYTES = 64 + 2
ENVELOPE_BYTES = 256


def resolve_reply_bytes(request: kv.KVRequest) -> int:
    """An upper bound of the `resolve` reply's size, from counts the parser already has."""
    return (request.plan_bytes + PATH_OVERHEAD_BYTES * request.files
            + HEX_HASH_BYTES * request.blocks + ENVELOPE_BYTES)


class KVService:
    def __init__(
        self,
        profiles: Mapping[str, kv.Profile],
        limits: kv.Limits,
        *,
        allow_inline: bool,
        stale_streak: int,
        roots: tuple[str, ...] = (),
        capacity: int = 1024,
        max_reply_bytes: int = 8 << 20,
        scout: Scout | None = None,
    ) -> None:
        self.profiles = profiles
        self.limits = limits
        self.allow_inline = allow_inline
        self.roots = roots
        self.max_reply_bytes = max_reply_bytes
        self.stale = kv.StaleDetector(streak=stale_streak, capacity=capacity)
        self.scout = scout
        # Inline "discover" profiles are keys too: as bounded as the stale watches. A
        # value is the fingerprint found, or the reason none could be.
        self._discovered: OrderedDict[kv.Profile, tuple[float, str | Failed]] = OrderedDict()
        self._parked: dict[kv.Profile, list[Callable[[], None]]] = {}
        self._scanning: set[str] = set()  # stale-detector keys with a scan out
        self.capacity = capacity
        self.resolved_requests = 0
        self.resolve_seconds = 0.0

    @classmethod
    def from_config(cls, config: Config, scout: Scout | None = None) -> KVService:
        return cls(
            config.models, kv_limits(config), allow_inline=config.allow_inline_layouts,
            stale_streak=config.stale_streak, roots=config.roots,
            capacity=config.max_stale_profiles, max_reply_bytes=config.max_output_bytes,
            scout=scout,
        )

    def reconfigure(self, config: Config) -> None:
        """New profiles and limits on reload; discovered fingerprints are looked up afresh."""
        self.profiles = config.models
        self.limits = kv_limits(config)
        self.allow_inline = config.allow_inline_layouts
        self.max_reply_bytes = config.max_output_bytes
        self.capacity = config.max_stale_profiles
        self.stale.resize(config.max_stale_profiles)
        self._discovered.clear()

    def resolve(
        self, body: Mapping[str, Any], request_id: int, *, for_prefetch: bool
    ) -> tuple[kv.Profile, kv.Resolution]:
        """Parse, hash and lay out a KV request; errors become protocol error replies.

        `allow_inline_layouts = false` refuses inline layouts for `resolve` too: it costs
        the supervisor what warming them costs, short of the reads. A `resolve` whose
        reply would exceed max_output_bytes is refused before anything is hashed.
        """
        started = time.perf_counter()
        try:
            request = kv.parse_kv_request(
                body, self.profiles, self.limits, allow_inline=self.allow_inline
            )
            if not for_prefetch:
                self.check_reply_size(request, request_id)
            fingerprint = self.discovered(request.profile)
            resolution = kv.resolve(request, fingerprint=fingerprint)
        except kv.KVError as error:
            raise RequestError(error.code, str(error), request_id) from error
        elapsed = time.perf_counter() - started
        self.resolved_requests += 1
        self.resolve_seconds += elapsed
        log.debug(
            "resolved %s: %d prompt(s), %d file(s) in %.3f ms",
            request.profile.name,
            len(resolution.block_hashes),
            len(resolution.paths),
            elapsed * 1e3,
        )
        return request.profile, resolution

    def check_reply_size(self, request: kv.KVRequest, request_id: int) -> None:
        size = resolve_reply_bytes(request)
        if size > self.max_reply_bytes:
            raise RequestError(
                TOO_LARGE,
                f"the reply would take up to {size} bytes ({request.files} paths, "
                f"{request.blocks} block hashes), above max_output_bytes "
                f"({self.max_reply_bytes}): ask for fewer blocks at a time",
                request_id,
            )

    def discovered(self, profile: kv.Profile) -> str | None:
        """The fingerprint found on disk for a `discover` profile, from memory; raises
        DiscoveryPending when it must be looked for (the caller parks the request)."""
        if not profile.needs_discovery:
            return None
        if not self.may_list(profile):
            raise RequestError(BAD_REQUEST, not_beneath(profile))
        cached = self._discovered.get(profile)
        if cached is not None:
            when, found = cached
            fresh = REDISCOVER_SECONDS if isinstance(found, str) else NEGATIVE_SECONDS
            if time.monotonic() - when < fresh:
                if isinstance(found, str):
                    return found
                raise discovery_error(found)
        raise DiscoveryPending(profile)

    def park(self, profile: kv.Profile, retry: Callable[[], None]) -> None:
        """Run `retry` once the scout has looked for the profile's fingerprint."""
        if sum(map(len, self._parked.values())) >= MAX_PARKED:
            raise RequestError(OVERLOADED, f"{MAX_PARKED} requests already wait for "
                               "fingerprint discovery; try again shortly")
        waiting = self._parked.setdefault(profile, [])
        waiting.append(retry)
        if len(waiting) > 1:
            return  # its discovery is out already
        if self.scout is None:
            self.found(profile, Failed("error", "no scout to look with"))
            return
        self.scout.ask(Discover(profile, self.roots), lambda result: self.found(profile, result))

    def found(self, profile: kv.Profile, result: Any) -> None:
        """The scout's answer: remember it, then run every request parked for it."""
        previous = self._discovered.get(profile)
        if isinstance(result, str):
            if previous is None or previous[1] != result:
                log.info("profile %s: discovered fingerprint %s", profile.name, result)
        else:
            log.warning("profile %s: %s", profile.name, result.message)
        self._discovered[profile] = (time.monotonic(), result)
        self._discovered.move_to_end(profile)
        while len(self._discovered) > self.capacity:
            self._discovered.popitem(last=False)
        for retry in self._parked.pop(profile, []):
            retry()

    def may_list(self, profile: kv.Profile) -> bool:
        """May discovery list this profile's root_dir and read the config.json files there?

        A configured profile's root_dir was checked against the roots at start. An
        inline layout names any directory its client likes: without this check a
        request could make the supervisor list any directory and read (and quote back
        in its error) any `<dir>/<model>_<12 hex>/config.json` on the host. It must lie
        beneath an allowed root as written (here: no file system is touched) and once
        symlinks are resolved (the scout checks that before it lists anything).
        """
        if self.profiles.get(profile.name) is profile:
            return True
        lexical = os.path.normpath(profile.layout.root_dir)
        return any(beneath(lexical, os.path.normpath(root)) for root in self.roots)

    def record(self, profile: kv.Profile, fingerprint: str, outcomes: Mapping[str, int]) -> None:
        """Feed one request's outcomes to the stale detector; warn once it is sure."""
        key = profile.name if profile.name != "inline" else f"inline:{fingerprint}"
        present = outcomes.get("read", 0) + outcomes.get("resident", 0)
        missing = outcomes.get("missing", 0)
        if not self.stale.record(key, fingerprint, missing=missing, present=present):
            return
        if not self.may_list(profile) or key in self._scanning or self.scout is None:
            return
        self._scanning.add(key)
        self.scout.ask(Scan(profile, self.roots),
                       lambda result: self.scanned(key, fingerprint, result))

    def scanned(self, key: str, fingerprint: str, result: Any) -> None:
        """The scout's listing for a profile the stale detector suspects."""
        self._scanning.discard(key)
        if isinstance(result, Failed):
            log.debug("stale check of %s: %s", key, result.message)
            return
        self.stale.observe(key, result)
        if self.stale.stale(key):
            log.warning(
                "profile %s: every file under fingerprint %s is missing; the folder on disk "
                "is likely %s (fix layout.fingerprint, or use \"discover\")",
                key,
                fingerprint,
                self.stale.likely_fingerprint(key),
            )

    def stats(self) -> KVStats:
        return {
            "profiles": sorted(self.profiles),
            "resolved_requests": self.resolved_requests,
            "resolve_ms_total": round(self.resolve_seconds * 1e3, 3),
            "stale": self.stale.report(),
        }

    def bounds(self) -> dict[str, tuple[int, int]]:
        """Its per-key maps: {name: (entries, capacity)} for the `bounds` stats section."""
        return {
            "stale_profiles": (len(self.stale), self.stale.capacity),
            "discovered_fingerprints": (len(self._discovered), self.capacity),
        }


def discovery_error(failed: Failed) -> RequestError:
    """What a client is told when its profile's fingerprint could not be found."""
    if failed.kind == "timeout":
        return RequestError(OVERLOADED, "fingerprint discovery: the file system under "
                            f"layout.root_dir did not answer ({failed.message})")
    return RequestError(BAD_REQUEST, failed.message)
