"""Config keys: what one request may ask (its size, its deadline, its verbs, its KV form)."""

from __future__ import annotations

from kvprefetchd.config_keys.key import BOOL, INT, KIB, MIB, Key, Section

LIMITS = Section("request limits", (
    Key("max_frame_bytes", INT, 16 * MIB, bounds=(64, 1 << 30), help="""
        Largest request frame (16 MiB); a larger one is answered `too_large` and skipped."""),
    Key("max_paths_per_request", INT, 100_000, bounds=(1, 10_000_000), help="""
        Most paths in one prefetch request, and longest path in bytes."""),
    Key("max_path_bytes", INT, 4096, bounds=(16, 65536)),
    Key("max_nesting_depth", INT, 16, bounds=(8, 512), help="""
        Deepest nesting of arrays and maps in a request (the top map is 1; a well-formed
        request needs 6 at most); deeper is `too_large`. At least 8, at most 512."""),
    Key("max_request_containers", INT, 1 << 17, bounds=(64, 1 << 24), help="""
        Most arrays and maps one request may decode to, and most elements and map entries
        in all: counted while it decodes, so a frame of millions of tiny nested arrays is
        `too_large` after a few milliseconds instead of costing seconds and a GiB."""),
    Key("max_request_items", INT, 1 << 21, bounds=(1024, 1 << 28)),
    Key("max_output_bytes", INT, 8 * MIB, bounds=(64 * KIB, 1 << 32), help="""
        Largest reply (8 MiB): a larger one is refused `too_large` (a `resolve` before it
        is built). Also what may wait for a client that does not read its replies: beyond
        it the daemon stops reading that client's requests until it catches up."""),
    Key("max_input_buffer_bytes", INT, 32 * MIB, bounds=(64, 1 << 34), help="""
        Bytes of unfinished request frames buffered over all connections (32 MiB, at least
        max_frame_bytes), beyond the 64 KiB every connection may always hold: a larger frame
        takes its whole size from here, first come first served, one user holding at most
        half; until it fits its connection is not read (the client's send blocks; small
        frames, and other users' large ones, go on)."""),
))

VERBS = Section("deadlines, failures, check and evict", (
    Key("default_deadline_ms", INT, 0, bounds=(0, 86_400_000), help="""
        A warm request without deadline_ms / deadline_unix_ms of its own gets this one: a
        file whose deadline passed before its read was issued, or was nearer on arrival
        than a read takes on its root (docs/protocol.md, Order), is settled `expired`,
        unread (no fetch slot taken on a slow tier). 0: no deadline."""),
    Key("max_failures_listed", INT, 4096, bounds=(0, 1_000_000), help="""
        Replies list at most this many files that were not warmed (`failures`); a request
        may ask for fewer (max_failures, default 100)."""),
    Key("preserve_atime", BOOL, False, help="""
        Head reads refresh atime, which atime-based cleaners of shared KV storage read.
        true: read through O_NOATIME where the kernel permits it (the file's owner, or
        CAP_FOWNER); elsewhere the read goes ahead, counted in stats events.noatime_fallbacks
        and logged once. `check` never changes atime either way."""),
    Key("allow_evict", BOOL, False, help="""
        The `evict` op (kvprefetch evict) drops heads or whole files from the page cache
        under the allowed roots. It takes cache from every user of the host: off unless set."""),
))

KV = Section("KV requests (prefetch_blocks, resolve)", (
    Key("allow_inline_layouts", BOOL, True, help="""
        Accept inline `hash` + `layout` maps in prefetch_blocks and resolve alike."""),
    Key("max_prompts", INT, 64, bounds=(1, 65536), help="""
        Most prompts per KV request, and most tokens over all its prompts."""),
    Key("max_tokens", INT, 1 << 20, bounds=(1, 1 << 28)),
    Key("max_blocks", INT, 1 << 16, bounds=(1, 1 << 24), help="""
        Most block hashes a KV request may name or make the daemon compute (full blocks
        of its prompts), and the bytes of the paths it may expand to (an upper bound,
        known before any hash is computed). Its files count against max_paths_per_request."""),
    Key("max_kv_path_bytes", INT, 32 * MIB, bounds=(64 * KIB, 1 << 32)),
    Key("max_ranks", INT, 1024, bounds=(1, 1 << 20), help="""
        An inline layout's ranks (tp_size, pp_size, pcp_size, dcp_size, and tp x pp x pcp)
        and KV-cache groups; a configured profile beyond them is an error at start."""),
    Key("max_kv_cache_groups", INT, 64, bounds=(1, 65536)),
    Key("stale_streak", INT, 256, bounds=(1, 1 << 30), help="""
        After this many consecutive missing files under a profile, check whether its
        fingerprint is stale (another folder of the model exists); see `stats`."""),
    Key("max_stale_profiles", INT, 1024, bounds=(1, 1 << 20), help="""
        Profiles watched for staleness (each inline fingerprint is one), and discovered
        fingerprints remembered: the least recently used are forgotten beyond this."""),
))
