"""From what a router knows about a request to the exact files vLLM's fs connector wrote.

Pure (no sockets, no processes; the only I/O is discovery's listing of root_dir):

    request  KV request map -> validated KVRequest          request.py
    specs    the `hash` and `layout` maps, read key by key   specs.py
    profile  [models.NAME] / inline hash+layout -> Profile   profile.py
    hashing  tokens + extra keys -> vLLM block hashes        hashing.py
    layout   block hashes -> rank/group/file paths           layout.py
    discover fingerprint folder on disk; stale detection     discover.py

The supervisor's `resolve` and `prefetch_blocks` ops:

    request = kv.parse_kv_request(message, profiles, limits, allow_inline=...)
    fingerprint = None
    if request.profile.needs_discovery:              # layout.fingerprint = "discover"
        fingerprint = kv.discover_fingerprint(request.profile).fingerprint   # cache it
    resolution = kv.resolve(request, fingerprint=fingerprint)
    resolution.paths, resolution.block_hashes_hex()

Every deliberate error is a KVError whose `code` is the protocol error code.
Section numbers in docstrings refer to the verified spec, kv-file-layout.md.
"""

from kvprefetchd.kv.discover import (
    Candidate,
    Discovery,
    StaleDetector,
    discover_fingerprint,
    scan,
)
from kvprefetchd.kv.errors import DiscoveryError, KVError, KVRequestError, ProfileError
from kvprefetchd.kv.hashing import LoRA, MMFeature, Prompt, engine_key
from kvprefetchd.kv.profile import HashSpec, KVCacheGroup, LayoutSpec, Profile
from kvprefetchd.kv.request import KVRequest, Limits, Resolution, parse_kv_request, resolve

__all__ = [
    "Candidate",
    "Discovery",
    "DiscoveryError",
    "HashSpec",
    "KVCacheGroup",
    "KVError",
    "KVRequest",
    "KVRequestError",
    "LayoutSpec",
    "Limits",
    "LoRA",
    "MMFeature",
    "Profile",
    "ProfileError",
    "Prompt",
    "Resolution",
    "StaleDetector",
    "discover_fingerprint",
    "engine_key",
    "parse_kv_request",
    "resolve",
    "scan",
]
