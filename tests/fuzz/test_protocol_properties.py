"""Properties of framing and request decoding, for any input hypothesis can think of.

The corpus (tests/corpus/frames) and the 100k-frame mutation fuzz (test_bad_frames.py)
check named bad inputs and near misses of valid ones against the real daemon; these
properties state the contract for *every* input and let hypothesis search for a
counterexample, in-process (protocol_target.py) so a few thousand examples take seconds:
- framing: any bytes, cut anywhere, give the frames a stateless reference finds;
- decoding: any bytes give a map or `bad_request`, nothing else;
- requests: any msgpack value, and any map shaped like a request with any value in
  any field, get one reply with a documented code (never `internal`) and their id;
- valid requests round-trip through framing and decoding and are answered `ok`,
  their path counts balancing and agreeing with an independent confinement oracle;
- every limit holds exactly at its boundary: the limit passes, one more is refused.

Runs derandomized with a modest example count so CI is repeatable and quick;
KVP_FUZZ_EXAMPLES=20000 searches harder (the seed still fixed: set KVP_FUZZ_RANDOM=1
for a fresh one).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvharness.wire import frame
from kvprefetchd.protocol import (
    BAD_REQUEST,
    OPS,
    Frame,
    FrameReader,
    Limits,
    RequestError,
    decode_payload,
    encode_frame,
    parse_request,
)
from kvprefetchd.request_fields import DAY_MS, MAX_DEADLINE_MS, MAX_FAILURES_ASKED, MAX_TIMEOUT_MS
from kvprefetchd.roots.confine import Roots
from protocol_target import (
    ROOT,
    SMALL_LIMITS,
    InProcessSupervisor,
    chunked,
    reference_frames,
    usable_id,
)

EXAMPLES = int(os.environ.get("KVP_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=os.environ.get("KVP_FUZZ_RANDOM") != "1",
    deadline=None,  # a shared 2-CPU machine: time is not the property
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
LIMITS = Limits(max_frame_bytes=SMALL_LIMITS["max_frame_bytes"],
                max_paths=SMALL_LIMITS["max_paths_per_request"],
                max_path_bytes=SMALL_LIMITS["max_path_bytes"])


@pytest.fixture(scope="module")
def target() -> Iterator[InProcessSupervisor]:
    instance = InProcessSupervisor(**SMALL_LIMITS)
    yield instance
    assert instance.internal_errors() == 0, instance.supervisor.ops.requests
    instance.close()


# ---- strategies ----------------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats() | st.text(max_size=12) | st.binary(max_size=12))
VALUES = st.recursive(
    SCALARS,
    lambda children: (st.lists(children, max_size=4)
                      | st.dictionaries(st.text(max_size=6), children, max_size=4)
                      | st.dictionaries(st.integers(-3, 3) | st.binary(max_size=3), children,
                                        max_size=2)),
    max_leaves=12,
)


def either(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value (so checks deep inside an op are reached), else anything."""
    return plausible | plausible | VALUES


