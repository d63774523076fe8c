"""docs/protocol.md is the one source of the protocol's names: the daemon and the Python client
are held to its tables here, the Go client by clients/go/conformance_test.go.

The tables are parsed as a reader sees them (the first column of each, in backticks), so a
name added to the document and not to the code, or the other way round, fails here.
"""

from __future__ import annotations

import errno
import re
import time
from pathlib import Path
from typing import Any, cast

import pytest

from kvharness.daemon import start_cli
from kvprefetch import ErrorCode, Outcome
from kvprefetch.stats import Stats
from kvprefetchd import protocol
from kvprefetchd.config import Config
from kvprefetchd.supervisor.loop import Supervisor

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "protocol.md"


def all_tables(text: str) -> dict[str, list[list[list[str]]]]:
    """Every Markdown table under each `## heading`, in order: its body rows, cells stripped."""
    found: dict[str, list[list[list[str]]]] = {}
    heading, inside = "", False
    for line in text.splitlines():
        if line.startswith("## "):
            heading, inside = line[3:].strip(), False
        elif line.startswith("|"):
            if not inside:
                found.setdefault(heading, []).append([])
                inside = True
            if not re.fullmatch(r"\|[\s|:-]+\|", line):
                found[heading][-1].append([c.strip() for c in line.strip("|").split("|")])
        else:
            inside = False
    return {name: [rows[1:] for rows in tables] for name, tables in found.items()}


def tables(text: str) -> dict[str, list[list[str]]]:
    """The first Markdown table under each `## heading`: its body rows (rows[0], the
    header, left out)."""
    return {name: found[0] for name, found in all_tables(text).items()}


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


# ---- one source per name list ------------------------------------------------------------


def test_the_failures_default_is_written_once_and_the_clients_say_the_same() -> None:
    """protocol.DEFAULT_MAX_FAILURES is the daemon's one copy; the clients cannot import it,
    so what they and the document say is held to it here."""
    from kvprefetchd.request_fields import WarmOptions
    from kvprefetchd.supervisor.books import Waiter

    default = protocol.DEFAULT_MAX_FAILURES
    assert WarmOptions(False, 1, None).max_failures == default
    assert Waiter(0, 0.0, None).max_failures == default
    prefetch_row = next(row for row in DOC_TABLES["Requests"] if row[0] == "`prefetch`")
    assert re.findall(r"`max_failures` \(optional: how many failures to list, default (\d+)",
                      prefetch_row[1]) == [str(default)]
    go = (ROOT / "clients" / "go" / "messages.go").read_text()
    assert re.findall(r"0 means the daemon's default \((\d+)\)", go) == [str(default)]


