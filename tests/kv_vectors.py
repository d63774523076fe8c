"""Golden vectors for the kv tests, loaded from tests/vectors/ (copied unchanged from the
research spec's vectors; tests/vectors/README.md explains the format)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

VECTORS = Path(__file__).resolve().parent / "vectors"
VERSION_RE = re.compile(r"\d+\.\d+\.\d+")

# Every vector file of kind block_hash_chain*: each case is a prompt and its hash chain.
CHAIN_FILES = [
    "sha256_cbor_text.json",
    "sha256_cbor_extras_eraA.json",
    "sha256_cbor_extras_eraB.json",
    "sha256_cbor_extras_eraB2.json",
    "sha256_cbor_extras_eraC.json",
    "sha256_cbor_explicit_extra_keys.json",
    "none_hash_and_unset_seed.json",
    "sha256_pickle_text_optional.json",
]



@cache
def vector(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((VECTORS / name).read_text(encoding="utf-8"))
    assert data["schema"] == "kv-prefetch-golden/v1", name
    return data


def vector_files() -> list[str]:
    return sorted(path.name for path in VECTORS.glob("*.json"))


def typed(value: Any) -> Any:
    """Typed JSON (vectors README) -> the Python value upstream hashed: arrays are
    tuples, {"bytes_hex": ...} is bytes, null stays None."""
    if isinstance(value, list):
        return tuple(typed(item) for item in value)
    if isinstance(value, dict):
        assert set(value) == {"bytes_hex"}, value
        return bytes.fromhex(value["bytes_hex"])
    return value


def versions_of(entries: list[str]) -> list[str]:
    """'0.23.0' or '>=0.29.0 (verified 0.29.0, 0.30.0)' -> every version named."""
    found: list[str] = []
    for entry in entries:
        for version in VERSION_RE.findall(entry):
            if version not in found:
                found.append(version)
    return found


def one_group_layout(block_size: int, **extra: Any) -> dict[str, Any]:
    """A layout for hashing tests that do not look at paths."""
    return {
        "root_dir": "/kv",
        "model_name": "org/model",
        "kv_cache_groups": [{"block_size": block_size}],
        "connector_block_size_tokens": block_size,
        "fingerprint": "0123456789ab",
        **extra,
    }
