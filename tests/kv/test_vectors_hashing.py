"""Every hash-chain vector: NONE_HASH, extra keys per era, CBOR payloads, block hashes,
engine keys, llm-d FNV keys. Each case runs once per vLLM release it was verified on,
through the wire-level request parser and through the hashing functions directly."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2
import pytest

from kv_vectors import CHAIN_FILES, one_group_layout, typed, vector, versions_of
from kvprefetchd import kv
from kvprefetchd.kv import hashing


def chain_cases() -> list[Any]:
    params = []
    for name in CHAIN_FILES:
        data = vector(name)
        for case in data["cases"]:
            versions = versions_of(case.get("valid_for_vllm_versions")
                                   or data["valid_for_vllm_versions"])
            assert versions, case["id"]
            for version in versions:
                params.append(pytest.param(name, case, version,
                                           id=f"{name[:-5]}:{case['id']}@{version}"))
    return params


def message_for(case: dict[str, Any], version: str) -> dict[str, Any]:
    """The case's `inputs` as they are, plus the version and a layout."""
    inputs = case["inputs"]
    return {
        **inputs,
        "hash": {**inputs["hash"], "vllm_version": version},
        "layout": one_group_layout(inputs["hash"]["block_size"]),
    }


@pytest.mark.parametrize(("name", "case", "version"), chain_cases())
def test_chain_through_the_request_parser(name: str, case: dict[str, Any], version: str) -> None:
    request = kv.parse_kv_request(message_for(case, version), {})
    resolution = kv.resolve(request)
    assert resolution.block_hashes_hex() == [case["expected"]["block_hashes_hex"]]
    assert request.profile.none_hash is not None
    assert request.profile.none_hash.hex() == case["expected"]["none_hash_hex"]


@pytest.mark.parametrize(("name", "case", "version"), chain_cases())
def test_chain_block_by_block(name: str, case: dict[str, Any], version: str) -> None:
    """Extra keys, payload bytes, hash and engine key of every block."""
    inputs, expected = case["inputs"], case["expected"]
    algo = inputs["hash"]["algo"]
    size = inputs["hash"]["block_size"]
    era = hashing.era_of(hashing.parse_vllm_version(version))
    seed = hashing.seed_string(inputs["hash"]["python_hash_seed"],
                               hashing.parse_vllm_version(version))
    parent = hashing.none_hash(seed, algo)
    assert parent.hex() == expected["none_hash_hex"]

    request = inputs["request"]
    lora = request["lora"]
    explicit = inputs.get("explicit_extra_keys")
    prompt = kv.Prompt(
        token_ids=request["token_ids"],
        cache_salt=request["cache_salt"],
        lora=kv.LoRA(lora["name"], lora["path"]) if lora else None,
        mm_features=tuple(kv.MMFeature(m["identifier"], m["offset"], m["length"])
                          for m in request["mm_features"]),
        explicit_extra_keys=typed(explicit) if explicit is not None else None,
    )
    extras = hashing.extra_keys_for(prompt, size, era)
    blocks = expected["blocks"]
    assert len(blocks) == expected["num_full_blocks"] == len(request["token_ids"]) // size
    for index, block in enumerate(blocks):
        assert (block["index"], block["start"], block["end"]) == (
            index, index * size, (index + 1) * size)
        extra = extras[index] if extras is not None else None
        assert extra == typed(block["extra_keys"])
        tokens = request["token_ids"][block["start"]:block["end"]]
        payload = hashing.block_payload(parent, tokens, extra, algo)
        if block["cbor_payload_hex"] is not None:
            assert payload.hex() == block["cbor_payload_hex"]
        block_hash = hashlib.sha256(payload).digest()
        assert block_hash.hex() == block["block_hash_hex"] == expected["block_hashes_hex"][index]
        key = kv.engine_key(block_hash)
        assert str(key) == block["engine_key_u64"] == expected["engine_keys_u64"][index]
        assert f"{key:016x}" == block["engine_key_hex"]
        parent = block_hash
    chain = hashing.prompt_block_hashes(
        prompt, hash_block_size=size, parent=hashing.none_hash(seed, algo), era=era, algo=algo)
    assert [h.hex() for h in chain] == expected["block_hashes_hex"]


