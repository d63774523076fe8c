"""The channel between supervisor and workers: every record round-trips, compactly, and
only channel.py knows a record's wire order.

Two rules are read from the code itself (its AST), so they hold for code not written yet:
- nowhere but channel.py is a channel record indexed by position: no integer subscript
  of a record or of a record's field (`record[0]`, `message.settled[3]`, `bulk[4]`), no
  msgpack but the public protocol's, no ticket or share layout arithmetic;
- the worker package loads no supervisor, listeners or ops module, directly or through
  another of the daemon's modules, at module level, in a function or under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import select
import socket
import time
from pathlib import Path
from typing import get_type_hints

import pytest

from kvprefetchd import channel
from kvprefetchd.channel import (
    CHECK,
    EVICT_FILE,
    UNFOLLOWED,
    BootFailed,
    Bulk,
    ChannelReader,
    Check,
    Done,
    Evict,
    Looked,
    Message,
    Ready,
    Root,
    RootTier,
    Settled,
    Share,
    Verdict,
    Warm,
    decode,
    encode,
    index_of,
    share_id_of,
    ticket_of,
)
from kvprefetchd.protocol import HEADER

PACKAGE = Path(channel.__file__).resolve().parent
SHARE = Share.of([0, 3, 65535], [b"a.bin", "é/b.bin".encode(), b"c"])


def round_trip(message: Message) -> Message:
    data = encode(message)
    (length,) = HEADER.unpack_from(data)
    assert length == len(data) - HEADER.size
    return decode(data[HEADER.size:])


# ---- records ---------------------------------------------------------------------------------


def test_tickets_name_a_share_and_an_index_and_unfollowed_is_none() -> None:
    for share_id, index in [(1, 0), (7, 5), (2**39, 2**24 - 1)]:
        ticket = ticket_of(share_id, index)
        assert (share_id_of(ticket), index_of(ticket)) == (share_id, index)
        assert ticket != UNFOLLOWED


def test_a_share_keeps_its_files_in_two_buffers() -> None:
    assert SHARE.count == 3
    assert list(SHARE.root_indexes()) == [0, 3, 65535]
    assert SHARE.names() == [b"a.bin", "é/b.bin".encode(), b"c"]
    assert len(SHARE.roots) == Share.roots_size(3)
    assert SHARE.paths.count(b"\0") == 3


@pytest.mark.parametrize("message", [
    Warm(SHARE, 4, 1 << 20, "read", 12.5, 3, 9),
    Warm(SHARE, UNFOLLOWED, 4096, "advise"),
    Check(SHARE, 5, 65536),
    Evict(SHARE, 6, 65536, whole=True),
    Ready("io_uring", 1234, "cannot renice"),
    BootFailed("NoEngine: none"),
], ids=lambda message: type(message).__name__)
def test_flat_messages_round_trip(message: Message) -> None:
    assert round_trip(message) == message


def test_a_root_message_round_trips_and_its_fd_goes_beside() -> None:
    tier = RootTier("hold", True, "/var/cache/*", True, 8)
    let_go = round_trip(Root(2, 1, tier))
    assert let_go == Root(2, 1, tier, -1)
    opened = round_trip(Root(2, 1, tier, fd=99))
    assert isinstance(opened, Root) and opened.fd == 0  # "one travels beside"


def filled_done() -> Done:
    done = Done(counters={"batches": 2}, unfollowed={"read": 3, "missing": 1},
                unfollowed_bytes=8192, latency_counts=[1, 0, 2], latency_sum=0.25,
                queue={"threads": 4, "depth": {"0": [8, 120]}},
                verdicts=[Verdict(0, "kept"), Verdict(0, "dropped")])
    done.settled.add(ticket_of(1, 0), "missing", 0, 2)
    done.settled.add(ticket_of(1, 7), "futile", 4096)
    done.settled.add_run(3, [2, 4], "expired")
    done.looked.add(ticket_of(2, 1), "resident", 0, 100, 100, 0)
    done.looked.add(ticket_of(2, 2), "failed", 18)
    warm = Bulk(4, "read")
    warm.add_one(3, 65536)
    warm.add([5, 6])
    done.bulk.append(warm)
    return done


def test_a_done_round_trips_column_by_column() -> None:
    sent = filled_done()
    got = round_trip(sent)
    assert isinstance(got, Done)
    assert list(got.settled.tickets) == [ticket_of(1, 0), ticket_of(1, 7), ticket_of(3, 2),
                                         ticket_of(3, 4)]
    assert got.settled.outcomes == ["missing", "futile", "expired", "expired"]
    assert list(got.settled.nbytes) == [0, 4096, 0, 0]
    assert list(got.settled.errnos) == [2, 0, 0, 0]
    looked = got.looked
    assert list(looked.tickets) == [ticket_of(2, 1), ticket_of(2, 2)]
    assert looked.states == ["resident", "failed"]
    assert (list(looked.errnos), list(looked.sizes), list(looked.cached),
            list(looked.tiers)) == ([0, 18], [100, 0], [100, 0], [0, 0])
    (bulk,) = got.bulk
    assert (bulk.share_id, bulk.outcome, bulk.count, bulk.nbytes) == (4, "read", 3, 65536)
    assert list(bulk.indexes) == [3, 5, 6]
    assert (got.counters, got.unfollowed, got.unfollowed_bytes) == (
        sent.counters, sent.unfollowed, 8192)
    assert (got.latency_counts, got.latency_sum, got.queue) == ([1, 0, 2], 0.25, sent.queue)
    assert got.verdicts == sent.verdicts


def test_an_empty_done_round_trips() -> None:
    got = round_trip(Done())
    assert isinstance(got, Done)
    assert not got.settled and not got.looked and got.bulk == [] and got.verdicts == []


def test_settled_files_cost_a_few_bytes_and_no_object_each() -> None:
    """2x10^4 files not warmed: the wire form is columns (ticket, outcome code, errno;
    bytes read only when some were), and the decoded outcomes share their few strings
    instead of one each. (msgpack lists, one per file, took 16 bytes a file.)"""
    files = 10_000
    done = Done()
    done.settled.add_run(9, range(files), "missing", 2)
    for index in range(files):
        done.settled.add(ticket_of(10, index), "failed", 0, 5)
    data = encode(done)
    assert len(data) < 14 * 2 * files  # 8 + 1 + 4 bytes a file, and a header
    got = round_trip(done)
    assert isinstance(got, Done) and len(got.settled) == 2 * files
    assert got.settled.nbytes.count(0) == 2 * files
    assert len({id(outcome) for outcome in got.settled.outcomes}) == 2


def test_decode_refuses_what_is_not_a_channel_message() -> None:
    import msgpack

    for raw in ([], ["nope"], {"kind": "warm"}, ["ready", "pread"], ["warm", b"", b""],
                ["ready", "pread", 1, "", "extra"]):
        with pytest.raises(ValueError):
            decode(msgpack.packb(raw))


def test_records_name_their_fields_and_carry_no_positional_lists() -> None:
    """What makes positional indexing impossible outside channel.py: every record is a
    class with named fields, none of them a list of mixed values (the one `Any`, `queue`,
    is the stats' own mapping, passed through)."""
    for kind in (Warm, Check, Evict, Root, Ready, BootFailed, Done, Verdict, Share, RootTier):
        assert dataclasses.is_dataclass(kind)
        hints = get_type_hints(kind, vars(channel))
        for name, hint in hints.items():
            if name == "KIND" or (kind is Done and name == "queue"):
                continue
            assert "Any" not in str(hint), f"{kind.__name__}.{name}: {hint}"
            assert "tuple" not in str(hint), f"{kind.__name__}.{name}: {hint}"
    for columns in (Settled, Looked, Bulk):
        assert columns.__slots__, columns  # attributes, not a list


def test_a_reader_pairs_each_root_message_with_its_fd() -> None:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    read_end, write_end = os.pipe()
    try:
        ours.sendall(encode(Warm(SHARE, 1, 4096, "read")))
        socket.send_fds(ours, [encode(Root(0, 1, RootTier(), write_end))], [write_end])
        ours.sendall(encode(Root(1, 1)) + encode(filled_done()))
        reader, messages = ChannelReader(theirs), []
        deadline = time.monotonic() + 10.0
        while len(messages) < 4 and time.monotonic() < deadline:
            select.select([theirs], [], [], 1.0)
            messages += reader.read_available()
        warm, opened, let_go, done = messages
        assert isinstance(warm, Warm) and warm.files == SHARE
        assert isinstance(opened, Root) and opened.fd >= 0 and opened.fd != write_end
        os.write(opened.fd, b"x")  # the very pipe, passed over
        assert os.read(read_end, 1) == b"x"
        os.close(opened.fd)
        assert isinstance(let_go, Root) and let_go.fd == -1
        assert isinstance(done, Done) and len(done.settled) == 4
    finally:
        for end in (ours, theirs):
            end.close()
        os.close(read_end)
        os.close(write_end)


def test_the_inspect_verbs_are_distinct() -> None:
    assert len({CHECK, EVICT_FILE, channel.EVICT_HEAD}) == 3


# ---- the rules, read from the code ----------------------------------------------------------


def daemon_modules() -> dict[str, Path]:
    """Every module of the daemon package by dotted name (a package by its own name)."""
    root = PACKAGE.parent
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(PACKAGE.rglob("*.py"))}


