"""Fingerprint discovery on a temporary tree laid out as the connector writes it, and the
stale-fingerprint detector."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvprefetchd import kv
from kvprefetchd.kv import layout
from kvprefetchd.kv.discover import Candidate, differences, scan

MODEL = "Qwen/Qwen3-8B"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
HASH = {"algo": "sha256_cbor", "python_hash_seed": "10", "block_size": 64,
        "vllm_version": "0.23.0"}


def profile(root: Path, **layout_changes: Any) -> kv.Profile:
    layout_map = {"root_dir": str(root), "model_name": MODEL, "tp_size": 2,
                  "connector_block_size_tokens": 512,
                  "kv_cache_groups": [{"block_size": 64, "layer_names": LAYERS}],
                  **layout_changes}
    return kv.Profile.from_mapping("qwen", {"hash": HASH, "layout": layout_map})


def write_folder(root: Path, fields: dict[str, Any] | None, *, fingerprint: str | None = None,
                 ranks: int = 1, config: bool = True, mtime: int | None = None) -> str:
    """A writer's folders: config.json as the connector dumps it, and _r<rank> folders."""
    fp = fingerprint or layout.fingerprint_of(fields or {})
    base = Path(layout.base_path(str(root), MODEL, fp))
    if config and fields is not None:
        base.mkdir()
        (base / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True))
    for rank in range(ranks):
        folder = Path(layout.rank_dir(str(base), rank))
        (folder / "abc" / "de_g0").mkdir(parents=True)
        if mtime is not None:
            os.utime(folder, ns=(mtime, mtime))
    return fp


def fields_of(p: kv.Profile, field_set: str = "v1", **changes: Any) -> dict[str, Any]:
    fields = layout.fingerprint_fields(
        field_set=field_set,  # type: ignore[arg-type]
        model_name=MODEL, block_size=64, blocks_per_file=p.blocks_per_file,
        tp_size=p.layout.tp_size, pp_size=1, pcp_size=1, dcp_size=1, dtype="auto",
        kv_cache_groups=[(64, LAYERS)])
    return {**fields, **changes}


def test_the_computed_fingerprint_is_found(tmp_path: Path) -> None:
    p = profile(tmp_path)
    own = write_folder(tmp_path, fields_of(p), ranks=2)
    write_folder(tmp_path, fields_of(p, tp_size=4))  # an older deployment
    found = kv.discover_fingerprint(p)
    assert (found.fingerprint, found.how) == (own, "computed") and own == p.fingerprint
    assert len(found.candidates) == 2


def test_a_profile_without_layer_names_finds_the_folder_by_its_config(tmp_path: Path) -> None:
    writer = profile(tmp_path)
    own = write_folder(tmp_path, fields_of(writer))
    write_folder(tmp_path, fields_of(writer, gpu_blocks_per_file=4))
    p = profile(tmp_path, fingerprint="discover", kv_cache_groups=[{"block_size": 64}])
    found = kv.discover_fingerprint(p)
    assert (found.fingerprint, found.how) == (own, "config.json")
    other = next(c for c in found.candidates if c.fingerprint != own)
    assert other.differences == ("gpu_blocks_per_file is 4, the profile's 8",)


def test_v2_config_json_is_understood(tmp_path: Path) -> None:
    writer = profile(tmp_path)
    own = write_folder(tmp_path, fields_of(writer, "v2b"))
    p = profile(tmp_path, fingerprint="discover", kv_cache_groups=[{"block_size": 64}])
    assert kv.discover_fingerprint(p).fingerprint == own


def test_two_agreeing_folders_are_refused_as_ambiguous(tmp_path: Path) -> None:
    writer = profile(tmp_path)
    first = write_folder(tmp_path, fields_of(writer, "v1"))
    second = write_folder(tmp_path, fields_of(writer, "v2b"))
    p = profile(tmp_path, fingerprint="discover", kv_cache_groups=[{"block_size": 64}])
    with pytest.raises(kv.DiscoveryError, match=r"2 folders .* match .* equally well") as caught:
        kv.discover_fingerprint(p)
    assert first in str(caught.value) and second in str(caught.value)


def test_the_only_folder_without_config_is_taken(tmp_path: Path) -> None:
    only = write_folder(tmp_path, None, fingerprint="0123456789ab", ranks=2)
    p = profile(tmp_path, fingerprint="discover")
    found = kv.discover_fingerprint(p)
    assert (found.fingerprint, found.how) == (only, "only candidate")


