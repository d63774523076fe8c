"""A small but real kvprefetchd stand-in for the client tests.

It listens on a real Unix socket and speaks protocol v1 with the test harness's framing
(kvharness.wire, not the client's), so a framing bug in the client cannot hide behind the
same bug in the server.
Knobs on the instance make it misbehave in the ways a real daemon can: slow replies,
out-of-order `wait` replies, error replies, hang-ups, restarts, dribbled frames, refused
peers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

from kvharness.wire import FrameSplitter, pack, unpack


class FakeDaemon:
    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: list[dict[Any, Any]] = []  # every decoded request, in arrival order
        self.connections = 0  # accepted so far
        self.replies_sent = 0  # whole replies written to a socket so far
        self._sent = threading.Condition()
        # Knobs.
        self.hold_waits = 0  # hold `wait` replies until this many, then send them reversed
        self.delay_s: dict[str, float] = {}  # op -> seconds before its reply
        self.fail_with: dict[str, tuple[str, str]] = {}  # op -> (code, message)
        self.hang_up_on: set[str] = set()  # ops that make the daemon close the connection
        self.wrong_id = False  # echo a different id (a daemon bug)
        self.dribble_s = 0.0  # pause this long between the first 3 bytes and the rest
        # Refuse every connection as the daemon refuses a peer it does not allow: a
        # `forbidden` reply without id as soon as it is accepted, then closed, unread.
        self.refuse = False
        self.refused = threading.Event()  # set once a connection was refused and closed
        self.max_frame = 16 * 1024 * 1024
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._held: list[tuple[socket.socket, threading.Lock, dict[str, Any]]] = []
        self._listener: socket.socket | None = None
        self._acceptor = threading.Thread()
        self.start()

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(16)
        listener.settimeout(0.02)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, args=(listener,), daemon=True)
        self._acceptor.start()

    def stop(self) -> None:
        """Close everything, as a daemon exiting would: clients see EOF."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        # The acceptor first, so no connection it is accepting right now escapes the close.
        self._acceptor.join()
        listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
            threads, self._threads = self._threads, []
            self._held.clear()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=5)
        for conn in conns:
            conn.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def restart(self) -> None:
        self.stop()
        self.start()

    def requests(self, op: str) -> list[dict[Any, Any]]:
        return [r for r in self.seen if r.get("op") == op]

    # --- serving --------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            if self.refuse:
                with contextlib.suppress(OSError):
                    conn.sendall(pack(_error(None, "forbidden", "this user may not")))
                conn.close()
                self.refused.set()
                continue
            conn.settimeout(None)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._conns.append(conn)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()
        frames = FrameSplitter(self.max_frame)
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            frames.max_frame = self.max_frame  # a knob: it may change while connected
            for payload in frames.feed(data):
                if payload is None:
                    # The body is never read, so the id is unknown: the reply carries none.
                    self._send(conn, send_lock, _error(None, "too_large", "frame too large"))
                    continue
                request = unpack(payload)
                with self._lock:
                    self.seen.append(request)
                if request.get("op") in self.hang_up_on:
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
                    return
                self._answer(conn, send_lock, request)

    def _answer(self, conn: socket.socket, send_lock: threading.Lock, req: dict[Any, Any]) -> None:
        rid = req.get("id")
        op = req.get("op")
        if not isinstance(rid, int) or not isinstance(op, str) or "v" not in req:
            reply = _error(rid if isinstance(rid, int) else None, "bad_request", "envelope")
        elif req["v"] != 1:
            reply = _error(rid, "unsupported_version", f"version {req['v']!r}")
        elif op in self.fail_with:
            reply = _error(rid, *self.fail_with[op])
        elif op not in HANDLERS:
            reply = _error(rid, "unknown_op", f"no op {op!r}")
        else:
            try:
                reply = {"id": rid, "ok": True, **HANDLERS[op](self, req)}
            except BadRequest as exc:
                reply = _error(rid, "bad_request", str(exc))
        if self.wrong_id and isinstance(rid, int):
            reply["id"] = rid + 1000
        if req.get("wait") is True and self.hold_waits:
            with self._lock:
                self._held.append((conn, send_lock, reply))
                if len(self._held) < self.hold_waits:
                    return
                held, self._held = self._held[::-1], []
            for held_conn, held_lock, held_reply in held:
                self._send(held_conn, held_lock, held_reply)
            return
        delay = self.delay_s.get(str(op), 0.0)
        if delay:
            timer = threading.Timer(delay, self._send, (conn, send_lock, reply))
            timer.daemon = True
            timer.start()
        else:
            self._send(conn, send_lock, reply)

    def _send(self, conn: socket.socket, send_lock: threading.Lock, reply: dict[str, Any]) -> None:
        frame = pack(reply)
        with send_lock, contextlib.suppress(OSError):
            if self.dribble_s:
                conn.sendall(frame[:3])
                time.sleep(self.dribble_s)
                conn.sendall(frame[3:])
            else:
                conn.sendall(frame)
        with self._sent:
            self.replies_sent += 1
            self._sent.notify_all()

    def wait_replies_sent(self, count: int, timeout: float = 10.0) -> None:
        """Block until `count` replies in all were written (a late one is then waiting on
        the client's socket): the state a test waits for instead of sleeping its delay."""
        with self._sent:
            if not self._sent.wait_for(lambda: self.replies_sent >= count, timeout):
                raise AssertionError(f"{self.replies_sent} replies sent in {timeout} s, "
                                     f"not {count}")


