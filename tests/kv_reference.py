"""Reference forms of the KV layout that the tests check the daemon against: one file's path
as the fs connector names it, and the llm-d router PR #1156 plugin's `kvFilePathBase` as a
layout map (spec docs/kv-file-layout.md, section 6.1). The daemon computes paths in bulk
(kv/layout.plan_paths) and has no use for the PR's configuration; these are the spec's
formulas written plainly, so the vectors can hold both to them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvprefetchd.kv import ProfileError


def file_path(base: str, rank: int, group: int, block_hash: bytes | str) -> str:
    """One file's path (FileMapper.get_file_name); the hash as bytes or lower-case hex."""
    h = block_hash if isinstance(block_hash, str) else block_hash.hex()
    return f"{base}_r{rank}/{h[0:3]}/{h[3:5]}_g{group}/{h}.bin"


PR1156_SIZE_KEYS = ("kvCacheGroupCount", "gpuBlocksPerFile", "tpSize", "ppSize", "pcpSize",
                    "dcpSize")


def pr1156_path_base(params: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, bool]:
    """The PR plugin's `kvFilePathBase` after its own defaulting, and its IsSet().

    Counts below 1 (or absent) become 1; IsSet needs non-empty rootDir, modelName and
    digest. A missing object stays None (path building off).
    """
    if params is None:
        return None, False
    base: dict[str, Any] = {
        "rootDir": params.get("rootDir") or "",
        "modelName": params.get("modelName") or "",
        "digest": params.get("digest") or "",
    }
    for key in PR1156_SIZE_KEYS:
        value = params.get(key)
        base[key] = value if type(value) is int and value >= 1 else 1
    is_set = bool(base["rootDir"] and base["modelName"] and base["digest"])
    return base, is_set


def layout_from_pr1156(params: Mapping[str, Any], block_size: int) -> dict[str, Any]:
    """A `layout` map equivalent to a PR #1156 `kvFilePathBase` and its producer's
    blockSizeTokens, WITHOUT the PR's gaps: ranks stop at tp*pp*pcp and the hash block
    size includes dcp*pcp (§6.5). The PR's `digest` is the folder fingerprint.
    """
    base, is_set = pr1156_path_base(params)
    if base is None or not is_set:
        raise ProfileError("kvFilePathBase: rootDir, modelName and digest are all required")
    cp = base["dcpSize"] * base["pcpSize"]
    groups = [{"block_size": block_size}] * base["kvCacheGroupCount"]
    return {
        "root_dir": base["rootDir"],
        "model_name": base["modelName"],
        "fingerprint": base["digest"],
        "tp_size": base["tpSize"],
        "pp_size": base["ppSize"],
        "pcp_size": base["pcpSize"],
        "dcp_size": base["dcpSize"],
        "kv_cache_groups": groups,
        "connector_block_size_tokens": base["gpuBlocksPerFile"] * block_size * cp,
    }