def test_two_folders_without_config_are_refused(tmp_path: Path) -> None:
    write_folder(tmp_path, None, fingerprint="0123456789ab")
    write_folder(tmp_path, None, fingerprint="ba9876543210")
    with pytest.raises(kv.DiscoveryError) as caught:
        kv.discover_fingerprint(profile(tmp_path, fingerprint="discover"))
    # Both named (newest first: the order follows the folders' mtimes, which may tie).
    for fingerprint in ("0123456789ab", "ba9876543210"):
        assert f"{fingerprint} (no config.json)" in str(caught.value)


def test_a_contradicting_folder_is_refused_naming_the_fields(tmp_path: Path) -> None:
    write_folder(tmp_path, fields_of(profile(tmp_path), tp_size=4, dtype="fp8"))
    with pytest.raises(kv.DiscoveryError, match="tp_size is 4, the profile's 2") as caught:
        kv.discover_fingerprint(profile(tmp_path, fingerprint="discover"))
    assert "dtype is 'fp8'" in str(caught.value)


def test_a_config_json_that_does_not_name_its_folder_is_distrusted(tmp_path: Path) -> None:
    p = profile(tmp_path)
    write_folder(tmp_path, fields_of(p), fingerprint="0123456789ab")
    with pytest.raises(kv.DiscoveryError, match=r"hashes to .* not to its folder's 0123456789ab"):
        kv.discover_fingerprint(profile(tmp_path, fingerprint="discover"))


def test_nothing_to_discover(tmp_path: Path) -> None:
    (tmp_path / "other-model_0123456789ab_r0").mkdir()
    (tmp_path / "Qwen_Qwen3-8B_0123456789ab_r0.tmp").mkdir()
    (tmp_path / "Qwen_Qwen3-8B_0123456789ab_r1").mkdir()  # rank 0 is what identifies one
    (tmp_path / "Qwen_Qwen3-8B_x_0123456789ab_r0").mkdir()  # another model ("Qwen/Qwen3-8B_x")
    (tmp_path / "Qwen_Qwen3-8B_0123456789AB_r0").mkdir()  # not lower-case hex
    (tmp_path / "Qwen_Qwen3-8B_0123456789ab_r0_file").write_text("")
    with pytest.raises(kv.DiscoveryError, match="no 'Qwen_Qwen3-8B_<12 hex>_r0' folder"):
        kv.discover_fingerprint(profile(tmp_path, fingerprint="discover"))
    with pytest.raises(kv.DiscoveryError, match="cannot be listed"):
        kv.discover_fingerprint(profile(tmp_path / "absent", fingerprint="discover"))


def test_unreadable_or_odd_config_json_is_reported(tmp_path: Path) -> None:
    for fp, text in (("000000000001", "not json"), ("000000000002", "[1]"),
                     ("000000000003", " " * (2 << 20))):
        base = tmp_path / f"Qwen_Qwen3-8B_{fp}"
        base.mkdir()
        (base / "config.json").write_text(text)
    notes = {c.fingerprint: c.note for c in scan(profile(tmp_path, fingerprint="discover"))}
    assert notes == {"000000000001": "config.json is not JSON",
                     "000000000002": "config.json is not a JSON object",
                     "000000000003": "config.json too large to be the connector's"}


def test_differences_on_unknown_field_sets_and_groups(tmp_path: Path) -> None:
    p = profile(tmp_path)
    assert differences(p, fields_of(p)) == ()
    assert differences(p, {**fields_of(p), "hash_block_size": None, "kv_cache_groups": []}) == (
        "hash_block_size is None, the profile's 64", "kv_cache_groups has 0 groups, the profile 1")
    odd = {k: v for k, v in fields_of(p).items() if k != "hash_block_size"}
    assert differences(p, odd)[-1].startswith("an unknown field set")
    renamed = fields_of(p, kv_cache_groups=[{"block_size": 64, "layer_names": ["x"]}])
    assert differences(p, renamed) == ("kv_cache_groups[0].layer_names differ",)


# --- stale detection --------------------------------------------------------------------

def candidate(fp: str, *, agrees: bool | None = True, rank0: bool = True,
              mtime: int = 0) -> Candidate:
    diffs: tuple[str, ...] | None = None if agrees is None else (() if agrees else ("x",))
    return Candidate(fingerprint=fp, has_rank0=rank0, mtime_ns=mtime, differences=diffs)


OWN, OTHER, THIRD = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"


