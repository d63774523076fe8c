"""The scaffolding every test stands on (kvharness.files, kvharness.fixtures): a write
that is checked to have landed, files that start cold for certain, a wait on state that
fails saying what never held, and the simulator's mount-or-skip. Real files, the real
kernel (cachestat, else mincore), the real environment switch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tiersim
from kvharness import kernel_pages
from kvharness.files import WriteFailed, check_landed, make_files, write, write_all
from kvharness.fixtures import balanced, skip_without_fuse, until

KiB, MiB = 1 << 10, 1 << 20


def cached(path: str | Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return kernel_pages.cached_pages(fd).pages
    finally:
        os.close(fd)


def test_a_write_lands_whole_and_starts_cold(tmp_path: Path) -> None:
    data = os.urandom(3000)
    path = write(tmp_path / "deep" / "f.bin", 3 * MiB + 5, data=data)
    assert path == str(tmp_path / "deep" / "f.bin")
    assert Path(path).read_bytes() == (data * (3 * MiB // 3000 + 1))[: 3 * MiB + 5]


def test_cold_means_no_page_cached_and_warm_is_left_as_it_is(tmp_path: Path) -> None:
    assert cached(write(tmp_path / "cold", 2 * MiB)) == 0
    assert cached(write(tmp_path / "warm", 2 * MiB, cold=False)) > 0  # just written


def test_written_leaves_the_tail_a_hole(tmp_path: Path) -> None:
    path = Path(write(tmp_path / "stub", 4 * MiB, written=64 * KiB))
    assert path.stat().st_size == 4 * MiB
    assert path.stat().st_blocks * 512 < MiB  # only the head allocated
    content = path.read_bytes()
    assert content[64 * KiB:] == bytes(4 * MiB - 64 * KiB) and any(content[:64 * KiB])


def test_a_file_that_is_not_what_was_written_fails_the_check(tmp_path: Path) -> None:
    block = os.urandom(8 * KiB)
    path = Path(write(tmp_path / "f", 32 * KiB, data=block))
    check_landed(path, 32 * KiB, 32 * KiB, block)
    with pytest.raises(WriteFailed, match="bytes after writing"):
        check_landed(path, 32 * KiB + 1, 32 * KiB, block)  # the size it should have had
    with open(path, "r+b") as handle:  # another writer, between write and check
        handle.seek(20 * KiB)
        handle.write(b"\x00" if block[4 * KiB] else b"\x01")
    with pytest.raises(WriteFailed, match="read back different"):
        check_landed(path, 32 * KiB, 32 * KiB, block)


def test_many_files_are_written_alike_and_all_start_cold(tmp_path: Path) -> None:
    paths = write_all((tmp_path / "many" / f"{i:03d}.bin" for i in range(50)), 16 * KiB)
    assert len(paths) == 50 and all(cached(path) == 0 for path in paths)
    assert len({Path(path).read_bytes() for path in paths}) == 1  # one block for all


def test_make_files_lays_them_out_as_the_fs_connector_does(tmp_path: Path) -> None:
    names = make_files(tmp_path, 40, 4 * KiB, folder="m")
    assert names[0] == "m/00/00000.bin" and names[17] == "m/01/00017.bin"
    assert len({Path(name).parent for name in names}) == 16
    assert all((tmp_path / name).stat().st_size == 4 * KiB for name in names)
    assert make_files(tmp_path, 3, 0, folder="empty") == ["empty/00/00000.bin",
                                                         "empty/01/00001.bin",
                                                         "empty/02/00002.bin"]


def test_until_returns_the_state_or_fails_saying_where_it_stopped() -> None:
    calls = iter(range(10))
    assert until(lambda: next(calls) >= 3, "three polls", poll=0) is True
    seen = [0]

    def bump() -> int:
        seen[0] += 1
        return 0

    with pytest.raises(AssertionError, match=r"not within 0.05 s: stuck at \d+ polls"):
        until(bump, lambda: f"stuck at {seen[0]} polls", timeout=0.05, poll=0.01)


def test_balanced_is_a_success_whose_every_file_has_one_outcome() -> None:
    outcomes = {"read": 2, "resident": 1, "missing": 0, "rejected": 0, "failed": 1,
                "expired": 0}
    assert balanced({"ok": True, "accepted": 4, "outcomes": outcomes})
    assert not balanced({"ok": True, "accepted": 5, "outcomes": outcomes})
    assert not balanced({"ok": False, "accepted": 4, "outcomes": outcomes})


def test_no_fuse_skips_unless_fuse_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    error = tiersim.FuseUnavailable("no /dev/fuse here")
    monkeypatch.delenv(tiersim.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no /dev/fuse here"):
        skip_without_fuse(error)
    monkeypatch.setenv(tiersim.REQUIRE_ENV, "1")  # CI: being unable to mount fails
    with pytest.raises(tiersim.FuseUnavailable):
        skip_without_fuse(error)
