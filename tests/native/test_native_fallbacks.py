"""The fallbacks for kernels without openat2 (< 5.6) or without /proc, forced
on this kernel with kvp_ctx_force_fallback (a testing aid in kvprefetch.h)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

from native_helpers import (
    Batch,
    Ctx,
    KiB,
    Result,
    assert_warm,
    evict,
    new_queue,
    run_queue,
    write_file,
)

from kvprefetchd._native import ffi, lib


def _tree(root: Path, outside: Path) -> None:
    (root / "a" / "b").mkdir(parents=True)
    write_file(root / "a" / "b" / "f", 64 * KiB)
    evict(root / "a" / "b" / "f")
    os.symlink("b/f", root / "a" / "link_in")
    os.symlink("a/b", root / "dirlink")
    os.symlink(outside, root / "abs_out")
    os.mkfifo(root / "fifo")


def test_component_walk_is_stricter(engine: str, root, tmp_path: Path) -> None:
    outside = write_file(tmp_path / "outside", 4096)
    _tree(root.path, outside)
    ctx = Ctx(engine, fallback=lib.KVP_FALLBACK_OPENAT2)
    rels = ["a/b/f", "./a//b/./f", "a/link_in", "dirlink/f", "abs_out", "a/../a/b/f",
            "../outside", "/etc/hostname", "a/nope", "a/b/f/x", "fifo", "a", "x" * 300]
    res = ctx.run(root.fd, rels, 64 * KiB)
    assert [(r.outcome, r.err) for r in res] == [
        ("READ", ""),
        ("READ", ""),
        ("REJECTED", "ELOOP"),  # a symlink inside the root: followed by openat2, not here
        ("REJECTED", "ELOOP"),
        ("REJECTED", "ELOOP"),
        ("REJECTED", "EXDEV"),  # ".." refused outright
        ("REJECTED", "EXDEV"),
        ("REJECTED", "EXDEV"),
        ("MISSING", "ENOENT"),
        ("MISSING", "ENOTDIR"),
        ("REJECTED", "ENODEV"),
        ("REJECTED", "EISDIR"),
        ("REJECTED", "ENAMETOOLONG"),
    ]
    assert res[0] == Result("READ", "", 64 * KiB, 64 * KiB)
    assert_warm(root.path / "a" / "b" / "f", 64 * KiB)


def test_reopen_without_proc(engine: str, root, tmp_path: Path) -> None:
    outside = write_file(tmp_path / "outside", 4096)
    _tree(root.path, outside)
    for which in (lib.KVP_FALLBACK_PROC, lib.KVP_FALLBACK_PROC | lib.KVP_FALLBACK_OPENAT2):
        evict(root.path / "a" / "b" / "f")
        ctx = Ctx(engine, fallback=which)
        res = ctx.run(root.fd, ["a/b/f", "a/link_in", "abs_out", "fifo"], 64 * KiB)
        link = ("READ", "") if which == lib.KVP_FALLBACK_PROC else ("REJECTED", "ELOOP")
        assert [(r.outcome, r.err) for r in res] == [
            ("READ", ""),
            link,
            ("REJECTED", "EXDEV" if which == lib.KVP_FALLBACK_PROC else "ELOOP"),
            ("REJECTED", "ENODEV"),
        ]
        assert_warm(root.path / "a" / "b" / "f", 64 * KiB)


def test_socket_under_the_walk(engine: str, root, monkeypatch) -> None:
    monkeypatch.chdir(root.path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("s")
    try:
        res = Ctx(engine, fallback=lib.KVP_FALLBACK_OPENAT2 | lib.KVP_FALLBACK_PROC).run(
            root.fd, ["s"], 4096)
    finally:
        sock.close()
    assert [(r.outcome, r.err) for r in res] == [("REJECTED", "ENODEV")]


def test_a_queue_takes_a_fallback_from_another_thread_while_it_serves(root: Any) -> None:
    """kvp_queue_force_fallback may be called from any thread while the queue's own threads
    open files (the flags are atomics, internal.h): here from a second thread, with a burst
    in flight. Every file of the burst settles by one walk or the other, and from then on the
    queue's threads walk (a symlink inside the root: followed by openat2, refused by the
    walk). That the store itself is race-free is for a thread sanitizer, not this test."""
    (root.path / "a" / "b").mkdir(parents=True)
    names = [f"a/b/f{i}" for i in range(64)]
    for name in names:
        write_file(root.path / name, 16 * KiB)
    os.symlink("b/f0", root.path / "a" / "link_in")
    queue = new_queue(initial_depth=4, max_threads=4)
    first = Batch(root.fd, ["a/link_in"], 16 * KiB)
    run_queue(queue, first)
    assert [(r.outcome, r.err) for r in first.results()] == [("READ", "")]  # openat2's

    burst = Batch(root.fd, names, 16 * KiB)
    forcer = threading.Thread(
        target=lambda: lib.kvp_queue_force_fallback(queue, lib.KVP_FALLBACK_OPENAT2))
    stats = ffi.new("struct kvp_queue_stats *")
    lib.kvp_queue_stats(queue, stats)
    assert stats.threads >= 1  # the queue's threads are alive while the flag is written
    serving = threading.Thread(target=run_queue, args=(queue, burst))
    serving.start()
    forcer.start()
    forcer.join()
    serving.join()
    assert [(r.outcome, r.err) for r in burst.results()] == [("READ", "")] * len(names)

    after = Batch(root.fd, ["a/link_in", "a/b/f1"], 16 * KiB)
    run_queue(queue, after)
    assert [(r.outcome, r.err) for r in after.results()] == [("REJECTED", "ELOOP"), ("READ", "")]
