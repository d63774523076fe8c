"""Framing, limits, request builders and reply parsing: no sockets."""

from __future__ import annotations

import os
import pathlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharness.wire import HEADER, frame
from kvprefetch import protocol, results
from kvprefetch.errors import ProtocolError, ServerError
from kvprefetch.protocol import ErrorCode, FrameBuffer, Outcome

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=50)
    | st.binary(max_size=50)
)
keys = st.text(max_size=20) | st.integers(min_value=-(2**63), max_value=2**64 - 1)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=30,
)
messages = st.dictionaries(keys, values, max_size=8)


@given(messages)
def test_any_map_survives_a_frame_round_trip(message: dict[object, object]) -> None:
    assert protocol.decode_frame(protocol.encode_frame(message)) == message


@given(messages, st.data())
def test_every_truncated_frame_raises(message: dict[object, object], data: st.DataObject) -> None:
    frame = protocol.encode_frame(message)
    cut = data.draw(st.integers(min_value=0, max_value=len(frame) - 1))
    with pytest.raises(ProtocolError, match="truncated"):
        protocol.decode_frame(frame[:cut])


@settings(max_examples=50)  # byte-by-byte feeding is slow; the other properties cover values
@given(st.lists(messages, min_size=1, max_size=4), st.integers(min_value=1, max_value=7))
def test_frame_buffer_reassembles_any_chunking(
    batch: list[dict[object, object]], chunk: int
) -> None:
    stream = b"".join(protocol.encode_frame(m) for m in batch)
    buffer = FrameBuffer()
    decoded = []
    for start in range(0, len(stream), chunk):
        buffer.feed(stream[start : start + chunk])
        while (message := buffer.pop()) is not None:
            decoded.append(message)
    assert decoded == batch
    assert buffer.pending == 0


@given(st.binary(max_size=200))
def test_garbage_payload_decodes_to_a_map_or_raises_protocol_error(payload: bytes) -> None:
    try:
        message = protocol.decode_payload(payload)
    except ProtocolError:
        return
    assert isinstance(message, dict)


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (msgpack.packb([1, 2]), "not a map"),
        (msgpack.packb("hello"), "not a map"),
        (msgpack.packb({"a": 1}) + msgpack.packb({"b": 2}), "more than one"),
        (b"\xc1", "undecodable"),  # 0xc1 is never used in msgpack
        (msgpack.packb({"t": msgpack.ExtType(1, b"x")}), "undecodable"),  # v1 has no ext
        (b"\x81\xa1a\xdb\xff\xff\xff\xff", "ends inside"),  # a str claiming 4 GiB
        (b"", "ends inside"),
    ],
)
def test_bad_payloads_are_protocol_errors(payload: bytes, error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        protocol.decode_frame(frame(payload))


def test_strings_beyond_the_explicit_limit_are_refused() -> None:
    payload = msgpack.packb({"s": "x" * (protocol.MAX_STR_BYTES + 1)})
    with pytest.raises(ProtocolError, match="undecodable"):
        protocol.decode_payload(payload)
    protocol.decode_payload(msgpack.packb({"s": "x" * protocol.MAX_STR_BYTES}))


def test_a_length_prefix_above_the_limit_is_refused_before_buffering() -> None:
    buffer = FrameBuffer(max_frame=1000)
    buffer.feed(HEADER.pack(1001))
    with pytest.raises(ProtocolError, match="above the 1000 limit"):
        buffer.pop()


def test_bytes_after_a_frame_are_refused() -> None:
    with pytest.raises(ProtocolError, match="after the frame"):
        protocol.decode_frame(protocol.encode_frame({"a": 1}) + b"\x00")


def test_encode_refuses_frames_the_daemon_would_refuse() -> None:
    with pytest.raises(ValueError, match="frame limit"):
        protocol.encode_frame({"p": "x" * 100}, max_frame=50)


def test_str_goes_out_as_msgpack_str_and_bytes_as_bin() -> None:
    frame = protocol.encode_frame({"paths": ["/a", b"/b"]})
    assert b"\xa2/a" in frame  # fixstr of length 2
    assert b"\xc4\x02/b" in frame  # bin8 of length 2
    assert protocol.decode_frame(frame) == {"paths": ["/a", b"/b"]}


# --- request builders ---------------------------------------------------------------------


def test_prefetch_request_keeps_path_types_and_omits_unset_options() -> None:
    request = protocol.prefetch_request(["/a", b"/b\xff", pathlib.Path("/c")])
    assert request == {"op": "prefetch", "paths": ["/a", b"/b\xff", "/c"], "wait": False}


def test_surrogate_escaped_names_go_back_to_their_bytes() -> None:
    name = os.fsdecode(b"/kv/\xff\xfe.bin")  # how argv and os.listdir hand them over
    assert protocol.wire_path(name) == b"/kv/\xff\xfe.bin"
    assert protocol.wire_path("/kv/caf\u00e9") == "/kv/caf\u00e9"


def test_prefetch_request_options() -> None:
    request = protocol.prefetch_request(["/a"], wait=True, read_bytes=4096, timeout_ms=250)
    assert request["wait"] is True
    assert request["read_bytes"] == 4096
    assert request["timeout_ms"] == 250
    assert protocol.wait_allowance_s(request) == 0.25
    assert protocol.wait_allowance_s(protocol.prefetch_request(["/a"])) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"paths": "/one/path"}, TypeError),
        ({"paths": b"/one/path"}, TypeError),
        ({"paths": pathlib.Path("/one/path")}, TypeError),
        ({"paths": ["/a"], "timeout_ms": 10}, ValueError),  # without wait
        ({"paths": ["/a"], "read_bytes": -1}, ValueError),
        ({"paths": ["/a"], "read_bytes": True}, ValueError),
        ({"paths": ["/a"], "wait": 1}, TypeError),
    ],
)
def test_prefetch_request_refuses_misuse(kwargs: dict[str, object], error: type) -> None:
    with pytest.raises(error):
        protocol.prefetch_request(**kwargs)  # type: ignore[arg-type]


