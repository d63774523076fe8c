"""Framing and request decoding, without sockets."""

from __future__ import annotations

import math
import time

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvprefetchd.engines.base import deadline_ns
from kvprefetchd.protocol import (
    BAD_REQUEST,
    HEADER,
    TOO_LARGE,
    UNKNOWN_OP,
    UNSUPPORTED_VERSION,
    FrameReader,
    Limits,
    RequestError,
    decode_payload,
    encode_frame,
    nests_deeper_than,
    parse_request,
)
from kvprefetchd.request_fields import (
    DAY_MS,
    deadline_of,
    parse_inspect_options,
    parse_paths,
    parse_warm_options,
)

LIMITS = Limits(max_frame_bytes=1 << 20, max_paths=1000, max_path_bytes=4096)


def frames_of(reader: FrameReader, data: bytes) -> list[bytes | None]:
    return [frame.payload for frame in reader.feed(data)]


def test_frames_split_across_reads_are_reassembled() -> None:
    stream = encode_frame({"a": 1}) + encode_frame({"b": [1, 2, 3]})
    reader = FrameReader(1024)
    got: list[bytes | None] = []
    for byte in stream:
        got += frames_of(reader, bytes([byte]))
    assert [msgpack.unpackb(p) for p in got if p is not None] == [{"a": 1}, {"b": [1, 2, 3]}]
    assert reader.buffered == 0


def test_oversized_frame_is_skipped_and_the_stream_goes_on() -> None:
    reader = FrameReader(16)
    big = HEADER.pack(100) + b"x" * 100
    frames = list(reader.feed(big[:50])) + list(reader.feed(big[50:] + encode_frame({"ok": 1})))
    assert frames[0].payload is None and frames[0].skipped_bytes == 100
    assert msgpack.unpackb(frames[1].payload) == {"ok": 1}


MSGPACK_SCALARS = st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary() | st.booleans()


@given(st.dictionaries(st.text(max_size=8), MSGPACK_SCALARS, max_size=8))
def test_any_map_round_trips(message: dict[str, object]) -> None:
    frames = list(FrameReader(1 << 20).feed(encode_frame(message)))
    assert len(frames) == 1 and frames[0].payload is not None
    assert decode_payload(frames[0].payload, LIMITS) == message


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", b"\x93\x01", msgpack.packb([1, 2]), msgpack.packb("str"), msgpack.packb(1) * 2],
    ids=["reserved-byte", "truncated-array", "array", "string", "two-values"],
)
def test_undecodable_or_non_map_payloads_are_bad_requests(payload: bytes) -> None:
    with pytest.raises(RequestError) as caught:
        decode_payload(payload, LIMITS)
    assert caught.value.code == BAD_REQUEST


def test_array_longer_than_the_path_limit_is_refused_while_decoding() -> None:
    payload = msgpack.packb({"v": 1, "id": 1, "op": "prefetch", "paths": ["/a"] * 1001})
    with pytest.raises(RequestError) as caught:
        decode_payload(payload, LIMITS)
    assert caught.value.code == BAD_REQUEST


def nested(depth: int) -> dict[str, object]:
    """A request whose containers nest exactly `depth` levels (the top map is level 1)."""
    inner: object = "leaf"
    for _ in range(depth - 1):
        inner = [inner]
    return {"v": 1, "id": 9, "op": "ping", "extra": inner}


@pytest.mark.parametrize("depth", [2, 3, 8, 16, 17, 40])
def test_nesting_depth_is_counted_exactly(depth: int) -> None:
    message = nested(depth)
    assert not nests_deeper_than(message, depth)
    assert nests_deeper_than(message, depth - 1)


def test_nesting_is_found_in_maps_and_beside_scalars() -> None:
    message = {"a": 1, "b": [1, "x", {"c": [[b"y"]]}], "d": {"e": None}}  # 5 levels at b
    assert not nests_deeper_than(message, 5)
    assert nests_deeper_than(message, 4)


