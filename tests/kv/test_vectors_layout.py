"""Every layout vector: fingerprints per field set, leaf path formatting, end-to-end paths
(tokens -> hashes -> selected hashes -> ranks x groups x files), and the router PR's
configuration defaulting; the PR's gaps (§6.5) are checked NOT to be copied."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kv_reference import file_path, layout_from_pr1156, pr1156_path_base
from kv_vectors import vector, vector_files
from kvprefetchd import kv
from kvprefetchd.kv import layout

FINGERPRINT_SECTIONS = {
    "field_set_v1_cases": ("v1", ["0.23.0", "0.25.0", None]),
    "field_set_v2a_cases_vllm_0_26": ("v2a", ["0.26.0"]),
    "field_set_v2b_cases": ("v2b", ["0.27.0", "0.28.0", "0.34.0"]),
}


def fingerprint_cases() -> list[Any]:
    data = vector("fs_connector_fingerprint.json")
    assert set(FINGERPRINT_SECTIONS) == {k for k in data if k.startswith("field_set_")}
    return [pytest.param(section, case, id=f"{section}:{case['id']}")
            for section in FINGERPRINT_SECTIONS for case in data[section]]


def neutral_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Constructor kwargs of either FileMapper generation -> layout.fingerprint_fields'."""
    size_key = "block_size" if "hash_block_size" in kwargs else "tokens_per_block"
    return {
        "model_name": kwargs["model_name"],
        "block_size": kwargs.get("hash_block_size", kwargs.get("tokens_per_hash")),
        "blocks_per_file": kwargs.get("gpu_blocks_per_file", kwargs.get("blocks_per_file")),
        "tp_size": kwargs["tp_size"], "pp_size": kwargs["pp_size"],
        "pcp_size": kwargs["pcp_size"], "dcp_size": kwargs["dcp_size"], "dtype": kwargs["dtype"],
        "kv_cache_groups": [(g[size_key], g["layer_names"])
                            for g in kwargs.get("kv_cache_groups", [])],
        "parallel_agnostic": kwargs.get("parallel_agnostic", False),
        "replicated_layout": kwargs.get("replicated_layout", False),
    }


@pytest.mark.parametrize(("section", "case"), fingerprint_cases())
def test_fingerprint_fields_and_digest(section: str, case: dict[str, Any]) -> None:
    field_set, _ = FINGERPRINT_SECTIONS[section]
    kwargs, expected = case["inputs"]["constructor_kwargs"], case["expected"]
    fields = layout.fingerprint_fields(field_set=field_set, **neutral_kwargs(kwargs))
    assert fields == expected["fingerprint_fields"]
    assert layout.canonical_json(fields) == expected["canonical_json"]
    assert layout.fingerprint_of(fields) == expected["digest"]
    base = layout.base_path(kwargs["root_dir"], kwargs["model_name"], expected["digest"])
    assert base == expected["base_path"]
    assert layout.config_json_path(base) == expected["config_json_path"]
    rank = 0 if kwargs.get("parallel_agnostic") else kwargs["rank"]
    assert layout.rank_dir(base, rank) == expected["rank_dir_example"]


