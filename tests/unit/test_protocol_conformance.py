"""docs/protocol.md is the one source of the protocol's names: the daemon and the Python client
are held to its tables here, the Go client by clients/go/conformance_test.go.

The tables are parsed as a reader sees them (the first column of each, in backticks), so a
name added to the document and not to the code, or the other way round, fails here.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from kvprefetch import ErrorCode, Outcome
from kvprefetch.stats import Stats
from kvprefetchd import protocol
from kvprefetchd.config import Config
from kvprefetchd.supervisor.loop import Supervisor

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def tables(text: str) -> dict[str, list[list[str]]]:
    """Every Markdown table under each `## heading`: its body rows, cells stripped."""
    found: dict[str, list[list[str]]] = {}
    heading = ""
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        elif line.startswith("|") and not re.fullmatch(r"\|[\s|:-]+\|", line):
            found.setdefault(heading, []).append([c.strip() for c in line.strip("|").split("|")])
    return {name: rows[1:] for name, rows in found.items()}  # rows[0] is the header


def names(rows: list[list[str]], column: int = 0) -> list[str]:
    out = []
    for row in rows:
        match = re.fullmatch(r"`([a-z_]+)`", row[column])
        assert match, f"not a `name` cell: {row[column]!r}"
        out.append(match.group(1))
    return out


DOC_TABLES = tables(DOC.read_text())
DOC_OPS = names(DOC_TABLES["Requests"])
DOC_OUTCOMES = names(DOC_TABLES["Per-file outcomes"])
DOC_IN_OUTCOMES = [
    name for name, row in zip(DOC_OUTCOMES, DOC_TABLES["Per-file outcomes"], strict=True)
    if row[2] == "yes"
]
DOC_CODES = names(DOC_TABLES["Errors"])
DOC_STATS = names(DOC_TABLES["The `stats` reply"])


def test_the_document_has_every_table() -> None:
    assert DOC_OPS and DOC_OUTCOMES and DOC_CODES and DOC_STATS
    assert set(DOC_IN_OUTCOMES) < set(DOC_OUTCOMES)


def test_the_daemons_names_are_the_documents() -> None:
    assert list(protocol.OPS) == DOC_OPS
    assert list(protocol.OUTCOMES) == DOC_IN_OUTCOMES
    assert list(protocol.ERROR_CODES) == DOC_CODES


def test_the_daemon_dispatches_exactly_the_documented_ops(tmp_path: Path) -> None:
    config = Config(roots=(str(tmp_path),), workers=1, socket=str(tmp_path / "s.sock"))
    supervisor = Supervisor(config)  # not run: no socket, no worker
    try:
        assert sorted(supervisor.ops.handlers) == sorted(DOC_OPS)
    finally:
        supervisor.halt()


def test_the_stats_schema_is_the_documents() -> None:
    assert sorted(Stats.__required_keys__) == sorted(DOC_STATS)


@pytest.mark.parametrize(("enum", "documented"), [(Outcome, DOC_OUTCOMES), (ErrorCode, DOC_CODES)])
def test_the_python_clients_names_are_the_documents(enum: type, documented: list[str]) -> None:
    assert [member.value for member in enum] == documented


def test_every_failure_reason_the_daemon_gives_is_documented() -> None:
    from kvprefetchd import reasons
    from kvprefetchd.roots.confine import Roots

    rows = DOC_TABLES["Failures"]
    documented = {m.group(1) for row in rows if (m := re.fullmatch(r"`([a-z_]+)`", row[0]))}
    roots = Roots(("/kv",), 64)
    supervisor = {roots.place_canonical(path) for path in (
        "kv/a", "/etc/x", "/kv/../x", "/kv/a\0b", "/kv/" + "a" * 80, 7, "/kv/", b"/kv\0")}
    workers = {reasons.reason_of("rejected", e) for e in reasons._REJECTED}
    named = {reasons.DROPPED, reasons.DEADLINE, reasons.WORKER_LOST, reasons.OTHER_MOUNT,
             reasons.MOUNT_UNRESPONSIVE, reasons.NOT_KEPT}
    assert supervisor | workers | named == documented
    assert reasons.reason_of("missing", 2) == "ENOENT"  # the errno-name row
    assert reasons.reason_of("failed", errno.EHOSTDOWN) == reasons.MOUNT_UNRESPONSIVE
