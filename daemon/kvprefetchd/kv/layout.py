"""Where vLLM's fs connector writes a block: folder fingerprint, ranks, groups, file names.

    <root_dir>/<safe_model>_<fp12>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin     (§5.1)

- `h` is the lower-case hex of all block-hash bytes; `safe_model` is `--model` as
  given with every '/' made '_'; parts are joined by plain string concatenation with
  '/', so a root_dir with a trailing slash yields '//' exactly as the connector does
  (llm-d FileMapper, vLLM 0.23+ vllm/v1/kv_offload/file_mapper.py).
- One file holds F_g consecutive hash blocks of group g; it is named by the LAST hash
  of its run, so a prompt's files are its hashes at F_g-1, 2F_g-1, ... (§5.2).
- Ranks are 0 .. tp*pp*pcp-1: dcp reuses the tp ranks and adds none (§5.4).
- `fp12` is the first 12 hex digits of SHA-256 over the canonical JSON of a field set
  that changed across writers (§5.3).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from kvprefetchd.kv.hashing import Version

FieldSet = Literal["v1", "v2a", "v2b"]
FIELD_SETS: tuple[FieldSet, ...] = ("v1", "v2a", "v2b")
INFERENCE_ENGINE = "vllm"


def safe_model_name(model_name: str) -> str:
    return model_name.replace("/", "_")


def base_path(root_dir: str, model_name: str, fingerprint: str) -> str:
    """The folder base shared by every rank; config.json lives in it (without _r<rank>)."""
    return f"{root_dir}/{safe_model_name(model_name)}_{fingerprint}"


def rank_dir(base: str, rank: int) -> str:
    return f"{base}_r{rank}"


def config_json_path(base: str) -> str:
    return f"{base}/config.json"


# --- Which hashes name files (§5.2) -----------------------------------------------------

def gpu_blocks_per_file(connector_block_size_tokens: int, hash_block_size: int) -> int:
    """The connector's block_size_factor: its block size (tokens) over H (spec.py)."""
    if connector_block_size_tokens % hash_block_size:
        raise ValueError(
            f"layout.connector_block_size_tokens ({connector_block_size_tokens}) must be a "
            f"multiple of the hash block size ({hash_block_size} tokens)"
        )
    return connector_block_size_tokens // hash_block_size