@pytest.mark.parametrize(("section", "case"), fingerprint_cases())
def test_profile_computes_the_fingerprint(section: str, case: dict[str, Any]) -> None:
    """The same through a profile, for every vLLM release of the field set (and with the
    field set named explicitly)."""
    field_set, versions = FINGERPRINT_SECTIONS[section]
    kwargs, expected = case["inputs"]["constructor_kwargs"], case["expected"]
    neutral = neutral_kwargs(kwargs)
    block_size = neutral["block_size"]
    layout_map = {
        "root_dir": kwargs["root_dir"], "model_name": kwargs["model_name"],
        "tp_size": kwargs["tp_size"], "pp_size": kwargs["pp_size"],
        "pcp_size": kwargs["pcp_size"], "dcp_size": kwargs["dcp_size"], "dtype": kwargs["dtype"],
        "kv_cache_groups": [{"block_size": size, "layer_names": names}
                            for size, names in neutral["kv_cache_groups"]],
        "connector_block_size_tokens": neutral["blocks_per_file"] * block_size,
        "parallel_agnostic": neutral["parallel_agnostic"],
        "replicated_layout": neutral["replicated_layout"],
    }
    if not neutral["kv_cache_groups"]:
        # A profile must know its groups' files, so it refuses a layout without any, by
        # the key's name; this case's digest is checked by the fields test above.
        hash_map = {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": block_size,
                    "vllm_version": versions[0]}
        with pytest.raises(kv.ProfileError, match=r"layout\.kv_cache_groups: must be a non-empty"):
            kv.Profile.from_mapping("m", {"hash": hash_map, "layout": layout_map})
        return
    variants: list[tuple[str | None, dict[str, Any]]] = [
        (version, layout_map) for version in versions
    ] + [(None, {**layout_map, "fingerprint_field_set": field_set})]
    for version, layout_variant in variants:
        hash_map = {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": block_size,
                    "vllm_version": version}
        profile = kv.Profile.from_mapping("m", {"hash": hash_map, "layout": layout_variant})
        assert profile.field_set == field_set
        assert profile.fingerprint == expected["digest"]
        assert profile.fingerprint_fields() == expected["fingerprint_fields"]
        assert profile.base_path() == expected["base_path"]
        assert list(profile.ranks)[-1] == (0 if kwargs.get("parallel_agnostic")
                                           else kwargs["tp_size"] * kwargs["pp_size"]
                                           * kwargs["pcp_size"] - 1)


@pytest.mark.parametrize("case", vector("path_format.json")["cases"],
                         ids=lambda c: c["description"][:40])
def test_path_format(case: dict[str, Any]) -> None:
    i = case["inputs"]
    for block_hash in (i["block_hash_hex"], bytes.fromhex(i["block_hash_hex"])):
        assert file_path(i["base_path"], i["rank"], i["group_idx"], block_hash) == (
            case["expected"]["path"])


PATH_CASES = vector("fs_connector_paths.json")["cases"]


@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: c["id"])
def test_paths_end_to_end(case: dict[str, Any]) -> None:
    """The vector's inputs, sent as they are, resolve to exactly the connector's files."""
    expected = case["expected"]
    request = kv.parse_kv_request(case["inputs"], {})
    resolution = kv.resolve(request)
    profile = request.profile
    assert resolution.block_hashes_hex() == [expected["block_hashes_hex"]]
    assert profile.blocks_per_file == expected["gpu_blocks_per_file"]
    assert profile.fingerprint_fields() == expected["fingerprint_fields"]
    assert layout.canonical_json(expected["fingerprint_fields"]) == expected["canonical_json"]
    assert resolution.fingerprint == expected["digest"]
    assert resolution.base_path == expected["base_path"]
    assert layout.config_json_path(resolution.base_path) == expected["config_json_path"]
    assert list(profile.ranks) == expected["ranks_on_disk"]
    assert profile.hash_block_size == case["inputs"]["hash"]["hash_block_size_tokens"]
    count = len(expected["block_hashes_hex"])
    for selection, factor in zip(expected["file_selection"], profile.group_factors, strict=True):
        assert selection["hash_block_size_factor"] == factor
        assert list(layout.file_block_indices(count, factor)) == selection["file_block_indices"]
    want = [p["path"] for p in expected["paths"]]
    assert set(resolution.paths) == set(want)
    assert resolution.paths == want  # rank-major, then group, then file order
    for entry in expected["paths"]:
        assert file_path(resolution.base_path, entry["rank"], entry["group_idx"],
                                entry["block_hash_hex"]) == entry["path"]
        assert expected["block_hashes_hex"][entry["block_index"]] == entry["block_hash_hex"]


@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: c["id"])
def test_router_pr1156_gaps_are_not_copied(case: dict[str, Any]) -> None:
    router = case["router_pr1156_comparison"]
    assert router["executed"]
    paths = kv.resolve(kv.parse_kv_request(case["inputs"], {})).paths
    assert not set(paths) & set(router["extra_paths_not_on_disk"])
    assert set(router["missing_paths"]) <= set(paths)
    if router["identical_list_and_order"]:
        assert router["ranks_enumerated"] == case["expected"]["ranks_on_disk"]
        assert router["path_count"] == len(paths)


