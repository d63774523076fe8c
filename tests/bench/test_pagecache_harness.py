"""The page-cache tools every residency-dependent test relies on (bench/kvharness/pagecache.py),
held to what they promise, on the real page cache.

The host's reclaimer is reproduced with MADV_PAGEOUT (kernel_pages.page_out), which goes
through the same reclaim_pages path as DAMON's pageout; drop_caches by DONTNEED, which
invalidates through the same mapping_try_invalidate (nobody else's cache is dropped).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvharness import kernel_pages
from kvharness.files import EvictionFailed, evict, make_file
from kvharness.pagecache import PAGE, assert_warmed, cached_and_reclaimed, drops, pinned, warmth

KiB, MiB = 1 << 10, 1 << 20

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux page cache only")


def cached(path: Path) -> int:
    return cached_and_reclaimed(path)[0]


def invalidate(path: Path) -> None:
    """What drop_caches does to one file (DONTNEED: mapping_try_invalidate), unverified."""
    evict(path, verify=False)


def test_a_pinned_head_survives_reclaim_and_invalidation_and_nothing_beyond_is_read(
        tmp_path: Path) -> None:
    path = make_file(tmp_path / "f", 4 * MiB)
    with pinned([path], MiB) as pin:
        assert pin.locked == [str(path)] and not pin.unlocked, pin.why
        assert cached(path) == MiB  # the head, read by the pin, and no readahead past it
        assert kernel_pages.page_out(str(path), MiB) == 0  # mlocked: reclaim passes it by
        invalidate(path)
        assert cached(path) == MiB and pin.kept() == [str(path)]
    evict(path)
    assert cached_and_reclaimed(path) == (0, 0)


def test_pinning_an_offset_and_an_empty_file(tmp_path: Path) -> None:
    path, empty = make_file(tmp_path / "f", 4 * MiB), make_file(tmp_path / "e", 0)
    with pinned([path, empty], MiB, offset=2 * MiB) as pin:
        assert pin.kept() == [str(path), str(empty)]
        assert cached_and_reclaimed(path, 2 * MiB, MiB)[0] == cached(path) == MiB
    with pytest.raises(ValueError, match="page size"), pinned([path], MiB, offset=100):
        pass


def test_evict_is_verified_and_says_what_holds_a_page(tmp_path: Path) -> None:
    path = make_file(tmp_path / "f", MiB)
    with pinned([path]), pytest.raises(EvictionFailed, match="mapped or locked"):
        evict(path, timeout=0.2)
    dirty = tmp_path / "dirty"
    dirty.write_bytes(os.urandom(MiB))  # not synced: DONTNEED alone leaves dirty pages
    evict(dirty, sync=False)  # synced on the retry
    assert cached_and_reclaimed(dirty) == (0, 0)


def test_assert_warmed_tells_a_reclaimed_page_from_one_never_read(tmp_path: Path) -> None:
    read, half = make_file(tmp_path / "read", MiB), make_file(tmp_path / "half", MiB)
    since = drops()
    read.read_bytes()
    fd = os.open(half, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # exactly what is asked: no readahead
        assert len(os.pread(fd, MiB // 2, 0)) == MiB // 2
    finally:
        os.close(fd)
    taken = kernel_pages.page_out(str(read), 256 * KiB, 256 * KiB)
    assert taken > 0  # the reclaimer's path: shadow entries stay behind
    assert warmth(read) == type(warmth(read))(str(read), MiB // PAGE, MiB // PAGE - taken,
                                              taken)
    assert assert_warmed([read], MiB, since=since) == taken
    with pytest.raises(AssertionError, match="1 heads not warmed"):
        assert_warmed([read, half], MiB, since=since)
    assert_warmed([half], MiB // 2, since=since)
    evict(read)  # an eviction clears the shadows: a cold file shows no past reclaim
    assert warmth(read).reclaimed == 0


CHILD = """
import json, sys
from kvharness import kernel_pages
from kvharness.pagecache import pinned
paths = sys.argv[1:]
with pinned(paths) as pin:
    before = pin.kept()
    pin.maps[paths[0]].page_out()  # the reclaimer takes an unlocked head (mapped by the pin)
    after = pin.kept()
print(json.dumps({"locked": pin.locked, "unlocked": pin.unlocked, "why": pin.why,
                  "before": before, "after": after, "taken": pin.taken}))
"""


def test_where_mlock_is_refused_the_pin_counts_what_the_reclaimer_took(
        tmp_path: Path) -> None:
    """RLIMIT_MEMLOCK 0 and, for root, CAP_IPC_LOCK dropped (setpriv): mlock is refused
    as for an ordinary user; the heads are mapped and kept() leaves out the one taken."""
    paths = [str(make_file(tmp_path / f"f{i}", 64 * KiB)) for i in range(3)]
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) is needed to drop CAP_IPC_LOCK as root")
        prefix = [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]
    done = subprocess.run(
        [*prefix, sys.executable, "-c", CHILD, *paths], capture_output=True, text=True,
        timeout=60, check=False, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0)))
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["locked"] == [] and got["unlocked"] == paths
    assert "mlock EPERM" in got["why"] and "no CAP_IPC_LOCK" in got["why"], got["why"]
    assert got["before"] == paths and got["after"] == paths[1:] and got["taken"] == 1
    assert "the reclaimer took 1 of 3 unlocked heads" in done.stdout
