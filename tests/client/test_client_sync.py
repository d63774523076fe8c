"""The blocking Client against the fake daemon on a real Unix socket."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_daemon import FakeDaemon

from kvprefetch import Client, PingResult, PrefetchResult
from kvprefetch.errors import ConnectFailed, ConnectionClosed, ProtocolError, ServerError, Timeout

HASH_A = bytes(range(32))
HASH_B = bytes(range(32, 64))


@pytest.fixture
def client(daemon: FakeDaemon) -> Iterator[Client]:
    with Client(daemon.path, timeout=2.0) as c:
        yield c


def test_ping_sends_the_envelope_and_returns_a_typed_result(
    client: Client, daemon: FakeDaemon
) -> None:
    assert client.ping() == PingResult(version="0.0-fake", protocol=1, engine="pread", workers=2)
    assert daemon.seen == [{"v": 1, "id": 1, "op": "ping"}]


def test_request_ids_increase_on_one_connection(client: Client, daemon: FakeDaemon) -> None:
    client.ping()
    client.stats()
    client.prefetch(["/a"])
    assert [r["id"] for r in daemon.seen] == [1, 2, 3]
    assert daemon.connections == 1


def test_str_paths_go_as_str_and_bytes_paths_as_bin(client: Client, daemon: FakeDaemon) -> None:
    result = client.prefetch(["/kv/a.bin", b"/kv/\xff\xfe.bin", "relative"])
    assert result == PrefetchResult(accepted=2, dropped=0, rejected=1)
    (request,) = daemon.requests("prefetch")
    assert request["paths"] == ["/kv/a.bin", b"/kv/\xff\xfe.bin", "relative"]
    assert [type(p) for p in request["paths"]] == [str, bytes, str]
    assert request["wait"] is False
    assert "read_bytes" not in request
    assert "timeout_ms" not in request


def test_prefetch_wait_returns_outcomes(client: Client, daemon: FakeDaemon) -> None:
    result = client.prefetch(["/a", "/b/missing"], wait=True, read_bytes=4096, timeout_ms=100)
    assert result.outcomes == {"read": 1, "missing": 1}
    assert result.elapsed_us == 1234
    (request,) = daemon.requests("prefetch")
    assert (request["wait"], request["read_bytes"], request["timeout_ms"]) == (True, 4096, 100)


def test_pipelined_wait_replies_out_of_order_reach_their_requests(
    client: Client, daemon: FakeDaemon
) -> None:
    daemon.hold_waits = 3
    ids = [client.send({"op": "prefetch", "paths": ["/a"] * n, "wait": True}) for n in (1, 2, 3)]
    # Arrival order is reversed ...
    assert [client.recv()["id"] for _ in ids] == ids[::-1]
    # ... and asking by id finds each reply whatever came first.
    ids = [client.send({"op": "prefetch", "paths": ["/a"] * n, "wait": True}) for n in (1, 2, 3)]
    assert [client.recv(i)["accepted"] for i in ids] == [1, 2, 3]


def test_prefetch_many_returns_results_in_batch_order(client: Client, daemon: FakeDaemon) -> None:
    daemon.hold_waits = 3
    got = client.prefetch_many([["/a"], ["/a", "/b"], ["/a", "/b", "/c"]], wait=True)
    assert [r.accepted for r in got] == [1, 2, 3]
    assert daemon.connections == 1


def test_prefetch_many_collects_every_reply_before_raising(
    client: Client, daemon: FakeDaemon
) -> None:
    with pytest.raises(ServerError, match="bad_request"):
        client.prefetch_many([["/a"], ["/refuse"], ["/c"]])
    with pytest.raises(RuntimeError):
        client.recv()  # nothing left behind on the connection
    assert client.ping().workers == 2


def test_error_replies_raise_server_error_and_the_connection_goes_on(
    client: Client, daemon: FakeDaemon
) -> None:
    with pytest.raises(ServerError) as info:
        client.call({"op": "defragment"})
    assert info.value.code == "unknown_op"
    assert info.value.request_id == 1
    daemon.fail_with["prefetch"] = ("overloaded", "queue full")
    with pytest.raises(ServerError, match="overloaded: queue full"):
        client.prefetch(["/a"])
    assert client.ping().protocol == 1
    assert daemon.connections == 1


def test_an_error_without_id_goes_to_the_request_in_flight(
    client: Client, daemon: FakeDaemon
) -> None:
    daemon.max_frame = 200
    with pytest.raises(ServerError) as info:
        client.prefetch([f"/kv/{i}.bin" for i in range(50)])
    assert info.value.code == "too_large"
    assert info.value.request_id == 1
    assert client.ping().workers == 2  # the daemon skipped the frame; the stream is intact


def test_a_refusal_waiting_on_the_socket_answers_the_next_call(
    client: Client, daemon: FakeDaemon
) -> None:
    # The daemon refuses a peer as it accepts it, before any request: the refusal is read
    # while the call's frame goes out, so the call must already be in flight by then.
    daemon.refuse = True
    client.connect()
    assert daemon.refused.wait(5)
    with pytest.raises(ServerError) as info:
        client.ping()
    assert (info.value.code, info.value.request_id) == ("forbidden", 1)
    with pytest.raises(ServerError, match="forbidden"):
        client.stats()  # a new connection, refused in turn
    daemon.refuse = False
    assert client.ping().workers == 2


def test_a_refusal_mid_write_answers_the_request_being_written(
    client: Client, daemon: FakeDaemon
) -> None:
    # A frame far larger than the socket buffers: the refusal comes, and the daemon
    # closes, long before the client could finish writing it.
    daemon.refuse = True
    with pytest.raises(ServerError) as info:
        client.prefetch([f"/kv/{i:06}.bin" for i in range(60_000)])
    assert (info.value.code, info.value.request_id) == ("forbidden", 1)


def test_a_refusal_answers_every_request_of_a_pipeline(
    client: Client, daemon: FakeDaemon
) -> None:
    daemon.refuse = True
    with pytest.raises(ServerError, match="forbidden"):
        client.prefetch_many([["/a"], ["/b"], ["/c"]])
    with pytest.raises(RuntimeError):
        client.recv()  # nothing left behind


def test_timeout_then_the_late_reply_is_skipped(client: Client, daemon: FakeDaemon) -> None:
    client.timeout = 0.1
    daemon.delay_s["ping"] = 0.3
    sent = daemon.replies_sent
    with pytest.raises(Timeout):
        client.ping()
    client.timeout = 2.0
    daemon.wait_replies_sent(sent + 1)  # the late ping reply is now waiting on the socket
    assert "requests" in client.stats()
    assert daemon.connections == 1


def test_a_timeout_inside_a_frame_does_not_desynchronise(
    client: Client, daemon: FakeDaemon
) -> None:
    client.timeout = 0.1
    daemon.dribble_s = 0.3  # every reply: 3 bytes, a pause, the rest
    with pytest.raises(Timeout):
        client.ping()
    client.timeout = 2.0
    assert "requests" in client.stats()


def test_a_wait_timeout_extends_the_client_timeout(client: Client, daemon: FakeDaemon) -> None:
    client.timeout = 0.1
    daemon.delay_s["prefetch"] = 0.3
    assert client.prefetch(["/a"], wait=True, timeout_ms=2000).accepted == 1
    with pytest.raises(Timeout):
        client.prefetch(["/a"], wait=True)


def test_idle_client_survives_a_daemon_restart(client: Client, daemon: FakeDaemon) -> None:
    client.ping()
    daemon.restart()
    assert client.ping().protocol == 1
    assert daemon.connections == 2


def test_hang_up_mid_call_raises_connection_closed_then_reconnects(
    client: Client, daemon: FakeDaemon
) -> None:
    client.ping()
    daemon.hang_up_on.add("stats")
    with pytest.raises(ConnectionClosed):
        client.stats()
    daemon.hang_up_on.clear()
    assert client.stats()["requests"] >= 2
    assert daemon.connections == 2


def test_sending_on_a_dead_connection_raises_then_reconnects(
    client: Client, daemon: FakeDaemon
) -> None:
    daemon.delay_s["ping"] = 10  # keep a request in flight, so no silent reconnect
    client.send({"op": "ping"})
    daemon.restart()
    with pytest.raises(ConnectionClosed):
        client.send({"op": "ping"})
    daemon.delay_s.clear()
    assert client.ping().workers == 2


def test_a_reply_for_an_unknown_id_is_a_protocol_error(client: Client, daemon: FakeDaemon) -> None:
    daemon.wrong_id = True
    with pytest.raises(ProtocolError, match="unknown request id"):
        client.ping()
    daemon.wrong_id = False
    assert client.ping().version == "0.0-fake"


def test_missing_socket_is_connect_failed_naming_the_path(tmp_path: Path) -> None:
    path = str(tmp_path / "nobody.sock")
    with Client(path) as c, pytest.raises(ConnectFailed, match=r"nobody\.sock"):
        c.ping()


def test_recv_without_anything_in_flight_is_a_usage_error(client: Client) -> None:
    with pytest.raises(RuntimeError):
        client.recv()
    with pytest.raises(RuntimeError):
        client.recv(42)


def test_kv_requests_pass_through(client: Client, daemon: FakeDaemon) -> None:
    kv: dict[str, Any] = {"model": "llama", "block_hashes": [[HASH_A, HASH_B]]}
    result = client.prefetch_blocks(**kv, wait=True)
    assert (result.files, result.accepted, result.outcomes) == (2, 2, {"read": 2, "missing": 0})
    (request,) = daemon.requests("prefetch_blocks")
    assert request["block_hashes"] == [[HASH_A, HASH_B]]  # bin on the wire
    resolved = client.resolve(**kv)
    assert resolved.block_hashes == [[HASH_A.hex(), HASH_B.hex()]]
    assert len(resolved.paths) == 2
    with pytest.raises(ServerError, match="bad_request"):
        client.resolve(block_hashes=[[HASH_A]])  # neither model nor hash+layout


def test_stats_is_a_plain_map(client: Client) -> None:
    stats = client.stats()
    assert stats["workers"][1] == {"queue": 2}  # integer keys survive


def test_close_is_idempotent_and_the_client_reconnects_after(
    client: Client, daemon: FakeDaemon
) -> None:
    client.ping()
    client.close()
    client.close()
    client.ping()
    assert daemon.connections == 2


def test_client_accepts_a_pathlike_socket(daemon: FakeDaemon) -> None:
    with Client(Path(daemon.path)) as c:
        assert c.ping().engine == "pread"
    assert os.path.exists(daemon.path)


def test_deep_pipelines_do_not_deadlock(client: Client, daemon: FakeDaemon) -> None:
    # Far more replies than a socket buffer holds: the fake, like a daemon with a bounded
    # output buffer, stops reading while its replies go unread, so send() must read them.
    ids = [client.send({"op": "ping"}) for _ in range(20_000)]
    assert [client.recv(i)["id"] for i in ids] == ids
    assert daemon.connections == 1