NAMES = st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=12)
PATHS = st.one_of(
    NAMES.map(lambda t: f"{ROOT}/{t}"),
    st.lists(st.sampled_from(["a", "..", ".", "", "x.bin", "\0", "é", "\uff41"]), max_size=5)
      .map(lambda parts: ROOT + "/" + "/".join(parts)),
    st.binary(max_size=12).map(lambda b: ROOT.encode() + b"/" + b),
    st.text(max_size=300).map(lambda t: f"{ROOT}/{t}"),
    st.text(max_size=12), st.binary(max_size=12), VALUES,
)
HASH = st.fixed_dictionaries(
    {"algo": either(st.sampled_from(["sha256_cbor", "sha256"])),
     "block_size": either(st.sampled_from([16, 1, 2**64 - 1, 0]))},
    optional={"python_hash_seed": either(st.sampled_from(["0", "random", None])),
              "vllm_version": either(st.sampled_from(["0.23.0", "0.9.0", "0.10.2", "1"])),
              "hash_block_size_tokens": either(st.integers(0, 64))},
)
LAYOUT = st.fixed_dictionaries(
    {"root_dir": either(st.sampled_from([ROOT, ROOT + "/", "/elsewhere", "rel"])),
     "model_name": either(st.sampled_from(["org/model", "", "../x", "a/../../b"])),
     "kv_cache_groups": either(st.lists(st.fixed_dictionaries(
         {"block_size": either(st.sampled_from([16, 32]))},
         optional={"layer_names": either(st.lists(st.text(max_size=4), max_size=2))}),
         max_size=3))},
    optional={"tp_size": either(st.integers(-1, 4) | st.just(2**40)),
              "pp_size": either(st.integers(0, 3)), "pcp_size": either(st.integers(0, 3)),
              "dcp_size": either(st.integers(0, 3)), "dtype": either(st.just("bfloat16")),
              "connector_block_size_tokens": either(st.sampled_from([16, 32, 256, 0, 7])),
              "fingerprint": either(st.sampled_from(["0123456789ab", "discover", "XYZ"])),
              "parallel_agnostic": either(st.booleans())},
)
PROMPT = st.fixed_dictionaries(
    {"token_ids": either(st.lists(st.integers(0, 2**64 - 1) | st.integers(-1, 1), max_size=70))},
    optional={"cache_salt": either(st.text(max_size=4) | st.none()),
              "lora": either(st.none() | st.fixed_dictionaries(
                  {"name": either(st.text(max_size=4))},
                  optional={"path": either(st.text(max_size=4))})),
              "mm_features": either(st.lists(st.fixed_dictionaries(
                  {"identifier": either(st.text(max_size=4)),
                   "offset": either(st.integers(-1, 80) | st.just(2**63)),
                   "length": either(st.integers(0, 80) | st.just(2**63))}), max_size=3)),
              "explicit_extra_keys": either(st.lists(st.none() | st.lists(VALUES, max_size=2),
                                                     max_size=5))},
)
REQUESTS = st.fixed_dictionaries(
    {"v": either(st.just(1)), "id": either(st.integers(0, 2**64 - 1)),
     "op": either(st.sampled_from(OPS))},
    optional={
        "paths": either(st.lists(PATHS, max_size=8)),
        "wait": either(st.booleans()),
        "read_bytes": either(st.integers(-1, SMALL_LIMITS["max_read_bytes"] + 1)),
        "timeout_ms": either(st.integers(-1, 2**64 - 1)),
        "deadline_ms": either(st.integers(-1, 2**64 - 1)),
        "deadline_unix_ms": either(st.integers(-1, 2**64 - 1)),
        "max_failures": either(st.integers(-1, 2**64 - 1)),
        "model": either(st.text(max_size=4)),
        "hash": either(HASH),
        "layout": either(LAYOUT),
        "prompts": either(st.lists(PROMPT, max_size=5)),
        "block_hashes": either(st.lists(st.lists(st.binary(min_size=31, max_size=33),
                                                 max_size=4), max_size=5)),
        "token_ids": either(st.lists(st.integers(0, 9), max_size=40)),
        "request": either(PROMPT),
        "root_dir": either(st.just(ROOT)),
    },
)


# ---- framing -------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=200) | st.lists(st.binary(max_size=24), max_size=6).map(
    lambda bodies: b"".join(frame(b) for b in bodies)),
    st.lists(st.integers(0, 220), max_size=12), st.integers(0, 32))
def test_any_bytes_cut_anywhere_give_the_reference_frames(
    data: bytes, cuts: list[int], max_frame: int
) -> None:
    reader = FrameReader(max_frame)
    got: list[Frame] = []
    for piece in chunked(data, cuts):
        got += reader.feed(piece)  # never raises: the reader has no error of its own
    assert [f.payload for f in got] == reference_frames(data, max_frame)
    assert all(f.skipped_bytes > max_frame for f in got if f.payload is None)
    assert 0 <= reader.buffered <= len(data)


@FUZZ
@given(st.lists(st.binary(max_size=40) | st.integers(41, 200), max_size=8),
       st.lists(st.integers(0, 2000), max_size=20))
