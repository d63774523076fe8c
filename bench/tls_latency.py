"""Issue 18's figures: ack p50/p99 for 1 and 1,000 paths over the Unix socket and over TLS,
directly across a veth pair and through 0.2 ms and 2 ms of round trip, in the same run.

A node daemon runs in network namespace `b` with its TCP listener on the veth; the
measuring client (bench/tls_measure.py) runs in namespace `a`, where delaying relays
(kvharness.relay; this kernel has no sch_netem) add 0.1 and 1 ms each way. The Unix socket
is reached by its path (path sockets are not per namespace). Targets are interleaved
request by request. Root only.

    bench/tls_latency.py --out bench/out/tls
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvharness import netns
from kvharness.certs import issue, make_ca, server_cert
from kvharness.daemon import launch, write_config

ROUTER = "spiffe://cluster.local/ns/llm-d/sa/router"
DELAYS_MS = (0.1, 1.0)  # one way: round trips of 0.2 and 2 ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/out/tls")
    parser.add_argument("--sizes", default="1,1000")
    parser.add_argument("--requests", default="2000,400")
    args = parser.parse_args()
    why = netns.unavailable()
    if why:
        print(f"tls_latency: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvtls-") as tmp, netns.pair() as net:
        work = Path(tmp)
        ca = make_ca(work)
        server = server_cert(ca, work, net.b_ip)
        router = issue(ca, work, "router", common_name="router", uris=(ROUTER,))
        root = work / "kv"
        root.mkdir()
        config = write_config(work / "node.toml", {
            "socket": str(work / "node.sock"), "roots": [str(root)], "workers": 2,
            "log_level": "warning", "listen_tcp": f"{net.b_ip}:7474",
            "tls_cert_file": str(server.cert), "tls_key_file": str(server.key),
            "tls_client_ca_file": str(ca.cert), "tls_allowed_clients": [ROUTER]})
        daemon = launch(["--config", str(config)], socket_path=work / "node.sock", root=root,
                        log_path=work / "node.log", wrapper=net.prefix(net.b))
        try:
            with netns.relay(net.a, 7475, f"{net.b_ip}:7474", DELAYS_MS[0]) as near, \
                    netns.relay(net.a, 7476, f"{net.b_ip}:7474", DELAYS_MS[1]) as far:
                targets = {"unix": str(work / "node.sock"), "tls-veth": f"tls://{net.b_ip}:7474",
                           "tls-rtt0.2ms": f"tls://{near}", "tls-rtt2ms": f"tls://{far}"}
                measured = subprocess.run(
                    [*net.prefix(net.a), sys.executable, str(Path(__file__).with_name(
                        "tls_measure.py")),
                     *[f"--target={name}={address}" for name, address in targets.items()],
                     "--cert", str(router.cert), "--key", str(router.key), "--ca", str(ca.cert),
                     "--root", str(root), "--sizes", args.sizes, "--requests", args.requests],
                    capture_output=True, text=True, check=True,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        finally:
            daemon.stop()
    figures = json.loads(measured.stdout)
    rtt_us = {"unix": 0.0, "tls-veth": 0.0, "tls-rtt0.2ms": 200.0, "tls-rtt2ms": 2000.0}
    lines = ["| paths | transport | p50 µs | p99 µs | p99 target (1.5 x Unix p99 + RTT) | met |",
             "|---|---|---|---|---|---|"]
    for size in args.sizes.split(","):
        unix_p99 = figures["unix"][size]["p99_us"]
        for name in rtt_us:
            row = figures[name][size]
            target = 1.5 * unix_p99 + rtt_us[name]
            met = "-" if name == "unix" else ("yes" if row["p99_us"] <= target else "NO")
            lines.append(f"| {size} | {name} | {row['p50_us']} | {row['p99_us']} | "
                         f"{'-' if name == 'unix' else round(target)} | {met} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(figures, indent=2))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
