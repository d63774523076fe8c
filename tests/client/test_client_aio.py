"""The asyncio AsyncClient against the fake daemon on a real Unix socket.

Each test runs its own event loop with asyncio.run (no pytest plugin needed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fake_daemon import FakeDaemon

from kvprefetch import AsyncClient, PingResult, PrefetchResult
from kvprefetch.errors import ConnectFailed, ConnectionClosed, ProtocolError, ServerError, Timeout


def run(daemon: FakeDaemon, body: Callable[[AsyncClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.path, timeout=2.0) as client:
            await body(client)

    asyncio.run(main())


def test_operations(daemon: FakeDaemon) -> None:
    async def body(c: AsyncClient) -> None:
        assert await c.ping() == PingResult("0.0-fake", 1, "pread", 2)
        assert await c.prefetch(["/a", b"/b\xff", "rel"]) == PrefetchResult(2, 0, 1)
        assert (await c.prefetch(["/a"], wait=True, timeout_ms=50)).outcomes == {
            "read": 1,
            "missing": 0,
        }
        assert (await c.stats())["workers"][0] == {"queue": 0}
        kv: dict[str, Any] = {"model": "m", "block_hashes": [[bytes(32)]]}
        assert (await c.prefetch_blocks(**kv)).files == 1
        assert (await c.resolve(**kv)).block_hashes == [["00" * 32]]

    run(daemon, body)
    assert [type(p) for p in daemon.requests("prefetch")[0]["paths"]] == [str, bytes, str]


def test_concurrent_calls_share_one_connection(daemon: FakeDaemon) -> None:
    async def body(c: AsyncClient) -> None:
        got = await asyncio.gather(*(c.ping() for _ in range(50)))
        assert all(r.workers == 2 for r in got)

    run(daemon, body)
    assert daemon.connections == 1
    assert sorted(r["id"] for r in daemon.seen) == list(range(1, 51))


def test_out_of_order_replies_reach_their_callers(daemon: FakeDaemon) -> None:
    daemon.hold_waits = 3  # replies come back reversed

    async def body(c: AsyncClient) -> None:
        calls = [c.prefetch(["/a"] * n, wait=True) for n in (1, 2, 3)]
        assert [r.accepted for r in await asyncio.gather(*calls)] == [1, 2, 3]
        many = await c.prefetch_many([["/a"], ["/a"] * 2, ["/a"] * 3], wait=True)
        assert [r.accepted for r in many] == [1, 2, 3]

    run(daemon, body)


def test_raw_send_and_recv(daemon: FakeDaemon) -> None:
    async def body(c: AsyncClient) -> None:
        first = await c.send({"op": "ping"})
        second = await c.send({"op": "nope"})
        assert (await c.recv(second))["error"]["code"] == "unknown_op"
        assert (await c.recv(first))["ok"] is True
        with pytest.raises(RuntimeError):
            await c.recv(first)

    run(daemon, body)


def test_server_errors_raise_and_the_connection_goes_on(daemon: FakeDaemon) -> None:
    daemon.fail_with["stats"] = ("forbidden", "peer not allowed")

    async def body(c: AsyncClient) -> None:
        with pytest.raises(ServerError) as info:
            await c.stats()
        assert (info.value.code, info.value.message) == ("forbidden", "peer not allowed")
        with pytest.raises(ServerError, match="bad_request"):
            await c.prefetch_many([["/a"], ["/refuse"]])
        assert (await c.ping()).protocol == 1

    run(daemon, body)
    assert daemon.connections == 1


def test_an_error_without_id_goes_to_the_request_in_flight(daemon: FakeDaemon) -> None:
    daemon.max_frame = 200

    async def body(c: AsyncClient) -> None:
        with pytest.raises(ServerError, match="too_large"):
            await c.prefetch([f"/kv/{i}.bin" for i in range(50)])
        assert (await c.ping()).workers == 2

    run(daemon, body)


def test_a_refusal_waiting_on_the_socket_answers_the_next_call(daemon: FakeDaemon) -> None:
    daemon.refuse = True

    async def body(c: AsyncClient) -> None:
        await c.connect()
        # Blocking the loop: the refusal and the close are in before the client reads or
        # writes anything, so its write fails with the refusal still unread.
        assert daemon.refused.wait(5)
        with pytest.raises(ServerError) as info:
            await c.ping()
        assert (info.value.code, info.value.request_id) == ("forbidden", 1)
        with pytest.raises(ServerError, match="forbidden"):
            await c.stats()  # a new connection, refused in turn
        daemon.refuse = False
        assert (await c.ping()).workers == 2

    run(daemon, body)


def test_a_refusal_answers_every_call_in_flight(daemon: FakeDaemon) -> None:
    daemon.refuse = True

    async def body(c: AsyncClient) -> None:
        big = [f"/kv/{i:06}.bin" for i in range(60_000)]  # far beyond the socket buffers
        calls = [c.prefetch(big), c.ping(), c.prefetch_many([["/a"], ["/b"]])]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            assert isinstance(outcome, ServerError) and outcome.code == "forbidden", outcome

    run(daemon, body)


def test_timeout_then_the_late_reply_is_dropped(daemon: FakeDaemon) -> None:
    daemon.delay_s["ping"] = 0.3

    async def body(c: AsyncClient) -> None:
        c.timeout = 0.1
        sent = daemon.replies_sent
        with pytest.raises(Timeout):
            await c.ping()
        c.timeout = 2.0
        daemon.wait_replies_sent(sent + 1)  # the late ping reply arrives, to be dropped
        assert "requests" in await c.stats()
        c.timeout = 0.1
        daemon.delay_s["prefetch"] = 0.3
        assert (await c.prefetch(["/a"], wait=True, timeout_ms=2000)).accepted == 1

    run(daemon, body)
    assert daemon.connections == 1


def test_reconnects_after_a_restart_and_after_a_hang_up(daemon: FakeDaemon) -> None:
    async def body(c: AsyncClient) -> None:
        await c.ping()
        daemon.restart()
        await asyncio.sleep(0.05)  # the reader task sees EOF while idle
        assert (await c.ping()).protocol == 1
        daemon.hang_up_on.add("stats")
        with pytest.raises(ConnectionClosed):
            await c.stats()
        daemon.hang_up_on.clear()
        assert "requests" in await c.stats()

    run(daemon, body)
    assert daemon.connections == 3


def test_a_reply_for_an_unknown_id_fails_the_connection(daemon: FakeDaemon) -> None:
    async def body(c: AsyncClient) -> None:
        daemon.wrong_id = True
        with pytest.raises(ProtocolError, match="unknown request id"):
            await c.ping()
        daemon.wrong_id = False
        assert (await c.ping()).engine == "pread"

    run(daemon, body)


def test_close_fails_calls_in_flight(daemon: FakeDaemon) -> None:
    daemon.delay_s["ping"] = 5

    async def main() -> None:
        client = AsyncClient(daemon.path)
        call = asyncio.create_task(client.ping())
        await asyncio.sleep(0.05)
        await client.close()
        with pytest.raises(ConnectionClosed):
            await call

    asyncio.run(main())


def test_missing_socket_is_connect_failed(tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncClient(tmp_path / "nobody.sock") as c:
            with pytest.raises(ConnectFailed, match=r"nobody\.sock"):
                await c.ping()

    asyncio.run(main())
