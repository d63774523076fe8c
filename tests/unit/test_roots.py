"""Opening a root without anyone being able to swap it: real directories, real symlinks,
real ownership (chown needs root: those cases skip elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvprefetchd.roots.opening import RootMissing, RootRefused, Trust, open_root

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
OTHER = 65534  # nobody


def same_directory(fd: int, path: Path) -> bool:
    here, there = os.fstat(fd), os.stat(path)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def test_a_plain_root_opens_as_the_directory_it_names(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    fd = open_root(str(root))
    try:
        assert same_directory(fd, root)
        # The fd stays that directory whatever later happens to the path.
        root.rename(tmp_path / "moved")
        (tmp_path / "kv").symlink_to("/")
        assert same_directory(fd, tmp_path / "moved")
    finally:
        os.close(fd)


def test_a_symlinked_root_or_component_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(RootRefused, match=r"link is a symlink"):
        open_root(str(tmp_path / "link"))
    (tmp_path / "real" / "kv").mkdir()
    with pytest.raises(RootRefused, match=r"link is a symlink"):
        open_root(str(tmp_path / "link" / "kv"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(RootRefused, match="not a directory"):
        open_root(str(tmp_path / "file"))


def test_a_root_that_does_not_exist_yet_is_missing_not_refused(tmp_path: Path) -> None:
    with pytest.raises(RootMissing, match="does not exist"):
        open_root(str(tmp_path / "later" / "kv"))


def test_a_world_writable_non_sticky_directory_on_the_way_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    (open_dir / "kv").mkdir(parents=True)
    open_dir.chmod(0o777)
    with pytest.raises(RootRefused, match="writable by others and not sticky"):
        open_root(str(open_dir / "kv"))
    os.close(open_root(str(open_dir / "kv"), checks=False))
    open_dir.chmod(0o1777)  # sticky, like /tmp: the root's own entry may be anyone's
    os.close(open_root(str(open_dir / "kv")))


@ROOT_ONLY
def test_ownership_by_another_user_is_refused_where_it_lets_them_swap(tmp_path: Path) -> None:
    trust = Trust(frozenset({0}))
    # Their directory on the way: they may rename what is in it.
    theirs = tmp_path / "theirs"
    (theirs / "kv").mkdir(parents=True)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(RootRefused, match=f"theirs is owned by uid {OTHER}"):
        open_root(str(theirs / "kv"), trust=trust)
    # Their entry in a sticky directory, above the root: they may still rename it.
    sticky = tmp_path / "sticky"
    (sticky / "above" / "kv").mkdir(parents=True)
    sticky.chmod(0o1777)
    os.chown(sticky / "above", OTHER, OTHER)
    with pytest.raises(RootRefused, match=f"the entry is owned by uid {OTHER}"):
        open_root(str(sticky / "above" / "kv"), trust=trust)
    # The root itself, the connector's user's, in a sticky directory: accepted.
    shared = sticky / "shared-kv"
    shared.mkdir()
    os.chown(shared, OTHER, OTHER)
    fd = open_root(str(shared), trust=trust)
    assert same_directory(fd, shared)
    os.close(fd)
