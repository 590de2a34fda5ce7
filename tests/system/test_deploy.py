"""deploy/: the compose files, the Grafana dashboard, and Prometheus with the alerts, against the real pair.

The Prometheus test runs Debian's `prometheus` on loopback with deploy/prometheus/prometheus.yml
pointed at a real target and draft service, sends traffic, and evaluates every query of the
dashboard through the HTTP API, as Grafana would.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from draft_service.config import DraftConfig, parse_config
from tests.support.service_fixtures import PROMPTS, greedy_request, run_requests
from tandem.launch import ServiceProcess, free_port
from tandem.registry import DEFAULT_DRAFT_MODEL
from tandem.v1 import generation_pb2
from tandem.v1.structured_pb2 import StructuredOutputs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tandem.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROMETHEUS_DIR = DEPLOY / "prometheus"
MODEL = "smollm2-135m"
MAX_TOKENS = 32
SCRAPE_SECONDS = 1
COPY_PROMPT = ("Repeat this text exactly, word for word: Tandem splits speculative decoding into a target service "
               "and a draft service. The target streams every token at once, and the drafter proposes tokens ahead.")


def _binary(name: str, package: str) -> str:
    """The path of a tool these tests need: skipped where it is missing, except in CI, which installs it."""
    path = shutil.which(name)
    if path is None:
        message = f"`{name}` is not installed (Debian: apt-get install -y {package})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install it")
        pytest.skip(message)
    return path


# ---- compose files ----

def _compose_config(name: str, env: dict[str, str] | None = None) -> dict:
    """The file as docker-compose resolves it (interpolated, `extends` applied): it must validate."""
    done = subprocess.run([_binary("docker-compose", "docker-compose"), "-f", str(DEPLOY / name), "config"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"docker-compose config {name}:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_compose_file_validates_with_healthchecks_and_monitoring(name):
    services = _compose_config(name)["services"]
    assert set(services) == {"target", "draft", "gateway", "prometheus", "grafana"}
    for service, port in (("target", 50051), ("draft", 50052)):
        assert services[service]["healthcheck"]["test"] == ["CMD", "python", "deploy/healthcheck.py",
                                                            f"127.0.0.1:{port}", "--ca-cert=",
                                                            f"--server-name={service}"]
        # TLS off: empty flags, which the services read as their defaults.
        assert "--tls-cert=" in services[service]["command"] and "--tls-key=" in services[service]["command"]
        assert "--host=0.0.0.0" in services[service]["command"]
    assert services["target"]["depends_on"] == {"draft": {"condition": "service_healthy"}}
    assert "--drafter=draft:50052" in services["target"]["command"]
    # The default drafter; on GPUs with the draft model on its own GPU behind it.
    drafter = DraftConfig().drafter + ("+model" if name == "docker-compose.yml" else "")
    assert f"--drafter={drafter}" in services["draft"]["command"]
    mounts = {volume.split(":")[1]: volume.split(":")[0]
              for s in ("prometheus", "grafana") for volume in services[s]["volumes"]}
    assert mounts["/etc/prometheus"] == str(PROMETHEUS_DIR)
    assert mounts["/etc/grafana/provisioning"] == str(DEPLOY / "grafana" / "provisioning")
    assert mounts["/etc/grafana/dashboards"] == str(DASHBOARD.parent)


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_the_gateway_publishes_the_openai_api_in_front_of_the_target(name):
    services = _compose_config(name)["services"]
    gateway = services["gateway"]
    assert gateway["command"][:2] == ["smg", "launch"]
    assert {"--backend=vllm", "--worker-urls=grpc://target:50051", "--port=8000"} <= set(gateway["command"])
    assert gateway["healthcheck"]["test"] == ["CMD", "python", "deploy/healthcheck.py",
                                              "http://127.0.0.1:8000/readiness"]
    assert gateway["depends_on"] == {"target": {"condition": "service_healthy"}}
    assert gateway["ports"] == ["127.0.0.1:8000:8000/tcp"]
    assert "--http-port=8000" in services["target"]["command"]
    assert not any("auth-token" in arg for arg in services["target"]["command"])


def test_gpu_stack_puts_target_and_draft_on_their_own_gpus():
    services = _compose_config("docker-compose.yml")["services"]
    for service, gpu in (("target", "0"), ("draft", "1")):
        devices = services[service]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]
        assert "--device=cuda" in services[service]["command"]


def test_cpu_stack_needs_no_gpu():
    services = _compose_config("docker-compose.cpu.yml")["services"]
    for service in ("target", "draft"):
        assert "deploy" not in services[service]
        assert not any(arg.startswith("--device") for arg in services[service]["command"])
    assert "--model=smollm2-135m" in services["target"]["command"]
    assert "--model=smollm2-135m-draft" in services["draft"]["command"]
    assert f"--max-fanout={DraftConfig().max_fanout}" in services["draft"]["command"]  # pre-drafting as shipped


def test_the_cpu_stacks_model_drafter_can_turn_pre_drafting_off():
    """On one machine a model drafter's pre-drafts cost the target more than they gain."""
    command = _compose_config("docker-compose.cpu.yml", {"DRAFTER_KIND": "suffix+model", "MAX_FANOUT": "0"})[
        "services"]["draft"]["command"]
    assert {"--drafter=suffix+model", "--max-fanout=0"} <= set(command)
    assert parse_config([arg for arg in command if arg.startswith("--max-fanout")]).max_fanout == 0


