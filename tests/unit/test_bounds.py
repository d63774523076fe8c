"""The bounds of issue 14 (items 1 and 4) as pure logic, and the input pool on real sockets:
decoding budgets, KV request costs known before any work, arithmetic that cannot escape as
`internal`, canonical spellings, the LRU maps, the dedup byte budget and the input pool."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprefetchd import kv
from kvprefetchd.config import Config, ConfigError, build_config
from kvprefetchd.listeners.connection import FREE_INPUT_BYTES, InputPool
from kvprefetchd.listeners.peers import PRIVILEGED_RESERVE, Peer, Seats
from kvprefetchd.listeners.server import Server
from kvprefetchd.protocol import TOO_LARGE, Limits, RequestError, decode_payload
from kvprefetchd.roots.confine import Roots, canonical
from kvprefetchd.worker.dedup import ENTRY_OVERHEAD_BYTES, RecentlyWarmed

HASH = {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
        "vllm_version": "0.23.0"}


def layout(**extra: Any) -> dict[str, Any]:
    return {"root_dir": "/kv", "model_name": "org/model", "fingerprint": "0123456789ab",
            "kv_cache_groups": [{"block_size": 16}], "connector_block_size_tokens": 16,
            **extra}


# ---- decoding -------------------------------------------------------------------------------

LIMITS = Limits(max_frame_bytes=1 << 24, max_paths=1 << 20, max_path_bytes=4096,
                max_containers=100, max_items=1000)


def test_containers_past_the_budget_stop_decoding() -> None:
    message = {"v": 1, "id": 1, "op": "ping", "x": [[0]] * 98}  # 98 + the list + the map
    assert decode_payload(msgpack.packb(message), LIMITS) == message
    with pytest.raises(RequestError) as caught:
        decode_payload(msgpack.packb({**message, "x": [[0]] * 99}), LIMITS)
    assert caught.value.code == TOO_LARGE and "max_request_containers (100)" in caught.value.message


def test_elements_past_the_budget_stop_decoding() -> None:
    message = {"v": 1, "id": 1, "op": "ping", "x": ["ab"] * 996}  # 996 + 4 entries
    assert decode_payload(msgpack.packb(message), LIMITS) == message
    with pytest.raises(RequestError) as caught:
        decode_payload(msgpack.packb({**message, "x": ["ab"] * 997}), LIMITS)
    assert caught.value.code == TOO_LARGE and "max_request_items (1000)" in caught.value.message


# ---- KV requests: cost known before the work, arithmetic that cannot overflow ----------------

def test_a_request_that_names_no_file_costs_nothing_per_rank() -> None:
    request = kv.parse_kv_request({"hash": HASH, "layout": layout(tp_size=1000),
                                   "prompts": [{"token_ids": [1, 2, 3]}]}, {})
    assert (request.blocks, request.files) == (0, 0)
    assert kv.resolve(request).paths == []


@pytest.mark.parametrize(
    ("fields", "limit"),
    [
        ({"layout": layout(tp_size=2**40)}, "max_ranks"),
        ({"layout": layout(tp_size=2**32, pp_size=2**32)}, "max_ranks"),
        ({"layout": layout(tp_size=64, pp_size=64)}, "4096 ranks"),
        ({"layout": layout(dcp_size=2048, tp_size=2048)}, "max_ranks"),
        ({"layout": layout(kv_cache_groups=[{"block_size": 16}] * 65)}, "max_kv_cache_groups"),
        ({"layout": layout(kv_cache_groups=[{"block_size": 16, "layer_names": ["x"] * 20_000}])},
         "layer names"),
        ({"layout": layout(fingerprint=None, fingerprint_fields={"x": [[1] * 200] * 200})},
         "fingerprint_fields"),
        ({"hash": {**HASH, "block_size": 1},
          "layout": layout(kv_cache_groups=[{"block_size": 1}])}, "max_blocks"),
    ],
)
def test_an_inline_layout_beyond_the_bounds_is_too_large(fields: dict[str, Any],
                                                          limit: str) -> None:
    message = {"hash": HASH, "layout": layout(), "prompts": [{"token_ids": [1] * 70_000}],
               **fields}
    with pytest.raises(kv.KVError) as caught:
        kv.parse_kv_request(message, {})
    assert caught.value.code == "too_large" and limit in str(caught.value), caught.value


def test_the_plan_bytes_bound_every_path_actually_built() -> None:
    request = kv.parse_kv_request(
        {"hash": HASH, "layout": layout(tp_size=12, kv_cache_groups=[{"block_size": 16}] * 11),
         "prompts": [{"token_ids": list(range(160))}, {"token_ids": list(range(5, 100))}]}, {})
    paths = kv.resolve(request).paths
    assert len(paths) <= request.files
    assert sum(len(p.encode()) for p in paths) <= request.plan_bytes
    with pytest.raises(kv.KVError) as caught:
        kv.parse_kv_request({"hash": HASH, "layout": layout(root_dir="/" + "r" * 4000),
                             "prompts": [{"token_ids": list(range(16 * 8192))}]},
                            {}, kv.Limits(max_plan_bytes=1 << 20))
    assert "max_kv_path_bytes" in str(caught.value)


SIZES = st.integers(1, 2**64) | st.sampled_from([1, 2, 3, 1024, 1025, 2**31, 2**63])


@settings(max_examples=300, deadline=None)
@given(tp=SIZES, pp=SIZES, pcp=SIZES, dcp=SIZES, block=SIZES, connector=SIZES,
       groups=st.integers(1, 70), agnostic=st.booleans(), tokens=st.integers(0, 300))
def test_no_size_makes_anything_but_a_kv_error(tp: int, pp: int, pcp: int, dcp: int, block: int,
                                               connector: int, groups: int, agnostic: bool,
                                               tokens: int) -> None:
    """Python integers do not overflow, but len(range) and C calls do: any size a client
    may send gives a request or a KVError, never another exception."""
    message = {
        "hash": {**HASH, "block_size": block},
        "layout": layout(tp_size=tp, pp_size=pp, pcp_size=pcp, dcp_size=dcp,
                         connector_block_size_tokens=connector, parallel_agnostic=agnostic,
                         kv_cache_groups=[{"block_size": block}] * groups),
        "prompts": [{"token_ids": list(range(tokens))}],
    }
    try:
        request = kv.parse_kv_request(message, {})
        resolution = kv.resolve(request)
    except kv.KVError:
        return
    assert len(resolution.paths) <= request.files <= kv.Limits().max_files


def test_a_configured_profile_is_held_to_the_same_bounds(tmp_path: Path) -> None:
    table = {"hash": HASH, "layout": {**layout(), "root_dir": str(tmp_path), "tp_size": 64,
                                      "pp_size": 64}}
    with pytest.raises(ConfigError, match="max_ranks"):
        build_config({"roots": [str(tmp_path)], "models": {"m": table}}, {})
    config = build_config({"roots": [str(tmp_path)], "models": {"m": table},
                           "max_ranks": 4096}, {})
    assert config.models["m"].rank_count == 4096


def test_the_input_pool_must_hold_a_whole_frame() -> None:
    with pytest.raises(ConfigError, match="max_input_buffer_bytes"):
        build_config({"max_input_buffer_bytes": 1 << 20}, {})


# ---- canonical spellings ----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("relative", "expected"),
    [
        (b"a/b.bin", b"a/b.bin"), (b"./a/.//b.bin", b"a/b.bin"), (b"a//b", b"a/b"),
        (b"a/.", b"a/"), (b"a/./", b"a/"), (b"a/", b"a/"), (b".", b"."), (b"./", b"."),
        (b"a./b.", b"a./b."), (b".hidden/x", b".hidden/x"),
    ],
)
def test_canonical_spellings(relative: bytes, expected: bytes) -> None:
    assert canonical(relative) == expected


@given(st.lists(st.sampled_from(["a", "b.bin", ".", "", ".x"]), min_size=1, max_size=8))
def test_every_spelling_of_a_file_is_placed_as_one(parts: list[str]) -> None:
    roots = Roots(("/kv",), 4096)
    plain = [p for p in parts if p not in ("", ".")]
    if not plain:
        return
    placed = roots.place_canonical("/kv/" + "/".join(parts))
    assert placed == roots.place_canonical("/kv/" + "/".join(plain) + (
        "/" if parts[-1] in ("", ".") else ""))
    # place (the lexical gate itself) still answers with a suffix of what was asked.
    assert isinstance(placed, tuple)


# ---- the per-key maps -----------------------------------------------------------------------

def test_the_stale_detector_forgets_the_least_recently_fed() -> None:
    detector = kv.StaleDetector(streak=2, capacity=3)
    for name in ("a", "b", "c"):
        detector.record(name, "0" * 12, missing=1, present=0)
    detector.record("a", "0" * 12, missing=1, present=0)  # a is the most recent now
    detector.record("d", "0" * 12, missing=1, present=0)
    assert sorted(detector.report()) == ["a", "c", "d"] and detector.forgotten == 1
    detector.resize(1)
    assert list(detector.report()) == ["d"]


def test_recently_warmed_is_bounded_in_bytes() -> None:
    long_name = b"x" * 4000
    budget = 10 * (4000 + ENTRY_OVERHEAD_BYTES)
    recent = RecentlyWarmed(ttl=60, capacity=1000, budget_bytes=budget)
    for index in range(100):
        recent.remember((0, long_name + str(index).encode()), 1)
    assert len(recent) < 10 and recent.bytes <= budget
    assert recent.covers((0, long_name + b"99"), 1)  # the most recent stay
    recent.remember((0, b"short"), 1)
    assert recent.bytes <= budget


# ---- connection slots ---------------------------------------------------------------------

def test_seats_per_user_and_the_privileged_reserve() -> None:
    seats = Seats()
    other, root = Peer(1, 4242, frozenset()), Peer(2, 0, frozenset())
    for _ in range(3):
        assert seats.refusal(other, 0, 10, 3) is None
        seats.take(other)
    assert "max_connections_per_uid" in (seats.refusal(other, 3, 10, 3) or "")
    assert "max_connections" in (seats.refusal(Peer(3, 4243, frozenset()), 10, 10, 3) or "")
    assert seats.refusal(root, 10 + PRIVILEGED_RESERVE - 1, 10, 3) is None
    assert seats.refusal(root, 10 + PRIVILEGED_RESERVE, 10, 3) is not None
    seats.give_back(other)
    assert seats.refusal(other, 2, 10, 3) is None


# ---- the input pool, on real sockets ----------------------------------------------------------

class FakeConnection:
    def __init__(self, user: int) -> None:
        self.user, self.need, self.grant, self.waiting = user, 0, 0, False
        self.partial_since: float | None = None


def test_the_pool_serves_in_order_and_one_user_holds_at_most_half() -> None:
    pool = InputPool(100)
    a1, a2, b1, c1 = (FakeConnection(u) for u in (1, 1, 2, 3))
    assert pool.ask(a1, 50) == [a1]  # type: ignore[arg-type]
    assert pool.ask(a2, 10) == []  # type: ignore[arg-type]  # user 1 holds its half
    assert pool.ask(b1, 40) == [b1]  # type: ignore[arg-type]  # another user passes it
    assert pool.ask(c1, 20) == []  # type: ignore[arg-type]  # no room: in order
    assert pool.give_back(b1) == [c1]  # type: ignore[arg-type]
    assert pool.give_back(a1) == [a2]  # type: ignore[arg-type]
    assert pool.granted == 30 and not pool.queue


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Server, list[bytes]]]:
    config = Config(roots=(str(tmp_path),), socket=str(tmp_path / "s.sock"),
                    max_frame_bytes=1 << 20, max_input_buffer_bytes=1 << 20)
    selector = selectors.DefaultSelector()
    frames: list[bytes] = []
    events: Counter[str] = Counter()
    instance = Server(config, selector, lambda c, payload: frames.append(payload), events,
                      events)
    yield instance, frames
    instance.drop_all()
    selector.close()


def pump(server: Server, rounds: int = 200) -> None:
    for _ in range(rounds):
        for key, mask in server.selector.select(0):
            key.data(mask)


def feed(server: Server, sock: socket.socket, data: bytes) -> int:
    """Send what the server reads, pumping it between sends; the bytes it took."""
    sent = 0
    for _ in range(1000):
        with contextlib.suppress(BlockingIOError):
            sent += sock.send(data[sent:sent + 65536])
        pump(server, 5)
        if sent == len(data):
            break
    return sent


def test_a_frame_that_does_not_fit_waits_unread_and_is_read_once_room_frees(
    server: tuple[Server, list[bytes]],
) -> None:
    instance, frames = server
    pairs = [socket.socketpair() for _ in range(2)]
    connections = []
    for ours, _theirs in pairs:
        ours.setblocking(False)
        connections.append(instance.add_connection(ours))
    big = 700 * 1024  # two of these do not fit a 1 MiB pool at once
    for _, theirs in pairs:
        theirs.setblocking(False)
        theirs.send(struct.pack(">I", big) + b"\x00" * (FREE_INPUT_BYTES * 2))
    pump(instance)
    first, second = connections
    assert first.grant == big + 4 - FREE_INPUT_BYTES and second.waiting
    assert second.watched == 0  # not read at all while it waits
    assert second.frames.buffered <= FREE_INPUT_BYTES
    assert feed(instance, pairs[0][1], b"\x00" * (big - FREE_INPUT_BYTES * 2)) == (
        big - FREE_INPUT_BYTES * 2)
    pump(instance)
    assert len(frames) == 1 and not second.waiting and second.grant > 0
    assert instance.input_pool.granted == second.grant
    for _ours, theirs in pairs:
        theirs.close()
