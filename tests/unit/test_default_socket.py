"""One default socket chain (docs/configuration.md, "The default socket"): the daemon's
(kvprefetchd.addresses) and the Python client's (kvprefetch.protocol, which cannot import
the daemon) give the same socket for every case of clients/go/testdata/default_socket.json,
the file the Go client's DefaultSocket is held to by default_socket_test.go."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvprefetch.protocol import DEFAULT_SOCKET, default_socket
from kvprefetchd import addresses
from kvprefetchd.config import Config, build_config

VECTORS = Path(__file__).resolve().parents[2] / "clients/go/testdata/default_socket.json"
CASES: list[dict[str, Any]] = json.loads(VECTORS.read_text())["cases"]
VARIABLES = ("KVPREFETCHD_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_the_daemon_and_the_python_client_follow_one_chain(
    case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in VARIABLES:
        if name in case["env"]:
            monkeypatch.setenv(name, case["env"][name])
        else:
            monkeypatch.delenv(name, raising=False)
    systemd = tmp_path / "kvprefetchd.sock"
    if case["systemd"]:
        systemd.touch()
    expected = case["socket"].replace("@systemd", str(systemd))
    assert addresses.default_socket_path(str(systemd)) == expected
    assert default_socket(str(systemd)) == expected


def test_the_cases_cover_every_step_of_the_chain() -> None:
    assert set().union(*(case["env"] for case in CASES)) == set(VARIABLES)
    sockets = {case["socket"] for case in CASES}
    assert {"@systemd", addresses.FALLBACK_SOCKET} <= sockets


def test_the_constants_are_the_same_on_both_sides() -> None:
    assert addresses.SYSTEMD_SOCKET == DEFAULT_SOCKET


def test_a_config_without_a_socket_takes_the_chain(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setenv("KVPREFETCHD_SOCKET", str(tmp_path / "s.sock"))
    assert Config().socket == build_config({}, {}).socket == str(tmp_path / "s.sock")
    assert build_config({"socket": "/x.sock"}, {}).socket == "/x.sock"  # the file wins
