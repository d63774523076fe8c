"""The table of config keys: every key the daemon takes, written once.

Each row (key.Key) gives a key's name, kind (its type), default, bounds or choices,
whether a reload applies it or it waits for a restart, its flag (or none), an environment
variable (or none) and its help. From the rows come:
  - the Config dataclass's fields: config_fields.py, generated;
  - the checks, the restart set and the reload merge: config.py, at import;
  - the daemon's flags: cli.py, at import;
  - systemd/config.example.toml and docs/configuration.md: generated.
The generated files are rewritten by `python -m kvprefetchd.config_keys --write` (run from
the repository) and held to the table by tests/unit/test_config_keys.py: adding a key is a
row here (in its section's module) and that command.
"""

from __future__ import annotations

from kvprefetchd.config_keys.key import Key, Section
from kvprefetchd.config_keys.network import TCP
from kvprefetchd.config_keys.operations import LOG_LEVELS, METRICS_ENV, OPERATIONS, TABLES
from kvprefetchd.config_keys.requests import KV, LIMITS, VERBS
from kvprefetchd.config_keys.serving import DEFAULT_ROOT, REQUESTS, RESIDENCY_RULES, WARMED
from kvprefetchd.config_keys.warming import ENGINES, WARMING

__all__ = [
    "BY_NAME",
    "DEFAULT_ROOT",
    "ENGINES",
    "KEYS",
    "LOG_LEVELS",
    "METRICS_ENV",
    "RESIDENCY_RULES",
    "RESTART_KEYS",
    "SECTIONS",
    "Key",
    "Section",
]

# In the example file's order (TOML needs its tables after every top-level key).
SECTIONS: tuple[Section, ...] = (REQUESTS, WARMED, WARMING, LIMITS, VERBS, TCP, KV, OPERATIONS,
                                 TABLES)
KEYS: tuple[Key, ...] = tuple(key for section in SECTIONS for key in section.keys)
BY_NAME: dict[str, Key] = {key.name: key for key in KEYS}
assert len(BY_NAME) == len(KEYS), "a key is listed twice"

# Keys a running daemon cannot take over on SIGHUP: they are baked into the listening
# socket or into the forked workers. A reload keeps their old values and says so; a
# restart applies them.
RESTART_KEYS = frozenset(key.name for key in KEYS if key.restart)