class BadRequest(Exception):
    pass


def _error(rid: int | None, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"code": code, "message": message}}


def _ping(daemon: FakeDaemon, req: dict[Any, Any]) -> dict[str, Any]:
    return {"version": "0.0-fake", "protocol": 1, "engine": "pread", "workers": 2}


def _is_abs(path: str | bytes) -> bool:
    return path.startswith("/") if isinstance(path, str) else path.startswith(b"/")


def _counts(paths: list[Any], req: dict[Any, Any]) -> dict[str, Any]:
    for key in ("read_bytes", "timeout_ms"):
        if key in req and not isinstance(req[key], int):
            raise BadRequest(f"{key} must be an integer")
    if not isinstance(req.get("wait", False), bool):
        raise BadRequest("wait must be a bool")
    accepted = [p for p in paths if _is_abs(p)]
    reply: dict[str, Any] = {
        "accepted": len(accepted),
        "dropped": 0,
        "rejected": len(paths) - len(accepted),
    }
    if req.get("wait"):
        missing = sum(
            1 for p in accepted if (b"missing" if isinstance(p, bytes) else "missing") in p
        )
        reply["outcomes"] = {"read": len(accepted) - missing, "missing": missing}
        reply["elapsed_us"] = 1234
    return reply


def _prefetch(daemon: FakeDaemon, req: dict[Any, Any]) -> dict[str, Any]:
    paths = req.get("paths")
    if not isinstance(paths, list) or not all(isinstance(p, str | bytes) for p in paths):
        raise BadRequest("paths must be an array of paths")
    if "/refuse" in paths:
        raise BadRequest("refused on request")
    return _counts(paths, req)


def _kv_paths(req: dict[Any, Any]) -> list[str]:
    if not (isinstance(req.get("model"), str) or ("hash" in req and "layout" in req)):
        raise BadRequest("model, or hash and layout, required")
    hashes = req.get("block_hashes")
    if not isinstance(hashes, list) or not all(
        isinstance(h, bytes) and len(h) == 32 for per_prompt in hashes for h in per_prompt
    ):
        raise BadRequest("this fake only takes block_hashes: arrays of 32-byte bin")
    return [f"/kv/{h.hex()[:12]}.bin" for per_prompt in hashes for h in per_prompt]


def _prefetch_blocks(daemon: FakeDaemon, req: dict[Any, Any]) -> dict[str, Any]:
    paths = _kv_paths(req)
    return {**_counts(paths, req), "files": len(paths)}


def _resolve(daemon: FakeDaemon, req: dict[Any, Any]) -> dict[str, Any]:
    hashes = [[h.hex() for h in per_prompt] for per_prompt in req["block_hashes"]]
    return {"block_hashes": hashes, "paths": _kv_paths(req)}


def _stats(daemon: FakeDaemon, req: dict[Any, Any]) -> dict[str, Any]:
    return {
        "stats": {
            "requests": len(daemon.seen),
            "files": {"read": 3, "missing": 1},
            "workers": {0: {"queue": 0}, 1: {"queue": 2}},  # integer keys, as a daemon may
            "uptime_s": 1.5,
        }
    }


HANDLERS = {
    "ping": _ping,
    "prefetch": _prefetch,
    "prefetch_blocks": _prefetch_blocks,
    "resolve": _resolve,
    "stats": _stats,
}
