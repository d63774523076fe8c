"""The two maps of a model profile, `hash` and `layout`, read and checked key by key.

Pure parsing with errors that name the key (`models.NAME.layout.tp_size`); what follows
from the maps (hash block size, ranks, fingerprint) is derived in profile.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvprefetchd.kv import hashing, layout
from kvprefetchd.kv.errors import ProfileError
from kvprefetchd.kv.layout import FieldSet

DISCOVER = "discover"
DEFAULT_CONNECTOR_BLOCK_SIZE_TOKENS = 256  # llmd_fs_backend spec.py default
FINGERPRINT_RE = re.compile(r"[0-9a-f]{12}")
# The most a count or a position of tokens may say (block sizes, mm_features offsets and
# lengths): no request holds more tokens (max_tokens is at most 2**28), so a larger block
# never fills; a request's number beyond it is refused, never computed with
# (docs/protocol.md, "Numeric fields"). Ranks have their own bound, max_ranks.
MAX_TOKEN_COUNT = 1 << 28

HASH_KEYS = frozenset(
    {"algo", "python_hash_seed", "block_size", "vllm_block_size", "vllm_version",
     "hash_block_size_tokens"}
)
LAYOUT_KEYS = frozenset(
    {"root_dir", "model_name", "tp_size", "pp_size", "pcp_size", "dcp_size", "dtype",
     "kv_cache_groups", "connector_block_size_tokens", "fingerprint", "fingerprint_fields",
     "fingerprint_field_set", "parallel_agnostic", "replicated_layout", "canonical_format"}
)
GROUP_KEYS = frozenset({"block_size", "layer_names"})


@dataclass(frozen=True)
class ProfileBounds:
    """What a profile may ask of the supervisor, checked before anything is derived from
    it: an inline layout is the client's, and its sizes multiply every request's work
    (ranks x groups paths per named block; 2**40 ranks pinned the supervisor for good)."""

    max_ranks: int
    max_kv_cache_groups: int
    # Layer names plus fingerprint_fields elements: hashed into the fingerprint as JSON
    # (2 million names cost 0.5 s); a real model has one name per layer, a few hundred.
    max_layout_items: int = 16384


@dataclass(frozen=True)
class HashSpec:
    algo: str
    python_hash_seed: str | None
    block_size: int
    vllm_version: str | None = None
    hash_block_size_tokens: int | None = None


@dataclass(frozen=True)
class KVCacheGroup:
    block_size: int
    layer_names: tuple[str, ...] | None = None  # needed only to compute the fingerprint


@dataclass(frozen=True)
class LayoutSpec:
    root_dir: str
    model_name: str
    kv_cache_groups: tuple[KVCacheGroup, ...]
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    dtype: str = "auto"
    connector_block_size_tokens: int = DEFAULT_CONNECTOR_BLOCK_SIZE_TOKENS
    fingerprint: str | None = None  # 12 hex, "discover", or None: computed
    fingerprint_fields_json: str | None = None  # canonical JSON of a given field map
    fingerprint_field_set: FieldSet | None = None  # None: chosen by hash.vllm_version
    parallel_agnostic: bool = False
    replicated_layout: bool = False
    canonical_format: str | int | None = None


# --- reading the maps -------------------------------------------------------------------

def as_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProfileError(f"{where}: must be a map, got {type(value).__name__}")
    return value


def refuse_unknown(data: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise ProfileError(
            f"{where}{unknown[0]}: unknown key (known: {', '.join(sorted(known))})"
        )


def _opt_int(data: Mapping[str, Any], key: str, where: str,
             most: int | None = None) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 1 or (most is not None and value > most):
        bound = f" of at most {most}" if most is not None else ""
        shown = repr(value) if type(value) in (int, float, bool) else type(value).__name__
        raise ProfileError(f"{where}.{key}: must be a positive integer{bound}, got {shown}")
    return value


def _int(data: Mapping[str, Any], key: str, where: str, default: int,
         most: int | None = None) -> int:
    value = _opt_int(data, key, where, most)
    return default if value is None else value


def _req_int(data: Mapping[str, Any], key: str, where: str, what: str,
             most: int | None = None) -> int:
    value = _opt_int(data, key, where, most)
    if value is None:
        raise ProfileError(f"{where}.{key}: missing ({what})")
    return value


def _str(data: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> str | None:
    value = data.get(key)
    if value is None:
        if required:
            raise ProfileError(f"{where}.{key}: missing (a string)")
        return None
    if not isinstance(value, str):
        raise ProfileError(f"{where}.{key}: must be a string, got {type(value).__name__}")
    if required and not value:
        raise ProfileError(f"{where}.{key}: must not be empty")
    return value


def _bool(data: Mapping[str, Any], key: str, where: str) -> bool:
    value = data.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ProfileError(f"{where}.{key}: must be true or false, got {value!r}")
    return value


def read_hash_spec(data: Any, where: str, strict: bool) -> HashSpec:
    data = as_mapping(data, where)
    if strict:
        refuse_unknown(data, HASH_KEYS, f"{where}.")
    algo = _str(data, "algo", where, required=True)
    assert algo is not None
    if algo not in hashing.ALGOS:
        raise ProfileError(
            f"{where}.algo: {algo!r} is not supported (one of: {', '.join(hashing.ALGOS)}); "
            "it must equal vLLM's --prefix-caching-hash-algo"
        )
    block_size = _opt_int(data, "block_size", where, MAX_TOKEN_COUNT)
    alias = _opt_int(data, "vllm_block_size", where, MAX_TOKEN_COUNT)
    if block_size is not None and alias is not None and block_size != alias:
        raise ProfileError(f"{where}.block_size ({block_size}) and {where}.vllm_block_size "
                           f"({alias}) disagree")
    block_size = block_size or alias
    if block_size is None:
        raise ProfileError(f"{where}.block_size: missing (vLLM --block-size, in tokens)")
    seed = _str(data, "python_hash_seed", where)
    if seed is not None and not _possible_seed(seed):
        raise ProfileError(
            f"{where}.python_hash_seed: {seed!r} is not a PYTHONHASHSEED CPython starts with "
            '("random" or a decimal integer up to 4294967295; leave it out when unset)'
        )
    return HashSpec(
        algo=algo,
        python_hash_seed=seed,
        block_size=block_size,
        vllm_version=_str(data, "vllm_version", where),
        hash_block_size_tokens=_opt_int(data, "hash_block_size_tokens", where,
                                        MAX_TOKEN_COUNT),
    )


def _possible_seed(seed: str) -> bool:
    """CPython refuses to start with any other PYTHONHASHSEED (checked on 3.11, §2.2); an
    empty one counts as unset for CPython, but vLLM then hashes the empty string."""
    if seed in ("", "random"):
        return True
    return seed.isascii() and seed.isdigit() and int(seed) <= 0xFFFF_FFFF


def read_layout_spec(
    data: Any, where: str, strict: bool, bounds: ProfileBounds | None = None
) -> LayoutSpec:
    data = as_mapping(data, where)
    if strict:
        refuse_unknown(data, LAYOUT_KEYS, f"{where}.")
    root_dir = _str(data, "root_dir", where, required=True)
    model_name = _str(data, "model_name", where, required=True)
    assert root_dir is not None and model_name is not None
    if not root_dir.startswith("/"):
        raise ProfileError(f"{where}.root_dir: must be an absolute path, got {root_dir!r}")
    raw_groups = data.get("kv_cache_groups")
    if bounds is not None:
        _check_layout_size(data, raw_groups, bounds, where)
    groups = _groups(raw_groups, f"{where}.kv_cache_groups", strict)
    dtype = _str(data, "dtype", where) or "auto"
    dtype = dtype.removeprefix("torch.")  # str(torch.bfloat16) minus "torch.", §5.3
    fingerprint = _str(data, "fingerprint", where)
    if fingerprint is not None and fingerprint != DISCOVER and not FINGERPRINT_RE.fullmatch(
        fingerprint
    ):
        raise ProfileError(
            f'{where}.fingerprint: must be 12 lower-case hex digits or "discover", '
            f"got {fingerprint!r}"
        )
    fields_json = None
    if data.get("fingerprint_fields") is not None:
        fields = as_mapping(data["fingerprint_fields"], f"{where}.fingerprint_fields")
        try:
            fields_json = layout.canonical_json(fields)
        except (TypeError, ValueError) as error:
            raise ProfileError(f"{where}.fingerprint_fields: not JSON data ({error})") from None
    field_set = data.get("fingerprint_field_set")
    if field_set is not None and field_set not in layout.FIELD_SETS:
        raise ProfileError(
            f"{where}.fingerprint_field_set: must be one of {', '.join(layout.FIELD_SETS)}, "
            f"got {field_set!r}"
        )
    canonical_format = data.get("canonical_format")
    if canonical_format is not None and (
        type(canonical_format) not in (str, int)
    ):
        raise ProfileError(f"{where}.canonical_format: must be a string or an integer")
    sizes = {key: _int(data, key, where, 1) for key in ("tp_size", "pp_size", "pcp_size",
                                                          "dcp_size")}
    return LayoutSpec(
        root_dir=root_dir,
        model_name=model_name,
        kv_cache_groups=groups,
        dtype=dtype,
        connector_block_size_tokens=_int(
            data, "connector_block_size_tokens", where, DEFAULT_CONNECTOR_BLOCK_SIZE_TOKENS,
            MAX_TOKEN_COUNT,
        ),
        fingerprint=fingerprint,
        fingerprint_fields_json=fields_json,
        fingerprint_field_set=field_set,
        parallel_agnostic=_bool(data, "parallel_agnostic", where),
        replicated_layout=_bool(data, "replicated_layout", where),
        canonical_format=canonical_format,
        **sizes,
    )


def _check_layout_size(
    data: Mapping[str, Any], raw_groups: Any, bounds: ProfileBounds, where: str
) -> None:
    """Groups, layer names and fingerprint fields within bounds, counted before any is read."""
    if not isinstance(raw_groups, list | tuple):
        return  # _groups says what is wrong with it
    if len(raw_groups) > bounds.max_kv_cache_groups:
        raise ProfileError(
            f"{where}.kv_cache_groups: {len(raw_groups)} groups, above the limit of "
            f"{bounds.max_kv_cache_groups} (max_kv_cache_groups)", code="too_large",
        )
    items = 0
    for group in raw_groups:
        names = group.get("layer_names") if isinstance(group, Mapping) else None
        items += len(names) if isinstance(names, list | tuple) else 0
    items += count_items(data.get("fingerprint_fields"), bounds.max_layout_items - items + 1)
    if items > bounds.max_layout_items:
        raise ProfileError(
            f"{where}: more than {bounds.max_layout_items} layer names and fingerprint_fields "
            "elements in an inline layout", code="too_large",
        )


def count_items(value: Any, stop_at: int) -> int:
    """Elements and entries in a JSON-like value, counted up to `stop_at` (no further)."""
    count = 0
    pending = [value]
    while pending and count < stop_at:
        item = pending.pop()
        if isinstance(item, Mapping):
            count += len(item)
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            count += len(item)
            pending.extend(item)
    return count


def _groups(value: Any, where: str, strict: bool) -> tuple[KVCacheGroup, ...]:
    if value is None:
        raise ProfileError(f"{where}: missing (one {{block_size, layer_names}} per group)")
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise ProfileError(f"{where}: must be a non-empty array of {{block_size, layer_names}}")
    groups = []
    for index, item in enumerate(value):
        at = f"{where}[{index}]"
        item = as_mapping(item, at)
        if strict:
            refuse_unknown(item, GROUP_KEYS, f"{at}.")
        block_size = _req_int(item, "block_size", at, "the group's block size in tokens",
                              MAX_TOKEN_COUNT)
        names = item.get("layer_names")
        if names is not None:
            if (not isinstance(names, Sequence) or isinstance(names, str | bytes)
                    or not all(isinstance(n, str) for n in names)):
                raise ProfileError(f"{at}.layer_names: must be an array of strings")
            names = tuple(names)
        groups.append(KVCacheGroup(block_size=block_size, layer_names=names))
    return tuple(groups)