def test_stale_when_files_keep_missing_while_a_sibling_exists() -> None:
    detector = kv.StaleDetector(streak=100)
    assert not detector.record("qwen", OWN, missing=60, present=0)
    assert detector.record("qwen", OWN, missing=60, present=0)  # 120 >= 100: scan now
    detector.observe("qwen", [candidate(OTHER)])
    assert detector.stale("qwen")
    assert detector.likely_fingerprint("qwen") == OTHER
    report = detector.report()["qwen"]
    assert report["stale"] and report["likely_fingerprint"] == OTHER
    assert report["own_folder"] is False and report["missing_streak"] == 120
    assert OTHER in report["hint"] and "does not exist" in report["hint"]
    assert not detector.record("qwen", OWN, missing=50, present=0)  # asked again at 220
    assert detector.record("qwen", OWN, missing=50, present=0)


def test_a_cold_deployment_is_not_stale() -> None:
    detector = kv.StaleDetector(streak=10)
    assert detector.record("qwen", OWN, missing=10, present=0)
    detector.observe("qwen", [candidate(OWN)])  # only its own folder: nothing offloaded yet
    assert not detector.stale("qwen")
    assert detector.report()["qwen"] == {
        "fingerprint": OWN, "missing": 10, "present": 0, "missing_streak": 10, "stale": False,
        "likely_fingerprint": None, "sibling_fingerprints": [], "own_folder": True, "hint": None}


def test_a_file_found_ends_the_streak() -> None:
    detector = kv.StaleDetector(streak=10)
    detector.record("qwen", OWN, missing=20, present=0)
    detector.observe("qwen", [candidate(OTHER)])
    assert detector.stale("qwen")
    assert not detector.record("qwen", OWN, missing=5, present=1)
    assert not detector.stale("qwen")
    assert detector.report()["qwen"]["missing"] == 25


def test_a_new_fingerprint_starts_afresh() -> None:
    detector = kv.StaleDetector(streak=10)
    detector.record("qwen", OWN, missing=20, present=0)
    detector.observe("qwen", [candidate(OTHER)])
    detector.record("qwen", OTHER, missing=0, present=3)
    assert detector.report()["qwen"]["fingerprint"] == OTHER
    assert not detector.stale("qwen")


def test_the_likeliest_sibling_agrees_then_is_unknown_then_is_newest() -> None:
    detector = kv.StaleDetector(streak=1)
    detector.record("qwen", OWN, missing=1, present=0)
    detector.observe("qwen", [candidate(OTHER, agrees=False, mtime=9),
                              candidate(THIRD, agrees=None, mtime=1),
                              candidate("dddddddddddd", agrees=None, mtime=5),
                              candidate("eeeeeeeeeeee", rank0=False),
                              candidate(OWN)])
    report = detector.report()["qwen"]
    assert report["sibling_fingerprints"] == ["dddddddddddd", THIRD, OTHER]
    assert report["own_folder"] is True
    detector.observe("qwen", [candidate(OTHER, agrees=False), candidate(THIRD, agrees=True)])
    assert detector.likely_fingerprint("qwen") == THIRD


def test_stale_detector_end_to_end_on_disk(tmp_path: Path) -> None:
    """The supervisor's loop: outcomes -> record -> scan -> observe -> report."""
    p = profile(tmp_path)
    right = write_folder(tmp_path, fields_of(p, "v2b"))  # vLLM >= 0.27 wrote v2b
    assert p.fingerprint != right  # the profile says 0.23.0, so it computes v1
    detector = kv.StaleDetector(streak=64)
    assert detector.record(p.name, p.fingerprint or "", missing=64, present=0)
    detector.observe(p.name, scan(p))
    assert detector.likely_fingerprint(p.name) == right
    assert "config.json agrees" in detector.report()[p.name]["hint"]


def test_unknown_profiles_and_bad_thresholds() -> None:
    detector = kv.StaleDetector()
    detector.observe("nobody", [candidate(OTHER)])
    assert detector.report() == {} and detector.likely_fingerprint("nobody") is None
    with pytest.raises(ValueError):
        kv.StaleDetector(streak=0)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder-symlink"])
def test_config_json_that_is_no_regular_file_is_never_opened(tmp_path: Path, kind: str) -> None:
    """Discovery runs in the supervisor's only thread: a FIFO opened there would block it
    (and every client) for ever; a symlink could lead out of the root."""
    p = profile(tmp_path / "kv", fingerprint="discover")
    (tmp_path / "kv").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps(fields_of(p)))
    fp = "0123456789ab"
    base = Path(layout.base_path(str(tmp_path / "kv"), MODEL, fp))
    if kind == "folder-symlink":
        base.symlink_to(outside)
    else:
        base.mkdir()
        if kind == "fifo":
            os.mkfifo(base / "config.json")
        else:
            (base / "config.json").symlink_to(outside / "config.json")
    Path(layout.rank_dir(str(base), 0)).mkdir()
    (notes,) = [c.note for c in scan(p)]  # returns at once: nothing blocked
    assert notes.startswith("config.json unreadable"), notes
