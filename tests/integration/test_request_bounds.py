"""Issue 14, item 1: no request costs the supervisor more than a bounded slice of CPU, and no
request's arithmetic ends in `internal`. Each costly frame of the issue, through the real
daemon: refused `too_large` (naming the limit) before the work, for a small fraction of
the CPU it cost, while another client's pings are answered.

Figures are supervisor CPU seconds and peak RSS read from /proc (bounds_attacks.py), with
bounds far from both the fixed cost (milliseconds) and the unfixed one (seconds to forever).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bounds_attacks import (
    HASH,
    block_size_one,
    frame,
    huge_tp_resolve,
    inline_layout,
    many_groups,
    measured,
    nested_arrays,
    overflowing_resolve,
    read_reply,
)
from kvharness.daemon import Daemon

# The unfixed daemon spent 0.3 to 14 s on each of these (or never stopped); fixed, each
# is refused in milliseconds. Generous for a shared 2-CPU machine.
CPU_BOUND_S = 2.0
RSS_BOUND_MIB = 64.0


def send(daemon: Daemon, data: bytes) -> dict[str, Any]:
    """One frame on a fresh connection and its reply (a daemon stuck on it times out)."""
    connection = daemon.connect()
    connection.sock.settimeout(20)
    try:
        connection.sock.sendall(data)
        return read_reply(connection.sock)
    finally:
        connection.close()


def attack(daemon: Daemon, data: bytes) -> tuple[dict[str, Any], Any]:
    with measured(daemon.process.pid, daemon.socket_path) as out:
        reply = send(daemon, data)
    return reply, out["figures"]


def refused(reply: dict[str, Any], code: str, *names: str) -> None:
    assert reply["ok"] is False, {k: v for k, v in reply.items() if k != "paths"}
    assert reply["error"]["code"] == code, reply["error"]
    for name in names:
        assert name in reply["error"]["message"], reply["error"]


@pytest.mark.parametrize(
    ("build", "limit"),
    [
        (huge_tp_resolve, "max_ranks"),  # 2**40 ranks and no file: pinned the loop for good
        (overflowing_resolve, "max_ranks"),  # tp x pp >= 2**63: `internal` OverflowError
        (block_size_one, "max_blocks"),  # a million sha256 steps: 4-6 s
        (many_groups, "max_kv_cache_groups"),  # 65,536 groups x tp 16
    ],
    ids=["huge_tp", "overflow", "block_size_1", "many_groups"],
)
def test_a_costly_kv_request_is_refused_before_the_work(
    daemon: Daemon, build: Any, limit: str
) -> None:
    reply, figures = attack(daemon, build(str(daemon.root)))
    refused(reply, "too_large", limit)
    assert figures.cpu_s < CPU_BOUND_S, figures
    assert figures.ping_failures == 0, figures
    assert daemon.call("ping")["ok"]
    assert daemon.call("stats")["stats"]["requests"].get("resolve:error_internal") is None


def test_a_frame_of_a_million_nested_arrays_is_refused_while_it_decodes(daemon: Daemon) -> None:
    """14 MB, nested within max_nesting_depth: 14.5 s of CPU and +1 GiB before."""
    reply, figures = attack(daemon, nested_arrays())
    refused(reply, "too_large", "max_request_containers")
    assert figures.cpu_s < CPU_BOUND_S, figures
    assert figures.peak_mib < RSS_BOUND_MIB, figures
    assert daemon.call("ping")["ok"]


def test_too_many_scalars_are_refused_while_they_decode(daemon: Daemon) -> None:
    """Elements count too: 12 arrays of a million small strings are 12 million objects."""
    body = frame({"v": 1, "id": 3, "op": "ping", "x": [["ab"] * 1_000_000] * 3})
    reply, figures = attack(daemon, body)
    refused(reply, "too_large", "max_request_items")
    assert figures.cpu_s < CPU_BOUND_S, figures


def test_allow_inline_layouts_false_refuses_them_in_resolve_too(
    daemon_factory: Any, tmp_path: Path
) -> None:
    config = tmp_path / "strict.toml"
    config.write_text("allow_inline_layouts = false\n")
    d: Daemon = daemon_factory("--config", str(config))
    for op in ("resolve", "prefetch_blocks"):
        reply = d.call(op, hash=HASH, layout=inline_layout(str(d.root)),
                       prompts=[{"token_ids": list(range(32))}])
        refused(reply, "bad_request", "inline profiles are refused")
    # The costly inline layout of the first test costs nothing either.
    reply, figures = attack(d, huge_tp_resolve(str(d.root)))
    refused(reply, "bad_request", "inline profiles are refused")
    assert figures.cpu_s < CPU_BOUND_S, figures


def test_every_bound_is_a_key_the_operator_can_raise(daemon_factory: Any, tmp_path: Path) -> None:
    """The limits are configuration, not constants: raised, the same request passes."""
    config = tmp_path / "wide.toml"
    config.write_text("max_ranks = 4096\n")
    d: Daemon = daemon_factory("--config", str(config))
    reply = d.call("resolve", hash=HASH, layout=inline_layout(str(d.root), tp_size=2048),
                   prompts=[{"token_ids": list(range(16))}])
    assert reply["ok"] and len(reply["paths"]) == 2048, reply.get("error")
    reply = d.call("resolve", hash=HASH, layout=inline_layout(str(d.root), tp_size=8192),
                   prompts=[{"token_ids": list(range(16))}])
    refused(reply, "too_large", "max_ranks", "4096")