@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: c["id"])
def test_layout_from_the_router_pr_config(case: dict[str, Any]) -> None:
    """A PR #1156 kvFilePathBase migrates to a layout that names the connector's real
    files, even where the PR itself did not (dcp); per-group block sizes are not in the
    PR's configuration, so hybrid models need their groups written out."""
    sizes = {g["block_size"] for g in case["inputs"]["kv_cache_groups"]}
    if len(sizes) > 1:
        pytest.skip("hybrid block sizes cannot be expressed in the PR's configuration")
    params = case["router_pr1156_comparison"]["parameters"]["kvFilePathBase"]
    block_size = case["inputs"]["hash"]["vllm_block_size"]
    layout_map = layout_from_pr1156(params, block_size)
    hash_map = {k: v for k, v in case["inputs"]["hash"].items() if k != "hash_block_size_tokens"}
    request = kv.parse_kv_request(
        {"hash": hash_map, "layout": layout_map, "token_ids": case["inputs"]["token_ids"]}, {})
    assert kv.resolve(request).paths == [p["path"] for p in case["expected"]["paths"]]


BEHAVIOUR = vector("prefetch_plugin_behaviour.json")


@pytest.mark.parametrize("case", BEHAVIOUR["defaults_cases"], ids=lambda c: c["parameters_json"])
def test_router_pr1156_path_base_defaulting(case: dict[str, Any]) -> None:
    params = json.loads(case["parameters_json"])
    base, is_set = pr1156_path_base(params.get("kvFilePathBase"))
    assert base == case["expected"]["kvFilePathBase"]
    assert is_set is case["expected"]["kvFilePathBase_IsSet"]
    if is_set:
        assert base is not None
        profile = kv.Profile.from_parts(
            "pr", {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16},
            layout_from_pr1156(base, 16))
        assert profile.fingerprint == base["digest"]
    else:
        with pytest.raises(kv.ProfileError, match="rootDir, modelName and digest"):
            layout_from_pr1156(params.get("kvFilePathBase") or {}, 16)


# Its residency_cases and submit_cases are the worker's tier rule and the supervisor's
# bounded queues, not the kv package: tests/integration/test_plugin_vectors.py runs them
# through the real daemon, and tests/native/test_native_tier_vectors.py feeds the residency
# cases to the native tier rule itself.


def test_every_vector_file_is_covered() -> None:
    covered = {
        "fs_connector_fingerprint.json", "fs_connector_paths.json", "llmd_fnv64a_cbor.json",
        "none_hash_and_unset_seed.json", "path_format.json", "prefetch_plugin_behaviour.json",
        "sha256_cbor_explicit_extra_keys.json", "sha256_cbor_extras_eraA.json",
        "sha256_cbor_extras_eraB.json", "sha256_cbor_extras_eraB2.json",
        "sha256_cbor_extras_eraC.json", "sha256_cbor_text.json",
        "sha256_pickle_text_optional.json",
    }
    assert set(vector_files()) == covered
    kinds = {vector(name)["kind"] for name in covered}
    assert kinds == {
        "block_hash_chain", "none_hash", "block_hash_chain_with_extra_keys",
        "block_hash_chain_explicit_extra_keys", "llmd_fnv64a_chain", "fs_connector_fingerprint",
        "path_format", "fs_connector_paths", "prefetch_plugin_behaviour",
    }


@pytest.mark.parametrize(("version", "field_set"), [
    (None, "v1"), ((0, 21, 0), "v1"), ((0, 25, 3), "v1"), ((0, 26, 0), "v2a"),
    ((0, 27, 0), "v2b"), ((0, 34, 0), "v2b"),
])
def test_field_set_by_version(version: tuple[int, int, int] | None, field_set: str) -> None:
    assert layout.field_set_for(version) == field_set


def test_ranks_ignore_dcp_and_collapse_when_parallel_agnostic() -> None:
    assert list(layout.ranks(2, 2, 1)) == [0, 1, 2, 3]
    assert list(layout.ranks(4, 1, 2)) == list(range(8))
    assert list(layout.ranks(8, 2, 1, parallel_agnostic=True)) == [0]