def test_a_request_nested_past_the_limit_is_too_large_with_its_id() -> None:
    limits = Limits(max_frame_bytes=1 << 20, max_paths=1000, max_path_bytes=4096,
                    max_nesting_depth=8)
    assert decode_payload(msgpack.packb(nested(8)), limits)["id"] == 9
    with pytest.raises(RequestError) as caught:
        decode_payload(msgpack.packb(nested(9)), limits)
    assert caught.value.code == TOO_LARGE and caught.value.request_id == 9
    assert "max_nesting_depth (8)" in caught.value.message


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"v": 1, "op": "ping"}, BAD_REQUEST),
        ({"v": 1, "id": -1, "op": "ping"}, BAD_REQUEST),
        ({"v": 1, "id": True, "op": "ping"}, BAD_REQUEST),
        ({"id": 1, "op": "ping"}, BAD_REQUEST),
        ({"v": 2, "id": 1, "op": "ping"}, UNSUPPORTED_VERSION),
        ({"v": 1, "id": 1}, BAD_REQUEST),
        ({"v": 1, "id": 1, "op": 7}, BAD_REQUEST),
        ({"v": 1, "id": 1, "op": "format_disk"}, UNKNOWN_OP),
    ],
)
def test_envelope_errors(message: dict[str, object], code: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(message)
    assert caught.value.code == code


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"paths": "/a"},
        {"paths": [], "wait": 1},
        {"paths": [], "read_bytes": 0},
        {"paths": [], "read_bytes": "1"},
        {"paths": [], "read_bytes": 1 << 40},
        {"paths": [], "timeout_ms": -5},
    ],
)
def test_prefetch_field_errors(fields: dict[str, object]) -> None:
    request = parse_request({"v": 1, "id": 9, "op": "prefetch", **fields})
    with pytest.raises(RequestError) as caught:
        parse_paths(request)
        parse_warm_options(request, 4096, 1 << 20)
    assert caught.value.code == BAD_REQUEST and caught.value.request_id == 9


def test_prefetch_defaults() -> None:
    request = parse_request({"v": 1, "id": 1, "op": "prefetch", "paths": ["/x"]})
    options = parse_warm_options(request, 4096, 1 << 20)
    assert (options.wait, options.read_bytes, options.timeout_ms) == (False, 4096, None)
    assert parse_paths(request) == ["/x"]


def test_a_prompt_may_hold_more_token_ids_than_a_request_may_hold_paths() -> None:
    """Arrays are bounded by the larger of the two limits; each op then checks its own
    (a 128k-token prompt under the default 100k paths was refused as undecodable)."""
    limits = Limits(max_frame_bytes=1 << 20, max_paths=1000, max_path_bytes=4096,
                    max_tokens=5000)
    prompt = {"v": 1, "id": 1, "op": "resolve", "prompts": [{"token_ids": [1] * 5000}]}
    assert decode_payload(msgpack.packb(prompt), limits) == prompt
    with pytest.raises(RequestError) as caught:
        decode_payload(msgpack.packb({"token_ids": [1] * 5001}), limits)
    assert caught.value.code == BAD_REQUEST


# ---- numeric fields: every one bounded at the edge (issue 23, finding 2) ----------------------

HUGE = [2**44, 2**63 - 1, 2**64 - 1]  # 2**44 ms overflowed a worker's int64 ns in 0.3.0
NOT_INTEGERS = [-1, 1.5, True, "5", [1]]


def refusal(op: str, fields: dict[str, object]) -> RequestError:
    """The RequestError parsing these fields raises (the test fails when there is none)."""
    request = parse_request({"v": 1, "id": 9, "op": op, "paths": [], **fields})
    with pytest.raises(RequestError) as caught:
        if op in ("prefetch", "prefetch_blocks"):
            parse_warm_options(request, 4096, 1 << 20)
        else:
            parse_inspect_options(request, 4096, 1 << 20)
    return caught.value