def group_factors(
    group_block_sizes: Sequence[int],
    *,
    hash_block_size: int,
    blocks_per_file: int,
    dcp_size: int = 1,
    pcp_size: int = 1,
) -> tuple[int, ...]:
    """F_g = group_block_size * dcp * pcp * blocks_per_file / H: the hash blocks per file
    of each group (OffloadingSpec.hash_block_size_factor, vLLM 0.23 offloading scheduler)."""
    factors = []
    for index, size in enumerate(group_block_sizes):
        tokens = size * dcp_size * pcp_size * blocks_per_file
        if tokens % hash_block_size:
            raise ValueError(
                f"layout.kv_cache_groups[{index}].block_size ({size}) x dcp x pcp x "
                f"blocks per file is not a multiple of the hash block size ({hash_block_size})"
            )
        factors.append(tokens // hash_block_size)
    return tuple(factors)


def file_block_indices(num_hashes: int, factor: int) -> range:
    """Indices of the hashes that name files: the last of each full run of `factor`."""
    return range(factor - 1, num_hashes, factor)


def ranks(tp_size: int, pp_size: int, pcp_size: int, *, parallel_agnostic: bool = False) -> range:
    """Every rank that writes files: world = tp*pp*pcp (dcp adds none); one when the
    layout is parallel-agnostic."""
    return range(rank_count(tp_size, pp_size, pcp_size, parallel_agnostic=parallel_agnostic))


def rank_count(tp_size: int, pp_size: int, pcp_size: int, *, parallel_agnostic: bool = False
               ) -> int:
    """How many ranks write files: plain integer arithmetic, so a product beyond 2**63
    is just a large number for the caller's bound to refuse (len(range) would overflow)."""
    return 1 if parallel_agnostic else tp_size * pp_size * pcp_size


def count_files(
    hashes_per_prompt: Iterable[int], factors: Sequence[int], rank_count: int
) -> int:
    """How many paths `plan_paths` yields at most (before de-duplication)."""
    counts = list(hashes_per_prompt)
    return rank_count * sum(n // f for f in factors for n in counts)


# A path's bytes beyond its base: "_r" RANK "/" h[0:3] "/" h[3:5] "_g" GROUP "/" h ".bin",
# with h the 64 hex digits of a 32-byte hash (the digits of RANK and GROUP come on top).
PATH_TAIL_BYTES = 2 + 1 + 3 + 1 + 2 + 2 + 1 + 64 + 4


def plan_bytes(base_bytes: int, files: int, rank_count: int, groups: int) -> int:
    """An upper bound of the bytes of `files` paths under a base of `base_bytes`: what a
    request would make the supervisor build, known before any hash is computed."""
    digits = len(str(max(rank_count - 1, 0))) + len(str(max(groups - 1, 0)))
    return files * (base_bytes + PATH_TAIL_BYTES + digits)


def plan_paths(
    base: str,
    rank_range: Iterable[int],
    factors: Sequence[int],
    hashes_per_prompt: Sequence[Sequence[bytes]],
) -> list[str]:
    """Every file path, rank-major, then group, then prompt, then file order.

    Each prompt's chain is selected on its own (selection over concatenated prompts
    would misalign every prompt after the first, §6.5.4). A path two prompts share
    (a common prefix) is listed once, where it first appears. The part below the rank
    folder is the same for every rank, so it is built once: the cost is the paths
    returned, and a request that names no file costs nothing per rank.
    """
    tails: dict[str, None] = {}  # insertion-ordered, each once
    for group, factor in enumerate(factors):
        suffix = f"_g{group}/"
        for chain in hashes_per_prompt:
            for index in range(factor - 1, len(chain), factor):
                h = chain[index].hex()
                tails[f"{h[0:3]}/{h[3:5]}{suffix}{h}.bin"] = None
    if not tails:
        return []
    paths: list[str] = []
    for rank in rank_range:
        folder = f"{base}_r{rank}/"
        paths.extend([folder + tail for tail in tails])
    return paths


# --- Fingerprint (§5.3) -----------------------------------------------------------------

def field_set_for(version: Version | None) -> FieldSet:
    """The field set vLLM's own FS tier writes: v1 up to 0.25, v2a in 0.26, v2b from 0.27.

    Without a version: v1, the set of the standalone llm-d fs connector (llmd_fs_backend
    0.21 - 0.23), which writes v1 whatever the vLLM release.
    """
    if version is None or version < (0, 26, 0):
        return "v1"
    if version < (0, 27, 0):
        return "v2a"
    return "v2b"


def fingerprint_fields(
    *,
    field_set: FieldSet,
    model_name: str,
    block_size: int,
    blocks_per_file: int,
    tp_size: int,
    pp_size: int,
    pcp_size: int,
    dcp_size: int,
    dtype: str,
    kv_cache_groups: Sequence[tuple[int, Sequence[str]]],
    parallel_agnostic: bool = False,
    replicated_layout: bool = False,
    canonical_format: str | int | None = None,
) -> dict[str, Any]:
    """The map a writer hashes into its folder fingerprint.

    `block_size` is vLLM's --block-size (v1 `hash_block_size` is that, not x dcp x pcp;
    v2 `tokens_per_hash` is taken to be the same, which the spec marks unverified).
    `kv_cache_groups` holds (block_size, layer_names) per group, in group order.
    parallel_agnostic forces tp/pp/pcp/dcp to 1; v2b records it as
    `"parallel_agnostic": false` when NOT set, `"replicated_layout": true` only when set.
    """
    if parallel_agnostic:
        tp_size = pp_size = pcp_size = dcp_size = 1
    fields: dict[str, Any] = {
        "model_name": model_name,
        "tp_size": tp_size,
        "pp_size": pp_size,
        "pcp_size": pcp_size,
        "dcp_size": dcp_size,
        "dtype": dtype,
        "inference_engine": INFERENCE_ENGINE,
    }
    if field_set == "v1":
        fields["hash_block_size"] = block_size
        fields["gpu_blocks_per_file"] = blocks_per_file
        fields["kv_cache_groups"] = [
            {"block_size": size, "layer_names": list(names)} for size, names in kv_cache_groups
        ]
        return fields
    fields["tokens_per_hash"] = block_size
    fields["blocks_per_file"] = blocks_per_file
    fields["kv_cache_groups"] = [
        {"tokens_per_block": size, "layer_names": list(names)} for size, names in kv_cache_groups
    ]
    if field_set == "v2b":
        if not parallel_agnostic:
            fields["parallel_agnostic"] = False
        if replicated_layout:
            fields["replicated_layout"] = True
        if canonical_format is not None:
            fields["canonical_format"] = canonical_format
    return fields


def canonical_json(fields: Mapping[str, Any]) -> str:
    """Python's json.dumps with sorted keys and no spaces; non-ASCII escaped as \\uXXXX."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def fingerprint_of(fields: Mapping[str, Any]) -> str:
    return fingerprint_of_json(canonical_json(fields))


def fingerprint_of_json(canonical: str) -> str:
    """The first 12 hex digits of SHA-256 over the canonical JSON text."""
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]