@pytest.mark.parametrize("entry", vector("none_hash_and_unset_seed.json")["seed_table"],
                         ids=lambda e: repr(e["python_hash_seed"]))
def test_none_hash_seed_table(entry: dict[str, Any]) -> None:
    assert cbor2.dumps(entry["python_hash_seed"], canonical=True).hex() == entry["cbor_of_seed_hex"]
    assert hashing.none_hash(entry["python_hash_seed"], entry["hash_algo"]).hex() == (
        entry["none_hash_hex"])


@pytest.mark.parametrize("version", ["0.18.0", "0.18.1", "0.23.0", "0.28.0", "0.28.9"])
def test_unset_seed_refused_where_vllm_draws_a_random_none_hash(version: str) -> None:
    case = vector("none_hash_and_unset_seed.json")["cases"][0]
    assert "<=0.28" in case["not_reproducible_on"]
    with pytest.raises(kv.KVRequestError, match=r"random NONE_HASH .* block_hashes"):
        kv.parse_kv_request(message_for(case, version), {})


def test_unset_seed_uses_the_fixed_string_from_0_29() -> None:
    assert hashing.seed_string(None, (0, 29, 0)) == hashing.UNSET_SEED_STRING
    assert hashing.seed_string(None, (0, 34, 0)) == "vllm-none-hash"
    assert hashing.seed_string("0", (0, 18, 0)) == "0"


ERA_FILES = [f"sha256_cbor_extras_era{era}.json" for era in ("A", "B", "B2", "C")]


@pytest.mark.parametrize("name", ERA_FILES)
def test_era_boundaries_match_the_files(name: str) -> None:
    data = vector(name)
    for version in data["valid_for_vllm_versions"]:
        assert hashing.era_of(hashing.parse_vllm_version(version)) == data["era"]


def era_comparison_cases() -> list[Any]:
    return [pytest.param(name, case, id=f"{name[:-5]}:{case['id']}")
            for name in ERA_FILES for case in vector(name)["cases"]]


@pytest.mark.parametrize(("name", "case"), era_comparison_cases())
def test_router_pr1156_digests_match_exactly_where_the_vector_says(
    name: str, case: dict[str, Any]
) -> None:
    """The PR hashes [mm identifiers..., salt] only; it agrees with vLLM (and with us)
    only for the cases the vector marks, and we never copy its shape."""
    version = vector(name)["valid_for_vllm_versions"][0]
    ours = kv.resolve(kv.parse_kv_request(message_for(case, version), {})).block_hashes_hex()[0]
    assert ours == case["expected"]["block_hashes_hex"]
    assert (ours == case["llmd_pr1156_router_digests_hex"]) is case[
        "llmd_pr1156_matches_this_vllm_era"]


def test_text_chains_identical_on_every_listed_release() -> None:
    data = vector("sha256_cbor_text.json")
    for case in data["cases"]:
        results = {
            tuple(kv.resolve(kv.parse_kv_request(message_for(case, v), {})).block_hashes_hex()[0])
            for v in data["valid_for_vllm_versions"]
        }
        assert results == {tuple(case["expected"]["block_hashes_hex"])}


def test_prefix_shared_case_shares_its_first_hashes() -> None:
    cases = {c["id"]: c for c in vector("sha256_cbor_text.json")["cases"]}
    shared, many = cases["text-prefix-shared-bs16"], cases["text-many-bs16"]
    prefix = shared["inputs"]["request"]["token_ids"][:32]
    assert prefix == many["inputs"]["request"]["token_ids"][:32]
    assert shared["expected"]["block_hashes_hex"][:2] == many["expected"]["block_hashes_hex"][:2]
    ours = kv.resolve(kv.parse_kv_request(message_for(shared, "0.23.0"), {})).block_hashes_hex()
    assert ours[0][:2] == many["expected"]["block_hashes_hex"][:2]


