"""Warm the heads of a list of files through kvprefetchd._native in ONE batch:
the Python-side twin of uring_heads.c, printing the same JSON line.

  python bench/c/native_heads.py -f LIST -e uring_read -b 1M -c 1M -q 128 -t 32 -o 1024 [-R] [-P]

All paths in LIST must share one directory (it becomes the root); the batch is
built before the clock starts, so "seconds" is kvp_run_batch alone.  -b is the
request's read_bytes; -P applies the page-cache residency rule (so a warm set
measures the skip) instead of none.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kvprefetchd._native import ffi, lib

# -e label -> a row of the native engine table (kvp_engines): engine, warm mode.
ENGINES = {
    "pread": (b"pread", b"read"),
    "fadvise": (b"fadvise", b"advise"),
    "uring_read": (b"io_uring", b"read"),
    "uring_fadvise": (b"io_uring", b"advise"),
}


def size(text: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1].lower(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-f", required=True)
    ap.add_argument("-e", choices=ENGINES, default="uring_read")
    ap.add_argument("-b", type=size, default=1 << 20)
    ap.add_argument("-c", type=size, default=1 << 20)
    ap.add_argument("-q", type=int, default=128)
    ap.add_argument("-t", type=int, default=1)
    ap.add_argument("-o", type=int, default=1024)
    ap.add_argument("-R", action="store_true")
    ap.add_argument("-P", action="store_true")
    a = ap.parse_args()
    with open(a.f) as f:
        paths = [p for p in f.read().splitlines() if p]
    root = os.path.dirname(paths[0])
    assert all(os.path.dirname(p) == root for p in paths), "one directory please"
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    engine, warm_mode = (ffi.new("char[]", name) for name in ENGINES[a.e])
    cfg = ffi.new("struct kvp_config *", {"engine": engine, "warm_mode": warm_mode,
                                          "fadv_random": int(a.R), "chunk": a.c,
                                          "queue_depth": a.q, "threads": a.t, "max_open": a.o})
    err = ffi.new("int *")
    ctx = lib.kvp_ctx_new(cfg, err)
    if ctx == ffi.NULL:
        raise OSError(err[0], os.strerror(err[0]))
    items = ffi.new("struct kvp_item[]", len(paths))
    names = [ffi.new("char[]", os.path.basename(p).encode()) for p in paths]
    rule = lib.KVP_RES_PAGECACHE if a.P else lib.KVP_RES_OFF
    for it, name in zip(items, names, strict=True):
        it.root_fd, it.residency, it.rel, it.read_bytes = root_fd, rule, name, a.b
    t0 = time.monotonic()
    rc = lib.kvp_run_batch(ctx, items, len(paths))
    secs = time.monotonic() - t0
    outcomes = [it.outcome for it in items]
    print(json.dumps({"files": len(paths), "bytes": sum(it.done for it in items),
                      "seconds": round(secs, 4), "engine": a.e, "rc": rc,
                      "read": outcomes.count(lib.KVP_OUT_READ),
                      "resident": outcomes.count(lib.KVP_OUT_RESIDENT)}))
    lib.kvp_ctx_free(ctx)


if __name__ == "__main__":
    main()