def test_frames_and_oversized_ones_in_any_chunking_keep_the_stream_in_step(
    items: list[bytes | int], cuts: list[int]
) -> None:
    """Oversized frames (ints: a body that long) are skipped; every other body comes back."""
    stream = b"".join(frame(i) if isinstance(i, bytes) else frame(b"\xc1" * i) for i in items)
    reader = FrameReader(40)
    got: list[Frame] = []
    for piece in chunked(stream, cuts):
        got += reader.feed(piece)
    assert [f.payload if f.payload is not None else f.skipped_bytes for f in got] == items
    assert reader.buffered == 0


# ---- decoding ------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=300) | VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_any_payload_decodes_to_a_map_or_a_bad_request(payload: bytes) -> None:
    try:
        message = decode_payload(payload, LIMITS)
    except RequestError as error:
        assert error.code == BAD_REQUEST and error.message
    else:
        assert isinstance(message, dict)


# ---- requests through the supervisor's own read path ---------------------------------------


@FUZZ
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=6))
def test_any_bytes_on_the_connection_get_one_documented_reply_per_frame(
    target: InProcessSupervisor, data: bytes, cuts: list[int]
) -> None:
    target.reset_stream()
    try:
        target.stream(data, cuts)
    finally:
        target.reset_stream()  # arbitrary bytes may leave the connection mid-frame or mid-skip


@FUZZ
@given(VALUES)
def test_any_msgpack_value_as_a_request_gets_a_documented_reply(
    target: InProcessSupervisor, value: Any
) -> None:
    reply = target.request(value)
    if not isinstance(value, dict):
        assert reply["error"]["code"] == BAD_REQUEST


@FUZZ
@given(REQUESTS)
def test_any_request_shaped_map_gets_a_documented_reply(
    target: InProcessSupervisor, message: dict[str, Any]
) -> None:
    reply = target.request(message)
    if not reply["ok"]:
        return
    op = message["op"]
    assert message["v"] == 1 and op in OPS and usable_id(message) is not None
    if op in ("prefetch", "prefetch_blocks"):
        counts = [reply[k] for k in ("accepted", "dropped", "rejected")]
        assert all(isinstance(n, int) and n >= 0 for n in counts), reply
        expected = len(message["paths"]) if op == "prefetch" else reply["files"]
        assert sum(counts) == expected, (message, reply)
        if message.get("wait") is True:
            assert sum(reply["outcomes"].values()) == reply["accepted"], reply
    elif op == "resolve":
        assert isinstance(reply["paths"], list) and isinstance(reply["block_hashes"], list)
    elif op == "ping":
        assert reply["protocol"] == 1


# ---- valid requests: round trip and an independent confinement oracle ----------------------


def oracle_inside(path: Any, root: str = ROOT, max_bytes: int = LIMITS.max_path_bytes) -> bool:
    """Is this path placed under the root? Stated from the contract, not from confine.py."""
    if isinstance(path, str):
        raw = path.encode()
    elif isinstance(path, bytes):
        raw = path
    else:
        return False
    prefix = root.encode() + b"/"
    if len(raw) > max_bytes or b"\0" in raw or not raw.startswith(prefix):
        return False
    relative = raw[len(prefix):].lstrip(b"/")
    return bool(relative) and b".." not in relative.split(b"/")


