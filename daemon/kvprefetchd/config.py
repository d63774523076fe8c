"""One frozen Config, built from the embedded defaults, an optional TOML file and flags.

Everything the daemon can be told lives here, validated once at start so that a
typo fails loudly with the key's name instead of surfacing as odd behaviour later.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvprefetchd.kv import KVError, Profile
from kvprefetchd.roots.tiers import WARM_EXTENTS

ENGINES = ("auto", "io_uring", "fadvise", "pread")
WARM_MODES = ("read", "advise")
RESIDENCY_RULES = ("auto", "tier", "pagecache", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")

KIB = 1024
MIB = 1024 * KIB

# The llm-d fs connector's default shared_storage_path (spec §5.1): a daemon
# started with no configuration at all warms what a default connector writes.
DEFAULT_ROOT = "/tmp/shared-kv"


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


def default_socket_path() -> str:
    """Where the socket goes when nobody says: systemd's runtime dir, then the user's, then /tmp.

    Clients resolve the same chain (KVPREFETCHD_SOCKET first), so a daemon and a
    client started with no flags find each other without root-only paths.
    """
    explicit = os.environ.get("KVPREFETCHD_SOCKET")
    if explicit:
        return explicit
    for env in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        base = os.environ.get(env)
        if base:
            return os.path.join(base.split(":")[0], "kvprefetchd.sock")
    return "/tmp/kvprefetchd.sock"


@dataclass(frozen=True)
class Config:
    """Every setting, with its default. The example file in systemd/ documents each one."""

    socket: str = field(default_factory=default_socket_path)
    socket_mode: int = 0o660
    # Peers allowed besides the daemon's own user and the socket's group (SO_PEERCRED).
    allowed_uids: tuple[int, ...] = ()
    allowed_gids: tuple[int, ...] = ()
    roots: tuple[str, ...] = (DEFAULT_ROOT,)
    residency: str = "auto"
    residency_by_root: Mapping[str, str] = field(default_factory=dict)
    # How much of a file a warm-up reads: "head" (read_bytes), "whole", or "auto" (the
    # root's tier profile: whole on FUSE object stores, head elsewhere; tiers.py).
    warm_extent: str = "auto"
    warm_extent_by_root: Mapping[str, str] = field(default_factory=dict)
    # Hold-open warming (holds.py), on roots whose file system keeps a file's data only
    # while it is open (s3fs without kernel_cache): a warmed file stays open until
    # another process opens it, or hold_seconds pass, at most hold_max_files files and
    # hold_max_bytes of them per daemon (the oldest let go first).
    hold_seconds: float = 120.0
    hold_max_files: int = 4096
    hold_max_bytes: int = 64 * 1024 * MIB
    workers: int = 0  # 0: one per CPU
    engine: str = "auto"
    warm_mode: str = "read"
    read_bytes: int = 1 * MIB
    max_read_bytes: int = 64 * MIB
    chunk_bytes: int = 128 * KIB
    queue_depth: int = 128
    pread_threads: int = 16  # io_uring advise: confirming threads per batch
    # The queue engines (pread, fadvise: `auto`'s choices): reads in flight per root to
    # start from, threads per worker at most (its reads in flight follow each root's
    # file system up to this: native/depthctl.c), and how long a file may take before
    # it is settled `failed` (a tier that never answers; 0: no limit).
    initial_depth: int = 16
    max_in_flight: int = 512
    file_timeout: float = 60.0
    # Files behind another mount beneath their root (a FUSE or NFS mount in a
    # subdirectory) are read by this many threads per worker at most, apart from
    # max_in_flight, so that a hung one never starves the roots' own files; once all are
    # stuck, such files fail at once (`mount_unresponsive`: native/queue.c).
    other_mount_threads: int = 4
    # Roots: refuse one whose path another user could swap (roots.py; false accepts it),
    # and how long the scout may take over a file-system task (opening a root, KV
    # discovery) before it is presumed stuck and replaced, the task failing.
    root_path_checks: bool = True
    fs_timeout: float = 10.0
    # Killed workers stuck in the kernel (a tier that never answers) at most: past this
    # a dead worker's shard is not respawned until one of them exits.
    max_stuck_workers: int = 8
    fadv_random: bool = True
    batch_files: int = 256
    max_open_files: int = 1024
    queue_limit: int = 8192  # files outstanding per worker before new ones are dropped
    # Workers yield the CPU to the supervisor (acks) and to the router beside them: their
    # work is I/O-bound, and since the probe (native/probe.c) a warm file costs a few us,
    # so spare CPU is enough for them. Measured with bench/ack_latency.py --modes busy on
    # 2 vCPUs, 1,000-path acks while the workers settle earlier requests: p99 10-12x the
    # echo floor at nice 5, 2.2-4.0x at 10, 1.7-2.2x at 19; the hot path's 150,000
    # files/s sustained with 0 dropped at 19 too (bench/hot.py).
    worker_nice: int = 19
    # Workers run SCHED_BATCH (sched(7)): a worker woken by a Warm never preempts the
    # running task, so the supervisor finishes its round and the client woken by the ack
    # is not queued behind a worker (EEVDF then lets the worker's slice run out first,
    # and this 250 Hz kernel checks only at the next tick: 4 ms). Their CPU share is
    # worker_nice's as before. Traced with bench/ack_latency.py's resident set (1,000
    # resident paths, idle): client waits > 0.5 ms behind a worker after the ack, 17 of
    # 400 requests at nice 19 alone, 7 of 400 with SCHED_BATCH (docs/bench/ack-and-load.md).
    worker_batch: bool = True
    dedup_ttl_ms: int = 1000
    dedup_entries: int = 65536
    dedup_bytes: int = 16 * MIB  # of remembered path keys per worker
    max_frame_bytes: int = 16 * MIB
    max_paths_per_request: int = 100_000
    max_path_bytes: int = 4096
    max_nesting_depth: int = 16  # arrays and maps in a request (the top map is 1)
    max_request_containers: int = 1 << 17  # arrays and maps a request may decode to
    max_request_items: int = 1 << 21  # their elements and entries
    max_output_bytes: int = 8 * MIB  # the largest reply; and what waits for a slow reader
    max_input_buffer_bytes: int = 32 * MIB  # unfinished frames, all connections (connection.py)
    max_connections: int = 1024
    max_connections_per_uid: int = 128
    idle_timeout: float = 600.0  # a connection that owes and asks nothing this long is closed
    frame_timeout: float = 30.0  # a frame begun must be whole within this many seconds
    models: Mapping[str, Profile] = field(default_factory=dict)
    # [models.NAME] warm_mode: a profile may warm by advice where the global mode reads.
    model_warm_modes: Mapping[str, str] = field(default_factory=dict)
    allow_inline_layouts: bool = True  # inline hash+layout maps (prefetch_blocks and resolve)
    # The operator's verbs and the router's deadlines (docs/protocol.md): `evict` takes
    # cache from every user of the host, so it is off unless asked for; a request without
    # a deadline of its own gets this one (0: none); `failures` lists at most this many
    # files per reply; reads keep atime (O_NOATIME where the kernel permits it).
    allow_evict: bool = False
    # A TCP listener beside the Unix socket (off: ""), for routers on other hosts: mutual
    # TLS with client certificates from tls_client_ca_file whose identity (SAN DNS or URI
    # name, or CN) is in tls_allowed_clients (tcp.py). Plaintext only on loopback, only
    # when tcp_plaintext_loopback says so (tests).
    listen_tcp: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    tls_allowed_clients: tuple[str, ...] = ()
    tcp_plaintext_loopback: bool = False
    max_connections_per_address: int = 64
    tls_handshake_timeout: float = 5.0
    # Handshakes in progress have slots of their own, and new ones a rate: strangers can
    # neither take the routers' connections nor the supervisor's CPU (tcp.py, handshakes.py).
    max_tls_handshakes: int = 64
    tls_handshake_rate: int = 50  # a second, all addresses no router came from before
    tls_handshake_rate_per_address: int = 32  # a second, each address
    default_deadline_ms: int = 0
    max_failures_listed: int = 4096
    preserve_atime: bool = False
    max_prompts: int = 64
    max_tokens: int = 1 << 20
    max_blocks: int = 1 << 16  # block hashes a KV request names or computes
    max_ranks: int = 1024  # tp x pp x pcp of an inline layout
    max_kv_cache_groups: int = 64  # of an inline layout
    max_kv_path_bytes: int = 32 * MIB  # the paths one KV request may expand to
    stale_streak: int = 256  # consecutive missing files before a profile is checked for staleness
    max_stale_profiles: int = 1024  # profiles (inline fingerprints too) watched for staleness
    drain_seconds: float = 3.0  # plus at most 1 s to stop workers: out within 5 s
    # A worker that owes outcomes and has sent nothing for this long is wedged (stuck
    # in a native call on a dead tier): killed, its files failed, and replaced. 0: never.
    worker_timeout: float = 60.0
    log_level: str = "info"
    metrics: str = ""
    # The metrics endpoint is unauthenticated (metrics_limits.py): a client's request
    # header must arrive within metrics_header_timeout seconds; an address holds at most
    # metrics_max_clients_per_address of the 32 slots; new connections are capped at
    # metrics_rate_per_address a second per address and metrics_rate in all (closed at
    # once beyond); the page is rendered at most once per metrics_cache_seconds.
    metrics_header_timeout: float = 0.5
    metrics_max_clients_per_address: int = 4
    metrics_rate: int = 200
    metrics_rate_per_address: int = 10
    metrics_cache_seconds: float = 0.5

    @property
    def worker_count(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)

    def residency_for(self, root: str) -> str:
        return self.residency_by_root.get(root, self.residency)

    def warm_extent_for(self, root: str) -> str:
        return self.warm_extent_by_root.get(root, self.warm_extent)


_INT_KEYS = {
    "socket_mode": (0, 0o777),
    "workers": (0, 256),
    "read_bytes": (1, 1 << 40),
    "max_read_bytes": (1, 1 << 40),
    "hold_max_files": (0, 1 << 20),
    "hold_max_bytes": (0, 1 << 50),
    "chunk_bytes": (4 * KIB, 64 * MIB),
    "queue_depth": (1, 4096),
    "pread_threads": (1, 256),
    "max_stuck_workers": (1, 1024),
    "initial_depth": (1, 4096),
    "max_in_flight": (1, 4096),
    "other_mount_threads": (1, 4096),
    "batch_files": (1, 65536),
    "max_open_files": (8, 16384),
    "queue_limit": (1, 10_000_000),
    "worker_nice": (0, 19),
    "dedup_ttl_ms": (0, 3_600_000),
    "default_deadline_ms": (0, 86_400_000),
    "max_failures_listed": (0, 1_000_000),
    "max_connections_per_address": (1, 65536),
    "max_tls_handshakes": (1, 65536),
    "tls_handshake_rate": (1, 1_000_000),
    "tls_handshake_rate_per_address": (1, 1_000_000),
    "dedup_entries": (0, 10_000_000),
    "dedup_bytes": (0, 1 << 30),
    "max_frame_bytes": (64, 1 << 30),
    "max_paths_per_request": (1, 10_000_000),
    "max_path_bytes": (16, 65536),
    "max_nesting_depth": (8, 512),
    "max_request_containers": (64, 1 << 24),
    "max_request_items": (1024, 1 << 28),
    "max_output_bytes": (64 * KIB, 1 << 32),
    "max_input_buffer_bytes": (64, 1 << 34),
    "max_connections": (1, 65536),
    "max_connections_per_uid": (1, 65536),
    "max_prompts": (1, 65536),
    "max_tokens": (1, 1 << 28),
    "max_blocks": (1, 1 << 24),
    "max_ranks": (1, 1 << 20),
    "max_kv_cache_groups": (1, 65536),
    "max_kv_path_bytes": (64 * KIB, 1 << 32),
    "stale_streak": (1, 1 << 30),
    "max_stale_profiles": (1, 1 << 20),
    "metrics_max_clients_per_address": (1, 32),
    "metrics_rate": (1, 100_000),
    "metrics_rate_per_address": (1, 100_000),
}
# Seconds, 0 meaning never: (the key, the shortest non-zero value, the longest).
_SECONDS_KEYS = {
    # Below 1 s a healthy batch on a slow tier would look wedged.
    "worker_timeout": (1.0, 3600.0),
    "file_timeout": (0.1, 86400.0),
    "fs_timeout": (0.1, 3600.0),
    "idle_timeout": (1.0, 86400.0),
    "frame_timeout": (1.0, 3600.0),
    "tls_handshake_timeout": (0.1, 600.0),
}
# Seconds without an "off": (the key, the least, the most).
_BOUNDED_SECONDS_KEYS = {
    "hold_seconds": (0.1, 86400.0),
    "metrics_header_timeout": (0.05, 10.0),
    "metrics_cache_seconds": (0.0, 60.0),  # 0: every scrape renders
}
_CHOICE_KEYS = {
    "engine": ENGINES,
    "warm_mode": WARM_MODES,
    "residency": RESIDENCY_RULES,
    "warm_extent": WARM_EXTENTS,
    "log_level": LOG_LEVELS,
}
_FIELDS = {f.name for f in dataclasses.fields(Config)}
# Per-root tables overriding a key: (the values allowed, what a value is).
_BY_ROOT_KEYS = {
    "residency_by_root": (RESIDENCY_RULES, "rule"),
    "warm_extent_by_root": (WARM_EXTENTS, "extent"),
}


def _check(key: str, value: Any) -> Any:
    """Validate one key's value and return it in its Config type."""
    if key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        low, high = _INT_KEYS[key]
        if not low <= value <= high:
            raise ConfigError(f"{key}: {value} is outside [{low}, {high}]")
        return value
    if key in _CHOICE_KEYS:
        if value not in _CHOICE_KEYS[key]:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(_CHOICE_KEYS[key])}")
        return value
    if key == "socket":
        if not isinstance(value, str) or not value:
            raise ConfigError("socket: expected a non-empty path")
        return value
    if key == "roots":
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise ConfigError("roots: expected a list of absolute directory paths")
        roots = []
        for root in value:
            if not isinstance(root, str) or not root.startswith("/"):
                raise ConfigError(f"roots: {root!r} is not an absolute path")
            roots.append(os.path.normpath(root))
        if len(set(roots)) != len(roots):
            raise ConfigError("roots: a root is listed twice")
        return tuple(roots)
    if key in ("allowed_uids", "allowed_gids"):
        if isinstance(value, str) or not isinstance(value, list | tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in value
        ):
            raise ConfigError(f"{key}: expected a list of numeric ids")
        return tuple(value)
    if key in _BY_ROOT_KEYS:
        choices, what = _BY_ROOT_KEYS[key]
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table of root = {what}")
        rules = {}
        for root, rule in value.items():
            if rule not in choices:
                raise ConfigError(f"{key}.{root}: {rule!r} is not one of {', '.join(choices)}")
            rules[os.path.normpath(root)] = rule
        return rules
    if key in ("listen_tcp", "tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string")
        return value
    if key == "tls_allowed_clients":
        if isinstance(value, str) or not isinstance(value, list | tuple) or not all(
            isinstance(v, str) and v for v in value
        ):
            raise ConfigError(f"{key}: expected a list of client identities (SAN names or CN)")
        return tuple(value)
    if key in ("fadv_random", "allow_inline_layouts", "root_path_checks", "allow_evict",
               "preserve_atime", "tcp_plaintext_loopback", "worker_batch"):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false")
        return value
    if key == "models":
        if not isinstance(value, Mapping):
            raise ConfigError("models: expected tables [models.NAME] with hash and layout")
        profiles = {}
        for name, table in value.items():
            if isinstance(table, Mapping) and "warm_mode" in table:
                table = {k: v for k, v in table.items() if k != "warm_mode"}
            try:
                profiles[name] = Profile.from_mapping(name, table, strict=True)
            except KVError as error:
                raise ConfigError(str(error)) from error
        return profiles
    if key == "metrics":
        if not isinstance(value, str):
            raise ConfigError("metrics: expected an address string such as 127.0.0.1:9464")
        if value == "":
            return value
        try:
            parse_metrics_address(value)
        except MetricsAddressError as error:
            raise ConfigError(str(error)) from error
        return value
    if key in _BOUNDED_SECONDS_KEYS:
        least, most = _BOUNDED_SECONDS_KEYS[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
            least <= value <= most
        ):
            raise ConfigError(f"{key}: expected seconds in [{least:g}, {most:g}]")
        return float(value)
    if key == "drain_seconds":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 60:
            raise ConfigError("drain_seconds: expected a number of seconds in [0, 60]")
        return float(value)
    if key in _SECONDS_KEYS:
        shortest, longest = _SECONDS_KEYS[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (value == 0 or shortest <= value <= longest)
        ):
            raise ConfigError(f"{key}: expected 0 (off) or seconds in [{shortest:g}, {longest:g}]")
        return float(value)
    raise ConfigError(f"{key}: unknown setting")


