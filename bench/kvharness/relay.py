"""A TCP relay that delays every byte by a fixed one-way time: the network a warm-up request
crosses between a gateway host and a GPU node, where `tc netem` is not available (this
project's CI kernel has no sch_netem: "Specified qdisc kind is unknown").

Each direction of each connection is a queue of (due time, bytes): a reader thread stamps
what it reads `delay` ahead, a writer thread sends it in order once due, so the round trip
gains 2 x delay and nothing is reordered. Threads and time.sleep, not asyncio: an event
loop's poll rounds its timeouts up to whole milliseconds, which swamps a 0.1 ms delay.
Run it in a network namespace with `ip netns exec`:

    python -m kvharness.relay --listen 127.0.0.1:7475 --to 10.77.0.2:7474 --delay-ms 1
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable


def pump(source: socket.socket, sink: socket.socket, delay: float,
         seen: Callable[[bytes], None] | None = None) -> None:
    """Copy source to sink, each chunk `delay` seconds late; `seen` is shown every chunk
    as read (a proxy that counts the requests crossing it: realtier.py)."""
    pending: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

    def deliver() -> None:
        while True:
            due, data = pending.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                sink.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    writer = threading.Thread(target=deliver, daemon=True)
    writer.start()
    try:
        while data := source.recv(1 << 18):
            if seen is not None:
                seen(data)
            pending.put((time.monotonic() + delay, data))
    except OSError:
        pass
    pending.put((0.0, b""))
    writer.join()


def relay(client: socket.socket, to: tuple[str, int], delay: float,
          requests: Callable[[bytes], None] | None = None) -> None:
    """One connection each way through the delay; `requests` sees what the client sends."""
    try:
        upstream = socket.create_connection(to)
    except OSError:
        client.close()
        return
    for sock in (client, upstream):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=pump, args=(upstream, client, delay), daemon=True)
    back.start()
    pump(client, upstream, delay, requests)
    back.join()
    client.close()
    upstream.close()


def serve(listen: tuple[str, int], to: tuple[str, int], delay: float) -> None:
    server = socket.create_server(listen, reuse_port=False)
    while True:
        client, _ = server.accept()
        threading.Thread(target=relay, args=(client, to, delay), daemon=True).start()


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--to", required=True)
    parser.add_argument("--delay-ms", type=float, required=True, help="one way")
    args = parser.parse_args()
    serve(address(args.listen), address(args.to), args.delay_ms / 1000)


if __name__ == "__main__":
    main()
