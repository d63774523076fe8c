"""The supervisor's side of the KV ops: profiles, fingerprint memory, stale detection.

`kv/` is pure; this holds the state around it that lives as long as the daemon:
the configured model profiles, the fingerprints discovered on disk (a directory
listing is paid once per profile, not once per request), and the detector that
notices when a profile's files are all missing while a sibling fingerprint exists.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from kvprefetch.stats import KVStats
from kvprefetchd import kv
from kvprefetchd.config import Config
from kvprefetchd.protocol import BAD_REQUEST, RequestError

log = logging.getLogger("kvprefetchd.kv")

# A discovered fingerprint is looked up again after this long, so a model
# redeployed with a new fingerprint is picked up without a restart.
REDISCOVER_SECONDS = 60.0


def kv_limits(config: Config) -> kv.Limits:
    return kv.Limits(max_prompts=config.max_prompts, max_tokens=config.max_tokens)


class KVService:
    def __init__(
        self,
        profiles: Mapping[str, kv.Profile],
        limits: kv.Limits,
        *,
        allow_inline: bool,
        stale_streak: int,
        roots: tuple[str, ...] = (),
    ) -> None:
        self.profiles = profiles
        self.limits = limits
        self.allow_inline = allow_inline
        self.roots = roots
        self.stale = kv.StaleDetector(streak=stale_streak)
        self._discovered: dict[kv.Profile, tuple[float, str]] = {}
        self.resolved_requests = 0
        self.resolve_seconds = 0.0

    @classmethod
    def from_config(cls, config: Config) -> KVService:
        return cls(
            config.models, kv_limits(config), allow_inline=config.allow_inline_layouts,
            stale_streak=config.stale_streak, roots=config.roots,
        )

    def reconfigure(self, config: Config) -> None:
        """New profiles and limits on reload; discovered fingerprints are looked up afresh."""
        self.profiles = config.models
        self.limits = kv_limits(config)
        self.allow_inline = config.allow_inline_layouts
        self._discovered.clear()

    def resolve(
        self, body: Mapping[str, Any], request_id: int, *, for_prefetch: bool
    ) -> tuple[kv.Profile, kv.Resolution]:
        """Parse, hash and lay out a KV request; errors become protocol error replies."""
        started = time.perf_counter()
        try:
            request = kv.parse_kv_request(
                body, self.profiles, self.limits,
                allow_inline=self.allow_inline or not for_prefetch,
            )
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

    def discovered(self, profile: kv.Profile) -> str | None:
        """The fingerprint found on disk for a `discover` profile (cached), else None."""
        if not profile.needs_discovery:
            return None
        if not self.may_list(profile):
            raise RequestError(
                BAD_REQUEST,
                f"layout.root_dir {profile.layout.root_dir!r} is not under an allowed root: "
                'an inline layout may "discover" only beneath the daemon\'s roots '
                "(or give layout.fingerprint)",
            )
        now = time.monotonic()
        cached = self._discovered.get(profile)
        if cached is not None and now - cached[0] < REDISCOVER_SECONDS:
            return cached[1]
        try:
            found = kv.discover_fingerprint(profile).fingerprint
        except kv.DiscoveryError as error:
            raise RequestError(BAD_REQUEST, f"fingerprint discovery: {error}") from error
        if cached is None or cached[1] != found:
            log.info("profile %s: discovered fingerprint %s", profile.name, found)
        self._discovered[profile] = (now, found)
        return found

    def may_list(self, profile: kv.Profile) -> bool:
        """May discovery list this profile's root_dir and read the config.json files there?

        A configured profile's root_dir was checked against the roots at start. An
        inline layout names any directory its client likes: without this check a
        request could make the supervisor list any directory and read (and quote back
        in its error) any `<dir>/<model>_<12 hex>/config.json` on the host. It must lie
        beneath an allowed root as written and once symlinks are resolved.
        """
        if self.profiles.get(profile.name) is profile:
            return True
        root_dir = profile.layout.root_dir
        lexical, real = os.path.normpath(root_dir), os.path.realpath(root_dir)
        return any(
            _beneath(lexical, os.path.normpath(root)) and _beneath(real, os.path.realpath(root))
            for root in self.roots
        )

    def record(self, profile: kv.Profile, fingerprint: str, outcomes: Mapping[str, int]) -> None:
        """Feed one request's outcomes to the stale detector; warn once it is sure."""
        key = profile.name if profile.name != "inline" else f"inline:{fingerprint}"
        present = outcomes.get("read", 0) + outcomes.get("resident", 0)
        missing = outcomes.get("missing", 0)
        if not self.stale.record(key, fingerprint, missing=missing, present=present):
            return
        if not self.may_list(profile):
            return
        try:
            candidates = kv.scan(profile)
        except kv.DiscoveryError as error:
            log.debug("stale check of %s: %s", key, error)
            return
        self.stale.observe(key, candidates)
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


def _beneath(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
