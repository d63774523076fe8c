"""Config keys: operating the daemon (metrics, stopping, wedged workers, logs), and the
tables after every top-level key (per-root overrides, model profiles)."""

from __future__ import annotations

from kvprefetchd.config_keys.key import (
    ADDRESS,
    BY_ROOT,
    CHOICE,
    DERIVED,
    INT,
    MODELS,
    SECONDS,
    SECONDS_OR_OFF,
    Flag,
    Key,
    Section,
)
from kvprefetchd.config_keys.serving import RESIDENCY_RULES
from kvprefetchd.roots.tiers import WARM_EXTENTS

LOG_LEVELS = ("debug", "info", "warning", "error")
METRICS_ENV = "KVPREFETCHD_METRICS"

# [models.NAME]: written whole here, its lines as long as the TOML's.
MODEL_EXAMPLE = """\
[models.qwen3-8b]
warm_mode = "advise"            # optional: this profile's warm mode (default: warm_mode above)

[models.qwen3-8b.hash]
algo = "sha256_cbor"            # or "sha256" (vLLM's default, pickle)
python_hash_seed = "10"         # vLLM's PYTHONHASHSEED; leave out when unset
block_size = 64                 # vLLM --block-size
vllm_version = "0.23.0"         # selects the extra-key era and the unset-seed rule
# hash_block_size_tokens = 64   # only for hybrid models whose H is not the gcd

[models.qwen3-8b.layout]
root_dir = "/mnt/kv"            # the connector's shared_storage_path
model_name = "Qwen/Qwen3-8B"    # vLLM --model exactly as given
tp_size = 1                     # pp_size, pcp_size, dcp_size: default 1
dtype = "auto"
connector_block_size_tokens = 512   # default 256, the connector's default
kv_cache_groups = [{ block_size = 64 }]   # layer_names = [...]: only to compute the fingerprint
fingerprint = "07d7b166f256"    # the 12-hex folder tag; or "discover" to find it on disk"""

OPERATIONS = Section("operations", (
    Key("metrics", ADDRESS, "", restart=True, env=METRICS_ENV,
        flag=Flag("--metrics", 'serve Prometheus metrics on ADDR: "127.0.0.1:9464", '
                  '"[::1]:9464" or "unix:/PATH"', "ADDR"), help=f"""
        Prometheus metrics over HTTP (GET /metrics); "" (the default) turns them off.
          "127.0.0.1:9464"   loopback TCP (the unit allows only localhost: IPAddressAllow=)
          "[::1]:9464"       IPv6 loopback
          "unix:/run/kvprefetchd/metrics.sock"   a Unix socket (mode 0660)
        --metrics ADDR and ${METRICS_ENV} override it (the flag first). The page also has
        the supervisor's standard process_* metrics, and is OpenMetrics when the scraper asks.
        Bind it to an address only the scraper can reach (never 0.0.0.0 on a shared network:
        the endpoint has no authentication; on Kubernetes, the pod IP: docs/metrics.md)."""),
    Key("metrics_header_timeout", SECONDS, 0.5, bounds=(0.05, 10.0), restart=True, help="""
        The endpoint's bounds, so that nobody who can reach it blinds it (holds its 32
        client slots) or saturates the supervisor (docs/metrics.md). A client's request
        header must arrive within metrics_header_timeout seconds of its connect (0.05 to
        10); when every slot is taken a newcomer evicts the oldest client still reading."""),
    Key("metrics_max_clients_per_address", INT, 4, bounds=(1, 32), restart=True, help="""
        Slots one address may hold (IPv6: one /64), 1 to 32."""),
    Key("metrics_rate_per_address", INT, 10, bounds=(1, 100_000), restart=True, help="""
        New connections a second from one address (bursts of twice as many), and from all
        addresses together; beyond them a connection is closed at once, unanswered.
        Addresses served a scrape in the last 15 minutes skip the second cap. 1 to 100000."""),
    Key("metrics_rate", INT, 200, bounds=(1, 100_000), restart=True),
    Key("metrics_cache_seconds", SECONDS, 0.5, bounds=(0.0, 60.0), restart=True, help="""
        The page is rendered at most once per this many seconds (per format); scrapes
        within it get the same page. 0 renders every scrape. 0 to 60."""),
    Key("drain_seconds", SECONDS, 3.0, bounds=(0.0, 60.0), help="""
        On SIGTERM, seconds to let waiting requests finish before answering them as
        `expired` (plus at most 1 s to stop the workers: out within 5 s)."""),
    # Below 1 s a healthy batch on a slow tier would look wedged.
    Key("worker_timeout", SECONDS_OR_OFF, 60.0, bounds=(1.0, 3600.0), help="""
        A worker that owes outcomes and has sent the supervisor nothing for this many
        seconds is wedged (stuck in a read on a dead or hung tier): it is killed with
        SIGKILL, its files are answered `failed`, and a new worker takes its shard
        (logged; `workers_killed_wedged` in stats). A healthy worker reports after every
        batch (at most batch_files files and 256 MiB of heads), so this must exceed the
        longest a batch can take on your slowest tier; a tier that recalls from tape
        can take minutes per file: raise it, or 0 to never kill. 0 or 1 to 3600."""),
    Key("log_level", CHOICE, "info", choices=LOG_LEVELS,
        flag=Flag("--log-level", "debug shows every refused path"), help="""
        "debug", "info", "warning" or "error". Under systemd the journal adds timestamps."""),
))

TABLES = Section("tables (TOML: after every top-level key)", (
    Key("residency_by_root", BY_ROOT, {}, choices=RESIDENCY_RULES, restart=True, help="""
        Per-root residency rules overriding `residency` (each root must be in `roots`).""",
        example='''
        [residency_by_root]
        "/mnt/kv" = "tier"'''),
    Key("warm_extent_by_root", BY_ROOT, {}, choices=WARM_EXTENTS, restart=True, help="""
        Per-root warm extents overriding `warm_extent` (each root must be in `roots`).""",
        example='''
        [warm_extent_by_root]
        "/mnt/s3-kv" = "whole"'''),
    Key("models", MODELS, {}, help="""
        A model profile: how one vLLM deployment hashes blocks and where its fs
        connector writes them, for `prefetch_blocks {model: NAME, prompts: ...}`. Key
        names are the wire protocol's (docs/protocol.md, "KV requests"). layout.root_dir
        must be under one of `roots`. A profile's warm_mode applies at the next restart.""",
        example=MODEL_EXAMPLE),
    # Each [models.NAME] table's warm_mode (config.py takes it out before the profile is
    # parsed): a profile may warm by advice where the global mode reads.
    Key("model_warm_modes", DERIVED, {}, restart=True),
))