VALID_PATHS = st.lists(st.one_of(
    st.lists(NAMES, min_size=1, max_size=4).map(lambda parts: ROOT + "/" + "/".join(parts)),
    st.binary(max_size=16).map(lambda b: ROOT.encode() + b"/" + b),
    st.text(max_size=8).map(lambda t: "/elsewhere/" + t),
    st.text(alphabet="é/.a", max_size=130).map(lambda t: f"{ROOT}/{t}"),
), max_size=SMALL_LIMITS["max_paths_per_request"])
VALID_REQUESTS = st.one_of(
    st.fixed_dictionaries({"op": st.sampled_from(["ping", "stats"])}),
    st.fixed_dictionaries(
        {"op": st.just("prefetch"), "paths": VALID_PATHS},
        optional={"wait": st.booleans(), "timeout_ms": st.integers(0, MAX_TIMEOUT_MS),
                  "deadline_ms": st.integers(0, MAX_DEADLINE_MS),
                  "max_failures": st.integers(0, MAX_FAILURES_ASKED),
                  "read_bytes": st.integers(1, SMALL_LIMITS["max_read_bytes"])}),
    st.fixed_dictionaries(
        {"op": st.just("resolve"),
         "hash": st.just({"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
                          "vllm_version": "0.23.0"}),
         "layout": st.just({"root_dir": ROOT, "model_name": "org/model",
                            "kv_cache_groups": [{"block_size": 16}],
                            "connector_block_size_tokens": 32, "fingerprint": "0123456789ab"}),
         "prompts": st.lists(st.fixed_dictionaries(
             {"token_ids": st.lists(st.integers(0, 2**64 - 1), max_size=60)},
             optional={"cache_salt": st.text(max_size=4)}), min_size=1, max_size=4)}),
).flatmap(lambda body: st.integers(0, 2**64 - 1).map(lambda rid: {"v": 1, "id": rid, **body}))


