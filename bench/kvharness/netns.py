"""Two network namespaces joined by a veth pair: a gateway host and a GPU node on one machine.

`a` (10.77.N.1) plays the router's host, `b` (10.77.N.2) the node whose daemon listens on
TCP; processes enter one with `ip netns exec NAME` (prefix()). A delaying relay in `a`
(kvharness.relay) stands in for the network's latency: this kernel has no sch_netem, so
`tc netem` cannot. Root only; `unavailable()` says why not elsewhere.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no ip command (Debian: iproute2)"
    probe = subprocess.run(["ip", "netns", "add", f"kvprobe{os.getpid()}"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"cannot make a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"kvprobe{os.getpid()}"], check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    a_ip: str
    b_ip: str

    def prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", name]


@contextmanager
def pair(tag: int | None = None) -> Iterator[Pair]:
    n = (tag if tag is not None else os.getpid()) % 250 + 1
    names = Pair(f"kvp{n}a", f"kvp{n}b", f"10.77.{n}.1", f"10.77.{n}.2")
    for name in (names.a, names.b):
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        _ip("netns", "add", name)
    try:
        _ip("link", "add", f"kvp{n}va", "type", "veth", "peer", "name", f"kvp{n}vb")
        _ip("link", "set", f"kvp{n}va", "netns", names.a)
        _ip("link", "set", f"kvp{n}vb", "netns", names.b)
        ends = ((names.a, f"kvp{n}va", names.a_ip), (names.b, f"kvp{n}vb", names.b_ip))
        for name, dev, ip in ends:
            _ip("-n", name, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in (names.a, names.b):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@contextmanager
def relay(inside: str, listen_port: int, to: str, delay_ms: float) -> Iterator[str]:
    """A delaying relay in namespace `inside`, on its loopback; yields HOST:PORT to dial."""
    process = subprocess.Popen(
        ["ip", "netns", "exec", inside, sys.executable, "-m", "kvharness.relay",
         "--listen", f"127.0.0.1:{listen_port}", "--to", to, "--delay-ms", str(delay_ms)],
        env={**os.environ, "PYTHONPATH": str(BENCH)})
    try:
        give_up = time.monotonic() + 10
        while True:  # listening yet? (probe from inside: the loopback is the namespace's)
            probe = subprocess.run(
                ["ip", "netns", "exec", inside, sys.executable, "-c",
                 f"import socket; socket.create_connection(('127.0.0.1', {listen_port}), 1)"],
                capture_output=True, check=False)
            if probe.returncode == 0:
                break
            if time.monotonic() > give_up or process.poll() is not None:
                raise RuntimeError("the relay did not start")
            time.sleep(0.05)
        yield f"127.0.0.1:{listen_port}"
    finally:
        process.terminate()
        process.wait(10)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
