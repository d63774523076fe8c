"""Two hosts on one machine: a gateway's daemon and a GPU node's, in two network namespaces
joined by a veth pair, the node's TCP listener reached over mutual TLS through a relay that
adds a 2 ms round trip (kvharness.netns; this kernel has no sch_netem). The Go client
fans out to both from the router's namespace; an unlisted certificate and plaintext are
refused across the link and open nothing. Root only: CI sets KVPREFETCH_REQUIRE_NETNS=1
so that "cannot make a namespace" fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharness import netns
from kvharness.certs import issue, make_ca, server_cert
from kvharness.daemon import Daemon, launch, write_config
from kvharness.files import write
from kvharness.pagecache import assert_warmed, drops, residency, resident_bytes

REPO = Path(__file__).resolve().parents[2]
ROUTER = "spiffe://cluster.local/ns/llm-d/sa/router"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    why = netns.unavailable()
    if why:
        if os.environ.get("KVPREFETCH_REQUIRE_NETNS") == "1":
            pytest.fail(f"KVPREFETCH_REQUIRE_NETNS=1 but {why}")
        pytest.skip(why)
    work = tmp_path_factory.mktemp("hosts")
    with netns.pair() as net:
        ca = make_ca(work)
        server = server_cert(ca, work, net.b_ip)
        router = issue(ca, work, "router", common_name="router", uris=(ROUTER,))
        other = issue(ca, work, "other", common_name="other", uris=("spiffe://x/other",))
        daemons: list[Daemon] = []
        for name, ns, tcp in (("gateway", net.a, {}), ("node", net.b, {
                "listen_tcp": f"{net.b_ip}:7474", "tls_cert_file": str(server.cert),
                "tls_key_file": str(server.key), "tls_client_ca_file": str(ca.cert),
                "tls_allowed_clients": [ROUTER]})):
            root = work / name / "kv"
            root.mkdir(parents=True)
            socket_path = work / name / "d.sock"
            config = write_config(work / name / "config.toml", {
                "socket": str(socket_path), "roots": [str(root)], "workers": 1,
                "read_bytes": 4096, "log_level": "info", **tcp})
            daemons.append(launch(["--config", str(config)], socket_path=socket_path,
                                  root=root, log_path=work / name / "daemon.log",
                                  wrapper=net.prefix(ns)))
        try:
            with netns.relay(net.a, 7476, f"{net.b_ip}:7474", 1.0) as far:
                yield {"net": net, "work": work, "ca": ca, "router": router, "other": other,
                       "gateway": daemons[0], "node": daemons[1], "far": far}
        finally:
            for daemon in daemons:
                daemon.stop()


def in_router_ns(hosts: dict[str, Any], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    net = hosts["net"]
    return subprocess.run(
        [*net.prefix(net.a), sys.executable, "-c", code, *args], capture_output=True,
        text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def make_file(daemon: Daemon, name: str) -> str:
    return write(daemon.root / name, 8192)


def test_the_go_client_fans_out_to_the_gateway_and_the_node(hosts: dict[str, Any]) -> None:
    gateway, node = hosts["gateway"], hosts["node"]
    paths = [make_file(gateway, "shared.bin"), make_file(node, "local.bin")]
    since = drops()
    subprocess.run([str(REPO / "clients/go/run-tests"), "--go", "version"], check=True,
                   capture_output=True, timeout=600)  # installs Go outside the namespace
    net, router = hosts["net"], hosts["router"]
    run = subprocess.run(
        [*net.prefix(net.a), str(REPO / "clients/go/run-tests"), "-run",
         "TestFanoutAcrossNamespaces", "-v"],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "KVP_NETNS_GATEWAY": str(gateway.socket_path),
             "KVP_NETNS_NODE": f"tls://{hosts['far']}", "KVP_NETNS_CERT": str(router.cert),
             "KVP_NETNS_KEY": str(router.key), "KVP_NETNS_CA": str(hosts["ca"].cert),
             "KVP_NETNS_PATHS": ",".join(paths)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "--- PASS: TestFanoutAcrossNamespaces" in run.stdout, run.stdout[-2000:]
    # Each daemon took its own root's file (read once, then resident) and rejected the
    # other's: both were asked 100 times.
    for daemon in (gateway, node):
        files = daemon.stats()["files"]
        assert files["accepted"] == 100 and files["rejected_by_supervisor"] == 100, files
    # read_bytes is 4096: the head of each, warmed on its own host (up to date, or taken
    # by the host's reclaimer since), and nothing beyond it.
    assert_warmed(paths, 4096, since=since)
    assert all(residency(path, 4096, 4096, uptodate=True)[0] == 0 for path in paths)


def test_an_unlisted_client_and_plaintext_are_refused_across_the_link(
    hosts: dict[str, Any]
) -> None:
    node = hosts["node"]
    path = make_file(node, "guarded.bin")
    before = node.stats()
    probe = """
import json, ssl, sys
from kvprefetch import Client
from kvprefetch.errors import KVPrefetchError
address, cert, key, ca, path = sys.argv[1:]
context = ssl.create_default_context(cafile=ca)
context.load_cert_chain(cert, key)
out = {}
for name, kwargs in (("tls", {"ssl_context": context}), ("plain", {})):
    target = address if name == "tls" else address.replace("tls://", "tcp://")
    try:
        with Client(target, timeout=10, **kwargs) as client:
            client.prefetch([path], wait=True)
        out[name] = "served"
    except KVPrefetchError as error:
        out[name] = type(error).__name__ + ": " + str(error)
print(json.dumps(out))
"""
    other = hosts["other"]
    run = in_router_ns(hosts, probe, f"tls://{hosts['far']}", str(other.cert), str(other.key),
                       str(hosts["ca"].cert), path)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["tls"].startswith("ServerError") and "forbidden" in out["tls"], out
    assert out["plain"] != "served", out
    after = node.stats()
    assert after["events"]["tls_refused"] - before["events"].get("tls_refused", 0) == 2
    assert after["files"]["accepted"] == before["files"]["accepted"]
    assert resident_bytes(path, 8192) == 0
    assert "refused a TLS peer" in node.log()
