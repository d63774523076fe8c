"""The TCP listener's rules, one at a time: who a certificate names (RFC 6125), which CA
vouched for it, who may start a handshake (slots, fair displacement, token buckets, the
reserve for routers seen), and the guards that keep one peer's trouble its own (issue 23).

The integration side (tests/integration/test_never_down_tls.py) runs the attacks; here
each rule is checked with a fake clock and in-memory TLS (ssl.MemoryBIO), no sockets.
"""

from __future__ import annotations

import logging
import ssl
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvharness.certs import issue, make_ca, server_cert
from kvprefetchd.listeners import handshakes
from kvprefetchd.listeners.handshakes import Handshake, HandshakeGate, displaced
from kvprefetchd.listeners.listening import Hush, Unforeseen
from kvprefetchd.listeners.tls_identity import identities, trust_of, trusted


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- identities ------------------------------------------------------------------------------


def cert(cn: str | None, *san: tuple[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {"subject": ((("commonName", cn),),) if cn else ()}
    if san:
        found["subjectAltName"] = san
    return found


def test_san_names_win_over_the_cn() -> None:
    assert identities(cert("router", ("URI", "spiffe://x/other"))) == {"spiffe://x/other"}
    assert identities(cert("router", ("DNS", "a.example"), ("URI", "spiffe://x/a"))) == {
        "a.example", "spiffe://x/a"}


def test_the_cn_counts_only_without_dns_or_uri_names() -> None:
    assert identities(cert("router")) == {"router"}
    assert identities(cert("router", ("IP Address", "10.0.0.1"))) == {"router"}
    assert identities(cert(None)) == set()


# ---- trust: which CA vouched ---------------------------------------------------------------


def handshake_in_memory(server: ssl.SSLContext, client: ssl.SSLContext) -> ssl.SSLObject:
    """A whole TLS handshake between two SSLObjects; the server's side, finished."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    theirs = server.wrap_bio(s_in, s_out, server_side=True)
    ours = client.wrap_bio(c_in, c_out, server_hostname="localhost")
    done = {"server": False, "client": False}
    for _ in range(20):
        for name, side in (("client", ours), ("server", theirs)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return theirs
    raise AssertionError("the handshake did not finish")


def test_a_connection_knows_its_ca_and_a_new_ca_file_without_it_does_not(
    tmp_path: Path,
) -> None:
    ca, other = make_ca(tmp_path), make_ca(tmp_path / "o", "other CA")
    srv = server_cert(ca, tmp_path)
    router = issue(ca, tmp_path, "router", common_name="router", uris=("spiffe://x/r",))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.verify_mode = ssl.CERT_REQUIRED
    server.load_cert_chain(srv.cert, srv.key)
    server.load_verify_locations(cafile=str(ca.cert))
    client = ssl.create_default_context(cafile=str(ca.cert))
    client.load_cert_chain(router.cert, router.key)
    session = handshake_in_memory(server, client)
    trust = trust_of(session)  # type: ignore[arg-type]  # an SSLObject answers the same
    assert trust is not None and trust.startswith(b"sha256:")
    assert trust in trusted(server)
    rotated = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    rotated.load_verify_locations(cafile=str(other.cert))
    assert trust not in trusted(rotated)
    both = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    both.load_verify_locations(cafile=str(other.cert))
    both.load_verify_locations(cafile=str(ca.cert))
    assert trust in trusted(both)


# ---- handshake slots: who is displaced ---------------------------------------------------


def held(address: str, started: float) -> Handshake:
    return Handshake(sock=None, address=address, started=started)  # type: ignore[arg-type]


def test_a_newcomer_displaces_the_oldest_of_the_busiest_address() -> None:
    slots = [held(f"10.0.0.{i % 16}", float(i)) for i in range(64)]  # 4 each
    slots.append(held("10.0.0.3", 100.0))  # 10.0.0.3 holds 5 now
    victim = displaced(slots, "192.0.2.1")
    assert victim is not None and victim.address == "10.0.0.3" and victim.started == 3.0


def test_the_busiest_address_cannot_churn_its_way_in() -> None:
    slots = [held("10.0.0.1", float(i)) for i in range(3)] + [held("10.0.0.2", 9.0)]
    assert displaced(slots, "10.0.0.1") is None
    victim = displaced(slots, "10.0.0.2")  # it holds 1, the busiest 3
    assert victim is not None and victim.address == "10.0.0.1"


def test_equal_shares_give_up_the_oldest() -> None:
    slots = [held("a", 5.0), held("b", 1.0), held("c", 3.0)]
    victim = displaced(slots, "new")
    assert victim is not None and victim.address == "b"
    assert displaced([], "new") is None


# ---- handshake rates -----------------------------------------------------------------------


def test_each_address_has_its_own_rate() -> None:
    clock = Clock()
    gate = HandshakeGate(rate=1000, rate_per_address=4, clock=clock)
    assert [gate.admit("a") for _ in range(5)][:4] == [None] * 4
    assert "per_address" in (gate.admit("a") or "")
    assert gate.admit("b") is None  # another address is not held back
    clock.now += 0.5  # two tokens back
    assert [gate.admit("a") is None for _ in range(3)] == [True, True, False]


def test_work_for_new_addresses_shares_one_rate_and_routers_seen_skip_it() -> None:
    clock = Clock()
    gate = HandshakeGate(rate=3, rate_per_address=100, clock=clock)
    gate.seen("router")
    # Accepting costs only the address's own bucket: silent connections spend nothing shared.
    assert all(gate.admit(f"stranger{i}") is None for i in range(10))
    assert [gate.charge(f"stranger{i}") is None for i in range(5)] == [True] * 3 + [False] * 2
    assert "tls_handshake_rate" in (gate.charge("stranger9") or "")
    assert all(gate.charge("router") is None for _ in range(10))  # the reserve
    gate.forget_seen()
    assert gate.charge("router") is not None
    clock.now += 1.0
    assert gate.charge("stranger0") is None


def test_a_reload_changes_the_rates_and_buckets_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handshakes, "MAX_BUCKETS", 8)
    clock = Clock()
    gate = HandshakeGate(rate=10_000, rate_per_address=2, clock=clock)
    for i in range(100):
        gate.admit(f"10.0.{i}.1")
    assert len(gate.buckets) == 8
    gate.configure(rate=1, rate_per_address=1)
    assert gate.everyone.burst == 1 and gate.everyone.tokens <= 1
    clock.now += 10
    gate.sweep()
    assert not gate.buckets  # all refilled: forgotten


# ---- one peer's trouble: counted, logged, hushed -------------------------------------------


def test_an_unforeseen_error_is_counted_and_its_traceback_told_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: Counter[str] = Counter()
    unforeseen = Unforeseen(events, logging.getLogger("test.unforeseen"))
    for _ in range(3):
        try:
            raise KeyError("odd")
        except KeyError as error:
            unforeseen.happened("uid 1000 pid 42", error)
    assert events["connection_errors"] == 3
    lines = [r for r in caplog.records if r.name == "test.unforeseen"]
    assert len(lines) == 3 and "uid 1000 pid 42" in lines[0].getMessage()
    assert [r.exc_info is not None for r in lines] == [True, False, False]


def test_a_flood_of_refusals_is_a_few_lines_and_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    hush = Hush(logging.getLogger("test.hush"), clock)
    for i in range(500):
        hush.warning("refused", "refused %d", i)
    clock.now += Hush.WINDOW
    hush.sweep()
    lines = [r.getMessage() for r in caplog.records if r.name == "test.hush"]
    assert len(lines) == Hush.LINES + 1
    assert lines[-1].startswith(f"{500 - Hush.LINES} more like the above (refused)")
