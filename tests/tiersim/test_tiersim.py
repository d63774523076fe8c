"""The slow-tier simulator (bench/tiersim), each mode on a real FUSE mount.

Real mounts, real readers (threads and child processes), the kernel's page cache.  The
latency checks are functional checks of the model with wide margins (a 200 ms fetch must
take at least 150 ms, a fetched chunk well under 50 ms), not performance assertions.
Skips with the reason where FUSE cannot be used, fails instead with KVPREFETCH_REQUIRE_FUSE=1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tiersim
from kvharness.pagecache import assert_warmed, drops, resident_bytes

MiB = 1 << 20
KiB = 1 << 10

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="FUSE on Linux only")

MakeTier = Callable[..., "tiersim.Tier"]


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[MakeTier]:
    """Mount simulators over tmp_path/backing; all are closed (unmounted) after the test."""
    started: list[tiersim.Tier] = []

    def factory(**options: Any) -> tiersim.Tier:
        mountpoint = tmp_path / f"mnt{len(started)}"
        tier = tiersim.Tier(tmp_path / "backing", mountpoint, tiersim.TierOptions(**options))
        try:
            tier.start()
        except tiersim.FuseUnavailable as exc:
            if tiersim.fuse_required():
                pytest.fail(f"{exc} (and {tiersim.REQUIRE_ENV}=1)")
            pytest.skip(str(exc))
        started.append(tier)
        return tier

    (tmp_path / "backing").mkdir()
    yield factory
    for tier in started:
        tier.close()
        assert tiersim.mount_device(tier.mountpoint) is None, "left mounted"


def write(root: Path, rel: str, size: int) -> bytes:
    data = os.urandom(size)
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def timed_pread(path: Path, size: int, offset: int) -> tuple[bytes, float]:
    """One read of exactly [offset, offset+size): POSIX_FADV_RANDOM turns readahead off
    (mm/fadvise.c sets FMODE_RANDOM), so nothing but this range is asked of the tier."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        start = time.monotonic()
        data = os.pread(fd, size, offset)
        return data, time.monotonic() - start
    finally:
        os.close(fd)


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    """A reader in a child process: if it hangs in the kernel, the test process does not."""
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def still_blocked(child: subprocess.Popen[str], seconds: float = 0.3) -> bool:
    try:
        child.wait(seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


READ_CHILD = "import sys; sys.stdout.write(open(sys.argv[1], 'rb').read().hex())"


def test_content_listing_and_metadata_pass_through(tmp_path: Path, make_tier: MakeTier) -> None:
    backing = tmp_path / "backing"
    sizes = {"empty": 0, "one": 1, "page-1": 4095, "chunk-1": MiB - 1, "chunk+1": MiB + 1,
             "dir/a/3.5chunks": 3 * MiB + MiB // 2}
    content = {rel: write(backing, rel, size) for rel, size in sizes.items()}
    (backing / "link").symlink_to("dir/a/3.5chunks")
    tier = make_tier(latency_ms=0)
    mnt = tier.mountpoint
    for rel, data in content.items():
        assert (mnt / rel).read_bytes() == data, rel
        assert (mnt / rel).stat().st_size == len(data)
    # reads that straddle chunk boundaries, at odd offsets
    data = content["dir/a/3.5chunks"]
    for offset, size in ((MiB - 3, 7), (2 * MiB - 4096, 3 * 4096), (3 * MiB + 5, MiB)):
        assert timed_pread(mnt / "dir/a/3.5chunks", size, offset)[0] == data[offset:offset + size]
    assert sorted(os.listdir(mnt)) == sorted(os.listdir(backing))
    assert sorted(os.listdir(mnt / "dir/a")) == ["3.5chunks"]
    assert os.readlink(mnt / "link") == "dir/a/3.5chunks"
    assert (mnt / "link").read_bytes() == data
    with pytest.raises(OSError) as refused:
        os.open(mnt / "one", os.O_WRONLY)
    assert refused.value.errno == 30  # EROFS: a read-only tier
    assert tier.stats().read_errors == 0


def test_first_read_of_a_chunk_pays_the_latency_and_later_ones_do_not(
        tmp_path: Path, make_tier: MakeTier) -> None:
    data = write(tmp_path / "backing", "f.bin", 3 * MiB)
    tier = make_tier(latency_ms=200, chunk_bytes=MiB)
    path = tier.mountpoint / "f.bin"
    got, first = timed_pread(path, 4096, 0)
    assert got == data[:4096] and first >= 0.150, first
    # the same chunk, a page the first read did not bring in: already near
    got, second = timed_pread(path, 4096, 512 * KiB)
    assert got == data[512 * KiB:512 * KiB + 4096] and second < 0.050, second
    # the next chunk is still far
    got, third = timed_pread(path, 4096, MiB + 4096)
    assert got == data[MiB + 4096:MiB + 8192] and third >= 0.150, third
    stats = tier.stats()
    assert (stats.fetches, stats.fetched_bytes) == (2, 2 * MiB)
    assert stats.in_flight == stats.queued == stats.pending_reads == 0


def test_jitter_adds_up_to_its_bound(tmp_path: Path, make_tier: MakeTier) -> None:
    write(tmp_path / "backing", "f.bin", 4 * MiB)
    tier = make_tier(latency_ms=50, jitter_ms=100)
    elapsed = [timed_pread(tier.mountpoint / "f.bin", 4096, c * MiB)[1] for c in range(4)]
    assert all(0.045 <= e <= 0.150 + 0.200 for e in elapsed), elapsed
    assert max(elapsed) - min(elapsed) > 0.001, "no jitter at all"


def test_st_blocks_counts_only_fetched_chunks(tmp_path: Path, make_tier: MakeTier) -> None:
    write(tmp_path / "backing", "f.bin", 3 * MiB + 100)
    tier = make_tier(latency_ms=0)
    path = tier.mountpoint / "f.bin"
    assert path.stat().st_blocks == 0  # never read: an HSM stub
    timed_pread(path, 1, 0)
    assert path.stat().st_blocks * 512 == MiB  # stat right after the read sees it
    timed_pread(path, 1, 3 * MiB)
    assert path.stat().st_blocks * 512 == MiB + 4096  # the 100-byte tail: one 4 KiB block
    path.read_bytes()
    assert path.stat().st_blocks * 512 == 3 * MiB + 4096
    assert tier.evict(path)["chunks"] == 4
    assert path.stat().st_blocks == 0


def test_evict_drops_fetched_chunks_and_the_kernels_pages(
        tmp_path: Path, make_tier: MakeTier) -> None:
    for name in ("a", "b/c"):
        write(tmp_path / "backing", name, 2 * MiB)
    tier = make_tier(latency_ms=100)
    a, c = tier.mountpoint / "a", tier.mountpoint / "b/c"
    since = drops()
    a.read_bytes()
    c.read_bytes()
    # Every page up to date, or taken by the host's reclaimer since (a shadow entry):
    # an invalidation (a reopen without keep_cache, an evict) leaves no shadow.
    assert_warmed([a], 2 * MiB, since=since)
    assert_warmed([a], 2 * MiB, since=since)  # keep_cache: pages survive a reopen
    _, warm = timed_pread(a, 4096, 4096)
    assert warm < 0.050

    result = tier.evict(a)
    assert (result["files"], result["chunks"], result["invalidated"]) == (1, 2, 1)
    assert resident_bytes(a, 2 * MiB) == 0
    assert_warmed([c], 2 * MiB, since=since)  # only the evicted file
    _, cold = timed_pread(a, 4096, 4096)
    assert cold >= 0.070, cold

    assert tier.evict(tier.mountpoint / "b")["files"] == 1  # a directory: what is under it
    assert resident_bytes(c, 2 * MiB) == 0
    a.read_bytes()
    c.read_bytes()
    result = tier.evict_all()
    assert (result["files"], result["chunks"]) == (2, 4)
    assert resident_bytes(a, 2 * MiB) == resident_bytes(c, 2 * MiB) == 0
    stats = tier.stats()
    assert stats.evictions == 4 and stats.evicted_chunks == 2 + 2 + 4
    with pytest.raises(tiersim.TierError, match="No such file"):
        tier.evict("/missing")


def read_concurrently(paths: list[Path]) -> float:
    """Read one page of each file at once, one thread per file; the wall time."""
    errors: list[Exception] = []

    def one(path: Path) -> None:
        try:
            timed_pread(path, 4096, 0)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in paths]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return time.monotonic() - start


def test_slots_cap_fetches_in_flight_and_queue_the_rest(
        tmp_path: Path, make_tier: MakeTier) -> None:
    names = [f"f{i:02}" for i in range(16)]
    for name in names:
        write(tmp_path / "backing", name, 4096)
    tier = make_tier(latency_ms=100, slots=4)
    paths = [tier.mountpoint / n for n in names]
    elapsed = read_concurrently(paths)
    stats = tier.stats()
    assert stats.fetches == 16 and stats.peak_in_flight == 4, stats
    assert elapsed >= 0.350, elapsed  # four rounds of 100 ms

    tier.evict_all()
    tier.set(slots=0)
    tier.reset_stats()
    read_concurrently(paths)
    stats = tier.stats()
    assert stats.fetches == 16 and stats.peak_in_flight > 4, stats


def test_bandwidth_cap_spreads_fetches_over_time(tmp_path: Path, make_tier: MakeTier) -> None:
    write(tmp_path / "backing", "f.bin", 8 * MiB)
    tier = make_tier(latency_ms=0, bandwidth=20 * MiB)  # 8 MiB: 0.4 s at the cap
    path = tier.mountpoint / "f.bin"
    start = time.monotonic()
    path.read_bytes()
    capped = time.monotonic() - start
    assert capped >= 0.300, capped
    tier.evict(path)
    tier.set(bandwidth=0)
    start = time.monotonic()
    path.read_bytes()
    assert time.monotonic() - start < capped / 2
    assert tier.stats().fetched_bytes == 16 * MiB


def test_hang_read_holds_readers_until_release(tmp_path: Path, make_tier: MakeTier) -> None:
    held = write(tmp_path / "backing", "model_a/x.bin", 64 * KiB)
    free = write(tmp_path / "backing", "model_b/y.bin", 64 * KiB)
    tier = make_tier(latency_ms=0)
    with tier.hang("read", "/model_a/"):
        child = spawn(READ_CHILD, str(tier.mountpoint / "model_a/x.bin"))
        assert tier.wait_held(1).held_read >= 1
        assert still_blocked(child)
        assert (tier.mountpoint / "model_b/y.bin").read_bytes() == free, "other paths served"
        assert os.listdir(tier.mountpoint / "model_a") == ["x.bin"], "only reads hang"
        # evicting a file under a read hang must not wait for the held READ's page locks
        assert tier.evict(tier.mountpoint / "model_a/x.bin")["pages_kept_hung"] == 1
    out, err = child.communicate(timeout=10)
    assert child.returncode == 0, err
    assert bytes.fromhex(out) == held
    stats = tier.stats()
    assert stats.held == 0 and stats.held_total >= 1


def test_hang_readdir_holds_listings_until_release(tmp_path: Path, make_tier: MakeTier) -> None:
    for name in ("one", "two"):
        write(tmp_path / "backing", f"model_a/{name}", 10)
    tier = make_tier()
    tier.hold("readdir", "/model_a")
    child = spawn("import os, sys; print(sorted(os.listdir(sys.argv[1])))",
                  str(tier.mountpoint / "model_a"))
    assert tier.wait_held(1).held_readdir == 1
    assert still_blocked(child)
    assert (tier.mountpoint / "model_a/one").read_bytes() == (tmp_path / "backing/model_a/one"
                                                              ).read_bytes(), "reads still served"
    assert tier.release("readdir", "/model_a") == 1
    out, err = child.communicate(timeout=10)
    assert child.returncode == 0 and out.strip() == "['one', 'two']", err


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_hang_stat_holds_even_through_sigkill_until_release(
        tmp_path: Path, make_tier: MakeTier) -> None:
    write(tmp_path / "backing", "model_a/x.bin", 10)
    tier = make_tier()
    seen = tier.mountpoint / "model_a/x.bin"
    assert seen.stat().st_size == 10  # its attributes are now in the kernel's cache
    with tier.hang("stat", "/model_a/"):
        cached = spawn("import os, sys; print(os.stat(sys.argv[1]).st_size)", str(seen))
        unseen = spawn("import os, sys; print(os.path.exists(sys.argv[1]))",
                       str(tier.mountpoint / "model_a/never-looked-up"))
        assert tier.wait_held(2).held_stat == 2  # a GETATTR and a LOOKUP
        # The hazard the reliability work guards against: once the request is read by the
        # file system, the caller waits uninterruptibly (fs/fuse/dev.c request_wait_answer).
        cached.send_signal(signal.SIGKILL)
        assert still_blocked(cached, 0.5), "SIGKILL freed a process held in FUSE"
        assert process_state(cached.pid) == "D"
    assert cached.wait(10) == -signal.SIGKILL
    out, err = unseen.communicate(timeout=10)
    assert unseen.returncode == 0 and out.strip() == "False", err
    assert tier.stats().held == 0


def held_reader(tmp_path: Path, make_tier: MakeTier, kind: tiersim.HangKind
                ) -> tuple[tiersim.Tier, subprocess.Popen[str], subprocess.Popen[bytes]]:
    """A child blocked in the simulator, reading model_a/x.bin under a `kind` hang."""
    write(tmp_path / "backing", "model_a/x.bin", 4096)
    tier = make_tier()
    tier.hold(kind, "/model_a/")
    child = spawn(READ_CHILD, str(tier.mountpoint / "model_a/x.bin"))
    tier.wait_held(1)
    assert tier.process is not None
    return tier, child, tier.process


def test_closing_with_requests_held_frees_the_readers(tmp_path: Path, make_tier: MakeTier) -> None:
    tier, child, simulator = held_reader(tmp_path, make_tier, "all")
    # SIGTERM without a release first: the simulator answers what it holds (EIO), unmounts
    simulator.send_signal(signal.SIGTERM)
    assert simulator.wait(10) == 0
    _, err = child.communicate(timeout=10)
    assert child.returncode != 0 and "Input/output error" in err, err
    tier.close()


def test_a_wedged_simulator_is_aborted_through_fusectl(
        tmp_path: Path, make_tier: MakeTier) -> None:
    tier, child, simulator = held_reader(tmp_path, make_tier, "read")
    simulator.send_signal(signal.SIGSTOP)  # neither release nor SIGTERM can reach it
    start = time.monotonic()
    tier.close(timeout=0.5)
    assert time.monotonic() - start < 8
    child.communicate(timeout=10)
    assert child.returncode != 0, "the abort must fail the held read"
    assert tiersim.mount_device(tier.mountpoint) is None


def test_max_background_caps_buffered_readers_unless_raised(
        tmp_path: Path, make_tier: MakeTier) -> None:
    """Buffered reads reach FUSE as background READs (fs/fuse/file.c fuse_readahead with
    async_read), at most max_background in flight: 12 by default, whatever the readers."""
    names = [f"f{i:02}" for i in range(32)]
    for name in names:
        write(tmp_path / "backing", name, 4096)
    default = make_tier(latency_ms=100, max_background=0)
    assert default.connection_value("max_background") == 12
    assert default.connection_value("congestion_threshold") == 9
    read_concurrently([default.mountpoint / n for n in names])
    assert default.stats().peak_in_flight == 12

    raised = make_tier(latency_ms=100)
    assert raised.connection_value("max_background") == 1024
    assert raised.connection_value("congestion_threshold") == 768
    read_concurrently([raised.mountpoint / n for n in names])
    assert raised.stats().peak_in_flight > 12
    assert raised.read_ahead_kb() == 128  # the kernel's offer, unchanged by default
    assert raised.stats().kernel_max_readahead == 128 * KiB

    tuned = make_tier(max_background=64, congestion_threshold=64, read_ahead_kb=1024)
    assert tuned.connection_value("max_background") == 64
    assert tuned.connection_value("congestion_threshold") == 64
    assert tuned.read_ahead_kb() == 1024


def test_counters_add_up(tmp_path: Path, make_tier: MakeTier) -> None:
    data = write(tmp_path / "backing", "f.bin", 5 * MiB // 2)
    tier = make_tier(latency_ms=10, chunk_bytes=MiB)
    assert (tier.mountpoint / "f.bin").read_bytes() == data
    stats = tier.stats()
    assert (stats.fetches, stats.fetched_bytes) == (3, len(data))
    assert stats.read_bytes == len(data) and stats.reads >= len(data) // (128 * KiB)
    assert stats.peak_in_flight >= 1 and stats.in_flight == 0
    assert stats.opens == 1 and stats.lookups >= 1 and stats.files_known == 2  # root + file
    tier.reset_stats()
    stats = tier.stats()
    assert stats.fetches == stats.reads == stats.peak_in_flight == stats.opens == 0
    assert stats.latency_ms == 10 and stats.chunk_bytes == MiB


def test_unusable_fuse_is_explained() -> None:
    """Not root: a FuseUnavailable that says why (what tests turn into a skip)."""
    if os.geteuid() != 0:
        with pytest.raises(tiersim.FuseUnavailable, match="root"):
            tiersim.check_fuse()
        return
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, ask, report through the pipe
        message = "no exception"
        try:
            os.setgid(65534)
            os.setuid(65534)
            tiersim.check_fuse()
        except tiersim.FuseUnavailable as exc:
            message = str(exc)
        except Exception as exc:
            message = f"unexpected: {exc!r}"
        finally:
            os.write(write_end, message.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        message = reader.read().decode()
    os.waitpid(pid, 0)
    assert "needs root" in message, message
