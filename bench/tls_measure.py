"""Ack latency over the daemon's transports, measured from one process (run inside a
network namespace by bench/tls_latency.py): each target a connection, requests of N paths
without `wait`, targets interleaved in random order every round, so all share the
machine's moods. Prints one JSON object: per target and size, p50/p99 in µs."""

from __future__ import annotations

import argparse
import json
import random
import ssl
import time

from kvprefetch import Client


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", action="append", required=True, help="NAME=ADDRESS")
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--ca", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--sizes", default="1,1000")
    parser.add_argument("--requests", default="2000,400")
    args = parser.parse_args()
    context = ssl.create_default_context(cafile=args.ca)
    context.load_cert_chain(args.cert, args.key)
    targets = dict(t.split("=", 1) for t in args.target)
    clients = {name: Client(address, timeout=30,
                            ssl_context=context if address.startswith("tls://") else None)
               for name, address in targets.items()}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for size, count in zip((int(s) for s in args.sizes.split(",")),
                           (int(n) for n in args.requests.split(",")), strict=True):
        paths = [f"{args.root}/lat/{i:064x}.bin" for i in range(size)]
        took: dict[str, list[float]] = {name: [] for name in clients}
        for client in clients.values():  # connect and warm up, untimed
            for _ in range(20):
                client.prefetch(paths)
        for _ in range(count):
            order = list(clients.items())
            random.shuffle(order)
            for name, client in order:
                start = time.perf_counter()
                client.prefetch(paths)
                took[name].append((time.perf_counter() - start) * 1e6)
        for name, values in took.items():
            out.setdefault(name, {})[str(size)] = {
                "p50_us": round(percentile(values, 0.5), 1),
                "p99_us": round(percentile(values, 0.99), 1), "requests": len(values)}
    for client in clients.values():
        client.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
