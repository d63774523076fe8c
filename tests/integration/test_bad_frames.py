"""Bad input against the real daemon: a named corpus of malformed frames, then a
mutation fuzz of 100,000 frames. Every frame is answered (or, for a frame whose
length alone is too large, the connection is kept in step), no worker dies, and
the daemon goes on serving."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest

from kvharness.daemon import Daemon
from kvharness.wire import RawConnection, frame, pack

CORPUS = Path(__file__).parent.parent / "corpus" / "frames"
CODES = {"bad_request", "unsupported_version", "unknown_op", "too_large", "forbidden",
         "overloaded", "internal"}


@dataclass(frozen=True)
class Expect:
    """What the daemon answers a corpus frame (docs/protocol.md, "Errors" and "Limits")."""

    breaks: str  # what the frame breaks, in words
    code: str | None  # the error code; None: answered ok (what it breaks is refused per path)
    id: int | None  # the id the reply carries: None when the frame has no usable one
    rejected: int = 0  # ok replies: paths refused by the supervisor
    stream_goes_on: bool = True  # the same connection answers the next request


UNDECODABLE = "bad_request"  # not one msgpack value: answered with id nil
EXPECTED: dict[str, Expect] = {
    "array-not-map": Expect("the request is an array, not a map", "bad_request", None),
    "string-not-map": Expect("the request is a string, not a map", "bad_request", None),
    "bool-id": Expect("id is true, not an unsigned integer", "bad_request", None),
    "missing-id": Expect("no id", "bad_request", None),
    "negative-id": Expect("id is -1", "bad_request", None),
    "huge-id": Expect("nothing: id 2^64-1 is a valid unsigned integer, echoed", None,
                      2**64 - 1),
    "missing-version": Expect("no v", "bad_request", 1),
    "version-2": Expect("v is 2", "unsupported_version", 1),
    "op-not-string": Expect("op is an integer", "bad_request", 1),
    "unknown-op": Expect("op names no operation", "unknown_op", 1),
    "empty-frame": Expect("a frame of zero bytes", UNDECODABLE, None),
    "truncated-array": Expect("an array that ends early", UNDECODABLE, None),
    "reserved-byte-0xc1": Expect("msgpack's never-used byte", UNDECODABLE, None),
    "two-values-in-one-frame": Expect("two msgpack values in one frame", UNDECODABLE, None),
    "ext-type": Expect("an ext value (v1 has none)", UNDECODABLE, None),
    "map-key-int": Expect("an integer map key", UNDECODABLE, None),
    "non-utf8-str": Expect("a str that is not UTF-8", UNDECODABLE, None),
    # 5,000 levels: msgpack's own decoder gives up before the depth check can read the
    # id, so it is undecodable (bad_request, id nil), not too_large like 22 levels.
    "deep-nesting": Expect("5,000 nested arrays", UNDECODABLE, None),
    "nested-deeper-than-the-limit": Expect("22 levels against max_nesting_depth 16",
                                           "too_large", 7),
    # The header alone announces 17 MiB against the 16 MiB limit: answered at once, and
    # the daemon then skips the 17 MiB it announced, so what follows on this connection
    # is swallowed (test_daemon.py sends the body and sees the connection go on).
    "oversized-length-header": Expect("a length above max_frame_bytes", "too_large", None,
                                      stream_goes_on=False),
    "paths-not-array": Expect("paths is a string", "bad_request", 1),
    "paths-of-ints": Expect("paths holds integers: each one refused", None, 1, rejected=3),
    "nul-in-path": Expect("a NUL byte inside a path: refused", None, 1, rejected=1),
    "very-long-path": Expect("a path longer than max_path_bytes: refused", None, 1,
                             rejected=1),
    "wait-not-bool": Expect("wait is a string", "bad_request", 1),
    "read-bytes-zero": Expect("read_bytes 0", "bad_request", 1),
    "read-bytes-huge": Expect("read_bytes 2^62, above max_read_bytes", "bad_request", 1),
    "timeout-negative": Expect("timeout_ms -1", "bad_request", 1),
    # Numeric fields out of their range (docs/protocol.md, "Numeric fields"), issue 23: a
    # deadline of 2^44 ms once overflowed a worker's native field and killed it.
    "deadline-ms-2-44": Expect("deadline_ms 2^44, above a day", "bad_request", 1),
    "deadline-ms-float": Expect("deadline_ms 1.5, not an integer", "bad_request", 1),
    "deadline-ms-int64-max": Expect("deadline_ms 2^63-1", "bad_request", 1),
    "deadline-unix-ms-huge": Expect("deadline_unix_ms 2^64-1, not within a day of now",
                                    "bad_request", 1),
    "max-failures-huge": Expect("max_failures 2^64-1, above 2^32-1", "bad_request", 1),
    "timeout-ms-huge": Expect("a check's timeout_ms 2^64-1, above a day", "bad_request", 1),
    "prefetch-blocks-bad-hashes": Expect("prefetch_blocks naming a model that is not "
                                         "configured", "bad_request", 1),
    "resolve-no-profile": Expect("resolve with neither model nor hash and layout",
                                 "bad_request", 1),
    "resolve-unknown-model": Expect("resolve naming a model that is not configured",
                                    "bad_request", 1),
}


def check_reply(reply: dict[str, object]) -> None:
    assert set(reply) >= {"id", "ok"}, reply
    if reply["ok"] is False:
        error = reply["error"]
        assert isinstance(error, dict) and error["code"] in CODES and error["message"]


def test_every_corpus_frame_has_its_expected_answer() -> None:
    assert sorted(p.stem for p in CORPUS.glob("*.bin")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_corpus_frame_gets_its_answer_and_the_connection_lives(
    daemon: Daemon, name: str
) -> None:
    expect = EXPECTED[name]
    pids = daemon.worker_pids()
    connection = daemon.connect()
    connection.sock.sendall((CORPUS / f"{name}.bin").read_bytes())
    reply = connection.recv()
    check_reply(reply)
    assert reply["id"] == expect.id, (expect.breaks, reply)
    if expect.code is None:
        assert reply["ok"] is True, (expect.breaks, reply)
        assert reply.get("rejected", 0) == expect.rejected, (expect.breaks, reply)
    else:
        assert reply["ok"] is False and reply["error"]["code"] == expect.code, (
            expect.breaks, reply)
    if expect.stream_goes_on:
        assert connection.call("ping")["ok"], expect.breaks  # the same connection goes on
    connection.close()
    assert daemon.call("ping")["ok"]
    assert daemon.worker_pids() == pids


def valid_requests(root: Path) -> list[dict[str, object]]:
    return [
        {"v": 1, "id": 1, "op": "ping"},
        {"v": 1, "id": 2, "op": "stats"},
        {"v": 1, "id": 3, "op": "prefetch", "paths": [f"{root}/a.bin", f"{root}/b/c.bin"]},
        {"v": 1, "id": 4, "op": "prefetch", "paths": [f"{root}/d.bin"], "wait": True,
         "timeout_ms": 100, "read_bytes": 4096},
        {"v": 1, "id": 5, "op": "resolve",
         "hash": {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16},
         "layout": {"root_dir": str(root), "model_name": "m", "fingerprint": "0123456789ab",
                    "kv_cache_groups": [{"block_size": 16}],
                    "connector_block_size_tokens": 16},
         "prompts": [{"token_ids": list(range(40))}]},
    ]


def mutate(body: bytes, rng: random.Random) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(4)
        if kind == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 2:
            del data[rng.randrange(len(data) + 1):]
        else:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 8))
    return bytes(data)


def test_100000_mutated_frames_are_all_answered(daemon: Daemon) -> None:
    rng = random.Random(20261202)
    bodies = [msgpack.packb(r, use_bin_type=True) for r in valid_requests(daemon.root)]
    pids = daemon.worker_pids()
    connection: RawConnection = daemon.connect()
    frames = answered = errors = 0
    while frames < 100_000:
        chunk = []
        for _ in range(500):
            body = mutate(rng.choice(bodies), rng)
            chunk.append(frame(body))
        connection.sock.sendall(b"".join(chunk))
        frames += len(chunk)
        for _ in chunk:
            reply = connection.recv()
            check_reply(reply)
            answered += 1
            errors += reply["ok"] is False
    assert answered == frames == 100_000
    assert 0 < errors < frames  # some mutations stay valid, most do not
    assert connection.call("ping")["ok"]
    connection.close()
    assert daemon.worker_pids() == pids
    stats = daemon.call("stats")["stats"]
    assert stats["worker_restarts"] == 0


def test_a_client_that_never_reads_is_not_buffered_without_bound(daemon: Daemon) -> None:
    stats = pack({"v": 1, "id": 1, "op": "stats"})
    hog = daemon.connect()
    hog.sock.settimeout(0.2)
    sent = 0
    try:
        while sent < 400 << 20:  # stop once the daemon stops taking requests
            sent += hog.sock.send(stats * 256)
    except TimeoutError:
        pass
    rss = daemon.call("stats")["stats"]["supervisor"]["rss_bytes"]
    # Replies held for the hog stay near max_output_bytes (8 MiB), not the ~GBs asked for.
    assert rss < 200 << 20, rss
    assert sent < 400 << 20
    assert daemon.call("ping")["ok"]  # everyone else is still served
    hog.close()
    assert daemon.call("ping")["ok"]


def test_a_client_that_leaves_mid_request_changes_nothing(daemon: Daemon) -> None:
    pids = daemon.worker_pids()
    for _ in range(20):
        connection = daemon.connect()
        connection.send({"v": 1, "id": 1, "op": "prefetch", "wait": True,
                         "paths": [str(daemon.root / f"{i}.bin") for i in range(200)]})
        connection.sock.sendall(b"\x00\x00\x01\x00partial")  # and half a frame
        connection.close()
    assert daemon.call("ping")["ok"]
    assert daemon.worker_pids() == pids
    files = daemon.call("stats")["stats"]["files"]
    assert files["accepted"] == 20 * 200