def build_config(file_values: Mapping[str, Any], overrides: Mapping[str, Any]) -> Config:
    """Defaults, then the file, then flags (flags win). Unknown keys are errors, not ignored."""
    merged: dict[str, Any] = {}
    for source in (file_values, overrides):
        for key, value in source.items():
            if key not in _FIELDS or key == "model_warm_modes":
                raise ConfigError(f"{key}: unknown setting")
            if key == "models" and isinstance(value, Mapping):
                merged["model_warm_modes"] = _model_warm_modes(value)
            merged[key] = _check(key, value)
    config = Config(**merged)
    if config.read_bytes > config.max_read_bytes:
        raise ConfigError("read_bytes: larger than max_read_bytes")
    if config.max_input_buffer_bytes < config.max_frame_bytes:
        raise ConfigError(
            "max_input_buffer_bytes: smaller than max_frame_bytes, so a frame of the largest "
            "size could never be read whole"
        )
    check_profiles(config, "")
    check_tcp(config)
    for key in _BY_ROOT_KEYS:
        unknown_roots = set(getattr(config, key)) - set(config.roots)
        if unknown_roots:
            raise ConfigError(f"{key}: {sorted(unknown_roots)} not in roots")
    return config


def check_tcp(config: Config) -> None:
    """A TCP listener has an address, and TLS files unless it is plaintext on loopback."""
    if not config.listen_tcp:
        return
    try:
        host, _ = split_host_port(config.listen_tcp)
    except ValueError as error:
        raise ConfigError(f"listen_tcp: {error}") from None
    if config.tcp_plaintext_loopback:
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError("tcp_plaintext_loopback: plaintext TCP is refused except on "
                              f"loopback, and listen_tcp is {config.listen_tcp}")
        return
    missing = [key for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
               if not getattr(config, key)]
    if missing:
        raise ConfigError(f"listen_tcp: mutual TLS needs {', '.join(missing)} "
                          "(plaintext TCP is refused)")


