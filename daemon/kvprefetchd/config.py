"""One frozen Config, built from the embedded defaults, an optional TOML file and flags.

Everything the daemon can be told is a row of the table of config keys (config_keys/):
the fields are generated from it (config_fields.py), and the checks here follow each row's
kind and bounds, at start, so that a typo fails loudly with the key's name instead of
surfacing as odd behaviour later.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvprefetchd.addresses import MetricsAddressError, parse_metrics_address, split_host_port
from kvprefetchd.config_fields import ConfigFields
from kvprefetchd.config_keys import (
    BY_NAME,
    DEFAULT_ROOT,
    ENGINES,
    LOG_LEVELS,
    RESIDENCY_RULES,
    RESTART_KEYS,
    Key,
)
from kvprefetchd.config_keys.key import KIB, MIB
from kvprefetchd.kv import KVError, Profile
from kvprefetchd.protocol import WARM_MODES

# Names other modules take from here (the table's choices and constants).
__all__ = [
    "DEFAULT_ROOT",
    "ENGINES",
    "KIB",
    "LOG_LEVELS",
    "MIB",
    "RESIDENCY_RULES",
    "RESTART_KEYS",
    "Config",
    "ConfigError",
    "build_config",
    "check_profiles",
    "check_tcp",
    "load_file",
    "merge_reload",
]


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


@dataclass(frozen=True)
class Config(ConfigFields):
    """Every setting, with its default: the fields are the table's (config_fields.py);
    what each one means is in config_keys/ and docs/configuration.md."""

    @property
    def worker_count(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)

    def residency_for(self, root: str) -> str:
        return self.residency_by_root.get(root, self.residency)

    def warm_extent_for(self, root: str) -> str:
        return self.warm_extent_by_root.get(root, self.warm_extent)


# ---- one check per kind of key (config_keys/key.py) ----------------------------------------


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int(key: Key, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key.name}: expected an integer, got {value!r}")
    assert key.bounds is not None
    low, high = key.bounds
    if not low <= value <= high:
        raise ConfigError(f"{key.name}: {value} is outside [{low}, {high}]")
    return value


def _seconds(key: Key, value: Any) -> float:
    assert key.bounds is not None
    least, most = key.bounds
    if not _number(value) or not least <= value <= most:
        raise ConfigError(f"{key.name}: expected seconds in [{least:g}, {most:g}]")
    return float(value)


def _seconds_or_off(key: Key, value: Any) -> float:
    assert key.bounds is not None
    shortest, longest = key.bounds
    if not _number(value) or not (value == 0 or shortest <= value <= longest):
        raise ConfigError(
            f"{key.name}: expected 0 (off) or seconds in [{shortest:g}, {longest:g}]")
    return float(value)


def _bool(key: Key, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key.name}: expected true or false")
    return value


def _choice(key: Key, value: Any) -> str:
    if value not in key.choices:
        raise ConfigError(f"{key.name}: {value!r} is not one of {', '.join(key.choices)}")
    return str(value)


def _text(key: Key, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key.name}: expected a string")
    return value


def _path(key: Key, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key.name}: expected a non-empty path")
    return value


def _address(key: Key, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key.name}: expected an address string such as 127.0.0.1:9464")
    if value:
        try:
            parse_metrics_address(value)
        except MetricsAddressError as error:
            raise ConfigError(str(error)) from error
    return value


def _is_list(value: Any) -> bool:
    return not isinstance(value, str) and isinstance(value, list | tuple)


def _roots(key: Key, value: Any) -> tuple[str, ...]:
    if not _is_list(value):
        raise ConfigError(f"{key.name}: expected a list of absolute directory paths")
    roots = []
    for root in value:
        if not isinstance(root, str) or not root.startswith("/"):
            raise ConfigError(f"{key.name}: {root!r} is not an absolute path")
        roots.append(os.path.normpath(root))
    if len(set(roots)) != len(roots):
        raise ConfigError(f"{key.name}: a root is listed twice")
    return tuple(roots)


def _ids(key: Key, value: Any) -> tuple[int, ...]:
    if not _is_list(value) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in value
    ):
        raise ConfigError(f"{key.name}: expected a list of numeric ids")
    return tuple(value)


def _names(key: Key, value: Any) -> tuple[str, ...]:
    if not _is_list(value) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key.name}: expected a list of non-empty names")
    return tuple(value)


def _by_root(key: Key, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key.name}: expected a table of root = value")
    rules = {}
    for root, rule in value.items():
        if rule not in key.choices:
            raise ConfigError(
                f"{key.name}.{root}: {rule!r} is not one of {', '.join(key.choices)}")
        rules[os.path.normpath(root)] = rule
    return rules


def _models(key: Key, value: Any) -> dict[str, Profile]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key.name}: expected tables [models.NAME] with hash and layout")
    profiles = {}
    for name, table in value.items():
        if isinstance(table, Mapping) and "warm_mode" in table:
            table = {k: v for k, v in table.items() if k != "warm_mode"}
        try:
            profiles[name] = Profile.from_mapping(name, table, strict=True)
        except KVError as error:
            raise ConfigError(str(error)) from error
    return profiles


_CHECKS: dict[str, Callable[[Key, Any], Any]] = {
    "int": _int, "seconds": _seconds, "seconds_or_off": _seconds_or_off, "bool": _bool,
    "choice": _choice, "text": _text, "path": _path, "address": _address, "roots": _roots,
    "ids": _ids, "names": _names, "by_root": _by_root, "models": _models,
}


def check_value(name: str, value: Any) -> Any:
    """Validate one key's value and return it in its Config type."""
    key = BY_NAME.get(name)
    if key is None or not key.settable:
        raise ConfigError(f"{name}: unknown setting")
    return _CHECKS[key.kind.name](key, value)


def build_config(file_values: Mapping[str, Any], overrides: Mapping[str, Any]) -> Config:
    """Defaults, then the file, then flags (flags win). Unknown keys are errors, not ignored."""
    merged: dict[str, Any] = {}
    for source in (file_values, overrides):
        for key, value in source.items():
            if key == "models" and isinstance(value, Mapping):
                merged["model_warm_modes"] = _model_warm_modes(value)
            merged[key] = check_value(key, value)
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
    for key in ("residency_by_root", "warm_extent_by_root"):
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


def merge_reload(old: Config, new: Config) -> tuple[Config, list[str]]:
    """The config a reload puts in force, and the changed keys it had to leave as they were
    (RESTART_KEYS: the table's keys marked restart).

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


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; errors name the file so the operator knows where to look."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as error:
        raise ConfigError(f"{path}: {error.strerror}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: {error}") from error
