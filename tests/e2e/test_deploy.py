"""deploy/: Kubernetes manifests against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail), the Envoy config against Envoy's own API protos, the Prometheus
Operator objects against the schemas of its CRDs, and the scaling/scrape configs against the
metrics the service really exports."""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.observability.metrics import ServiceMetrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes these manifests target (native gRPC probes are GA since 1.27)
IN_CI = os.environ.get("CI") == "true"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _validate(doc: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        raise AssertionError(f"{where}: {doc['kind']} {doc['metadata'].get('name')}: {err.message} at "
                             f"{'/'.join(map(str, err.path))}") from err


def _base_resources() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    docs = [d for name in kustomization["resources"] for d in _docs(K8S / "base" / name)]
    for generator in kustomization["configMapGenerator"]:  # as kustomize would generate it
        data = {Path(f).name: (K8S / "base" / f).read_text() for f in generator["files"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    return docs


def test_every_base_manifest_validates_strictly() -> None:
    docs = _base_resources()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                     "Service", "Service"]
    for doc in docs:
        _validate(doc, "base")


def test_a_schema_violation_is_caught() -> None:
    """The validator itself can fail: a misspelt field and a wrong type are both refused."""
    deployment = next(d for d in _base_resources() if d["kind"] == "Deployment" and d["metadata"]["name"] == "minivllm")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grpc"]["prot"] = container["readinessProbe"]["grpc"].pop("port")
    with pytest.raises(AssertionError, match="prot|port"):
        _validate(deployment, "mutated")
    deployment = next(d for d in _base_resources() if d["kind"] == "Deployment" and d["metadata"]["name"] == "minivllm")
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(AssertionError):
        _validate(deployment, "mutated")


@pytest.mark.parametrize("overlay", ["dev", "production"])
def test_overlays_build_and_validate(overlay: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (kustomize) not installed; the base manifests are validated on their own")
    proc = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    for doc in docs:
        _validate(doc, overlay)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    hpa = by_kind[("HorizontalPodAutoscaler", "minivllm")]
    replicas = by_kind[("Deployment", "minivllm")]["spec"]["replicas"]
    assert hpa["spec"]["minReplicas"] <= replicas <= hpa["spec"]["maxReplicas"]
    envoy = by_kind[("Deployment", "minivllm-envoy")]["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
    assert ("ConfigMap", envoy) in by_kind, "the Envoy Deployment mounts the generated ConfigMap"


def test_deployment_probes_drain_and_scrape_port_fit_together() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _base_resources()}
    template = docs[("Deployment", "minivllm")]["spec"]["template"]
    pod = template["spec"]
    container = pod["containers"][0]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if a.startswith("--"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # native gRPC: grpc.health.v1
        assert container[probe]["grpc"]["port"] == int(args["port"]), probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180, "the startup probe covers model loading"
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(args["drain-grace"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == int(args["metrics-port"]) and ports["grpc"] == int(args["port"])
    assert container["resources"]["limits"]["cpu"] and container["securityContext"]["readOnlyRootFilesystem"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    cache = next(e["value"] for e in container["env"] if e["name"] == "MINIVLLM_CACHE")
    assert cache in mounts, "the model cache lives on a volume"
    headless = docs[("Service", "minivllm-headless")]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= template["metadata"]["labels"].items()


def test_hpa_metric_is_served_by_the_adapter_and_exported_by_the_service() -> None:
    hpa = next(d for d in _base_resources() if d["kind"] == "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    adapter = yaml.safe_load(yaml.safe_load((K8S / "monitoring" / "prometheus-adapter.yaml").read_text())
                             ["data"]["config.yaml"])
    served = {rule["name"]["as"] for rule in adapter["rules"]}
    assert metric in served
    exported = {m.name for m in ServiceMetrics("m").registry.collect()}
    for rule in adapter["rules"]:
        series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
        assert series in exported, f"{series} is not a metric minivllm exports"
        assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])


def test_prometheus_operator_objects_match_their_crd_schemas() -> None:
    node = shutil.which("node")
    modules = ROOT / "tests" / "node" / "node_modules" / "@kubernetes-models" / "prometheus-operator"
    if node is None or not modules.exists():
        if IN_CI:
            pytest.fail("node and tests/node/node_modules are required in CI (make test installs them)")
        pytest.skip("run `make test` to install tests/node packages")
    proc = subprocess.run([node, "tests/node/check_crds.mjs", str(K8S / "monitoring" / "podmonitor.yaml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    monitor = _docs(K8S / "monitoring" / "podmonitor.yaml")[0]
    pod_labels = next(d for d in _base_resources() if d["kind"] == "Deployment" and d["metadata"]["name"] == "minivllm"
                      )["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_plain_prometheus_kubernetes_scrape_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if IN_CI:
            pytest.fail("promtool is required in CI (make test installs it)")
        pytest.skip("promtool not installed")
    config = yaml.safe_load((K8S / "monitoring" / "prometheus-kubernetes.yml").read_text())
    job = config["scrape_configs"][0]
    for each in config["scrape_configs"]:  # minivllm, and the smg overlay's gateway
        assert each["kubernetes_sd_configs"] == [{"role": "pod"}]
        # Debian builds Prometheus without Kubernetes discovery: promtool checks everything else
        # (relabelling included) with the discovery swapped for a static target.
        each["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
        del each["kubernetes_sd_configs"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(ROOT / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    kept = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    deployment = next(d for d in _base_resources() if d["kind"] == "Deployment" and d["metadata"]["name"] == "minivllm")
    assert kept["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == \
        deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    assert kept["__meta_kubernetes_pod_container_port_name"] in {
        p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    proc = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _register_envoy_types(node: Any) -> None:
    """Import the envoy_data_plane module of every typed_config, so its Any can be unpacked."""
    if isinstance(node, dict):
        url = node.get("@type")
        if url:
            package = url.rsplit("/", 1)[1].rsplit(".", 1)[0]
            importlib.import_module(f"envoy_data_plane.{package}")
        for value in node.values():
            _register_envoy_types(value)
    elif isinstance(node, list):
        for value in node:
            _register_envoy_types(value)


def _parse_envoy(config: dict[str, Any]) -> Any:
    from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

    _register_envoy_types(config)
    return Bootstrap().from_dict(config)


def test_envoy_config_parses_against_envoys_api_and_retries_only_unstarted_calls() -> None:
    config = yaml.safe_load((K8S / "base" / "envoy" / "envoy.yaml").read_text())
    bootstrap = _parse_envoy(config)
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    grpc_cluster = clusters["minivllm_grpc"]
    assert grpc_cluster.health_checks[0].grpc_health_check is not None
    raw = config["static_resources"]["clusters"][0]
    assert raw["type"] == "STRICT_DNS" and raw["lb_policy"] == "ROUND_ROBIN"
    assert "http2_protocol_options" in raw["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    address = raw["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    headless = next(d for d in _base_resources() if d["metadata"]["name"] == "minivllm-headless")
    assert address["address"] == headless["metadata"]["name"]
    # Retries only of calls that never started: no condition that can fire after a response began.
    for listener in config["static_resources"]["listeners"]:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        for vhost in manager["route_config"]["virtual_hosts"]:
            for route in vhost["routes"]:
                conditions = set(route["route"]["retry_policy"]["retry_on"].split(","))
                assert conditions <= {"connect-failure", "refused-stream", "reset-before-request", "unavailable"}
    # The parser refuses what Envoy would refuse.
    config["static_resources"]["clusters"][0]["lb_polcy"] = "ROUND_ROBIN"
    with pytest.raises(Exception, match="lb_polcy|lbPolcy"):
        _parse_envoy(config)


def _smg_docs() -> list[dict[str, Any]]:
    return _docs(K8S / "overlays" / "smg" / "smg.yaml")


def test_smg_gateway_manifests_validate_and_discover_the_replicas() -> None:
    """SMG's objects validate strictly; its discovery selects the minivllm pods on their gRPC port,
    its Role lets it watch them, its probes and scraped port exist."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _smg_docs()}
    for doc in docs.values():
        _validate(doc, "smg")
    assert set(docs) == {("ServiceAccount", "smg"), ("Role", "smg-discovery"), ("RoleBinding", "smg-discovery"),
                         ("Deployment", "smg"), ("Service", "smg")}
    pod = docs[("Deployment", "smg")]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = container["args"]
    options = dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--") and "=" in a)
    assert options["backend"] == "vllm" and options["policy"] == "cache_aware" and "--service-discovery" in args
    selector = dict(a.split("=", 1) for a in args[args.index("--selector") + 1:] if not a.startswith("--"))
    replica = next(d for d in _base_resources() if d["kind"] == "Deployment" and d["metadata"]["name"] == "minivllm")
    assert selector.items() <= replica["spec"]["template"]["metadata"]["labels"].items()
    replica_ports = {p["name"]: p["containerPort"] for p in replica["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert int(options["service-discovery-port"]) == replica_ports["grpc"]
    rule = docs[("Role", "smg-discovery")]["rules"][0]
    assert "pods" in rule["resources"] and {"list", "watch"} <= set(rule["verbs"])
    binding = docs[("RoleBinding", "smg-discovery")]
    assert binding["subjects"][0]["name"] == pod["spec"]["serviceAccountName"] == "smg"
    assert binding["roleRef"]["name"] == "smg-discovery"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == int(options["port"]) and ports["metrics"] == int(options["prometheus-port"])
    assert ports["probes"] == int(options["health-check-port"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "probes", probe
    assert docs[("Service", "smg")]["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    monitor = next(d for d in _docs(K8S / "monitoring" / "podmonitor.yaml") if d["metadata"]["name"] == "smg")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_smg_overlay_builds_without_envoy() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (kustomize) not installed; the SMG manifests are validated on their own")
    proc = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / "smg")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    for doc in docs:
        _validate(doc, "smg")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not any("envoy" in name for _, name in names) and ("Service", "minivllm") not in names
    assert {("Deployment", "minivllm"), ("Deployment", "smg"), ("Service", "minivllm-headless")} <= names
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "Namespace"} == {"minivllm-smg"}
