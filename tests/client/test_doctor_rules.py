"""`kvprefetch doctor`'s own rules, without a daemon: the probe's verdict (a table of
probes named after what they show), the bounded walk for a sample file, and --probe
paths given to their roots. The daemon end to end: tests/integration/test_cli_doctor.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvprefetch.doctor import _assign, consumer_read, judge, sample_file

VERDICTS: list[tuple[str, dict[str, Any], bool | None]] = [
    ("consumer_much_faster", {"outcome": "read", "warm_ms": 140.0, "consumer_ms": 20.0}, True),
    ("consumer_under_the_floor", {"outcome": "read", "warm_ms": 4.0, "consumer_ms": 3.0}, True),
    ("consumer_as_slow_as_the_warm_up",
     {"outcome": "read", "warm_ms": 140.0, "consumer_ms": 130.0}, False),
    ("futile_outcome", {"outcome": "futile", "reason": "not_kept", "warm_ms": 90.0,
                        "consumer_ms": 1.0}, False),
    ("failed_read", {"outcome": "failed", "reason": "EIO", "warm_ms": 1.0}, False),
    ("resident_and_fast", {"outcome": "resident", "warm_ms": 1.0, "consumer_ms": 0.5}, True),
    ("resident_but_slow_cannot_tell",
     {"outcome": "resident", "warm_ms": 1.7, "consumer_ms": 20.0}, None),
    ("missing_cannot_tell", {"outcome": "missing", "warm_ms": 1.0}, None),
    ("consumer_read_failed_cannot_tell",
     {"outcome": "read", "warm_ms": 9.0, "consumer_error": "[Errno 13] Permission denied"},
     None),
    ("consumer_read_hung", {"outcome": "read", "warm_ms": 9.0,
                            "consumer_error": "did not finish in 60 s"}, False),
]


@pytest.mark.parametrize(("probe", "useful"), [(p, u) for _, p, u in VERDICTS],
                         ids=[name for name, _, _ in VERDICTS])
def test_the_verdict_follows_the_rule(probe: dict[str, Any], useful: bool | None) -> None:
    verdict, why = judge(probe)
    assert verdict is useful and why


def test_the_walk_takes_the_first_non_empty_file_within_its_bounds(tmp_path: Path) -> None:
    (tmp_path / "empty.bin").touch()
    (tmp_path / "link.bin").symlink_to("/etc/hostname")
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "x.bin").write_bytes(b"kv")
    assert sample_file(str(tmp_path)) == str(deep / "x.bin")
    assert sample_file(str(tmp_path), depth=3) is None  # x.bin is on the fourth level
    assert sample_file(str(tmp_path), entries=4) is None


def test_the_consumer_reads_the_head_or_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 << 20))
    assert consumer_read(str(path), 1 << 20)[1] == 1 << 20
    assert consumer_read(str(path), None)[1] == 3 << 20


def test_a_named_probe_goes_to_the_deepest_root_that_holds_it() -> None:
    roots = [{"root": "/mnt/kv"}, {"root": "/mnt/kv/fast"}, {"root": "/mnt/kvx"}]
    assert _assign(roots, ["/mnt/kv/fast/a.bin", "/mnt/kv/b.bin"]) == {
        1: "/mnt/kv/fast/a.bin", 0: "/mnt/kv/b.bin"}
    with pytest.raises(ValueError, match="not under any"):
        _assign(roots, ["/mnt/kvy/a.bin"])