# ---- dashboard ----

def _all_panels(panels: list[dict]) -> list[dict]:
    """Panels, including those inside collapsed rows."""
    return [p for panel in panels for p in (panel, *_all_panels(panel.get("panels", [])))]


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in _all_panels(dashboard["panels"]) for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_panels_use_the_provisioned_datasource(dashboard):
    (datasource,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    expected = {"type": "prometheus", "uid": datasource["uid"]}
    panels = _all_panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == expected, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(t["datasource"] == expected for t in panel["targets"]), panel["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "model" in variables
    assert all(v["datasource"] == expected for v in variables.values())


def test_dashboard_has_the_panels_operators_need(dashboard):
    titles = {p["title"] for p in _all_panels(dashboard["panels"])}
    assert {"Time to first token", "Inter-token latency", "End-to-end latency", "Tokens per second",
            "Acceptance rate", "Mean acceptance length", "Acceptance by draft position", "Draft round trip",
            "Draft-miss rate", "Stale drafts", "Running and waiting requests", "Drafter connected"} <= titles


def test_percentiles_are_histogram_quantiles_over_bucket_rates(dashboard):
    quantile = re.compile(r"^histogram_quantile\(0\.\d+, sum by \(le(, \w+)?\) "
                          r"\(rate\(tandem_\w+_bucket\{[^}]*\}\[\$__rate_interval\]\)\)\)$")
    for title, expr in _queries(dashboard):
        if "histogram_quantile" in expr or "_bucket" in expr:
            assert quantile.match(expr), (title, expr)
    for title in ("Time to first token", "Inter-token latency", "End-to-end latency", "Draft round trip"):
        (panel,) = [p for p in dashboard["panels"] if p["title"] == title]
        assert [t["legendFormat"] for t in panel["targets"]] == ["p50", "p90", "p99"], title


# ---- Prometheus config and alerts ----

def test_promtool_accepts_the_shipped_config_and_rules():
    promtool = _binary("promtool", "prometheus")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([promtool, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"


# ---- the real pair, scraped by a real Prometheus ----

def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        reply = json.load(response)
    assert reply["status"] == "success", reply
    return reply["data"]


class Prometheus:
    """Debian's prometheus on a loopback port, with prometheus.yml's jobs pointed at the given services."""

    def __init__(self, binary: str, workdir: Path, services: dict[str, ServiceProcess]):
        config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
        config["global"].update(scrape_interval=f"{SCRAPE_SECONDS}s", evaluation_interval=f"{SCRAPE_SECONDS}s")
        config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
        assert {job["job_name"] for job in config["scrape_configs"]} == set(services)
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": [f"127.0.0.1:{services[job['job_name']].metrics_port}"]}]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> dict:
        return _get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")

    def wait_until(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited; see {self.log_path}"
            try:
                if ready():
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(0.5)
        raise AssertionError(f"prometheus: {what} within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def _sampled_request(prompt: str, seed: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=prompt, sampling_params=generation_pb2.SamplingParams(temperature=0.8, seed=seed, max_tokens=MAX_TOKENS))


@pytest.fixture(scope="module")
def observed_pair(tmp_path_factory):
    """(prometheus, target, draft, traffic start): the pair scraped while it served greedy, sampled and
    constrained requests."""
    binary = _binary("prometheus", "prometheus")
    workdir = tmp_path_factory.mktemp("deploy")
    common = ["--threads", "1", "--max-model-len", "512"]
    draft = ServiceProcess("draft_service", [*common, "--drafter", "ngram"], log_path=workdir / "draft.log").start()
    target = ServiceProcess("target_service", [*common, "--drafter", draft.address],
                            log_path=workdir / "target.log").start()
    prometheus = None
    try:
        draft.wait_healthy()
        target.wait_healthy()
        prometheus = Prometheus(binary, workdir, {"tandem-target": target, "tandem-draft": draft})
        prometheus.wait_until(lambda: [t["health"] for t in prometheus.api("targets")["activeTargets"]]
                              == ["up", "up"], "both services scraped")
        prometheus.wait_until(lambda: [r["value"][1] for r in prometheus.api("query", query="tandem_drafter_connected")
                                       ["result"]] == ["1"], "the target's drafter connected")
        traffic_start = time.time()
        constrained = [greedy_request(p, MAX_TOKENS, structured_outputs=StructuredOutputs(regex="[a-z ]{1,40}"))
                       for p in PROMPTS[:2]]
        # A copying request alone first: its n-gram drafts pay even on a slow CPU, where a batch of
        # chat requests rarely drafts well enough for the policy to keep the drafter going.
        results = run_requests(target.address, [greedy_request(COPY_PROMPT, MAX_TOKENS)])
        results += run_requests(target.address, [greedy_request(p, MAX_TOKENS) for p in PROMPTS]
                                + [_sampled_request(p, seed) for seed, p in enumerate(PROMPTS)] + constrained)
        assert sum(r.accepted_tokens for r in results) > 0, "speculation never accepted a draft"
        time.sleep(3 * SCRAPE_SECONDS)  # the last counts scraped
        yield prometheus, target, draft, traffic_start
    finally:
        if prometheus is not None:
            prometheus.stop()
        target.kill()
        draft.kill()


def _label_values(prometheus: Prometheus, query: str) -> list[str]:
    """Grafana's `label_values(metric, label)` through the same API call Grafana makes."""
    match = re.fullmatch(r"label_values\((\w+), (\w+)\)", query)
    assert match, f"unexpected variable query {query!r}"
    metric, label = match.groups()
    return prometheus.api(f"label/{label}/values", **{"match[]": metric})


def _metric_families(prometheus: Prometheus) -> set[str]:
    """Names of the metric families the services export, from the scrape metadata: labelled counters not
    yet incremented (no series yet) are exported with HELP and TYPE, and so are listed too."""
    return set(prometheus.api("metadata"))


def _known(name: str, families: set[str]) -> bool:
    return any(name.removesuffix(suffix) in families for suffix in ("", "_total", "_bucket", "_sum", "_count"))


def test_every_dashboard_query_returns_data(observed_pair, dashboard):
    prometheus, _, _, traffic_start = observed_pair
    variables = {}
    expected = {"model": MODEL, "draft_model": DEFAULT_DRAFT_MODEL}  # the drafter labels its metrics with its own
    for variable in dashboard["templating"]["list"]:
        values = _label_values(prometheus, variable["query"])
        assert values == [expected[variable["name"]]], (variable["name"], values)
        variables[variable["name"]] = values[0]
    # What Grafana's $__rate_interval would be on a dashboard zoomed to the traffic: a window that holds it all.
    now = time.time()
    variables["__rate_interval"] = f"{math.ceil(now - traffic_start) + 5 * SCRAPE_SECONDS}s"
    families = _metric_families(prometheus)

    failures = []
    for title, expr in _queries(dashboard):
        query = re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], expr)
        unknown = [n for n in re.findall(r"\btandem_\w+", query) if not _known(n, families)]
        result = prometheus.api("query", query=query, time=str(now))["result"]
        values = [float(series["value"][1]) for series in result]
        if unknown or not any(math.isfinite(v) for v in values):
            failures.append(f"{title}: {query}\n    unknown metrics {unknown}, values {values}")
    assert not failures, "queries without data:\n" + "\n".join(failures)


def test_alert_rules_evaluate_and_see_the_pair_up_and_connected(observed_pair):
    prometheus = observed_pair[0]
    prometheus.wait_until(lambda: all(r["health"] != "unknown" for g in prometheus.api("rules")["groups"]
                                      for r in g["rules"]), "every alert rule evaluated")
    rules = {r["name"]: r for g in prometheus.api("rules")["groups"] for r in g["rules"]}
    assert set(rules) == {"TandemServiceDown", "TandemDrafterDisconnected", "TandemAcceptanceCollapsed",
                          "TandemSpeculationCosts"}
    for name, rule in rules.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
    assert rules["TandemServiceDown"]["state"] == "inactive"
    assert rules["TandemDrafterDisconnected"]["state"] == "inactive"
    # TandemSpeculationCosts weighs measured speed, which a busy 2-core box moves: its state here
    # would assert wall-clock speed. Its logic is promtool's test (alerts_test.yml), on given series.


TLS_ENV = {"TLS_DIR": "/srv/tls", "TLS_CA": "/tls/ca.crt", "DRAFT_TLS_CERT": "/tls/draft.crt",
           "DRAFT_TLS_KEY": "/tls/draft.key", "TARGET_TLS_CERT": "/tls/target.crt", "TARGET_TLS_KEY": "/tls/target.key"}


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_compose_files_follow_the_tls_settings(name):
    services = _compose_config(name, TLS_ENV)["services"]
    for service in ("draft", "target"):
        command, probe = services[service]["command"], services[service]["healthcheck"]["test"]
        prefix = service.upper()
        assert f"--tls-cert=/tls/{service}.crt" in command and f"--tls-key=/tls/{service}.key" in command, prefix
        assert "--ca-cert=/tls/ca.crt" in probe and f"--server-name={service}" in probe
        assert "/srv/tls:/tls:ro" in services[service]["volumes"]
    assert "--drafter-ca=/tls/ca.crt" in services["target"]["command"]


def test_healthcheck_probe_reports_serving_and_down(observed_pair):
    _, target, draft, _ = observed_pair
    probe = [sys.executable, str(DEPLOY / "healthcheck.py")]
    for service in (target, draft):
        done = subprocess.run([*probe, service.address], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and "SERVING" in done.stdout, done.stderr
    down = subprocess.run([*probe, f"127.0.0.1:{free_port()}", "--timeout", "1"], capture_output=True, text=True,
                          timeout=30)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_healthcheck_probe_reads_an_http_health_endpoint(front_doors):
    probe = [sys.executable, str(DEPLOY / "healthcheck.py")]
    base = front_doors.http_url.removesuffix("/v1")
    done = subprocess.run([*probe, f"{base}/health"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "HTTP 200" in done.stdout, done.stderr
    missing = subprocess.run([*probe, f"{base}/nope"], capture_output=True, text=True, timeout=30)
    assert missing.returncode == 1 and "HTTP 404" in missing.stdout
    down = subprocess.run([*probe, f"http://127.0.0.1:{free_port()}/health", "--timeout", "1"], capture_output=True,
                          text=True, timeout=30)
    assert down.returncode == 1