def record_names() -> tuple[set[str], set[str]]:
    """(names a record goes by: its class in snake case, and what code calls one;
    the fields of records that hold several values) as channel.py defines them."""
    classes = (Warm, Check, Evict, Root, Ready, BootFailed, Done, Verdict, Settled, Looked,
               Bulk, Share, RootTier)
    names = {"record", "message", "report", "done", "settled", "looked", "bulk", "verdict",
             "share", "files", "tier"}
    names |= {kind.__name__.lower() for kind in classes}
    fields: set[str] = set()
    for kind in classes:
        slots = kind.__slots__ if "__slots__" in vars(kind) else ()
        fields |= {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) \
            else set(slots)
    scalars = {"share_id", "read_bytes", "warm_mode", "deadline", "flags", "client", "whole",
               "index", "rule", "fd", "engine", "pid", "problem", "reason", "count",
               "unfollowed_bytes", "latency_sum", "outcome", "root_index", "verdict", "keep",
               "fs_cache", "hold", "depth", "nbytes", "queue", "counters", "unfollowed"}
    return names, (fields - scalars) | {"roots", "paths"}


def positional_uses(source: str) -> list[str]:
    """Integer subscripts and constant slices of a record, or of a record's field."""
    names, fields = record_names()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Subscript):
            continue
        index = node.slice
        constant = (isinstance(index, ast.Constant) and isinstance(index.value, int)) or (
            isinstance(index, ast.Slice) and any(
                isinstance(bound, ast.Constant) for bound in (index.lower, index.upper)))
        if not constant:
            continue
        target = node.value
        if (isinstance(target, ast.Name) and target.id in names) or (
                isinstance(target, ast.Attribute) and target.attr in fields):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_rule_finds_what_the_old_code_did() -> None:
    """The shapes issue 26 found: books.py's `record[0]`, `record[4:7]`; a bulk record
    unpacked by index; a Warm's share read by its byte layout."""
    old = ("ticket = record[0]\nsize, cached, tier = record[4:7]\n"
           "first = message.settled[0]\nshare_id = bulk[0]\nroot = message.roots[0:2]\n")
    assert len(positional_uses(old)) == 5
    assert positional_uses("x = counts[0]\ny = waiter.outcomes[outcome]\n") == []


