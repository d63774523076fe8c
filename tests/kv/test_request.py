"""KV requests: per-prompt handling of multi-prompt requests, block_hashes requests,
bounds, and a corpus of bad requests and bad profiles named after what they break."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from kv_reference import file_path
from kvprefetchd import kv
from kvprefetchd.kv import hashing, layout

HASH = {"algo": "sha256_cbor", "python_hash_seed": "10", "block_size": 16,
        "vllm_version": "0.23.0"}
LAYOUT = {"root_dir": "/mnt/kv", "model_name": "org/m", "tp_size": 2,
          "kv_cache_groups": [{"block_size": 16, "layer_names": ["l0", "l1"]}],
          "connector_block_size_tokens": 64}
PROFILES = {"m": kv.Profile.from_mapping("m", {"hash": HASH, "layout": LAYOUT})}


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 150_000 for i in range(n)]


def resolve(message: dict[str, Any], **kwargs: Any) -> kv.Resolution:
    return kv.resolve(kv.parse_kv_request(message, PROFILES, **kwargs))


# --- several prompts --------------------------------------------------------------------

def test_each_prompt_is_its_own_chain_and_its_own_file_selection() -> None:
    a, b = tokens(90, 1), tokens(130, 2)  # 5 and 8 hashes; a file every 4th hash
    both = resolve({"model": "m", "prompts": [{"token_ids": a}, {"token_ids": b}]})
    alone_a = resolve({"model": "m", "prompts": [{"token_ids": a}]})
    alone_b = resolve({"model": "m", "prompts": [{"token_ids": b}]})
    assert both.block_hashes == alone_a.block_hashes + alone_b.block_hashes
    assert [len(c) for c in both.block_hashes] == [5, 8]
    profile = PROFILES["m"]
    assert profile.group_factors == (4,)
    base = profile.base_path()
    chain_a, chain_b = both.block_hashes
    want = [file_path(base, rank, 0, h)
            for rank in (0, 1) for h in (chain_a[3], chain_b[3], chain_b[7])]
    assert both.paths == want  # rank, then group, then prompt, then file order
    assert both.paths == [p for rank in (0, 1) for p in alone_a.paths + alone_b.paths
                          if f"_r{rank}/" in p]
    # selecting over the concatenation (the router PR) would name b's 3rd and 7th
    # hashes, files vLLM never writes for b, and miss b's real ones
    concatenated = chain_a + chain_b
    wrong = {file_path(base, 0, 0, concatenated[i]) for i in (3, 7, 11)}
    assert wrong - set(both.paths) == {file_path(base, 0, 0, chain_b[i]) for i in (2, 6)}


def test_prompts_sharing_a_prefix_share_files_listed_once() -> None:
    common = tokens(64, 3)
    first = common + tokens(64, 4)
    second = common + tokens(64, 5)
    result = resolve({"model": "m", "prompts": [{"token_ids": first}, {"token_ids": second}]})
    assert result.block_hashes[0][:4] == result.block_hashes[1][:4]
    assert len(result.paths) == len(set(result.paths)) == 2 * 3  # 2 ranks x (1 shared + 2)
    assert result.paths[0] == file_path(PROFILES["m"].base_path(), 0, 0,
                                               result.block_hashes[0][3])


def test_block_hashes_request_names_the_same_files() -> None:
    prompts = [{"token_ids": tokens(130, 6)}, {"token_ids": tokens(64, 7)}]
    from_tokens = resolve({"model": "m", "prompts": prompts})
    from_hashes = resolve({"model": "m", "block_hashes": [list(c) for c in
                                                          from_tokens.block_hashes]})
    assert from_hashes.paths == from_tokens.paths
    assert from_hashes.block_hashes_hex() == from_tokens.block_hashes_hex()


def test_block_hashes_serve_a_profile_whose_seed_cannot_be_reproduced() -> None:
    hash_map = {**HASH, "python_hash_seed": None}
    profile = kv.Profile.from_parts("old", hash_map, LAYOUT)
    assert profile.none_hash is None and profile.seed_problem
    digest = hashlib.sha256(b"x").digest()
    request = kv.parse_kv_request({"hash": hash_map, "layout": LAYOUT,
                                   "block_hashes": [[digest] * 4]}, {})
    assert len(kv.resolve(request).paths) == 2
    with pytest.raises(kv.KVRequestError, match="random NONE_HASH"):
        kv.parse_kv_request({"hash": hash_map, "layout": LAYOUT,
                             "prompts": [{"token_ids": tokens(64)}]}, {})


def test_inline_profile_equals_the_configured_one() -> None:
    prompts = [{"token_ids": tokens(200, 8)}]
    assert resolve({"hash": HASH, "layout": LAYOUT, "prompts": prompts}).paths == resolve(
        {"model": "m", "prompts": prompts}).paths


def test_extra_keys_reach_the_hash() -> None:
    base = {"token_ids": tokens(64, 9)}
    plain = resolve({"model": "m", "prompts": [base]}).block_hashes[0]
    salted = resolve({"model": "m", "prompts": [{**base, "cache_salt": "t"}]}).block_hashes[0]
    lora = resolve({"model": "m", "prompts": [{**base, "lora": {"name": "a"}}]}).block_hashes[0]
    image = resolve({"model": "m", "prompts": [{**base, "mm_features": [
        {"identifier": "img", "offset": 20, "length": 4}]}]}).block_hashes[0]
    assert salted[0] != plain[0] and salted[1] != plain[1]  # block 0 salted, chain carries
    assert len({plain[0], salted[0], lora[0]}) == 3
    assert image[0] == plain[0] and image[1] != plain[1]  # the image sits in block 1
    empty_salt = resolve({"model": "m", "prompts": [{**base, "cache_salt": ""}]})
    assert empty_salt.block_hashes[0] == plain


def test_explicit_extra_keys_accept_msgpack_bin_and_bytes_hex_alike() -> None:
    raw = bytes(range(32))
    as_bin = resolve({"model": "m", "prompts": [{"token_ids": tokens(32),
                                                 "explicit_extra_keys": [["x", raw], None]}]})
    as_hex = resolve({"model": "m", "prompts": [{"token_ids": tokens(32), "explicit_extra_keys":
                                                 [["x", {"bytes_hex": raw.hex()}], None]}]})
    assert as_bin.block_hashes == as_hex.block_hashes
    parent = hashing.none_hash("10")
    first = hashlib.sha256(hashing.block_payload(parent, tokens(16), ("x", raw))).digest()
    assert as_bin.block_hashes[0][0] == first


def test_discover_profile_needs_a_fingerprint_to_resolve() -> None:
    layout_map = {**LAYOUT, "fingerprint": "discover"}
    request = kv.parse_kv_request({"hash": HASH, "layout": layout_map,
                                   "prompts": [{"token_ids": tokens(64)}]}, {})
    assert request.profile.needs_discovery
    with pytest.raises(kv.KVRequestError, match="discover it first"):
        kv.resolve(request)
    with pytest.raises(kv.KVRequestError, match="12 lower-case hex"):
        kv.resolve(request, fingerprint="ABC")
    resolution = kv.resolve(request, fingerprint="00112233aabb")
    assert resolution.paths[0].startswith("/mnt/kv/org_m_00112233aabb_r0/")


def test_parse_ignores_the_rest_of_the_protocol_map() -> None:
    message = {"v": 1, "id": 7, "op": "resolve", "wait": True, "future_key": 1, "model": "m",
               "prompts": [{"token_ids": tokens(64), "future_key": 2}]}
    assert len(resolve(message).paths) == 2


# --- bad requests, named after what they break ------------------------------------------

def prompt(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompts": [{"token_ids": tokens(64), **fields}]}


BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("no-profile", {"prompts": [{"token_ids": [1]}]}, "model: missing"),
    ("unknown-model", {"model": "x", "prompts": [{"token_ids": [1]}]}, "no profile named 'x'"),
    ("model-not-a-string", {"model": 3, "prompts": [{"token_ids": [1]}]}, "model: must be"),
    ("model-and-inline", {"model": "m", "hash": HASH, "prompts": [{"token_ids": [1]}]},
     "not both"),
    ("inline-without-layout", {"hash": HASH, "prompts": [{"token_ids": [1]}]}, "layout: missing"),
    ("no-prompt-source", {"model": "m"}, "got none"),
    ("two-prompt-sources", {"model": "m", "prompts": [{"token_ids": [1]}], "block_hashes": [[]]},
     "got prompts, block_hashes"),
    ("prompts-not-an-array", {"model": "m", "prompts": {"token_ids": [1]}}, "prompts: must be"),
    ("prompts-empty", {"model": "m", "prompts": []}, "at least one prompt"),
    ("prompt-not-a-map", {"model": "m", "prompts": [[1, 2]]}, "prompts[0]: must be a map"),
    ("token-ids-missing", {"model": "m", "prompts": [{}]}, "prompts[0].token_ids: missing"),
    ("token-ids-not-an-array", prompt(token_ids="abc"), "token_ids: must be an array"),
    ("token-id-float", prompt(token_ids=[1, 2.0]), "every token id must be an integer"),
    ("token-id-bool", prompt(token_ids=[1, True]), "every token id must be an integer"),
    ("token-id-negative", prompt(token_ids=[1, -1]), "[0, 2**64)"),
    ("token-id-too-big", prompt(token_ids=[1 << 64]), "[0, 2**64)"),
    ("salt-not-a-string", prompt(cache_salt=5), "prompts[0].cache_salt: must be a string"),
    ("lora-not-a-map", prompt(lora="a"), "prompts[0].lora: must be a map"),
    ("lora-without-name", prompt(lora={"path": "/a"}), "prompts[0].lora.name"),
    ("lora-path-not-a-string", prompt(lora={"name": "a", "path": 1}), "lora.path: must be"),
    ("mm-not-an-array", prompt(mm_features={"identifier": "x"}), "mm_features: must be"),
    ("mm-item-not-a-map", prompt(mm_features=["x"]), "mm_features[0]: must be a map"),
    ("mm-identifier-not-a-string",
     prompt(mm_features=[{"identifier": 1, "offset": 0, "length": 1}]), "identifier"),
    ("mm-negative-offset",
     prompt(mm_features=[{"identifier": "x", "offset": -1, "length": 1}]), "offset"),
    ("mm-empty-item", prompt(mm_features=[{"identifier": "x", "offset": 0, "length": 0}]),
     "mm_features[0].length"),
    ("mm-unsorted", prompt(mm_features=[{"identifier": "x", "offset": 9, "length": 1},
                                        {"identifier": "y", "offset": 2, "length": 1}]),
     "sorted by offset"),
    ("mm-overlapping", prompt(mm_features=[{"identifier": "x", "offset": 2, "length": 5},
                                           {"identifier": "y", "offset": 6, "length": 1}]),
     "must not overlap"),
    ("prompt-embeds", prompt(prompt_embeds=b"\0" * 8), "cannot be prefetched"),
    ("explicit-with-salt", prompt(cache_salt="s", explicit_extra_keys=[None] * 4),
     "must be absent"),
    ("explicit-too-short", prompt(explicit_extra_keys=[None]), "1 entries for 4 full blocks"),
    ("explicit-not-an-array", prompt(explicit_extra_keys="x"), "explicit_extra_keys: must be"),
    ("explicit-block-not-an-array", prompt(explicit_extra_keys=["x", None, None, None]),
     "explicit_extra_keys[0]: must be an array"),
    ("explicit-float", prompt(explicit_extra_keys=[[1.5], None, None, None]),
     "explicit_extra_keys[0][0]: an extra key must be"),
    ("explicit-map", prompt(explicit_extra_keys=[[{"a": 1}], None, None, None]),
     "an extra key must be"),
    ("explicit-bad-hex", prompt(explicit_extra_keys=[[{"bytes_hex": "zz"}], None, None, None]),
     "bytes_hex: must be a hex string"),
    ("explicit-too-deep", prompt(explicit_extra_keys=[[[[[[[[[["x"]]]]]]]]], None, None, None]),
     "nested deeper"),
    ("explicit-int-out-of-range", prompt(explicit_extra_keys=[[1 << 64], None, None, None]),
     "64-bit range"),
    ("block-hashes-not-nested", {"model": "m", "block_hashes": [b"\0" * 32]},
     "block_hashes[0]: must be an array"),
    ("block-hash-short", {"model": "m", "block_hashes": [[b"\0" * 31]]},
     "block_hashes[0][0]: must be a 32-byte binary hash"),
    ("block-hash-as-hex", {"model": "m", "block_hashes": [["00" * 32]]}, "32-byte binary hash"),
    ("block-hashes-empty", {"model": "m", "block_hashes": []}, "non-empty array"),
    ("extras-without-version",
     {"hash": {**HASH, "vllm_version": None}, "layout": LAYOUT,
      "prompts": [{"token_ids": [1] * 16, "cache_salt": "s"}]}, "need hash.vllm_version"),
    ("lora-path-needed-on-era-c",
     {"hash": {**HASH, "vllm_version": "0.31.0"}, "layout": LAYOUT,
      "prompts": [{"token_ids": [1] * 16, "lora": {"name": "a"}}]}, "prompts[0].lora.path"),
    ("unset-seed-without-version",
     {"hash": {**HASH, "python_hash_seed": None, "vllm_version": None}, "layout": LAYOUT,
      "prompts": [{"token_ids": [1] * 16}]}, "version must be known"),
    ("inline-layout-bad", {"hash": HASH, "layout": {**LAYOUT, "tp_size": 0},
                           "prompts": [{"token_ids": [1]}]}, "layout.tp_size: must be a positive"),
]


@pytest.mark.parametrize(("message", "match"), [pytest.param(m, s, id=n)
                                                for n, m, s in BAD_REQUESTS])
def test_bad_request_is_refused_naming_the_field(message: dict[str, Any], match: str) -> None:
    with pytest.raises(kv.KVRequestError) as caught:
        kv.parse_kv_request(message, PROFILES)
    assert match in str(caught.value)
    assert caught.value.code == "bad_request"


def test_inline_profiles_can_be_refused() -> None:
    with pytest.raises(kv.KVRequestError, match="refused by this daemon's configuration"):
        kv.parse_kv_request({"hash": HASH, "layout": LAYOUT, "prompts": [{"token_ids": [1]}]},
                            PROFILES, allow_inline=False)
    assert kv.parse_kv_request({"model": "m", "prompts": [{"token_ids": [1]}]}, PROFILES,
                               allow_inline=False)


TOO_LARGE: list[tuple[str, dict[str, Any], kv.Limits, str]] = [
    ("too-many-prompts", {"model": "m", "prompts": [{"token_ids": [1]}] * 3},
     kv.Limits(max_prompts=2), "3 prompts"),
    ("too-many-tokens", {"model": "m", "prompts": [{"token_ids": [1] * 600}] * 2},
     kv.Limits(max_tokens=1000), "1200 tokens"),
    ("too-many-files", {"model": "m", "prompts": [{"token_ids": [1] * 640}]},
     kv.Limits(max_files=19), "maps to 20 files"),
    ("too-many-hashes", {"model": "m", "block_hashes": [[b"\0" * 32] * 5] * 2},
     kv.Limits(max_block_hashes=9), "more than 9 hashes"),
    ("too-many-hash-prompts", {"model": "m", "block_hashes": [[]] * 3},
     kv.Limits(max_prompts=2), "3 prompts"),
    ("too-many-mm-items", prompt(mm_features=[{"identifier": "x", "offset": i, "length": 1}
                                              for i in range(5)]),
     kv.Limits(max_mm_features=4), "5 items"),
]


@pytest.mark.parametrize(("message", "limits", "match"), [pytest.param(m, lim, s, id=n)
                                                          for n, m, lim, s in TOO_LARGE])
def test_bounds_are_refused_as_too_large(message: dict[str, Any], limits: kv.Limits,
                                         match: str) -> None:
    with pytest.raises(kv.KVRequestError) as caught:
        kv.parse_kv_request(message, PROFILES, limits)
    assert match in str(caught.value)
    assert caught.value.code == "too_large"


# --- bad profiles ---------------------------------------------------------------------

def table(hash_changes: dict[str, Any] | None = None,
          layout_changes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"hash": {**HASH, **(hash_changes or {})},
            "layout": {**LAYOUT, **(layout_changes or {})}}


BAD_PROFILES: list[tuple[str, Any, str]] = [
    ("not-a-map", [], "models.p: must be a map"),
    ("no-hash", {"layout": LAYOUT}, "models.p.hash: missing"),
    ("no-layout", {"hash": HASH}, "models.p.layout: missing"),
    ("unknown-section", {**table(), "hashes": {}}, "models.p.hashes: unknown key"),
    ("unknown-hash-key", table({"seed": "1"}), "models.p.hash.seed: unknown key"),
    ("unknown-layout-key", table(None, {"tp": 2}), "models.p.layout.tp: unknown key"),
    ("unknown-group-key", table(None, {"kv_cache_groups": [{"block_size": 16, "size": 1}]}),
     "kv_cache_groups[0].size: unknown key"),
    ("algo-missing", table({"algo": None}), "models.p.hash.algo: missing"),
    ("algo-unsupported", table({"algo": "xxhash"}), "'xxhash' is not supported"),
    ("block-size-missing", table({"block_size": None}), "models.p.hash.block_size: missing"),
    ("block-size-aliases-disagree", table({"vllm_block_size": 32}), "disagree"),
    ("block-size-zero", table({"block_size": 0}), "hash.block_size: must be a positive"),
    ("block-size-string", table({"block_size": "16"}), "hash.block_size: must be a positive"),
    ("seed-not-a-string", table({"python_hash_seed": 10}), "python_hash_seed: must be a string"),
    ("seed-impossible", table({"python_hash_seed": "abc"}), "not a PYTHONHASHSEED CPython"),
    ("seed-too-big", table({"python_hash_seed": "4294967296"}), "not a PYTHONHASHSEED"),
    ("seed-with-space", table({"python_hash_seed": "10 "}), "not a PYTHONHASHSEED"),
    ("version-garbage", table({"vllm_version": "latest"}), "hash.vllm_version: not a vLLM"),
    ("root-missing", table(None, {"root_dir": None}), "layout.root_dir: missing"),
    ("root-relative", table(None, {"root_dir": "kv"}), "must be an absolute path"),
    ("model-empty", table(None, {"model_name": ""}), "layout.model_name: must not be empty"),
    ("tp-zero", table(None, {"tp_size": 0}), "layout.tp_size: must be a positive integer"),
    ("dcp-not-dividing-tp", table(None, {"dcp_size": 3}), "must divide layout.tp_size"),
    ("groups-missing", table(None, {"kv_cache_groups": None}), "kv_cache_groups: missing"),
    ("groups-empty", table(None, {"kv_cache_groups": []}), "non-empty array"),
    ("group-not-a-map", table(None, {"kv_cache_groups": [16]}), "kv_cache_groups[0]: must be"),
    ("group-block-size-missing", table(None, {"kv_cache_groups": [{"layer_names": []}]}),
     "kv_cache_groups[0].block_size: missing"),
    ("layer-names-not-strings", table(None, {"kv_cache_groups": [
        {"block_size": 16, "layer_names": [1]}]}), "layer_names: must be an array of strings"),
    ("single-group-size-differs", table(None, {"kv_cache_groups": [
        {"block_size": 32, "layer_names": []}]}), "must equal hash.block_size"),
    ("hybrid-with-dcp", table(None, {"dcp_size": 2, "kv_cache_groups": [
        {"block_size": 16, "layer_names": []}, {"block_size": 32, "layer_names": []}]}),
     "context parallelism"),
    ("hash-block-size-contradicts", table({"hash_block_size_tokens": 32}), "vLLM hashes"),
    ("connector-not-a-multiple", table(None, {"connector_block_size_tokens": 40}),
     "multiple of the hash block size"),
    ("group-factor-fractional", table({"hash_block_size_tokens": 16}, {
        "connector_block_size_tokens": 16,
        "kv_cache_groups": [{"block_size": 16, "layer_names": []},
                            {"block_size": 40, "layer_names": []}]}),
     "kv_cache_groups[1].block_size (40)"),
    ("fingerprint-not-hex", table(None, {"fingerprint": "07D7B166F256"}), "12 lower-case hex"),
    ("fingerprint-short", table(None, {"fingerprint": "07d7"}), "12 lower-case hex"),
    ("fingerprint-fields-disagree", table(None, {"fingerprint": "000000000000",
                                                 "fingerprint_fields": {"a": 1}}),
     "hash to"),
    ("discover-and-fields", table(None, {"fingerprint": "discover",
                                         "fingerprint_fields": {"a": 1}}), "contradicts"),
    ("fields-not-json", table(None, {"fingerprint_fields": {"a": b"\0"}}), "not JSON data"),
    ("field-set-unknown", table(None, {"fingerprint_field_set": "v3"}), "must be one of"),
    ("canonical-format-bad", table(None, {"canonical_format": [1]}), "canonical_format"),
    ("agnostic-not-bool", table(None, {"parallel_agnostic": "yes"}), "must be true or false"),
    ("layer-names-needed", table(None, {"kv_cache_groups": [{"block_size": 16}]}),
     "kv_cache_groups[0].layer_names: needed to compute"),
]


@pytest.mark.parametrize(("data", "match"), [pytest.param(d, s, id=n) for n, d, s in BAD_PROFILES])
def test_bad_profile_is_refused_naming_the_key(data: Any, match: str) -> None:
    with pytest.raises(kv.ProfileError) as caught:
        kv.Profile.from_mapping("p", data)
    assert match in str(caught.value)


def test_profile_defaults_and_derived_values() -> None:
    profile = kv.Profile.from_mapping("p", {
        "hash": {"algo": "sha256", "vllm_block_size": 16},
        "layout": {"root_dir": "/kv", "model_name": "m", "dtype": "torch.bfloat16",
                   "kv_cache_groups": [{"block_size": 16}], "fingerprint": "discover"}})
    assert profile.layout.tp_size == profile.layout.dcp_size == 1
    assert profile.layout.connector_block_size_tokens == 256  # the connector's default
    assert profile.blocks_per_file == 16 and profile.group_factors == (16,)
    assert profile.layout.dtype == "bfloat16"
    assert profile.hash.python_hash_seed is None and profile.version is None
    assert profile.seed_problem is not None and profile.needs_discovery
    assert profile.field_set == "v1"
    hash(profile)  # hashable: a cache key for discovered fingerprints


def test_profile_built_from_specs_is_checked_too() -> None:
    spec = kv.HashSpec(algo="sha256_cbor", python_hash_seed="0", block_size=16)
    groups = (kv.KVCacheGroup(16, ("l0",)),)
    assert kv.Profile.build("p", spec, kv.LayoutSpec("/kv", "m", groups)).fingerprint
    with pytest.raises(kv.ProfileError, match=r"layout\.dcp_size: must be a positive"):
        kv.Profile.build("p", spec, kv.LayoutSpec("/kv", "m", groups, dcp_size=0))
    with pytest.raises(kv.ProfileError, match="kv_cache_groups: must not be empty"):
        kv.Profile.build("p", spec, kv.LayoutSpec("/kv", "m", ()))


def test_profile_with_fingerprint_fields_uses_their_digest() -> None:
    fields = {"model_name": "org/m", "tp_size": 2}
    profile = kv.Profile.from_mapping("p", table(None, {"fingerprint_fields": fields}))
    assert profile.fingerprint == layout.fingerprint_of(fields)
    same = kv.Profile.from_mapping("p", table(None, {"fingerprint_fields": fields,
                                                     "fingerprint": profile.fingerprint}))
    assert same.fingerprint == profile.fingerprint


def test_inline_profiles_ignore_unknown_keys_but_configured_ones_do_not() -> None:
    assert kv.Profile.from_parts("i", {**HASH, "new": 1}, {**LAYOUT, "new": 2})
    with pytest.raises(kv.ProfileError, match="unknown key"):
        kv.Profile.from_mapping("p", table({"new": 1}))