def test_stamp_adds_the_envelope_and_guards_it() -> None:
    assert protocol.stamp({"op": "ping"}, 7) == {"v": 1, "id": 7, "op": "ping"}
    with pytest.raises(ValueError, match="op"):
        protocol.stamp({}, 1)
    with pytest.raises(ValueError, match="id"):
        protocol.stamp({"op": "ping", "id": 3}, 1)


def test_kv_requests_pass_fields_through_but_not_envelope_keys() -> None:
    kv = {"model": "m", "block_hashes": [[b"\x00" * 32]]}
    request = protocol.prefetch_blocks_request(kv, wait=True)
    assert request == {**kv, "op": "prefetch_blocks", "wait": True}
    assert protocol.resolve_request(kv) == {**kv, "op": "resolve"}
    with pytest.raises(ValueError, match="op"):
        protocol.resolve_request({"op": "stats"})


# --- replies ------------------------------------------------------------------------------


def test_check_reply_maps_errors_to_server_error() -> None:
    assert protocol.check_reply({"id": 1, "ok": True}) == {"id": 1, "ok": True}
    error = {"id": 4, "ok": False, "error": {"code": "overloaded", "message": "queue full"}}
    with pytest.raises(ServerError) as info:
        protocol.check_reply(error)
    assert (info.value.code, info.value.message, info.value.request_id) == (
        "overloaded",
        "queue full",
        4,
    )
    assert info.value.code == ErrorCode.OVERLOADED
    with pytest.raises(ProtocolError):
        protocol.check_reply({"id": 1})
    with pytest.raises(ProtocolError):
        protocol.check_reply({"id": 1, "ok": False})


def test_names_match_protocol_md() -> None:
    assert {o.value for o in Outcome} == {
        "read",
        "resident",
        "missing",
        "dropped",
        "rejected",
        "failed",
        "expired",
        "futile",
    }
    assert {c.value for c in ErrorCode} == {
        "bad_request",
        "unsupported_version",
        "unknown_op",
        "too_large",
        "forbidden",
        "overloaded",
        "internal",
    }


def test_reply_parsing_names_the_bad_field() -> None:
    with pytest.raises(ProtocolError, match="'dropped'"):
        results.parse_prefetch({"accepted": 1, "rejected": 0})
    with pytest.raises(ProtocolError, match="'workers'"):
        results.parse_ping({"version": "1", "protocol": 1, "engine": "pread", "workers": True})
    with pytest.raises(ProtocolError, match="outcomes"):
        results.parse_prefetch({"accepted": 1, "dropped": 0, "rejected": 0, "outcomes": [1]})


def test_merge_sums_counts_and_takes_the_longest_wait() -> None:
    merged = results.merge_prefetch(
        [
            results.PrefetchResult(2, 0, 1, {"read": 2}, 300),
            results.PrefetchResult(3, 1, 0, {"read": 1, "missing": 2}, 500),
        ]
    )
    assert merged == results.PrefetchResult(5, 1, 1, {"read": 3, "missing": 2}, 500, None)
    assert results.merge_prefetch([results.PrefetchResult(1, 0, 0)]).outcomes is None