@FUZZ
@given(VALID_REQUESTS, st.lists(st.integers(0, 4000), max_size=8))
def test_valid_requests_round_trip_and_are_answered_ok(
    target: InProcessSupervisor, message: dict[str, Any], cuts: list[int]
) -> None:
    encoded = encode_frame(message)
    frames = list(_feed_all(encoded, cuts))
    assert len(frames) == 1 and frames[0].payload is not None
    decoded = decode_payload(frames[0].payload, LIMITS)
    assert decoded == message
    request = parse_request(decoded)
    assert (request.request_id, request.op) == (message["id"], message["op"])
    reply = target.request(message)
    assert reply["ok"] is True, reply
    if message["op"] == "prefetch":
        paths = message["paths"]
        inside = sum(oracle_inside(p) for p in paths)
        assert reply["rejected"] == len(paths) - inside, (paths, reply)
        assert reply["accepted"] + reply["dropped"] == inside
    if message["op"] == "resolve":
        blocks = [len(p["token_ids"]) // 16 for p in message["prompts"]]
        assert [len(chain) for chain in reply["block_hashes"]] == blocks


def _feed_all(data: bytes, cuts: list[int]) -> Iterator[Frame]:
    reader = FrameReader(1 << 20)
    for piece in chunked(data, cuts):
        yield from reader.feed(piece)


@FUZZ
@given(st.one_of(PATHS, st.text(alphabet="/.a\0é", max_size=40).map(lambda t: ROOT + t),
                 st.text(alphabet="é", min_size=100, max_size=140).map(lambda t: f"{ROOT}/{t}")))
def test_confinement_agrees_with_the_oracle(path: Any) -> None:
    placed = Roots((ROOT,), LIMITS.max_path_bytes).place(path)
    assert isinstance(placed, tuple) == oracle_inside(path), (path, placed)
    if isinstance(placed, tuple):
        raw = path.encode() if isinstance(path, str) else path
        assert raw.endswith(placed[1]) and placed[1] and not placed[1].startswith(b"/")


# ---- limits, exactly at the boundary -------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 1, 64, 4096])
def test_a_frame_of_exactly_the_limit_is_read_and_one_byte_more_is_skipped(limit: int) -> None:
    reader = FrameReader(limit)
    frames = list(reader.feed(frame(b"x" * limit) + frame(b"y" * (limit + 1)) + frame(b"")))
    assert [f.payload for f in frames] == [b"x" * limit, None, b""]
    assert frames[1].skipped_bytes == limit + 1


def test_the_supervisor_answers_too_large_exactly_above_max_frame_bytes(
    target: InProcessSupervisor,
) -> None:
    limit = SMALL_LIMITS["max_frame_bytes"]
    pad = limit
    while True:  # the str header grows with the pad: converge on a body of exactly `limit`
        padded = msgpack.packb({"v": 1, "id": 7, "op": "ping", "pad": "p" * pad})
        if len(padded) == limit:
            break
        pad += limit - len(padded)
    assert len(padded) == limit
    target.reset_stream()
    at_limit = target.stream(frame(padded))
    over = target.stream(frame(padded + b"\xc0"))
    assert at_limit[0]["ok"] is True and at_limit[0]["id"] == 7
    assert over[0]["error"]["code"] == "too_large" and over[0]["id"] is None


@pytest.mark.parametrize(("shape", "limit"), [("array", LIMITS.max_paths), ("map", 1024)])
def test_arrays_and_maps_are_decoded_up_to_their_limit_exactly(shape: str, limit: int) -> None:
    def make(n: int) -> bytes:
        if shape == "array":
            return msgpack.packb({"paths": [0] * n})
        return msgpack.packb({"m": {str(i): 0 for i in range(n)}})

    assert decode_payload(make(limit), LIMITS)
    with pytest.raises(RequestError) as caught:
        decode_payload(make(limit + 1), LIMITS)
    assert caught.value.code == BAD_REQUEST


def paths_of_length(n: int, unit: str) -> str:
    """An absolute path under ROOT of exactly n UTF-8 bytes, built of `unit` characters."""
    head = ROOT + "/"
    room = n - len(head.encode())
    width = len(unit.encode())
    return head + unit * (room // width) + "a" * (room % width)


@pytest.mark.parametrize("unit", ["a", "é", "€", "😀"], ids=["1-byte", "2-byte", "3-byte",
                                                             "4-byte"])
@pytest.mark.parametrize("as_bytes", [False, True], ids=["str", "bin"])
def test_max_path_bytes_counts_bytes_exactly(unit: str, as_bytes: bool) -> None:
    limit = LIMITS.max_path_bytes
    roots = Roots((ROOT,), limit)
    at, over = paths_of_length(limit, unit), paths_of_length(limit + 1, unit)
    assert len(at.encode()) == limit and len(over.encode()) == limit + 1
    if as_bytes:
        assert isinstance(roots.place(at.encode()), tuple)
        assert roots.place(over.encode()) == "too_long"
    else:
        assert isinstance(roots.place(at), tuple)
        assert roots.place(over) == "too_long"


def base_request(op: str, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "id": 42, "op": op, **fields}


def test_paths_per_request_and_read_bytes_hold_at_their_boundary(
    target: InProcessSupervisor,
) -> None:
    most = SMALL_LIMITS["max_paths_per_request"]
    paths = [f"{ROOT}/{i}.bin" for i in range(most)]
    reply = target.request(base_request("prefetch", paths=paths))
    assert reply["ok"] and reply["accepted"] + reply["dropped"] == most
    refused = target.request(base_request("prefetch", paths=[*paths, f"{ROOT}/x.bin"]))
    assert refused["error"]["code"] == "too_large" and refused["id"] == 42, refused
    biggest = SMALL_LIMITS["max_read_bytes"]
    assert target.request(base_request("prefetch", paths=[], read_bytes=biggest))["ok"]
    too_big = target.request(base_request("prefetch", paths=[], read_bytes=biggest + 1))
    assert too_big["error"]["code"] == "bad_request"
    assert target.request(base_request("prefetch", paths=[], wait=True, timeout_ms=0))["ok"]
    negative = target.request(base_request("prefetch", paths=[], timeout_ms=-1))
    assert negative["error"]["code"] == "bad_request"


KV = {"hash": {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
               "vllm_version": "0.23.0"},
      "layout": {"root_dir": ROOT, "model_name": "org/model", "kv_cache_groups": [
          {"block_size": 16}], "connector_block_size_tokens": 16,
          "fingerprint": "0123456789ab"}}


@pytest.mark.parametrize("op", ["resolve", "prefetch_blocks"])
def test_prompts_and_tokens_hold_at_their_boundary(target: InProcessSupervisor, op: str) -> None:
    most_prompts, most_tokens = SMALL_LIMITS["max_prompts"], SMALL_LIMITS["max_tokens"]
    one = {"token_ids": [1] * 16}
    assert target.request(base_request(op, **KV, prompts=[one] * most_prompts))["ok"]
    refused = target.request(base_request(op, **KV, prompts=[one] * (most_prompts + 1)))
    assert refused["error"]["code"] == "too_large", refused
    # One prompt of exactly max_tokens: more tokens than max_paths_per_request (64), which
    # bounds the path array, not a prompt's token array.
    at = target.request(base_request(op, **KV, prompts=[{"token_ids": [1] * most_tokens}]))
    assert at["ok"], at
    split = [{"token_ids": [1] * (most_tokens // 2)}, {"token_ids": [1] * (most_tokens // 2 + 1)}]
    over = target.request(base_request(op, **KV, prompts=split))
    assert over["error"]["code"] == "too_large" and over["id"] == 42, over
    # One array longer than any op takes is refused while decoding, before its id is read.
    huge = target.request(base_request(op, **KV, prompts=[{"token_ids": [1] * (most_tokens + 1)}]))
    assert huge["error"]["code"] == "bad_request" and huge["id"] is None, huge


def test_a_frame_cut_at_every_byte_is_answered_once() -> None:
    target = InProcessSupervisor(**SMALL_LIMITS)
    try:
        body = msgpack.packb(base_request("prefetch", paths=[f"{ROOT}/a", "/etc/passwd"]))
        data = frame(body) * 2
        replies = target.exchange(data, range(len(data)))
        assert [r["rejected"] for r in replies] == [1, 1]
    finally:
        target.close()



# ---- numeric fields: served inside their documented range, refused naming it outside -------

# docs/protocol.md, "Numeric fields": (low, high) per field, by the op that reads it.
NUMERIC_RANGES = {
    "read_bytes": (1, SMALL_LIMITS["max_read_bytes"]),
    "timeout_ms": (0, MAX_TIMEOUT_MS),
    "deadline_ms": (0, MAX_DEADLINE_MS),
    "max_failures": (0, MAX_FAILURES_ASKED),
}
NUMERIC_FIELDS = {"prefetch": ("read_bytes", "timeout_ms", "deadline_ms", "deadline_unix_ms",
                               "max_failures"),
                  "check": ("read_bytes", "timeout_ms")}
NUMBERS = (st.integers(-(2**63), 2**64 - 1) | st.sampled_from(
    [0, 1, -1, DAY_MS, DAY_MS + 1, 2**32 - 1, 2**32, 2**44, 2**63 - 1, 2**64 - 1])
    | st.floats() | st.booleans() | st.text(max_size=3))


@FUZZ
@given(st.sampled_from(["prefetch", "check"]),
       st.sampled_from([*NUMERIC_RANGES, "deadline_unix_ms"]), NUMBERS, st.booleans())
def test_a_number_is_served_inside_its_range_and_refused_naming_it_outside(
    target: InProcessSupervisor, op: str, name: str, value: Any, near_now: bool
) -> None:
    if name == "deadline_unix_ms" and near_now and type(value) is int:
        value = int(time.time() * 1000) + value % (2 * DAY_MS - 20_000) - DAY_MS + 10_000
    reply = target.request({"v": 1, "id": 5, "op": op, "paths": [f"{ROOT}/a"], name: value})
    if name not in NUMERIC_FIELDS[op]:
        assert reply["ok"], reply  # a key the op does not use is ignored
        return
    if name == "deadline_unix_ms":
        now = time.time() * 1000
        inside = type(value) is int and abs(value - now) < DAY_MS - 5_000
        outside = type(value) is not int or abs(value - now) > DAY_MS + 5_000
    else:
        low, high = NUMERIC_RANGES[name]
        inside = type(value) is int and low <= value <= high
        outside = not inside
    if inside:
        assert reply["ok"], reply
    elif outside:
        assert reply["error"]["code"] == BAD_REQUEST and reply["id"] == 5, reply
        assert reply["error"]["message"].startswith(f"{name}: expected an integer in ["), reply
