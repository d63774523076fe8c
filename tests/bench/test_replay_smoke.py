"""The router replay (bench/replay.py): its stream is what it claims, and a small run through
the real daemon and a real tiersim mount gives a report of the right shape.

The generator's checks are statistical on a stream of thousands of requests drawn from a
fixed seed: deterministic, so they cannot flake; the bounds are those any Poisson / Zipf
sample of that size meets by a wide margin. The run needs root and FUSE and skips cleanly
without them (unless KVPREFETCH_REQUIRE_FUSE=1).
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import replay
import replay_run
import replay_stream
from replay_stream import StreamSpec, stream

from kvharness.fixtures import require_fuse

SPEC = StreamSpec(seed=7, docs=3000, systems=6, system_blocks=2, doc_blocks=4, zipf_s=1.0)


@pytest.fixture(scope="module")
def big() -> replay_stream.Stream:
    return stream(SPEC, load=1.5, capacity=150, duration_s=20)


def test_the_stream_is_deterministic_given_its_seed(big: replay_stream.Stream) -> None:
    again = stream(SPEC, load=1.5, capacity=150, duration_s=20)
    assert again.requests == big.requests and again.warm == big.warm
    other = stream(StreamSpec(**{**vars(SPEC), "seed": 8}), 1.5, 150, 20)
    assert [r.files for r in other.requests[:50]] != [r.files for r in big.requests[:50]]


def test_arrivals_are_poisson(big: replay_stream.Stream) -> None:
    times = [r.arrival_s for r in big.requests]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert len(gaps) > 2000 and all(g > 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(big.duration_s / len(gaps), rel=0.06)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert 0.9 < cv < 1.1  # an exponential's coefficient of variation is 1
    beyond = sum(g > mean for g in gaps) / len(gaps)
    assert beyond == pytest.approx(math.exp(-1), abs=0.03)  # P(gap > mean) = 1/e


def test_documents_are_zipf_popular(big: replay_stream.Stream) -> None:
    counts = Counter(r.doc for r in big.requests)
    n = len(big.requests)
    weights = [(rank + 1) ** -SPEC.zipf_s for rank in range(SPEC.docs)]
    total = sum(weights)
    for rank in range(5):  # the head of the distribution, where counts are large
        expected = n * weights[rank] / total
        assert abs(counts[rank] - expected) < 5 * math.sqrt(expected), (rank, counts[rank])
    # rank-frequency slope over the top 20 on log-log axes: -s
    xs = [math.log(rank + 1) for rank in range(20)]
    ys = [math.log(max(counts[rank], 1)) for rank in range(20)]
    mx, my = sum(xs) / 20, sum(ys) / 20
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / \
        sum((x - mx) ** 2 for x in xs)
    assert slope == pytest.approx(-SPEC.zipf_s, abs=0.2)


def test_requests_share_prefixes_as_block_chains(big: replay_stream.Stream) -> None:
    population = replay_stream.Population.of(SPEC)
    for request in big.requests:
        assert len(request.files) == SPEC.files_per_request
        assert list(request.files[: SPEC.system_blocks]) == population.system_files[request.system]
        assert all(f.endswith(".bin") and "_r0/" in f and "_g0/" in f for f in request.files)
    by_system = Counter(r.files[0] for r in big.requests)
    assert len(by_system) == SPEC.systems and min(by_system.values()) > 1
    # documents behind one system prompt share its leading files, then diverge
    a, b = [d for d in range(SPEC.docs) if population.doc_system[d] == 0][:2]
    fa, fb = population.request_files(a), population.request_files(b)
    assert fa[: SPEC.system_blocks] == fb[: SPEC.system_blocks]
    assert not set(fa[SPEC.system_blocks :]) & set(fb[SPEC.system_blocks :])
    repeats = Counter(r.files for r in big.requests)
    assert max(repeats.values()) > 10  # popular prompts come back whole


def test_load_warm_files_and_deltas(big: replay_stream.Stream) -> None:
    assert big.offered == pytest.approx(1.5, rel=0.01)
    population = replay_stream.Population.of(SPEC)
    warm = set(big.warm)
    assert {f for chain in population.system_files for f in chain} <= warm
    first = {f for r in big.requests for f in r.files}
    assert big.new_files == len(first - warm) == sum(r.new for r in big.requests)
    assert any(set(r.files[SPEC.system_blocks:]) <= warm for r in big.requests)
    assert all(0.05 <= r.delta_s <= 0.5 for r in big.requests)
    half = stream(SPEC, load=0.5, capacity=150, duration_s=20)
    assert [r.files for r in half.requests] == [r.files for r in big.requests[: len(half.requests)]]


def test_where_an_open_costs_the_tier_the_load_counts_it(big: replay_stream.Stream) -> None:
    """On s3fs each open of a warm file costs the endpoint two HEADs: counted (here at the
    cold rate), the same load offers fewer requests, and the offered work still comes to
    it."""
    costly = stream(SPEC, load=1.5, capacity=150, duration_s=20, warm_capacity=150)
    assert costly.offered == pytest.approx(1.5, rel=0.01)
    opens = sum(len(r.files) for r in costly.requests) - costly.new_files
    assert (costly.new_files + opens) / 150 / 20 == pytest.approx(1.5, rel=0.01)
    assert len(costly.requests) < len(big.requests) / 2  # most of a request's files are warm
    assert [r.files for r in costly.requests] == [
        r.files for r in big.requests[: len(costly.requests)]]  # the same prefix
    free = stream(SPEC, load=1.5, capacity=150, duration_s=20, warm_capacity=0)
    assert [r.files for r in free.requests] == [r.files for r in big.requests]


def test_fully_warm_new_requests_are_counted_per_bin_of_arrival() -> None:
    head = 100
    rows = {"arrival_s": [0.1, 0.5, 1.9, 2.0, 4.2, 6.7], "new": [1, 1, 0, 1, 1, 1],
            "warm_bytes": [100, 40, 100, 100, 0, 100], "delta_s": [0.2] * 6,
            "read_s": [0.1] * 6, "late_s": [0.0] * 6, "warmup_s": [0.1] * 5 + [0.3],
            "warmup_ok": [True] * 6}
    summary = replay_run.summarize({"method": "daemon", "requests": rows}, head, 0.05)
    # the third request brings no new file; the fifth found nothing warm
    assert summary["fully_warm_new_by_bin"] == [[1, 2], [1, 1], [0, 1], [1, 1]]
    # the last was found warm, but its warm-up ended after its consumer started
    assert summary["fully_warm_new"] == 0.6 and summary["fully_warm_new_on_time"] == 0.4
    old = {k: v for k, v in rows.items() if k != "arrival_s"}  # recorded before arrivals were
    assert replay_run.summarize({"method": "daemon", "requests": old}, head,
                                0.05)["fully_warm_new_by_bin"] == []


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_a_small_replay_through_the_daemon_and_tiersim(tmp_path: Path) -> None:
    require_fuse()
    out = tmp_path / "out"
    code = replay.main(["--out", str(out), "--base", str(tmp_path / "data"), "--reps", "1",
                        "--loads", "0.9", "--duration-s", "1.5", "--drain-s", "20",
                        "--latency-ms", "20", "--slots", "4", "--docs", "60",
                        "--file-bytes", "16KiB", "--references", "1", "--quiet",
                        "--plot", str(out / "replay.png")])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "replay.png").stat().st_size > 0 and (out / "table.md").exists()
    assert results["capacity"]["files_per_s"] > 0
    assert results["capacity"]["warm_files_per_s"] > results["capacity"]["files_per_s"]
    assert set(results["table"]["0.9"]) == {"daemon", "pool-256", "none"}
    new_files = results["streams"]["0.9"]["new_files"]
    for run in results["runs"]:
        requests = results["streams"]["0.9"]["requests"]
        assert all(len(column) == requests for column in run["requests"].values())
        assert run["unfinished_consumers"] == 0
        # every method fetches exactly the stream's new files, once: no file fetched twice,
        # none missed, nothing left warm by the method before
        assert run["tier"]["fetches"] == new_files and run["tier"]["read_errors"] == 0
        summary = run["summary"]
        assert 0 <= summary["warm_hit"] <= 1 and 0 <= summary["fully_warm"] <= 1
        bins = summary["fully_warm_new_by_bin"]
        assert sum(count for _, count in bins) == summary["new_requests"]
        assert sum(full for full, _ in bins) == round(
            summary["fully_warm_new"] * summary["new_requests"])
        if run["method"] == "none":
            assert summary["warmup_p50_s"] is None
        else:
            assert summary["warmup_p50_s"] is not None and summary["warmup_completed"] > 0
    daemon = next(r for r in results["runs"] if r["method"] == "daemon")
    assert daemon["detail"]["dropped"] == 0 and daemon["detail"]["unanswered"] == 0