def split_host_port(address: str) -> tuple[str, int]:
    """HOST:PORT or [IPV6]:PORT."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def check_profiles(config: Config, note: str) -> None:
    """Every profile's root_dir lies beneath a root in force (a profile elsewhere could
    never be warmed, and its discovery would list, and quote, directories outside them),
    and within the bounds an inline profile is held to."""
    for name, profile in config.models.items():
        # Held to the bounds of an inline profile: ranks and groups multiply every path.
        if profile.rank_count > config.max_ranks:
            raise ConfigError(f"models.{name}.layout: {profile.rank_count} ranks (tp x pp x "
                              f"pcp), above max_ranks ({config.max_ranks})")
        if len(profile.group_factors) > config.max_kv_cache_groups:
            raise ConfigError(f"models.{name}.layout.kv_cache_groups: more than "
                              f"max_kv_cache_groups ({config.max_kv_cache_groups})")
        root_dir = os.path.normpath(profile.layout.root_dir)
        if not any(root_dir == r or root_dir.startswith(r.rstrip("/") + "/") for r in config.roots):
            raise ConfigError(
                f"models.{name}.layout.root_dir: {profile.layout.root_dir} is not under an "
                f"allowed root{note}, so none of its files could be warmed"
            )


# Keys a running daemon cannot take over on SIGHUP: they are baked into the
# listening socket or into the forked workers. A reload keeps their old values
# and says so; a restart applies them.
RESTART_KEYS = frozenset({
    "socket", "socket_mode", "roots", "residency", "residency_by_root", "workers", "engine",
    "warm_extent", "warm_extent_by_root", "hold_seconds", "hold_max_files", "hold_max_bytes",
    "warm_mode", "chunk_bytes", "queue_depth", "pread_threads", "fadv_random", "batch_files",
    "max_open_files", "initial_depth", "max_in_flight", "file_timeout", "root_path_checks",
    "other_mount_threads",
    "dedup_ttl_ms",
    "dedup_entries", "dedup_bytes", "worker_nice", "worker_batch", "metrics", "model_warm_modes",
    "metrics_header_timeout", "metrics_max_clients_per_address", "metrics_rate",
    "metrics_rate_per_address", "metrics_cache_seconds",
    "listen_tcp", "tcp_plaintext_loopback",
})


def merge_reload(old: Config, new: Config) -> tuple[Config, list[str]]:
    """The config a reload puts in force, and the changed keys it had to leave as they were.

    ConfigError when the result would not hold together (the reload is refused)."""
    held = [
        key for key in sorted(RESTART_KEYS) if getattr(old, key) != getattr(new, key)
    ]
    merged = dataclasses.replace(new, **{key: getattr(old, key) for key in held})
    if "roots" in held:
        # The new profiles must fit the roots still in force, not the ones held back.
        check_profiles(merged, " in force (a change of roots waits for a restart)")
    return merged, held


def _model_warm_modes(tables: Mapping[str, Any]) -> dict[str, str]:
    modes = {}
    for name, table in tables.items():
        mode = table.get("warm_mode") if isinstance(table, Mapping) else None
        if mode is None:
            continue
        if mode not in WARM_MODES:
            raise ConfigError(f"models.{name}.warm_mode: {mode!r} is not one of read, advise")
        modes[name] = mode
    return modes


# ---- the metrics address -------------------------------------------------------------------


class MetricsAddressError(ValueError):
    """The `metrics` setting is not "HOST:PORT", "[IPV6]:PORT" or "unix:/PATH"."""


@dataclass(frozen=True)
class MetricsAddress:
    family: socket.AddressFamily
    host: str = ""  # an IP literal (TCP)
    port: int = 0
    path: str = ""  # AF_UNIX

    def __str__(self) -> str:
        if self.family == socket.AF_UNIX:
            return f"unix:{self.path}"
        if self.family == socket.AF_INET6:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


_FORMS = '"127.0.0.1:9464", "[::1]:9464" or "unix:/run/kvprefetchd/metrics.sock"'


def parse_metrics_address(text: str) -> MetricsAddress:
    """Parse (and validate, without binding) the `metrics` setting.

    Only IP literals (and "localhost", meaning 127.0.0.1): resolving a name at
    start would make the listening address depend on DNS.
    """
    if not isinstance(text, str) or not text:
        raise MetricsAddressError(f"metrics: expected {_FORMS}")
    if text.startswith(("unix:", "/")):
        path = text.removeprefix("unix:")
        if not path.startswith("/"):
            raise MetricsAddressError(f"metrics: {text!r}: a Unix socket path must be absolute")
        if len(os.fsencode(path)) > 107:  # sun_path is 108 bytes with its NUL
            raise MetricsAddressError(f"metrics: {text!r}: path longer than 107 bytes")
        return MetricsAddress(socket.AF_UNIX, path=path)
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise MetricsAddressError(f"metrics: {text!r}: expected {_FORMS}")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise MetricsAddressError(
                f"metrics: {text!r}: expected {_FORMS} (say 0.0.0.0:PORT for every interface)"
            )
        if ":" in host:
            raise MetricsAddressError(f"metrics: {text!r}: write an IPv6 address in brackets")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise MetricsAddressError(f"metrics: {text!r}: {host!r} is not an IP address") from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise MetricsAddressError(f"metrics: {text!r}: {port_text!r} is not a port number")
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    return MetricsAddress(family, host=str(ip), port=int(port_text))


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; errors name the file so the operator knows where to look."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as error:
        raise ConfigError(f"{path}: {error.strerror}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: {error}") from error
