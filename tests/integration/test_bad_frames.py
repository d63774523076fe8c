"""Bad input against the real daemon: a named corpus of malformed frames, then a
mutation fuzz of 100,000 frames. Every frame is answered (or, for a frame whose
length alone is too large, the connection is kept in step), no worker dies, and
the daemon goes on serving."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import msgpack
import pytest

from daemon_harness import Daemon, RawConnection

CORPUS = sorted((Path(__file__).parent.parent / "corpus" / "frames").glob("*.bin"))
CODES = {"bad_request", "unsupported_version", "unknown_op", "too_large", "forbidden",
         "overloaded", "internal"}


def check_reply(reply: dict[str, object]) -> None:
    assert set(reply) >= {"id", "ok"}, reply
    if reply["ok"] is False:
        error = reply["error"]
        assert isinstance(error, dict) and error["code"] in CODES and error["message"]


@pytest.mark.parametrize("frame", CORPUS, ids=lambda p: p.stem)
def test_each_corpus_frame_is_answered_and_the_connection_lives(
    daemon: Daemon, frame: Path
) -> None:
    pids = daemon.worker_pids()
    connection = daemon.connect()
    connection.sock.sendall(frame.read_bytes())
    reply = connection.recv()
    check_reply(reply)
    if frame.stem == "oversized-length-header":
        assert reply["error"]["code"] == "too_large"  # type: ignore[index]
    elif frame.stem == "nested-deeper-than-the-limit":  # 22 levels against 16
        assert reply["id"] == 7 and reply["error"]["code"] == "too_large"  # type: ignore[index]
        assert connection.call("ping")["ok"]
    else:
        assert connection.call("ping")["ok"], frame.stem  # the same connection goes on
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
            chunk.append(struct.pack(">I", len(body)) + body)
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
    stats = msgpack.packb({"v": 1, "id": 1, "op": "stats"}, use_bin_type=True)
    frame = struct.pack(">I", len(stats)) + stats
    hog = daemon.connect()
    hog.sock.settimeout(0.2)
    sent = 0
    try:
        while sent < 400 << 20:  # stop once the daemon stops taking requests
            sent += hog.sock.send(frame * 256)
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
