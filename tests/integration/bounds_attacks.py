"""Costly requests and hogging clients (issue 14, items 1, 4 and 7), and how to measure them.

Shared by the regression tests (test_request_bounds.py, test_memory_bounds.py,
test_connection_bounds.py) and, run as a script, by the before/after figures of the issue:

    .venv/bin/python tests/integration/bounds_attacks.py [ATTACK ...]
    PYTHONPATH=/tmp/base/daemon:/tmp/base/clients/python .venv/bin/python \\
        tests/integration/bounds_attacks.py            # the same against another checkout

Each figure is read from /proc, not from the daemon: supervisor CPU seconds (utime +
stime) spent while the attack ran, the peak RSS growth (VmHWM, reset before the
attack through /proc/PID/clear_refs), and the latency of a ping another client sends
every 50 ms meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from kvharness.wire import HEADER, pack
from kvharness.wire import frame as wire_frame

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MIB = 1 << 20
HASH = {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
        "vllm_version": "0.23.0"}


frame = pack  # one message as a frame (kvharness.wire)


def inline_layout(root: str, **extra: Any) -> dict[str, Any]:
    return {"root_dir": root, "model_name": "org/model", "fingerprint": "0123456789ab",
            "kv_cache_groups": [{"block_size": 16}], "connector_block_size_tokens": 16,
            **extra}


# ---- the costly frames (item 1) -------------------------------------------------------------

def huge_tp_resolve(root: str) -> bytes:
    """~300 bytes: no full block, so no file, but 2**40 ranks to plan paths for."""
    return frame({"v": 1, "id": 1, "op": "resolve", "hash": HASH,
                  "layout": inline_layout(root, tp_size=2**40),
                  "prompts": [{"token_ids": [1, 2, 3]}]})


def overflowing_resolve(root: str) -> bytes:
    """tp x pp >= 2**63: the rank count no longer fits a C ssize_t."""
    return frame({"v": 1, "id": 1, "op": "resolve", "hash": HASH,
                  "layout": inline_layout(root, tp_size=2**32, pp_size=2**32),
                  "prompts": [{"token_ids": [1, 2, 3]}]})


def nested_arrays(count: int = 1_000_000, depth: int = 13) -> bytes:
    """`count` chains of `depth` arrays (14 MB at the defaults), under max_nesting_depth."""
    chain = b"\x91" * depth + b"\x00"
    fields = b"".join(msgpack.packb(x) for x in ("v", 1, "id", 1, "op", "ping", "x"))
    body = b"\x84" + fields + b"\xdd" + struct.pack(">I", count) + chain * count
    return wire_frame(body)


def block_size_one(root: str, tokens: int = 1_000_000) -> bytes:
    """An inline profile hashing one block per token: a million sha256 chain steps."""
    return frame({"v": 1, "id": 1, "op": "prefetch_blocks",
                  "hash": {**HASH, "block_size": 1},
                  "layout": inline_layout(root, kv_cache_groups=[{"block_size": 1}],
                                          connector_block_size_tokens=256),
                  "prompts": [{"token_ids": [7] * tokens}]})


def many_groups(root: str, groups: int = 65_536, tp: int = 16) -> bytes:
    return frame({"v": 1, "id": 1, "op": "resolve", "hash": HASH,
                  "layout": inline_layout(root, tp_size=tp,
                                          kv_cache_groups=[{"block_size": 16}] * groups),
                  "prompts": [{"token_ids": list(range(16))}]})


def big_reply_resolve(root: str, hashes: int = 65_536, tp: int = 4) -> bytes:
    """2.2 MB asking for 262,144 paths of ~300 bytes and 65,536 hex hashes: ~82 MB of reply."""
    long_root = root + "/" + "r" * 150
    chain = [i.to_bytes(32, "big") for i in range(hashes)]
    return frame({"v": 1, "id": 1, "op": "resolve", "hash": HASH,
                  "layout": inline_layout(long_root, tp_size=tp),
                  "block_hashes": [chain]})


def stale_fingerprint_request(root: str, index: int) -> bytes:
    """A KV request whose inline fingerprint is new each time (its file is missing)."""
    return frame({"v": 1, "id": index + 1, "op": "prefetch_blocks", "hash": HASH,
                  "layout": inline_layout(root, fingerprint=f"{index:012x}"),
                  "block_hashes": [[index.to_bytes(32, "big")]]})


def spellings(root: str, name: str, count: int, max_path_bytes: int = 4096) -> Iterator[str]:
    """`count` different spellings of root/name, padded with `./` and `//`."""
    room = (max_path_bytes - len(root) - len(name) - 8) // 2
    for index in range(count):
        dots, slashes = index % room, index // room
        yield f"{root}/{'./' * dots}{'/' * slashes}{name}"


# ---- figures from /proc ------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (proc(5))


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> None:
    """VmHWM back to the current RSS (proc(5): writing 5 to clear_refs, Linux 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_growth_mib(pid: int, rss_before_kib: int) -> float:
    return (status_kib(pid, "VmHWM") - rss_before_kib) / 1024


class Pinger(threading.Thread):
    """Another client: a ping every `interval` s on its own connection, latencies kept."""

    def __init__(self, socket_path: str, interval: float = 0.05, timeout: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.socket_path = socket_path
        self.interval = interval
        self.timeout = timeout
        self.latencies: list[float] = []
        self.failures = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            started = time.monotonic()
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(self.timeout)
                    sock.connect(self.socket_path)
                    sock.sendall(frame({"v": 1, "id": 1, "op": "ping"}))
                    read_reply(sock)
                self.latencies.append(time.monotonic() - started)
            except OSError:
                self.failures += 1
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(self.timeout + 1)

    @property
    def worst_ms(self) -> float:
        return max(self.latencies, default=float("nan")) * 1e3


def read_reply(sock: socket.socket) -> dict[str, Any]:
    """One whole reply frame from a blocking socket (its size in `_bytes`)."""
    data = b""
    while len(data) < 4:
        chunk = sock.recv(4 - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    (length,) = HEADER.unpack(data)
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(min(1 << 20, length - len(body)))
        if not chunk:
            raise ConnectionError("closed mid-reply")
        body += chunk
    reply: dict[str, Any] = msgpack.unpackb(bytes(body), raw=False, strict_map_key=False)
    reply["_bytes"] = length
    return reply


@dataclass
class Figures:
    cpu_s: float
    peak_mib: float
    ping_worst_ms: float
    ping_failures: int
    pings: int
    result: str
    extra: dict[str, Any] = field(default_factory=dict)

    def line(self, name: str) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.extra.items())
        return (f"{name:<22} cpu={self.cpu_s:6.2f}s peak_rss=+{self.peak_mib:7.1f}MiB "
                f"ping_worst={self.ping_worst_ms:8.1f}ms ping_failed={self.ping_failures}"
                f"/{self.pings + self.ping_failures} result={self.result}{extra}")


@contextlib.contextmanager
def measured(pid: int, socket_path: str) -> Iterator[dict[str, Any]]:
    """CPU, peak RSS and a pinger around the body; the figures land in the yielded dict."""
    reset_peak(pid)
    rss_before = status_kib(pid, "VmRSS")
    cpu_before = cpu_seconds(pid)
    pinger = Pinger(socket_path)
    pinger.start()
    out: dict[str, Any] = {}
    try:
        yield out
    finally:
        pinger.stop()
        out["figures"] = Figures(
            cpu_s=cpu_seconds(pid) - cpu_before, peak_mib=peak_growth_mib(pid, rss_before),
            ping_worst_ms=pinger.worst_ms, ping_failures=pinger.failures,
            pings=len(pinger.latencies), result=str(out.get("result", "")),
            extra=out.get("extra", {}),
        )


def send_and_answer(socket_path: str, data: bytes, timeout: float) -> str:
    """Send one frame and describe its reply (or that none came within `timeout`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        try:
            sock.sendall(data)
            reply = read_reply(sock)
        except TimeoutError:
            return f"no reply in {timeout:.0f}s"
        except OSError as error:
            return f"connection: {error}"
    if reply.get("ok"):
        return f"ok ({reply['_bytes']} bytes)"
    return f"{reply['error']['code']}: {reply['error']['message'][:90]}"


def hold_connections(socket_path: str, count: int) -> list[socket.socket]:
    out = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path)
        out.append(sock)
    return out


def push_partial_frames(socks: list[socket.socket], frame_bytes: int,
                        patience: float = 1.0) -> int:
    """Start a frame of `frame_bytes` on every socket and send all of it but its last byte,
    round robin, until done or the daemon took nothing for `patience` s. Bytes sent."""
    header = HEADER.pack(frame_bytes)
    left = {sock: header + b"\xc0" * (frame_bytes - 1) for sock in socks}
    for sock in socks:
        sock.setblocking(False)
    sent = 0
    idle_since = time.monotonic()
    while left and time.monotonic() - idle_since < patience:
        progressed = False
        for sock in list(left):
            try:
                n = sock.send(left[sock][: 1 << 20])
            except BlockingIOError:
                continue
            except OSError:
                del left[sock]
                continue
            sent += n
            progressed = True
            left[sock] = left[sock][n:]
            if not left[sock]:
                del left[sock]
        if progressed:
            idle_since = time.monotonic()
        else:
            time.sleep(0.01)
    return sent


# ---- the script: every attack against a fresh daemon ----------------------------------------

def _run(name: str, tmp: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvharness.daemon import start_cli as start_daemon

    config = tmp / "attack.toml"
    config.write_text("allow_inline_layouts = false\n" if name == "inline_refused" else "")
    daemon = start_daemon(tmp, "--config", str(config), "--log-level", "info")
    pid, path, root = daemon.process.pid, daemon.socket_path, str(daemon.root)
    window = 15.0
    try:
        with measured(pid, path) as out:
            if name in ("huge_tp", "overflow", "nested", "block_size_1", "many_groups",
                        "inline_refused"):
                data = {
                    "huge_tp": lambda: huge_tp_resolve(root),
                    "overflow": lambda: overflowing_resolve(root),
                    "nested": nested_arrays,
                    "block_size_1": lambda: block_size_one(root),
                    "many_groups": lambda: many_groups(root),
                    "inline_refused": lambda: huge_tp_resolve(root),
                }[name]()
                out["result"] = send_and_answer(path, data, window)
            elif name in ("big_reply", "big_reply_tp1"):
                tp = 4 if name == "big_reply" else 1
                out["result"] = send_and_answer(path, big_reply_resolve(root, tp=tp), window)
            elif name in ("non_readers", "non_readers_tp1"):
                tp = 4 if name == "non_readers" else 1
                socks = hold_connections(path, 10)
                for sock in socks:
                    sock.sendall(big_reply_resolve(root, tp=tp))
                time.sleep(8)
                out["result"] = "10 clients not reading"
            elif name == "pipelined":
                layout = inline_layout(root, tp_size=1024, kv_cache_groups=[{"block_size": 16}] * 8)
                frames = b"".join(frame({"v": 1, "id": i, "op": "resolve", "hash": HASH,
                                         "layout": layout,
                                         "prompts": [{"token_ids": list(range(16))}]})
                                  for i in range(300))
                hog = hold_connections(path, 1)[0]
                threading.Thread(target=hog.sendall, args=(frames,), daemon=True).start()
                time.sleep(3)
                out["result"] = "300 resolves of 1.4 MB replies, not read"
            elif name == "deadlines":
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.connect(path)
                    wait = {"v": 1, "op": "prefetch", "paths": [root + "/absent"],
                            "wait": True, "timeout_ms": 10**12}
                    for start in range(0, 20_000, 500):
                        sock.sendall(b"".join(frame({**wait, "id": i})
                                              for i in range(start, start + 500)))
                        for _ in range(500):
                            read_reply(sock)
                    sock.sendall(frame({"v": 1, "id": 9, "op": "stats"}))
                    stats = read_reply(sock)["stats"]
                out["result"] = "20000 waits with timeout_ms=10**12"
                out["extra"] = {"deadlines": stats.get("bounds", {}).get("deadlines", "n/a")}
            elif name == "slowloris":
                socks = hold_connections(path, 40)
                sent = push_partial_frames(socks, 16 * MIB - 1)
                time.sleep(1)
                out["result"] = f"{sent / MIB:.0f} MiB taken"
            elif name == "stale_map":
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.connect(path)
                    count = 20_000
                    for start in range(0, count, 500):
                        sock.sendall(b"".join(stale_fingerprint_request(root, i)
                                              for i in range(start, start + 500)))
                        for _ in range(500):
                            read_reply(sock)
                    time.sleep(1)
                    sock.sendall(frame({"v": 1, "id": 9, "op": "stats"}))
                    stats = read_reply(sock)
                out["result"] = f"{count} fingerprints"
                out["extra"] = {"stats_reply_bytes": stats["_bytes"],
                                "stale_entries": len(stats["stats"]["kv"]["stale"])}
            else:
                raise SystemExit(f"unknown attack {name}")
        line: str = out["figures"].line(name)
        try:
            daemon.stop(timeout=10)
        except subprocess.TimeoutExpired:
            line += " SIGTERM_not_honoured_in_10s"
        return line
    finally:
        if daemon.process.poll() is None:
            daemon.process.kill()
            daemon.process.wait()


def _dedup_run(tmp: Path) -> str:
    """131,072 spellings of one file: the RSS growth of the worker that owns it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvharness.daemon import start_cli as start_daemon

    daemon = start_daemon(tmp, "--log-level", "info", "--workers", "1")
    try:
        (daemon.root / "f.bin").write_bytes(b"x" * 4096)
        worker = daemon.worker_pids()[0]
        before = status_kib(worker, "VmRSS")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(daemon.socket_path)
            names = list(spellings(str(daemon.root), "f.bin", 131_072))
            for start in range(0, len(names), 2048):
                sock.sendall(frame({"v": 1, "id": 1, "op": "prefetch", "wait": True,
                                    "paths": names[start:start + 2048]}))
                read_reply(sock)
        grown = (status_kib(worker, "VmRSS") - before) / 1024
        stats = daemon.call("stats")["stats"]["workers"][0]
        return (f"{'dedup_spellings':<22} worker_rss=+{grown:.1f}MiB "
                f"dedup_recent={stats['dedup_recent']}")
    finally:
        daemon.stop(timeout=10)


ATTACKS = ["huge_tp", "overflow", "inline_refused", "nested", "block_size_1", "many_groups",
           "big_reply", "big_reply_tp1", "non_readers", "non_readers_tp1", "pipelined",
           "slowloris", "stale_map", "deadlines", "dedup"]


def main(names: list[str]) -> None:
    for name in names or ATTACKS:
        with tempfile.TemporaryDirectory(prefix="kvp-attack-") as tmp:
            line = _dedup_run(Path(tmp)) if name == "dedup" else _run(name, Path(tmp))
        print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