def test_the_warm_modes_are_defined_once() -> None:
    """protocol.WARM_MODES is the one list: no other module spells the modes out as a
    tuple, list or set, and the config and the engine table use it."""
    import ast

    from kvprefetchd import config, engines

    spelled = []
    modes = {"read", "advise"}
    for path in sorted((ROOT / "daemon").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and {
                    e.value for e in node.elts if isinstance(e, ast.Constant)} == modes:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert spelled == [f"daemon/kvprefetchd/protocol.py:{protocol_line('WARM_MODES')}"]
    for module in (config, engines):
        assert module.WARM_MODES is protocol.WARM_MODES, module.__name__
    assert set(engines.AUTO_ORDER) == set(protocol.WARM_MODES)
    assert all(set(modes) == set(protocol.WARM_MODES) for modes in engines.ENGINE_TABLE.values())


def protocol_line(name: str) -> int:
    text = (ROOT / "daemon" / "kvprefetchd" / "protocol.py").read_text()
    return next(n for n, line in enumerate(text.splitlines(), 1) if line.startswith(f"{name} = "))


# ---- the whole `stats` tree --------------------------------------------------------------


def key_table() -> dict[str, set[str]]:
    """docs/protocol.md's table of every stats key by path: path -> its keys."""
    rows = all_tables(DOC.read_text())["The `stats` reply"][1]
    found: dict[str, set[str]] = {}
    for path, keys in rows:
        match = re.fullmatch(r"`([a-z_.\[\]*]+)`", path)
        assert match, f"not a `path` cell: {path!r}"
        found[match.group(1)] = set(re.findall(r"`([a-z_]+)`", keys))
    return found


DOC_KEYS = key_table()
# Maps keyed by names the document gives elsewhere (ops, events, root indexes), not keys.
NAMED = {"requests", "events", "latency.ack_seconds", "workers[].queue.depth"}


def schema_of(path: str) -> type:
    """The Python client's TypedDict for what a path of the key table leads to."""
    from kvprefetch import stats as schema

    return {
        "files": schema.FileCounts, "kv": schema.KVStats, "kv.stale.*": schema.StaleProfile,
        "latency": schema.LatencyStats, "latency.ack_seconds.*": schema.HistogramSnapshot,
        "latency.wait_seconds": schema.HistogramSnapshot,
        "latency.file_seconds": schema.HistogramSnapshot,
        "supervisor": schema.SupervisorStats, "bounds.*": schema.BoundStats,
        "roots[]": schema.RootStats, "scout": schema.ScoutStats,
        "stuck[]": schema.StuckProcess, "workers[]": schema.WorkerStats,
        "workers[].queue": schema.QueueStats,
    }[path]


def keys_by_path(value: object, path: str, found: dict[str, set[str]]) -> None:
    """Every map of a reply under `path` (the key table's notation), with its keys, merged
    over the elements of lists and the values of named maps."""
    if isinstance(value, dict):
        named = path in NAMED or f"{path}.*" in DOC_KEYS
        if path and (path in DOC_KEYS or not named):
            found.setdefault(path, set()).update(value)
        for key, item in value.items():
            keys_by_path(item, f"{path}.*" if named else f"{path}.{key}".lstrip("."), found)
    elif isinstance(value, list):
        for item in value:
            keys_by_path(item, f"{path}[]", found)


def test_the_key_table_is_the_clients_schema_both_ways() -> None:
    for path, keys in DOC_KEYS.items():
        if path == "bounds" or path == "workers[].hold_released":
            continue  # maps of fixed names with no type of their own: checked on a reply
        assert set(schema_of(path).__annotations__) == keys, path


@pytest.fixture(scope="module")
def real_stats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real daemon's `stats` reply after a wait request that read, skipped and rejected."""
    workdir = tmp_path_factory.mktemp("stats")
    daemon = start_cli(workdir)
    try:
        (daemon.root / "warm.bin").write_bytes(b"kv" * 65536)
        paths = [str(daemon.root / "warm.bin"), str(daemon.root / "absent.bin"), "/etc/x"]
        reply = daemon.call("prefetch", paths=paths, wait=True, timeout_ms=10_000)
        assert reply["ok"] and reply["accepted"] == 2, reply
        deadline = time.monotonic() + 30
        while True:  # each worker's queue figures arrive with its first report
            stats = daemon.stats()
            if all(worker["queue"] for worker in stats["workers"]):
                return stats
            assert time.monotonic() < deadline, stats["workers"]
            daemon.call("prefetch", paths=[str(daemon.root / f"{n}.bin") for n in range(64)])
    finally:
        daemon.stop()


def test_every_key_of_a_real_stats_reply_is_documented_and_every_documented_one_sent(
    real_stats: dict[str, Any],
) -> None:
    found: dict[str, set[str]] = {}
    keys_by_path(real_stats, "", found)
    assert set(real_stats) == set(DOC_STATS)
    for path, keys in found.items():
        if path in NAMED or path.rsplit(".", 1)[0] in NAMED:
            continue
        assert path in DOC_KEYS, f"{path} ({sorted(keys)}) is not in the key table"
        documented = DOC_KEYS[path]
        assert keys <= documented, f"{path}: {sorted(keys - documented)} not documented"
        optional = (set() if path in ("bounds", "workers[].hold_released")
                    else set(schema_of(path).__optional_keys__))
        assert documented - optional <= keys, f"{path}: {sorted(documented - keys)} not sent"
    # A reply reaches every path of the table but those of lists and maps it holds empty.
    assert set(DOC_KEYS) - set(found) <= {"kv.stale.*", "stuck[]"}
    ops = {*protocol.OPS, "none", "unknown"}
    results = {"ok", *(f"error_{code}" for code in protocol.ERROR_CODES)}
    for key in real_stats["requests"]:
        op, _, result = key.partition(":")
        assert op in ops and result in results, key


# ---- the metrics' families and label values ------------------------------------------------


METRICS_DOC = ROOT / "docs" / "metrics.md"


def documented_families() -> dict[str, dict[str, set[str] | None]]:
    """docs/metrics.md's family tables: family -> label -> its listed values (None: open,
    a name or a number)."""
    found: dict[str, dict[str, set[str] | None]] = {}
    for tables_of_section in all_tables(METRICS_DOC.read_text()).values():
        for rows in tables_of_section:
            for row in rows:
                match = re.fullmatch(r"`(kvprefetchd_[a-z_]+)`", row[0])
                if not match:
                    continue
                labels: dict[str, set[str] | None] = {}
                for part in filter(None, (p.strip() for p in row[1].split(";"))):
                    label, _, values = part.partition(":")
                    name = re.fullmatch(r"`([a-z_]+)`(?: \(the state set\))?", label.strip())
                    assert name, f"{match.group(1)}: not a `label`: {label!r}"
                    listed = re.findall(r"`([a-z_0-9+]+)`", values)
                    labels[name.group(1)] = set(listed) or None
                assert found.setdefault(match.group(1), labels) == labels, match.group(1)
    return found


def label_sources() -> dict[tuple[str, str], set[str]]:
    """(family, label) -> the tuple the daemon takes that label's values from."""
    from kvprefetch.stats import ROOT_STATUSES
    from kvprefetchd.config import RESIDENCY_RULES
    from kvprefetchd.engines import ENGINE_TABLE
    from kvprefetchd.metrics.limits import CLOSE_REASONS, SCRAPE_RESULTS
    from kvprefetchd.roots.tiers import KEEPS, WARM_EXTENTS
    from kvprefetchd.worker.holds import RELEASES

    ops = {*protocol.OPS, "none", "unknown"}
    engines = {spec.name for modes in ENGINE_TABLE.values() for spec in modes.values()}
    return {
        ("kvprefetchd_engine_info", "engine"): engines,
        ("kvprefetchd_engine_info", "warm_mode"): set(protocol.WARM_MODES),
        ("kvprefetchd_root_info", "rule"): {*RESIDENCY_RULES, "unknown"} - {"auto"},
        ("kvprefetchd_root_info", "extent"): {*WARM_EXTENTS, "unknown"} - {"auto"},
        ("kvprefetchd_root_info", "keep"): {*KEEPS, "unknown"},
        ("kvprefetchd_root_status", "kvprefetchd_root_status"): set(ROOT_STATUSES),
        ("kvprefetchd_requests_total", "op"): ops,
        ("kvprefetchd_requests_total", "result"): {"ok", *protocol.ERROR_CODES},
        ("kvprefetchd_request_ack_seconds", "op"): ops,
        ("kvprefetchd_metrics_scrapes_total", "result"): set(SCRAPE_RESULTS),
        ("kvprefetchd_metrics_connections_closed_total", "reason"): set(CLOSE_REASONS),
        ("kvprefetchd_files_total", "outcome"): {*protocol.OUTCOMES, "dropped"},
        ("kvprefetchd_hold_released_total", "why"): set(RELEASES),
        ("kvprefetchd_worker_dedup_total", "kind"): {"recent", "in_flight"},
        ("kvprefetchd_worker_probed_total", "outcome"): {"resident", "missing"},
    }


def test_every_listed_label_value_is_its_sources() -> None:
    families = documented_families()
    listed = {(family, label): values for family, labels in families.items()
              for label, values in labels.items() if values is not None}
    # `as kvprefetchd_requests_total's`: the ack histogram's op names the same list.
    listed[("kvprefetchd_request_ack_seconds", "op")] = listed[("kvprefetchd_requests_total",
                                                                "op")]
    assert listed == label_sources()
    assert set(DOC_OUTCOMES) == listed[("kvprefetchd_files_total", "outcome")]


def exposed_name(family: Any) -> str:
    suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
    return f"{family.name}{suffix}"


def test_a_real_daemons_page_is_the_documents(real_stats: dict[str, Any]) -> None:
    """The page of a real reply (one stale profile added: a daemon reports one only after
    minutes of missing files) has exactly the documented families, labels and values."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from kvprefetchd.metrics.exposition import OWN_FAMILY_PREFIXES, render

    stats = cast(Stats, {**real_stats, "kv": {**real_stats["kv"], "profiles": ["m"], "stale": {
        "m": {"fingerprint": "f", "missing": 3, "present": 0, "missing_streak": 3,
              "stale": True, "likely_fingerprint": None, "sibling_fingerprints": [],
              "own_folder": None, "hint": None}}}})
    page = render(stats, openmetrics=True).decode()
    documented = documented_families()
    seen: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(page):
        name = exposed_name(family)
        if name.startswith("process_"):
            continue
        labels = seen.setdefault(name, {})
        for sample in family.samples:
            for label, value in sample.labels.items():
                if label not in ("le",):
                    labels.setdefault(label, set()).add(value)
    # Left out for having nothing to say on this daemon: events (none happened).
    assert set(documented) - set(seen) <= {"kvprefetchd_events_total"}
    for name, labels in seen.items():
        assert name in documented, f"{name} is not in docs/metrics.md"
        assert set(labels) == set(documented[name]), name
        for label, values in labels.items():
            allowed = documented[name][label]
            if name == "kvprefetchd_engine_info" and label == "engine":
                values = {part for value in values for part in value.split("+")}
            assert allowed is None or values <= allowed, (name, label, values - (allowed or set()))
    events = set(real_stats["events"])
    assert not {e for e in events if not e.startswith(OWN_FAMILY_PREFIXES)} - DOC_EVENTS


def documented_events() -> set[str]:
    row = next(row for row in DOC_TABLES["The `stats` reply"] if row[0] == "`events`")
    return set(re.findall(r"`([a-z_]+)`", row[1]))


DOC_EVENTS = documented_events()