def test_no_module_but_the_channel_indexes_a_record_by_position() -> None:
    found = {}
    for name, path in daemon_modules().items():
        if name == "kvprefetchd.channel":
            continue
        uses = positional_uses(path.read_text())
        if uses:
            found[name] = uses
    assert found == {}


def test_no_module_but_the_channel_knows_the_wire() -> None:
    """msgpack only in channel.py and protocol.py (the public protocol's frames); the
    ticket's bit layout and the share's root-index type nowhere else."""
    private = {"TICKET_INDEX_BITS", "_TICKET_INDEX_MASK", "ROOT_INDEX_TYPE"}
    found = []
    for name, path in daemon_modules().items():
        if name in ("kvprefetchd.channel", "kvprefetchd.protocol"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                found += [f"{name}: imports {m}" for m in modules if m.startswith("msgpack")]
            if isinstance(node, ast.Name | ast.alias):
                used = node.id if isinstance(node, ast.Name) else node.name
                if used in private:
                    found.append(f"{name}: {used}")
    assert found == []


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The daemon's modules one module loads, anywhere in its body (in a function, under
    TYPE_CHECKING), with the packages their import runs (a.b.c runs a and a.b)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets += [f"{base}.{alias.name}" for alias in node.names] + [base]
    loaded = set()
    for target in targets:
        while target:
            if target in modules:
                loaded.add(target)
            target = target.rpartition(".")[0]
    return loaded - {name}


def test_the_worker_loads_no_supervisor_listener_or_ops_module() -> None:
    paths = daemon_modules()
    modules = set(paths)
    forbidden = ("kvprefetchd.supervisor", "kvprefetchd.listeners", "kvprefetchd.ops")
    start = [name for name in modules if name.startswith("kvprefetchd.worker")]
    seen: dict[str, str] = {name: name for name in start}  # module -> who loaded it
    todo = list(start)
    while todo:
        current = todo.pop()
        for loaded in imports_of(paths[current], current, modules):
            if loaded not in seen:
                seen[loaded] = current
                todo.append(loaded)
    bad = {name: seen[name] for name in seen if name.startswith(forbidden)}
    assert bad == {}, f"module -> the worker-side module that loads it: {bad}"
    assert "kvprefetchd.channel" in seen  # the walk does see the worker's imports


def test_every_message_kind_is_known_to_the_decoder() -> None:
    for kind in (Warm, Check, Evict, Root, Ready, BootFailed, Done):
        assert channel._KINDS[kind.KIND] is kind
