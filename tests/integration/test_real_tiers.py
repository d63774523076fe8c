"""The real daemon on real FUSE tiers nobody here wrote (issue 24): s3fs-fuse and rclone,
mounted read-only over a local S3 endpoint (s3rver) behind a loopback delay proxy
(kvharness.realtier), the daemon rooted at the mount point.

- Every configuration a user runs (s3fs defaults / kernel_cache / use_cache, rclone
  vfs_off / vfs_full): a warm with wait over the files answers for every one of them.
- Where the file system keeps what a read fetched for the next opener (s3fs
  `kernel_cache`: the page cache across opens; rclone `vfs_full`: its disk cache), a
  consumer that reads after the warm-up sends the endpoint no GET: the proxy counts them.

The endpoint and each mount are module-scoped fixtures (`endpoint`, `tier`), reused by
later tests of the daemon's behaviour on these tiers. Not root, no /dev/fuse, or a package
missing: skipped with the reason; with KVPREFETCH_REQUIRE_REALTIER=1 (CI) a failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvharness import realtier
from kvharness.daemon import Daemon
from kvharness.pagecache import drops, warmth
from kvharness.wire import RawConnection

FILES = 20
# One 1 MiB object per file, read whole: the head the engine reads is the whole file, so a
# kernel readahead past the head cannot ask the endpoint for more than the warm-up fetched.
SIZE = 1 << 20
DELAY_MS = 5.0  # one way: +10 ms round trip, small enough for the module's time budget
ALL = [(kind, config) for kind, configs in realtier.CONFIGS.items() for config in configs]
KEEPING = [("s3fs", "kernel_cache"), ("rclone", "vfs_full")]  # keep a read for the next open
SETTLE_S = 1.0  # the consumer test counts requests, not time: no need to wait the VM out
# Someone else's drop_caches between the warm-up and the consumer (a shared machine; never
# on CI, where nothing else runs) empties the page cache s3fs kernel_cache relies on: the
# run is redone, at most this many times in all.
ATTEMPTS = 3


def available_or_skip(kinds: tuple[str, ...] = ()) -> None:
    try:
        realtier.check_available(kinds)
    except realtier.RealTierUnavailable as error:  # pragma: no cover - CI requires them
        if realtier.required():
            raise
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[realtier.Endpoint, realtier.DelayProxy]]:
    """The S3 endpoint with FILES objects of SIZE bytes, and the delay proxy before it."""
    available_or_skip()
    with realtier.endpoint(tmp_path_factory.mktemp("endpoint"), FILES, SIZE,
                           DELAY_MS) as pair:
        yield pair


@pytest.fixture(scope="module", params=ALL, ids=[f"{k}-{c}" for k, c in ALL])
def tier(request: pytest.FixtureRequest, endpoint: tuple[realtier.Endpoint,
         realtier.DelayProxy], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[realtier.Mount]:
    """One read-only mount of (kind, config) over the proxy, for the module."""
    kind, config = request.param
    available_or_skip((kind,))
    _, proxy = endpoint
    with realtier.mount(kind, config, proxy.url, tmp_path_factory.mktemp(f"{kind}-{config}"),
                        files=FILES, settle=SETTLE_S) as fs:
        yield fs


def warm(daemon: Daemon, paths: list[str]) -> dict[str, Any]:
    with RawConnection(daemon.socket_path, 120) as connection:
        reply: dict[str, Any] = connection.call("prefetch", paths=paths, wait=True,
                                                read_bytes=SIZE, timeout_ms=60_000)
    assert reply["ok"], reply
    return reply


def consume(paths: list[str], *, count_reclaimed: bool = False) -> int:
    """Read every file whole; with count_reclaimed, first look at each file's pages
    (cachestat and mincore, through an open that keeps them on a kernel_cache mount) and
    return how many files the host's reclaimer had already taken pages of: the consumer
    may fetch those again, which says nothing about the warm-up."""
    reclaimed = 0
    for path in paths:
        if count_reclaimed:
            head = warmth(path, SIZE)
            reclaimed += head.resident < head.wanted
        with open(path, "rb", buffering=0) as handle:
            assert len(handle.read(SIZE)) == SIZE
    return reclaimed


def test_a_warm_with_wait_answers_for_every_file(tier: realtier.Mount,
                                                 daemon_factory: Any) -> None:
    paths = tier.paths()
    assert len(paths) == FILES
    assert tier.limits["max_background"] is not None  # recorded from fusectl
    daemon: Daemon = daemon_factory(root=tier.path)
    reply = warm(daemon, paths)
    outcomes = reply["outcomes"]
    assert sum(outcomes.values()) == FILES, reply
    assert outcomes.get("failed", 0) == outcomes.get("missing", 0) == 0, reply
    assert reply["accepted"] == FILES and not reply["rejected"] and not reply["dropped"]


@pytest.mark.parametrize("tier", KEEPING, ids=[f"{k}-{c}" for k, c in KEEPING],
                         indirect=True)
def test_a_consumer_after_the_warm_up_sends_no_get(
        tier: realtier.Mount, endpoint: tuple[realtier.Endpoint, realtier.DelayProxy],
        daemon_factory: Any) -> None:
    _, proxy = endpoint
    for _attempt in range(ATTEMPTS):
        tier.cold()
        dropped = drops()  # after our own drop: anyone else's shows as a change
        paths = tier.paths()
        daemon: Daemon = daemon_factory(root=tier.path)
        before = proxy.counts()
        reply = warm(daemon, paths)
        assert reply["outcomes"].get("read", 0) + reply["outcomes"].get("resident", 0) == FILES
        fetched = realtier.requests_between(before, proxy.counts())
        assert fetched["GET"] >= FILES, fetched  # the warm-up went to the endpoint...
        daemon.stop()  # ...and whatever the daemon holds is gone before the consumer opens
        after_warm = proxy.counts()
        # s3fs kernel_cache keeps the warm-up in the page cache, which the host's
        # reclaimer (DAMON here) thins out within seconds: a file it took pages of may be
        # fetched again. rclone's near tier is its disk cache, which no reclaimer touches.
        reclaimed = consume(paths, count_reclaimed=tier.kind == "s3fs")
        consumer = realtier.requests_between(after_warm, proxy.counts())
        if drops() == dropped and reclaimed <= FILES // 4:  # pragma: no branch
            break
    assert reclaimed <= FILES // 4, f"the host took pages of {reclaimed} of {FILES} files"
    assert consumer["GET"] <= reclaimed, (consumer, reclaimed)  # ...and the consumer found it


def test_the_proxy_counts_requests_by_kind_across_reads_and_bodies() -> None:
    """The counter behind every `sends no GET` above: split and pipelined requests, a
    listing, and a request body skipped by its Content-Length."""
    counted: list[str] = []
    counter = realtier.RequestCounter(counted.append)
    stream = (b"GET /kvcache/f00001.bin HTTP/1.1\r\nHost: x\r\n\r\n"
              b"HEAD /kvcache/f00001.bin HTTP/1.1\r\n\r\n"
              b"GET /kvcache?list-type=2&prefix= HTTP/1.1\r\n\r\n"
              b"PUT /kvcache/f2 HTTP/1.1\r\nContent-Length: 8\r\n\r\nGET /x/y"
              b"GET /kvcache/f00002.bin HTTP/1.1\r\n\r\n")
    for start in range(0, len(stream), 7):  # arriving in pieces, cut anywhere
        counter.feed(stream[start:start + 7])
    assert counted == ["GET", "HEAD", "LIST", "PUT", "GET"]


def test_a_realtier_scenario_table_is_checked_by_key() -> None:
    import realtier as bench_realtier  # bench/realtier.py, not kvharness.realtier

    good = {"files": 4, "tiers": [{"kind": "s3fs", "config": "kernel_cache",
                                   "extent": "whole"}]}
    assert bench_realtier.check_table(good, 2) == []
    assert bench_realtier.parse_tiers("s3fs/defaults,rclone/vfs_full:whole") == [
        ("s3fs", "defaults", "head"), ("rclone", "vfs_full", "whole")]
    assert bench_realtier.check_table({**good, "tiers": [{"kind": "s3fs",
                                                          "config": "nope"}]}, 2)
    assert bench_realtier.check_table({**good, "methods": ["pool-x"]}, 2)
    assert bench_realtier.check_table({**good, "colour": 1}, 2)
