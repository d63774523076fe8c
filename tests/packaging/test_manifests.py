"""deploy/kubernetes and the Containerfile, checked offline: every manifest against the
Kubernetes API schemas (kubernetes-validate, strict: unknown fields fail), and against each
other and the daemon: the kustomizations list what is there, the ConfigMap is a config the
daemon accepts, probes ping the socket that config serves, ports, labels, image tag and user
agree with the Containerfile and the version."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

import kvprefetchd
from kvprefetchd.addresses import parse_metrics_address
from kvprefetchd.config import build_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
NO_SCHEMA = {"PodMonitor", "Certificate"}  # CRDs (Prometheus Operator, cert-manager)


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


def pods() -> list[tuple[Path, dict[str, Any]]]:
    """(file, pod spec) of every workload."""
    found = []
    for path in MANIFESTS:
        document = load(path)
        if document["kind"] in ("DaemonSet", "Deployment"):
            found.append((path, document["spec"]["template"]["spec"]))
    return found


def daemon_container(spec: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = next(c for c in spec["containers"] if c["name"] == "kvprefetchd")
    return container


def configmap_config(folder: Path = DEPLOY) -> Any:
    """The config of the layout in `folder` (its own ConfigMap, else the parent's)."""
    if not (folder / "configmap.yaml").exists():
        folder = DEPLOY
    document = load(folder / "configmap.yaml")
    return build_config(tomllib.loads(document["data"]["config.toml"]), {})


@pytest.mark.parametrize("path", [p for p in MANIFESTS if load(p)["kind"] not in NO_SCHEMA],
                         ids=lambda p: str(p.relative_to(DEPLOY)))
def test_each_manifest_passes_the_api_schema_strictly(path: Path) -> None:
    done = subprocess.run([VALIDATE, "--strict", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "passed" in done.stdout + done.stderr, done.stdout + done.stderr


def test_the_validator_refuses_an_unknown_field(tmp_path: Path) -> None:
    """The check above can fail: a misspelt field is caught."""
    broken = (DEPLOY / "daemonset.yaml").read_text().replace("readOnlyRootFilesystem",
                                                             "readOnlyRootFileSystem")
    (tmp_path / "broken.yaml").write_text(broken)
    done = subprocess.run([VALIDATE, "--strict", str(tmp_path / "broken.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0


@pytest.mark.parametrize("folder", [DEPLOY, DEPLOY / "sidecar", DEPLOY / "gpu-node"],
                         ids=["daemonset", "sidecar", "gpu-node"])
def test_each_kustomization_lists_files_that_exist(folder: Path) -> None:
    resources = load(folder / "kustomization.yaml")["resources"]
    assert resources and all((folder / name).is_file() for name in resources), resources


def test_the_daemonset_kustomization_lists_every_manifest_beside_it() -> None:
    beside = {p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(load(DEPLOY / "kustomization.yaml")["resources"]) == beside


def test_the_configmap_is_a_config_the_daemon_accepts() -> None:
    config = configmap_config()
    assert list(config.roots) == ["/mnt/kv"]
    assert config.metrics and parse_metrics_address(config.metrics).port == 9464


@pytest.mark.parametrize("path_and_spec", pods(), ids=lambda ps: ps[0].name)
def test_workloads_agree_with_the_config_the_image_and_the_version(
    path_and_spec: tuple[Path, dict[str, Any]],
) -> None:
    path, spec = path_and_spec
    config = configmap_config(path.parent)
    container = daemon_container(spec)
    assert container["image"].endswith(f"kvprefetchd:{kvprefetchd.__version__}")
    assert container["args"] == ["--config", "/etc/kvprefetchd/config.toml"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["config"]["mountPath"] == "/etc/kvprefetchd"
    assert mounts["kv-cache"]["mountPath"] in config.roots and mounts["kv-cache"]["readOnly"]
    assert str(Path(config.socket).parent) == mounts["run"]["mountPath"]
    for probe in ("readinessProbe", "livenessProbe"):
        if probe in container:
            command = container[probe]["exec"]["command"]
            assert command[0] == "kvprefetch" and command[-1] == "ping"
            assert command[command.index("--socket") + 1] == config.socket
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == parse_metrics_address(config.metrics).port
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert spec["securityContext"]["runAsNonRoot"]
    assert spec["securityContext"]["runAsUser"] == containerfile_uid()


def test_the_gpu_node_layout_serves_tls_to_the_router_only() -> None:
    folder = DEPLOY / "gpu-node"
    config = configmap_config(folder)
    assert config.listen_tcp.endswith(":7474") and not config.tcp_plaintext_loopback
    assert config.tls_allowed_clients and config.warm_mode == "advise"
    daemonset = load(folder / "daemonset.yaml")
    spec = daemonset["spec"]["template"]["spec"]
    tls_port = next(p for p in daemon_container(spec)["ports"] if p["name"] == "tls")
    assert tls_port["containerPort"] == tls_port["hostPort"] == 7474
    mounts = {m["name"]: m["mountPath"] for m in daemon_container(spec)["volumeMounts"]}
    secret = next(v for v in spec["volumes"] if v["name"] == "tls")["secret"]["secretName"]
    assert secret == load(folder / "certificate.yaml")["spec"]["secretName"]
    for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        assert getattr(config, key).startswith(mounts["tls"] + "/")
    policy = load(folder / "networkpolicy.yaml")["spec"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert {p["port"] for rule in policy["ingress"] for p in rule["ports"]} == {7474, 9464}
    router_rule = next(r for r in policy["ingress"] if r["ports"] == [{"port": 7474,
                                                                         "protocol": "TCP"}])
    assert router_rule["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "llm-d-router"}


# ---- the metrics endpoint: the pod's own IP, behind a NetworkPolicy (issue 23, finding 7) ----

EXAMPLE_POD_IP = "10.42.7.19"


def metrics_bind(path: Path, container: dict[str, Any]) -> str:
    """Where the daemon in this container binds metrics: KVPREFETCHD_METRICS (which the
    daemon prefers to the config's key) with Kubernetes' $(VAR) references expanded,
    else its ConfigMap's `metrics`."""
    env = {e["name"]: e for e in container.get("env", [])}
    if "KVPREFETCHD_METRICS" not in env:
        return str(configmap_config(path.parent).metrics)
    value = str(env["KVPREFETCHD_METRICS"]["value"])
    for name, entry in env.items():
        if entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            value = value.replace(f"$({name})", EXAMPLE_POD_IP)
    return value


def configmaps() -> list[Path]:
    return sorted(DEPLOY.rglob("configmap.yaml"))


@pytest.mark.parametrize("path", configmaps(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_no_configmap_binds_metrics_to_every_interface(path: Path) -> None:
    """The endpoint has no authentication: 0.0.0.0 exposed it to every network the node
    is on. The config's value is the loopback fallback; the pod IP comes from the env."""
    where = parse_metrics_address(configmap_config(path.parent).metrics)
    assert where.host not in ("0.0.0.0", "::") and where.host.startswith("127."), where


@pytest.mark.parametrize("path_and_spec", pods(), ids=lambda ps: ps[0].name)
def test_every_workload_binds_metrics_to_the_pods_own_ip(
    path_and_spec: tuple[Path, dict[str, Any]],
) -> None:
    path, spec = path_and_spec
    container = daemon_container(spec)
    where = parse_metrics_address(metrics_bind(path, container))
    assert where.host == EXAMPLE_POD_IP, f"{path.name} binds metrics to {where}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert where.port == ports["metrics"]
    assert not spec.get("hostNetwork"), "the pod IP would be the node's"


def policies(folder: Path) -> list[dict[str, Any]]:
    return [document for path in sorted(folder.glob("*.yaml"))
            if (document := load(path))["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("folder", [DEPLOY, DEPLOY / "gpu-node"], ids=["gateway", "gpu-node"])
def test_a_networkpolicy_admits_only_prometheus_to_the_metrics_port(folder: Path) -> None:
    daemonset = load(folder / "daemonset.yaml")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    covering = [p["spec"] for p in policies(folder)
                if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert covering, f"no NetworkPolicy selects the pods of {folder.name}/daemonset.yaml"
    assert all("Ingress" in policy["policyTypes"] for policy in covering)
    metrics_rules = [rule for policy in covering for rule in policy.get("ingress", [])
                     if any(p.get("port") in (9464, "metrics") for p in rule.get("ports", []))
                     or not rule.get("ports")]
    assert metrics_rules, "nothing may scrape the metrics port"
    for rule in metrics_rules:
        assert rule.get("from"), f"a rule admits everyone to the metrics port: {rule}"
        for peer in rule["from"]:
            assert "ipBlock" not in peer, peer
            namespace = peer["namespaceSelector"]["matchLabels"]
            assert namespace == {"kubernetes.io/metadata.name": "monitoring"}, peer
            assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}


def test_the_podmonitor_scrapes_the_metrics_port_of_the_daemonsets_pods() -> None:
    monitor = load(DEPLOY / "podmonitor.yaml")
    daemonset = load(DEPLOY / "daemonset.yaml")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in daemon_container(daemonset["spec"]["template"]["spec"])["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


def containerfile_uid() -> int:
    text = (ROOT / "Containerfile").read_text()
    user = next(line.split()[1] for line in text.splitlines() if line.startswith("USER "))
    return int(user.split(":")[0])


def test_the_containerfile_runs_unprivileged_without_a_compiler() -> None:
    text = (ROOT / "Containerfile").read_text()
    stages = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert len(stages) == 2 and stages[-1].endswith("AS runtime")
    assert containerfile_uid() != 0 and f"--uid {containerfile_uid()}" in text
    runtime = text[text.index("AS runtime"):]
    assert "! command -v gcc" in runtime  # the build fails if a compiler is left
    assert "EXPOSE 9464" in runtime
