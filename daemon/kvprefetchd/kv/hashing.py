"""vLLM's prefix-cache block hashes, bit-exact; llm-d's FNV keys; engine keys.

Section numbers refer to the verified research spec, kv-file-layout.md, whose golden
vectors are in tests/vectors/.

vLLM chains one hash per full block of H tokens (§2.1):

    parent_0 = NONE_HASH                      (§2.2, from PYTHONHASHSEED)
    hash_i   = SHA-256(CBOR_canonical((parent_i, tuple(block tokens), extra_i)))

`sha256_cbor` encodes with `cbor2.dumps(obj, canonical=True)`, exactly the call vLLM
makes (vllm/utils/hashing.py::sha256_cbor), so this module makes it too rather than
hand-encoding: the hand-written encoders tried (a byte table per token; one bulk
encode sliced per block) gained at most ~15% at 16 tokens per block and lost at 64,
since the per-block call, SHA-256 and slicing dominate (about 0.2 ms per 1,000 tokens
at 16 tokens per block, bench/kv_hash_speed.py), and cbor2 cannot drift from
upstream's encoder. vLLM's default `sha256` pickles the same
tuple instead (§2.7).

extra_i carries LoRA, multimodal and cache_salt keys whose shape changed twice across
vLLM releases (eras, §2.4); `extra_keys_for` builds them from what a router knows.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeAlias

import cbor2

from kvprefetchd.kv.errors import KVRequestError

# A caller-supplied or era-built extra key: a CBOR text string, integer, byte string or
# array (a tuple upstream). A block's extra keys are a tuple of these, or None (CBOR null).
ExtraKey: TypeAlias = str | int | bytes | tuple["ExtraKey", ...]
BlockExtra: TypeAlias = tuple[ExtraKey, ...] | None

Algo = Literal["sha256_cbor", "sha256"]
ALGOS: tuple[Algo, ...] = ("sha256_cbor", "sha256")
Era = Literal["A", "B", "B2", "C"]
Version = tuple[int, int, int]

# §2.2: vLLM >= 0.29 hashes this fixed string when PYTHONHASHSEED is unset (sha256 and
# sha256_cbor; vllm/v1/core/kv_cache_utils.py::resolve_none_hash_seed).
UNSET_SEED_STRING = "vllm-none-hash"
FIXED_UNSET_SEED_SINCE: Version = (0, 29, 0)

# vLLM's `sha256` pickles with pickle.HIGHEST_PROTOCOL, which is 5 on every CPython
# vLLM supports (3.8 - 3.13); pinned so a future protocol 6 cannot silently change it.
PICKLE_PROTOCOL = 5

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+\-a-z].*)?", re.IGNORECASE)
_U64 = (1 << 64) - 1


def parse_vllm_version(text: str) -> Version:
    """'0.23.0', 'v0.29.1', '0.31.0rc1', '0.30.0.dev12+gabc' -> (major, minor, patch)."""
    match = _VERSION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a vLLM release version: {text!r} (expected e.g. '0.23.0')")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def era_of(version: Version) -> Era:
    """The extra-key era of a vLLM release (§2.4).

    A <= 0.18, B 0.19-0.28, B2 0.29-0.30 (B's keys, fixed unset seed), C >= 0.31.
    Releases newer than the last verified one (0.34.0) are assumed to keep era C.
    """
    if version < (0, 19, 0):
        return "A"
    if version < (0, 29, 0):
        return "B"
    if version < (0, 31, 0):
        return "B2"
    return "C"


# --- NONE_HASH: the parent of block 0 (§2.2) --------------------------------------------

def seed_string(python_hash_seed: str | None, version: Version | None) -> str:
    """The string vLLM hashes into NONE_HASH, or a KVRequestError when it is unknowable.

    An explicit PYTHONHASHSEED is hashed as the string it is ("10" and "010" differ,
    "random" is the literal word). Unset: vLLM >= 0.29 uses a fixed string; older
    releases draw 32 random bytes per process, so their hashes cannot be reproduced.
    """
    if python_hash_seed is not None:
        return python_hash_seed
    if version is None:
        raise KVRequestError(
            "hash.python_hash_seed is unset and hash.vllm_version is not given: an unset "
            "seed is reproducible only on vLLM >= 0.29, so the version must be known"
        )
    if version < FIXED_UNSET_SEED_SINCE:
        shown = ".".join(map(str, version))
        raise KVRequestError(
            f"hash.python_hash_seed is unset and vLLM {shown} (< 0.29) then draws a random "
            "NONE_HASH per process: its block hashes cannot be reproduced; set "
            "PYTHONHASHSEED for vLLM, or send block_hashes the engine published"
        )
    return UNSET_SEED_STRING


def _cbor(value: object) -> bytes:
    return cbor2.dumps(value, canonical=True)


# The pickle encoding of text-only blocks is pinned by a vector (CPython 3.11). With
# extra keys pickle would also memoise repeated *objects* (the "mm" tag of two items),
# which mirrors vLLM as long as the same literals are shared; no vector covers it.
_ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "sha256_cbor": _cbor,
    "sha256": partial(pickle.dumps, protocol=PICKLE_PROTOCOL),
}


def _encoder(algo: str) -> Callable[[Any], bytes]:
    try:
        return _ENCODERS[algo]
    except KeyError:
        raise KVRequestError(
            f"hash.algo {algo!r} is not supported (one of: {', '.join(ALGOS)})"
        ) from None


def none_hash(seed: str, algo: str = "sha256_cbor") -> bytes:
    """NONE_HASH = hash_fn(seed string) (kv_cache_utils.py::init_none_hash)."""
    return hashlib.sha256(_encoder(algo)(seed)).digest()


# --- The chain (§2.1, §2.6) -------------------------------------------------------------

def block_payload(
    parent: bytes, tokens: Sequence[int], extra: BlockExtra, algo: str = "sha256_cbor"
) -> bytes:
    """The exact bytes vLLM hashes for one block (hash_block_tokens)."""
    return _encoder(algo)((parent, tuple(tokens), extra))


def block_hashes(
    token_ids: Sequence[int],
    *,
    hash_block_size: int,
    parent: bytes,
    extras: Sequence[BlockExtra] | None = None,
    algo: str = "sha256_cbor",
) -> list[bytes]:
    """The chained hash of every FULL block of `hash_block_size` tokens (§2.1, §2.6).

    `parent` is NONE_HASH for a fresh prompt. `extras`, when given, holds block i's
    extra keys at index i (None for a block without any); at least one entry per full
    block. A trailing partial block is not hashed.
    """
    size = hash_block_size
    count = len(token_ids) // size
    if extras is not None and len(extras) < count:
        raise ValueError(f"{count} full blocks but extra keys for only {len(extras)}")
    encode = _encoder(algo)
    sha256 = hashlib.sha256
    hashes: list[bytes] = []
    append = hashes.append
    if extras is None:
        for start in range(0, count * size, size):
            parent = sha256(encode((parent, tuple(token_ids[start:start + size]), None))).digest()
            append(parent)
    else:
        for index in range(count):
            start = index * size
            block = tuple(token_ids[start:start + size])
            parent = sha256(encode((parent, block, extras[index]))).digest()
            append(parent)
    return hashes


def engine_key(block_hash: bytes) -> int:
    """The u64 vLLM publishes in KV events: the last 8 bytes, big-endian (§4)."""
    return int.from_bytes(block_hash, "big") & _U64


# --- Extra keys by era (§2.3, §2.4) -----------------------------------------------------

@dataclass(frozen=True)
class LoRA:
    name: str
    path: str | None = None


@dataclass(frozen=True)
class MMFeature:
    """One multimodal item: vLLM's per-item hash and its placeholder range in the prompt."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class Prompt:
    """What a router knows about one prompt. The `explicit_extra_keys`, when given, are
    block i's extra keys at index i and replace the derived ones (§2.3)."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    lora: LoRA | None = None
    mm_features: tuple[MMFeature, ...] = ()
    explicit_extra_keys: tuple[BlockExtra, ...] | None = None

    @property
    def has_derived_extras(self) -> bool:
        return bool(self.cache_salt) or self.lora is not None or bool(self.mm_features)


def extra_keys_for(
    prompt: Prompt, hash_block_size: int, era: Era | None
) -> list[BlockExtra] | None:
    """Per full block, vLLM's extra keys for a freshly hashed prompt; None when no block
    has any (the common text-only case). Mirrors generate_block_hash_extra_keys:
    extra = lora + mm + cache_salt, in that order, None when empty.

    `era` may be None only when the prompt needs no derived extra keys.
    """
    count = len(prompt.token_ids) // hash_block_size
    if prompt.explicit_extra_keys is not None:
        return list(prompt.explicit_extra_keys[:count])
    if not prompt.has_derived_extras:
        return None
    if era is None:
        raise KVRequestError(
            "hash.vllm_version is required to hash a prompt with cache_salt, lora or "
            "mm_features: the shape of those keys depends on the vLLM release"
        )
    tagged = era == "C"
    lora_key: ExtraKey | None = None
    if prompt.lora is not None:
        if tagged:
            if prompt.lora.path is None:
                raise KVRequestError(
                    "lora.path is required on vLLM >= 0.31, which hashes the adapter's path"
                )
            lora_key = ("lora", prompt.lora.name, prompt.lora.path)
        else:
            lora_key = prompt.lora.name
    salt = prompt.cache_salt or None  # an empty salt is no salt (vLLM tests truthiness)
    salt_key: ExtraKey | None = None
    if salt is not None:
        salt_key = ("cache_salt", salt) if tagged else salt
    items = prompt.mm_features
    # Era A's "item already passed" test is `start > end_of_item`, later eras `>=`;
    # identical for a fresh prompt, kept for fidelity (§2.4).
    strict_pass = era == "A"
    extras: list[BlockExtra] = []
    item = 0
    for index in range(count):
        start = index * hash_block_size
        end = start + hash_block_size
        keys: list[ExtraKey] = []
        if lora_key is not None:
            keys.append(lora_key)
        while item < len(items):
            feature = items[item]
            item_end = feature.offset + feature.length
            if end <= feature.offset:
                break  # not reached yet
            if (start > item_end) if strict_pass else (start >= item_end):
                item += 1  # already passed
                continue
            if era == "A":
                keys.append(feature.identifier)
            elif tagged:
                keys.append(("mm", feature.identifier, feature.offset - start))
            else:
                keys.append((feature.identifier, feature.offset - start))
            if end >= item_end:
                item += 1  # ends in this block; the next one may start in it too
            else:
                break
        if salt_key is not None and start == 0:
            keys.append(salt_key)
        extras.append(tuple(keys) if keys else None)
    return extras


def prompt_block_hashes(
    prompt: Prompt,
    *,
    hash_block_size: int,
    parent: bytes,
    era: Era | None,
    algo: str = "sha256_cbor",
) -> list[bytes]:
    """One prompt's chain, from `parent` (NONE_HASH), with its extra keys."""
    extras = extra_keys_for(prompt, hash_block_size, era)
    return block_hashes(
        prompt.token_ids, hash_block_size=hash_block_size, parent=parent, extras=extras,
        algo=algo,
    )


# --- Hash block size (§2.5) -------------------------------------------------------------

def hash_block_size(
    block_size: int,
    group_block_sizes: Sequence[int],
    *,
    dcp_size: int = 1,
    pcp_size: int = 1,
    configured: int | None = None,
) -> int:
    """Tokens per block hash H (vLLM resolve_kv_cache_block_sizes).

    One KV-cache group: H = block_size * dcp * pcp. Several (hybrid models): context
    parallelism is refused, H = the configured hash_block_size, else the gcd of the
    groups' block sizes. (vLLM falls back to the lcm when a Mamba group's block size
    differs from block_size; such a deployment must configure H explicitly.)
    Raises ValueError naming the request/profile keys.
    """
    if len(group_block_sizes) <= 1:
        derived = block_size * dcp_size * pcp_size
        if configured is not None and configured != derived:
            raise ValueError(
                f"hash.hash_block_size_tokens is {configured}, but vLLM hashes a single-group "
                f"model in blocks of block_size x dcp_size x pcp_size = {derived}"
            )
        return derived
    if dcp_size != 1 or pcp_size != 1:
        raise ValueError(
            "layout.dcp_size and layout.pcp_size must be 1 with several kv_cache_groups: "
            "vLLM refuses context parallelism for hybrid models"
        )
    if configured is not None:
        return configured
    return math.gcd(*group_block_sizes)


# --- llm-d's FNV-64a request keys (§3): for comparison only, never file names ----------

_FNV64_OFFSET = 0xCBF29CE484222325
_FNV64_PRIME = 0x100000001B3


def fnv1a64(data: bytes) -> int:
    value = _FNV64_OFFSET
    for byte in data:
        value = ((value ^ byte) * _FNV64_PRIME) & _U64
    return value


def llmd_fnv64a_keys(
    token_ids: Sequence[int],
    *,
    block_size: int,
    model: str,
    seed: str = "",
    mm_features: Sequence[MMFeature] = (),
    cache_salt: str | None = None,
) -> list[int]:
    """llm-d-kv-cache's default `fnv64a_cbor` keys (pkg/kvcache/kvblock/token_processor.go).

    init = FNV(seed bytes); root = FNV(CBOR([init, null, model])); key_i =
    FNV(CBOR([parent, tokens, extra])) with extra null or a list of {"Hash": id} maps,
    one per MM item overlapping the block. The model name is hashed, unlike vLLM.
    The cache_salt fold (one more map on block 0) follows the router PR and is not
    covered by a vector.
    """
    parent = fnv1a64(_cbor([fnv1a64(seed.encode()), None, model]))
    keys: list[int] = []
    for index in range(len(token_ids) // block_size):
        start = index * block_size
        end = start + block_size
        extra: list[dict[str, str]] = [
            {"Hash": item.identifier}
            for item in mm_features
            if item.offset < end and item.offset + item.length > start
        ]
        if cache_salt and index == 0:
            extra.append({"Hash": cache_salt})
        payload = [parent, list(token_ids[start:end]), extra or None]
        parent = fnv1a64(_cbor(payload))
        keys.append(parent)
    return keys


def llmd_digest(key: int) -> bytes:
    """The router PR's "digest" of an FNV key: its 8-byte big-endian encoding (§4)."""
    return key.to_bytes(8, "big")
