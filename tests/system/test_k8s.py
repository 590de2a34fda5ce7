"""deploy/k8s: every overlay renders with kustomize, validates against a pinned Kubernetes schema
offline, and agrees with the services' config dataclasses (flags, ports, probes, grace)."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from draft_service.config import DraftConfig
from target_service.config import TargetConfig
from target_service.metrics import TargetMetrics

K8S = Path(__file__).parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.32.0"
GPU_DRAFTER = f"{DraftConfig().drafter}+model"  # the default, then the model on the drafter's GPU
SERVICES = {"tandem-target": (TargetConfig(), "target_service"), "tandem-draft": (DraftConfig(), "draft_service")}


def _render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize rendering is not checked")
    done = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request) -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in _render(request.param)}


def _container(objects, name: str) -> dict:
    [container] = objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return container


def _flags(container: dict) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in container["args"])


def test_every_object_validates_against_the_pinned_schema(objects):
    for (kind, name), doc in objects.items():
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert {kind for kind, _ in objects} == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
                                             "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy"}


@pytest.mark.parametrize("name", SERVICES)
def test_flags_ports_and_probes_follow_the_service_config(objects, name):
    config, module = SERVICES[name]
    container = _container(objects, name)
    assert container["command"] == ["python", "-m", module]
    flags = _flags(container)
    known = {f.name.replace("_", "-") for f in fields(config)}
    assert set(flags) <= known, set(flags) - known
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {"grpc": int(flags["port"]), "metrics": int(flags["metrics-port"])}
    for flag, port_name in (("http-port", "http"), ("vllm-grpc-port", "engine")):
        if flag in flags:
            expected[port_name] = int(flags[flag])
    assert ports == expected
    assert (int(flags["port"]), int(flags["metrics-port"])) == (config.port, config.metrics_port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        handler = container[probe]
        if "grpc" in handler:
            assert handler["grpc"]["port"] == config.port
        else:  # TLS: the probe runs deploy/healthcheck.py against the gRPC port
            assert f"127.0.0.1:{config.port}" in handler["exec"]["command"]
    grace = objects[("Deployment", name)]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(flags["grace-seconds"]), "a rolling update must let the service drain"


def test_config_map_holds_every_variable_the_args_use(objects):
    data = objects[("ConfigMap", "tandem-config")]["data"]
    for name in SERVICES:
        container = _container(objects, name)
        assert container["envFrom"] == [{"configMapRef": {"name": "tandem-config"}}]
        used = {v for arg in container["args"] for v in re.findall(r"\$\((\w+)\)", arg)}
        assert used <= set(data), used - set(data)


def test_cpu_pods_draft_with_the_default_drafter_and_gpu_pods_put_their_model_behind_it():
    configs = {overlay: next(d["data"] for d in _render(overlay) if d["metadata"]["name"] == "tandem-config")
               for overlay in OVERLAYS}
    drafters = {overlay: config["DRAFTER_KIND"] for overlay, config in configs.items()}
    assert drafters == {"cpu": DraftConfig().drafter, "gpu": GPU_DRAFTER}


def test_targets_resolve_every_drafter_through_the_headless_service(objects):
    drafter = _flags(_container(objects, "tandem-target"))["drafter"]
    service = objects[("Service", "tandem-draft")]["spec"]
    assert service["clusterIP"] == "None"
    assert drafter == f"dns:///tandem-draft:{DraftConfig().port}"
    assert {p["port"] for p in service["ports"]} == {DraftConfig().port, DraftConfig().metrics_port}


@pytest.mark.parametrize("name", SERVICES)
def test_services_and_disruption_budgets_select_their_pods(objects, name):
    labels = objects[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
    for kind, key in (("Service", "selector"), ("PodDisruptionBudget", "selector")):
        selector = objects[(kind, name)]["spec"][key]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), (kind, name)


def test_the_gpu_overlay_asks_for_one_gpu_per_pod_and_links_with_mtls():
    objects = {(doc["kind"], doc["metadata"]["name"]): doc for doc in _render("gpu")}
    for name in SERVICES:
        container = _container(objects, name)
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
        assert _flags(container)["device"] == "cuda"
    draft, target = _flags(_container(objects, "tandem-draft")), _flags(_container(objects, "tandem-target"))
    assert draft["tls-client-ca"] and draft["tls-cert"] and draft["tls-key"]
    assert target["drafter-ca"] == draft["tls-client-ca"] and target["drafter-client-cert"]
    probe = _container(objects, "tandem-draft")["readinessProbe"]
    assert "grpc" not in probe and "--client-cert=/etc/tandem/tls/tls.crt" in probe["exec"]["command"]


def test_the_gateway_discovers_the_target_pods_with_the_rights_to_watch_them(objects):
    [gateway] = objects[("Deployment", "tandem-gateway")]["spec"]["template"]["spec"]["containers"]
    pod = objects[("Deployment", "tandem-gateway")]["spec"]["template"]["spec"]
    assert gateway["command"] == ["smg", "launch"]
    args = gateway["args"]
    selector = args[args.index("--selector") + 1]
    key, value = selector.split("=")
    targets = objects[("Deployment", "tandem-target")]["spec"]["template"]["metadata"]["labels"]
    assert targets[key] == value
    flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
    engine_port = int(_flags(_container(objects, "tandem-target"))["vllm-grpc-port"])
    assert int(flags["service-discovery-port"]) == engine_port and flags["backend"] == "vllm"
    assert "--service-discovery" in args
    env = {e["name"]: e["valueFrom"] for e in gateway["env"]}
    assert flags["service-discovery-namespace"] == "$(POD_NAMESPACE)"
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["GATEWAY_API_KEY"]["secretKeyRef"] == {"name": "tandem-auth", "key": "token"}
    role = objects[("Role", "tandem-gateway")]["rules"]
    assert {"pods"} <= {r for rule in role for r in rule["resources"]}
    assert {"list", "watch"} <= {v for rule in role for v in rule["verbs"]}
    binding = objects[("RoleBinding", "tandem-gateway")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    assert binding["roleRef"]["name"] == "tandem-gateway"
    http = {p["name"]: p["containerPort"] for p in gateway["ports"]}["http"]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    service = objects[("Service", "tandem-gateway")]["spec"]
    assert service["selector"].items() <= objects[("Deployment", "tandem-gateway")]["spec"]["template"][
        "metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["ports"]} >= {"http"} and http == 8000


def test_only_the_gateway_reaches_the_tokenless_engine_port(objects):
    target = _flags(_container(objects, "tandem-target"))
    assert target["auth-token-file"], "clients' ports keep their bearer token"
    policy = objects[("NetworkPolicy", "tandem-target")]["spec"]
    labels = objects[("Deployment", "tandem-target")]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items() and policy["policyTypes"] == ["Ingress"]
    gateway_only, open_ports = policy["ingress"]
    assert gateway_only["ports"] == [{"port": "engine"}]
    gateway = objects[("Deployment", "tandem-gateway")]["spec"]["template"]["metadata"]["labels"]
    [peer] = gateway_only["from"]
    assert peer["podSelector"]["matchLabels"].items() <= gateway.items()
    assert "from" not in open_ports and {p["port"] for p in open_ports["ports"]} == {"grpc", "http", "metrics"}


# ---- monitoring: Prometheus Operator objects and the dashboard ------------------------------------

def _render_module():
    spec = importlib.util.spec_from_file_location("k8s_monitoring_render", K8S / "monitoring" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_monitoring_files_are_rendered_from_the_compose_stacks_sources():
    for name, render in _render_module().RENDERED.items():
        assert (K8S / "monitoring" / name).read_text() == render(), f"{name} is stale: run render.py"


def _monitoring() -> dict[str, dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize rendering is not checked")
    done = subprocess.run([kubectl, "kustomize", str(K8S / "monitoring")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {doc["kind"]: doc for doc in yaml.safe_load_all(done.stdout) if doc}


def test_the_pod_monitor_scrapes_every_service_under_its_compose_job_name():
    monitor = _monitoring()["PodMonitor"]["spec"]
    [expression] = monitor["selector"]["matchExpressions"]
    assert (expression["key"], set(expression["values"])) == ("app.kubernetes.io/name", set(SERVICES))
    assert monitor["jobLabel"] == "app.kubernetes.io/name"  # job="tandem-target", as the alerts expect
    [endpoint] = monitor["podMetricsEndpoints"]
    for overlay in OVERLAYS:
        objects = {(doc["kind"], doc["metadata"]["name"]): doc for doc in _render(overlay)}
        for name in SERVICES:
            assert endpoint["port"] in {p["name"] for p in _container(objects, name)["ports"]}


def test_the_prometheus_rule_passes_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: the rules' PromQL is not checked")
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(_monitoring()["PrometheusRule"]["spec"]))
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "4 rules found" in done.stdout, done.stdout + done.stderr


def test_the_dashboard_config_map_asks_for_the_clusters_prometheus():
    config_map = _monitoring()["ConfigMap"]
    kubernetes_validate.validate(config_map, KUBERNETES_VERSION, strict=True)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["tandem.json"])
    uids = re.findall(r'"uid": "([^"]*)"', json.dumps(dashboard))
    assert dashboard["templating"]["list"][0]["type"] == "datasource"
    assert set(uids) - {"tandem"} == {"${datasource}"}  # "tandem" is the dashboard's own uid


# ---- autoscaling: the HPA and prometheus-adapter's rules ------------------------------------------

def test_the_hpa_scales_targets_on_a_gauge_they_export():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize rendering is not checked")
    done = subprocess.run([kubectl, "kustomize", str(K8S / "autoscaling")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    [hpa] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tandem-target"}
    [metric] = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    exported = {m.name for m in TargetMetrics("m").registry.collect()}
    assert name in exported and hpa["spec"]["minReplicas"] >= 2  # one target per PDB budget stays up
    rules = yaml.safe_load((K8S / "autoscaling" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    assert [rule["name"]["as"] for rule in rules] == [name]


def test_the_adapter_rules_are_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: the rules' PromQL is not checked")
    rules = yaml.safe_load((K8S / "autoscaling" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    # The adapter fills in its templates per query; a typical filling makes them plain PromQL.
    filled = [rule["metricsQuery"].replace("<<.GroupBy>>", "pod").replace("<<.Series>>", rule["name"]["as"])
              .replace("<<.LabelMatchers>>", 'namespace="tandem",pod=~"tandem-target-.*"') for rule in rules]
    exprs = [rule["seriesQuery"] for rule in rules] + filled
    check = tmp_path / "rules.yml"
    check.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": [
        {"record": f"tandem:adapter_check:{i}", "expr": expr} for i, expr in enumerate(exprs)]}]}))
    done = subprocess.run([promtool, "check", "rules", str(check)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