@pytest.mark.parametrize(
    ("op", "field", "value", "range_text"),
    [
        *[(op, "deadline_ms", v, "[0, 86400000]") for op in ("prefetch", "prefetch_blocks")
          for v in [*HUGE, 86_400_001, *NOT_INTEGERS]],
        *[("prefetch", "deadline_unix_ms", v, "CLOCK_REALTIME ms within 24 h")
          for v in [*HUGE, 0, 1_700_000_000, *NOT_INTEGERS]],  # 0, and seconds for ms
        *[(op, "timeout_ms", v, "[0, 86400000]") for op in ("prefetch", "check", "evict")
          for v in [*HUGE, 86_400_001, *NOT_INTEGERS]],
        *[(op, "read_bytes", v, "[1, 1048576]") for op in ("prefetch", "check")
          for v in [0, (1 << 20) + 1, *HUGE, *NOT_INTEGERS]],
        *[("prefetch", "max_failures", v, "[0, 4294967295]")
          for v in [2**32, 2**64 - 1, *NOT_INTEGERS]],
    ],
)
def test_a_number_out_of_its_range_is_a_bad_request_naming_field_and_range(
    op: str, field: str, value: object, range_text: str
) -> None:
    error = refusal(op, {field: value})
    assert error.code == BAD_REQUEST and error.request_id == 9
    assert error.message.startswith(f"{field}: expected an integer in [") and range_text in \
        error.message, error.message
    assert len(error.message) < 300  # a refused value is named by its type, never echoed whole


def test_a_refused_string_is_not_echoed() -> None:
    error = refusal("prefetch", {"timeout_ms": "x" * 100_000})
    assert error.message.endswith("got a string")


@pytest.mark.parametrize(
    ("field", "value"),
    [("deadline_ms", 0), ("deadline_ms", 86_400_000), ("timeout_ms", 0),
     ("timeout_ms", 86_400_000), ("max_failures", 0), ("max_failures", 2**32 - 1),
     ("read_bytes", 1), ("read_bytes", 1 << 20)],
)
def test_the_ends_of_each_range_are_served(field: str, value: int) -> None:
    request = parse_request({"v": 1, "id": 1, "op": "prefetch", "paths": [], field: value})
    options = parse_warm_options(request, 4096, 1 << 20, max_failures_listed=50)
    assert options.max_failures <= 50


def test_deadline_unix_ms_is_served_within_a_day_either_side() -> None:
    now_ms = int(time.time() * 1000)
    arrived = time.monotonic()
    for offset in (-DAY_MS + 5_000, -1, 0, 1_000, DAY_MS - 5_000):
        deadline = deadline_of({"deadline_unix_ms": now_ms + offset}, 1, 0, arrived)
        assert deadline == pytest.approx(max(arrived + offset / 1000, 1e-9), abs=1.0)
    for offset in (-DAY_MS - 5_000, DAY_MS + 5_000):
        with pytest.raises(RequestError):
            deadline_of({"deadline_unix_ms": now_ms + offset}, 1, 0, arrived)


def test_both_deadline_forms_are_refused_together() -> None:
    with pytest.raises(RequestError) as caught:
        deadline_of({"deadline_ms": 5, "deadline_unix_ms": int(time.time() * 1000)}, 1, 0, 0.0)
    assert "give one" in caught.value.message


@pytest.mark.parametrize(
    ("deadline", "expected"),
    [(0.0, 0), (-1.0, 0), (math.nan, 0), (1.5, 1_500_000_000),
     (2.0**44 / 1000, None), (1e300, None), (math.inf, None)],  # 2**44 ms: issue 23's
)
def test_the_native_deadline_is_clamped_into_int64(deadline: float, expected: int | None) -> None:
    """The backstop behind the edge: whatever reaches a worker fits its int64 field."""
    ns = deadline_ns(deadline)
    assert 0 <= ns <= (1 << 63) - 1
    if expected is not None:
        assert ns == expected
    else:
        assert ns > 9 * 10**18  # as good as never
