"""The Python side of the engines: the registry's table against C's, candidates, builds,
engines by warm mode name, and the names read from the header instead of copied.

Real native contexts throughout; an engine that cannot run is a real one too: a table row
naming an engine C does not have, which kvp_engine_detect and kvp_ctx_new really refuse.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import deque
from pathlib import Path

import pytest
from native_helpers import KiB, evict, open_root, write_file

from kvprefetchd.config import RESIDENCY_RULES
from kvprefetchd.engines import (
    AUTO_ORDER,
    ENGINE_TABLE,
    FADVISE,
    PREAD,
    URING_ADVISE,
    URING_READ,
    WARM_MODES,
    EngineSpec,
    NoEngine,
    WarmEngines,
    build_engine,
    engine_candidates,
)
from kvprefetchd.engines.base import EngineSettings, WarmItem
from kvprefetchd.native import NativeUnavailable, load_native
from kvprefetchd.roots.residency import RootRule

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
SETTINGS = EngineSettings(64 * KiB, 8, 2, True, 16, 32)
GHOST = EngineSpec("ghost", "read")  # no such row in C's table


def uring_ok() -> bool:
    return URING_READ.unavailable_reason() is None


def test_every_row_of_either_table_meets_the_other() -> None:
    served = {spec for modes in ENGINE_TABLE.values() for spec in modes.values()}
    assert {(s.name, s.warm_mode) for s in served} == {
        (row.engine, row.warm_mode) for row in load_native().engines()}
    assert all(set(modes) == set(WARM_MODES) for modes in ENGINE_TABLE.values())
    assert set(AUTO_ORDER) == set(WARM_MODES)
    assert all(name in ENGINE_TABLE for order in AUTO_ORDER.values() for name in order)


@pytest.mark.parametrize("warm_mode", WARM_MODES)
@pytest.mark.parametrize("name", list(ENGINE_TABLE))
def test_an_explicit_name_is_its_one_candidate(name: str, warm_mode: str) -> None:
    spec = ENGINE_TABLE[name][warm_mode]
    if spec.unavailable_reason() is not None:
        with pytest.raises(NoEngine, match=f"engine {name} is unavailable: "):
            engine_candidates(name, warm_mode)
    else:
        assert engine_candidates(name, warm_mode) == (spec,)


def test_c_lists_the_queue_engines_and_answers_for_them() -> None:
    """pread and fadvise are rows of C's one table: C says they are the queue's and that
    they can run here; the registry asks, it has no case of its own for them."""
    rows = load_native().engines()
    assert [row for row in rows if row.queued] == [("pread", "read", True),
                                                    ("fadvise", "advise", True)]
    assert {(row.engine, row.warm_mode) for row in rows if not row.queued} == {
        ("io_uring", "read"), ("io_uring", "advise")}
    assert PREAD.queued and FADVISE.queued
    assert not URING_READ.queued and not URING_ADVISE.queued and not GHOST.queued
    assert PREAD.unavailable_reason() is None and FADVISE.unavailable_reason() is None
    assert load_native().engine_unavailable("pread", "read") is None


def test_the_substitutes_for_a_missing_form() -> None:
    assert ENGINE_TABLE["pread"]["advise"] == FADVISE
    assert ENGINE_TABLE["fadvise"]["read"] == FADVISE


def test_auto_tries_what_measured_fastest_first() -> None:
    if uring_ok():
        assert engine_candidates("auto", "read") == (PREAD, URING_READ)
        assert engine_candidates("auto", "advise") == (FADVISE, URING_ADVISE)
    else:
        assert engine_candidates("auto", "read") == (PREAD,)
        assert engine_candidates("auto", "advise") == (FADVISE,)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(NoEngine, match="unknown engine 'sync'"):
        engine_candidates("sync", "read")
    for name in ("auto", "pread"):
        with pytest.raises(NoEngine, match="unknown warm mode 'write'"):
            engine_candidates(name, "write")


def test_an_explicit_engine_that_cannot_run_allows_no_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(ENGINE_TABLE, "ghost", {"read": GHOST, "advise": GHOST})  # type: ignore[index]
    with pytest.raises(NoEngine, match="engine ghost is unavailable: no engine ghost with warm"):
        engine_candidates("ghost", "read")


def test_auto_passes_over_what_cannot_run_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(ENGINE_TABLE, "ghost", {"read": GHOST, "advise": GHOST})  # type: ignore[index]
    monkeypatch.setitem(AUTO_ORDER, "read", ("ghost", "pread"))  # type: ignore[index]
    with caplog.at_level(logging.INFO, "kvprefetchd.engines"):
        assert engine_candidates("auto", "read") == (PREAD,)
    assert "passing over ghost: no engine ghost with warm mode read" in caplog.text
    monkeypatch.setitem(AUTO_ORDER, "read", ("ghost",))  # type: ignore[index]
    with pytest.raises(NoEngine, match="no engine can run here"):
        engine_candidates("auto", "read")


def test_build_engine_takes_the_first_that_sets_up(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "kvprefetchd.engines"):
        engine = build_engine((GHOST, PREAD), SETTINGS, "worker 7")
    assert (engine.name, engine.warm_mode) == ("pread", "read")
    assert "worker 7: engine ghost: ghost: cannot set up (Invalid argument)" in caplog.text
    with pytest.raises(NativeUnavailable, match="cannot set up"):
        build_engine((GHOST,), SETTINGS, "worker 7")
    with pytest.raises(RuntimeError, match="no engine to build"):
        build_engine((), SETTINGS, "worker 7")


def test_engines_by_warm_mode_name(caplog: pytest.LogCaptureFixture) -> None:
    candidates = {"read": engine_candidates("auto", "read"),
                  "advise": engine_candidates("auto", "advise")}
    warm = WarmEngines(candidates, "read", SETTINGS, "worker 1")
    assert warm.for_mode("read") is warm.default
    assert warm.default.name == "pread"
    advice = warm.for_mode("advise")
    assert advice.warm_mode == "advise" and advice is warm.for_mode("advise")
    # A mode whose candidates cannot set up is served by the default mode's engine.
    ghostly = WarmEngines({"read": (PREAD,), "advise": (GHOST,)}, "read", SETTINGS, "worker 2")
    with caplog.at_level(logging.WARNING, "kvprefetchd.engines"):
        assert ghostly.for_mode("advise") is ghostly.default
    assert "worker 2: warm mode advise unavailable" in caplog.text
    # The default mode's own failure is the worker's (it cannot boot).
    with pytest.raises(NativeUnavailable):
        _ = WarmEngines({"read": (GHOST,)}, "read", SETTINGS, "worker 3").default


def test_outcome_and_rule_names_are_read_from_the_header() -> None:
    native = load_native()
    lib = native.lib
    assert native.outcome_names == {
        lib.KVP_OUT_READ: "read", lib.KVP_OUT_RESIDENT: "resident",
        lib.KVP_OUT_MISSING: "missing", lib.KVP_OUT_REJECTED: "rejected",
        lib.KVP_OUT_FAILED: "failed", lib.KVP_OUT_EXPIRED: "expired",
    }
    assert native.rule_codes == {
        "off": lib.KVP_RES_OFF, "tier": lib.KVP_RES_TIER, "pagecache": lib.KVP_RES_PAGECACHE
    }
    # The header's names are the contract's: the protocol's outcomes, the config's rules.
    section = PROTOCOL.read_text().split("## Per-file outcomes", 1)[1].split("\n## ", 1)[0]
    protocol_outcomes = set(re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE))
    assert set(native.outcome_names.values()) <= protocol_outcomes
    section = PROTOCOL.read_text().split("## Check states", 1)[1].split("\n## ", 1)[0]
    assert set(native.check_states.values()) == {"resident", "cold", "missing", "rejected",
                                                 "failed"}
    assert all(f"`{name}`" in section for name in native.check_states.values())
    assert set(native.rule_codes) == set(RESIDENCY_RULES) - {"auto"}
    assert RootRule("/", "ext4", "tier", "configured").code == lib.KVP_RES_TIER


@pytest.mark.parametrize("spec", [PREAD, FADVISE, URING_READ, URING_ADVISE], ids=str)
def test_an_engine_reports_protocol_outcome_names(spec: EngineSpec, tmp_path: Path) -> None:
    if (why := spec.unavailable_reason()) is not None:
        pytest.skip(why)
    write_file(tmp_path / "cold", 128 * KiB)
    evict(tmp_path / "cold")
    write_file(tmp_path / "empty", 0)
    root_fd = open_root(tmp_path)
    try:
        engine = spec.build(SETTINGS)
        rule = RootRule(str(tmp_path), "ext4", "off", "configured").code
        pending = deque(WarmItem(root_fd, rule, name, 64 * KiB)
                        for name in (b"cold", b"empty", b"nope", b"../x"))
        engine.take(pending)
        assert not pending
        got: list[tuple[bytes, str, int]] = []
        deadline = time.monotonic() + 30
        while len(got) < 4:  # a queue settles as its reads finish, a batch at once
            assert time.monotonic() < deadline
            got += [(c.item.relative, c.outcome, c.done) for c in engine.reap()]
            time.sleep(0.01)
        assert engine.outstanding == 0
    finally:
        os.close(root_fd)
    assert sorted(got) == sorted([(b"cold", "read", 64 * KiB), (b"empty", "resident", 0),
                   (b"nope", "missing", 0), (b"../x", "rejected", 0)])
