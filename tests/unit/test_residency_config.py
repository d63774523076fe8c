"""Residency rule choice by file system type, and configuration validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvprefetchd.config import Config, ConfigError, build_config, load_file
from kvprefetchd.roots.residency import choose_rule, filesystem_type, parse_mountinfo

MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:45 / /gpfs/fs1 rw,relatime shared:20 - gpfs fs1 rw
41 22 0:46 / /mnt/with\\040space rw shared:21 - nfs4 srv:/x rw
"""


def test_mountinfo_is_parsed_with_escapes() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert ("0:45", "/gpfs/fs1", "gpfs") in mounts
    assert ("0:46", "/mnt/with space", "nfs4") in mounts


def test_this_machines_tmp_gets_the_pagecache_rule(tmp_path: Path) -> None:
    rule = choose_rule(str(tmp_path), "auto")
    assert rule.fstype != "unknown"
    assert rule.name == "pagecache"


def test_gpfs_roots_get_the_tier_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The device of tmp_path is matched to a gpfs mount line made up for it.
    device = os.stat(tmp_path).st_dev
    mountinfo = f"40 22 {os.major(device)}:{os.minor(device)} / / rw - gpfs fs1 rw\n"
    assert filesystem_type(str(tmp_path), mountinfo) == "gpfs"
    assert choose_rule(str(tmp_path), "auto", mountinfo).name == "tier"
    assert choose_rule(str(tmp_path), "pagecache", mountinfo).name == "pagecache"


def test_missing_root_is_unknown_and_gets_pagecache(tmp_path: Path) -> None:
    rule = choose_rule(str(tmp_path / "absent"), "auto")
    assert (rule.fstype, rule.name) == ("unknown", "pagecache")


def test_defaults_are_valid() -> None:
    config = build_config({}, {})
    assert config == Config(socket=config.socket)
    assert config.worker_count >= 1


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"workers": -1}, "workers"),
        ({"workers": "2"}, "workers"),
        ({"engine": "turbo"}, "engine"),
        ({"roots": "/kv"}, "roots"),
        ({"roots": ["kv"]}, "roots"),
        ({"read_bytes": 2, "max_read_bytes": 1}, "read_bytes"),
        ({"colour": "blue"}, "colour"),
        ({"residency_by_root": {"/nope": "tier"}}, "residency_by_root"),
        ({"fadv_random": 1}, "fadv_random"),
        ({"worker_timeout": 0.5}, "worker_timeout"),
        ({"worker_timeout": -1}, "worker_timeout"),
        ({"worker_timeout": "60"}, "worker_timeout"),
        ({"worker_timeout": True}, "worker_timeout"),
    ],
)
def test_bad_values_name_their_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}"):
        build_config(values, {})


@pytest.mark.parametrize("seconds", [0, 1, 2.5, 3600])
def test_worker_timeout_is_off_or_at_least_a_second(seconds: float) -> None:
    assert build_config({"worker_timeout": seconds}, {}).worker_timeout == seconds


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('workers = 3\nengine = "pread"\nroots = ["/a", "/b/"]\n')
    config = build_config(load_file(path), {"workers": 5})
    assert (config.workers, config.engine, config.roots) == (5, "pread", ("/a", "/b"))


def test_broken_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("workers = = 3\n")
    with pytest.raises(ConfigError, match=r"c\.toml"):
        load_file(path)