@pytest.mark.parametrize("case", vector("llmd_fnv64a_cbor.json")["cases"], ids=lambda c: c["id"])
def test_llmd_fnv64a_keys(case: dict[str, Any]) -> None:
    inputs, expected = case["inputs"], case["expected"]
    assert inputs["algo"] == "fnv64a_cbor"
    keys = hashing.llmd_fnv64a_keys(
        inputs["tokens"], block_size=inputs["block_size"], model=inputs["model"],
        seed=inputs["seed"], cache_salt=inputs["cache_salt"],
        mm_features=[kv.MMFeature(m["hash"], m["offset"], m["length"])
                     for m in inputs["mm_items"]],
    )
    assert [str(k) for k in keys] == expected["block_keys_u64"]
    assert [hashing.llmd_digest(k).hex() for k in keys] == expected["digests_hex"]


def test_fnv1a64_reference_values() -> None:
    # FNV-1a 64 test vectors (IETF draft-eastlake-fnv): "" and "a"
    assert hashing.fnv1a64(b"") == 0xCBF29CE484222325
    assert hashing.fnv1a64(b"a") == 0xAF63DC4C8601EC8C


def test_worked_example_of_the_spec() -> None:
    """§2.1: seed "10", H=16, tokens 1..16."""
    parent = hashing.none_hash("10")
    payload = hashing.block_payload(parent, range(1, 17), None)
    assert payload.hex() == ("835820" + parent.hex() + "90" + bytes(range(1, 17)).hex() + "f6")
    block_hash = hashlib.sha256(payload).digest()
    assert block_hash.hex() == "05c6751cc9aa112cdf1e00090a00205295f0173ecf8123a9309e93236a61c5ef"
    assert kv.engine_key(block_hash) == 3503399340458755567


@pytest.mark.parametrize(("text", "expected"), [
    ("0.23.0", (0, 23, 0)), ("v0.29.1", (0, 29, 1)), ("0.31.0rc1", (0, 31, 0)),
    ("0.30.0.dev12+gabc", (0, 30, 0)), ("0.18", (0, 18, 0)), ("1.0.0", (1, 0, 0)),
])
def test_vllm_versions_parse(text: str, expected: tuple[int, int, int]) -> None:
    assert hashing.parse_vllm_version(text) == expected


@pytest.mark.parametrize("text", ["", "latest", "0", "0.x.1", "23"])
def test_bad_vllm_versions_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a vLLM release version"):
        hashing.parse_vllm_version(text)


@pytest.mark.parametrize(("version", "era"), [
    ("0.10.0", "A"), ("0.18.1", "A"), ("0.19.0", "B"), ("0.28.5", "B"), ("0.29.0", "B2"),
    ("0.30.9", "B2"), ("0.31.0", "C"), ("0.34.0", "C"), ("1.2.0", "C"),
])
def test_era_boundaries(version: str, era: str) -> None:
    assert hashing.era_of(hashing.parse_vllm_version(version)) == era


@pytest.mark.parametrize(("sizes", "dcp", "pcp", "configured", "expected"), [
    ([16], 1, 1, None, 16), ([16], 2, 1, None, 32), ([16], 2, 2, 64, 64), ([64], 1, 4, None, 256),
    ([16, 32], 1, 1, None, 16), ([16, 16], 1, 1, None, 16), ([32, 48], 1, 1, None, 16),
    ([16, 32], 1, 1, 32, 32),
])
def test_hash_block_size(sizes: list[int], dcp: int, pcp: int, configured: int | None,
                         expected: int) -> None:
    assert hashing.hash_block_size(sizes[0], sizes, dcp_size=dcp, pcp_size=pcp,
                                   configured=configured) == expected


def test_hash_block_size_refuses_what_vllm_refuses() -> None:
    with pytest.raises(ValueError, match="block_size x dcp_size x pcp_size = 32"):
        hashing.hash_block_size(16, [16], dcp_size=2, configured=16)
    with pytest.raises(ValueError, match="context parallelism"):
        hashing.hash_block_size(16, [16, 32], dcp_size=2)
