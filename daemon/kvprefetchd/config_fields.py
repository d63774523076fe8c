"""The Config dataclass's fields, generated from the table of config keys
(kvprefetchd/config_keys/) by `python -m kvprefetchd.config_keys --write`: do not edit.
config.py's Config adds its methods; what each key means is in the table and in
docs/configuration.md."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvprefetchd.addresses import default_socket_path
from kvprefetchd.kv import Profile


@dataclass(frozen=True)
class ConfigFields:
    """Every setting, with its default, in the table's order."""

    socket: str = field(default_factory=default_socket_path)
    socket_mode: int = 0o660
    allowed_uids: tuple[int, ...] = ()
    allowed_gids: tuple[int, ...] = ()
    max_connections: int = 1024
    max_connections_per_uid: int = 128
    idle_timeout: float = 600.0
    frame_timeout: float = 30.0
    roots: tuple[str, ...] = ("/tmp/shared-kv",)
    residency: str = "auto"
    warm_extent: str = "auto"
    hold_seconds: float = 120.0
    hold_max_files: int = 4096
    hold_max_bytes: int = 68719476736
    workers: int = 0
    engine: str = "auto"
    warm_mode: str = "read"
    read_bytes: int = 1048576
    max_read_bytes: int = 67108864
    chunk_bytes: int = 131072
    initial_depth: int = 16
    max_in_flight: int = 512
    file_timeout: float = 60.0
    other_mount_threads: int = 4
    root_path_checks: bool = True
    fs_timeout: float = 10.0
    max_stuck_workers: int = 8
    queue_depth: int = 128
    pread_threads: int = 16
    fadv_random: bool = True
    batch_files: int = 256
    max_open_files: int = 1024
    queue_limit: int = 8192
    worker_nice: int = 19
    worker_batch: bool = True
    check_before_open: bool = False
    admit_by_tier_count: bool = True
    dedup_ttl_ms: int = 1000
    dedup_entries: int = 65536
    dedup_bytes: int = 16777216
    max_frame_bytes: int = 16777216
    max_paths_per_request: int = 100000
    max_path_bytes: int = 4096
    max_nesting_depth: int = 16
    max_request_containers: int = 131072
    max_request_items: int = 2097152
    max_output_bytes: int = 8388608
    max_input_buffer_bytes: int = 33554432
    default_deadline_ms: int = 0
    max_failures_listed: int = 4096
    preserve_atime: bool = False
    allow_evict: bool = False
    listen_tcp: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    tls_allowed_clients: tuple[str, ...] = ()
    tls_handshake_timeout: float = 5.0
    max_connections_per_address: int = 64
    max_tls_handshakes: int = 64
    tls_handshake_rate: int = 50
    tls_handshake_rate_per_address: int = 32
    tcp_plaintext_loopback: bool = False
    allow_inline_layouts: bool = True
    max_prompts: int = 64
    max_tokens: int = 1048576
    max_blocks: int = 65536
    max_kv_path_bytes: int = 33554432
    max_ranks: int = 1024
    max_kv_cache_groups: int = 64
    stale_streak: int = 256
    max_stale_profiles: int = 1024
    metrics: str = ""
    metrics_header_timeout: float = 0.5
    metrics_max_clients_per_address: int = 4
    metrics_rate_per_address: int = 10
    metrics_rate: int = 200
    metrics_cache_seconds: float = 0.5
    drain_seconds: float = 3.0
    worker_timeout: float = 60.0
    log_level: str = "info"
    residency_by_root: Mapping[str, str] = field(default_factory=dict)
    warm_extent_by_root: Mapping[str, str] = field(default_factory=dict)
    models: Mapping[str, Profile] = field(default_factory=dict)
    model_warm_modes: Mapping[str, str] = field(default_factory=dict)
