"""The metrics routers read, under vLLM's names and labels, beside the tandem_* ones."""
from __future__ import annotations

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.service_fixtures import PROMPTS, greedy_request, run_requests
from target_service.metrics import TargetMetrics
from target_service.vllm_metrics import MIRRORED


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _vllm_labels(labels: frozenset) -> frozenset:
    renamed = {"model": "model_name", "finish_reason": "finished_reason"}
    return frozenset({(renamed.get(k, k), v) for k, v in labels if k != "service"} | {("engine", "0")})


def _assert_mirrored(samples: dict[tuple[str, frozenset], float]) -> int:
    """Every tandem sample of a mirrored metric has its vLLM twin, same value; returns how many."""
    checked = 0
    for (name, labels), value in samples.items():
        families = [f for f in MIRRORED if name.startswith(f) and not name.endswith("_created")]
        if not families:
            continue
        family = max(families, key=len)
        for vllm_name in MIRRORED[family]:
            assert samples[(vllm_name + name[len(family):], _vllm_labels(labels))] == value, (name, vllm_name)
            checked += 1
    return checked


def test_each_mirrored_metric_has_vllms_name_labels_and_value():
    metrics = TargetMetrics("smollm2-135m")
    metrics.num_drafts.inc(3)
    metrics.num_accepted_tokens.inc(5)
    metrics.child(metrics.accepted_per_pos, position="1").inc(2)
    metrics.child(metrics.request_success, finish_reason="length").inc()
    metrics.ttft.observe(0.02)
    metrics.running.set(4)
    metrics.watch_kv_usage(lambda: 0.5)
    metrics.describe_cache(16, 1024, "bfloat16", True)
    samples = _samples(generate_latest(metrics.registry).decode())
    assert _assert_mirrored(samples) > 20
    labels = frozenset({("model_name", "smollm2-135m"), ("engine", "0")})
    assert samples[("vllm:num_requests_running", labels)] == 4
    assert samples[("vllm:kv_cache_usage_perc", labels)] == samples[("vllm:gpu_cache_usage_perc", labels)] == 0.5
    assert samples[("vllm:spec_decode_num_drafts_total", labels)] == 3
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", labels | {("position", "1")})] == 2
    assert samples[("vllm:request_success_total", labels | {("finished_reason", "length")})] == 1
    cache = {("block_size", "16"), ("cache_dtype", "bfloat16"), ("enable_prefix_caching", "True"),
             ("num_gpu_blocks", "1024")}
    assert samples[("vllm:cache_config_info", labels | cache)] == 1


def test_the_http_port_serves_them_as_a_router_scrapes_them(front_doors):
    prompt = "Repeat this text exactly: " + " ".join(["one two three four"] * 6)
    run_requests(front_doors.address, [greedy_request(prompt, 32), greedy_request(PROMPTS[0], 8)])
    text = httpx.get(front_doors.http_url.removesuffix("/v1") + "/metrics", timeout=10).text
    samples = _samples(text)
    assert _assert_mirrored(samples) > 20
    labels = frozenset({("model_name", "smollm2-135m"), ("engine", "0")})
    assert samples[("vllm:spec_decode_num_drafts_total", labels)] > 0
    assert 0 <= samples[("vllm:kv_cache_usage_perc", labels)] < 1
    assert ("vllm:num_requests_waiting", labels) in samples
    [config] = [dict(key[1]) for key in samples if key[0] == "vllm:cache_config_info"]
    assert config["block_size"] == "16" and config["num_gpu_blocks"] == str(8 * 512 // 16)  # --max-model-len 512, 8 slots
