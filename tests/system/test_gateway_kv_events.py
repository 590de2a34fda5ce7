"""The Shepherd Model Gateway's cache-aware routing on Tandem's KV events.

With `--policy cache_aware` the gateway subscribes to each gRPC worker's SubscribeKvEvents and
indexes the blocks the worker reports stored (its own hash over their token ids). Prompts are
cached on one target or the other directly, behind the gateway's back; the gateway then sends
each prompt to the target that holds it, which only the events can tell it.
"""
from __future__ import annotations

import time

import httpx

from tandem.launch import GatewayProcess, ServiceProcess, free_port
from tandem.metrics_scrape import metric, scrape

MODEL = "smollm2-135m"
WARMED_ON = (1, 0, 0, 1)  # which target caches each prompt first: no fixed or alternating choice matches
TOPICS = ("lighthouses", "glaciers", "violins", "volcanoes")


def _prompt(topic: str) -> str:
    """About 80 tokens that share no block with another topic's prompt."""
    return f"{topic.capitalize()}: " + " ".join(f"Tell me fact number {i} about {topic}." for i in range(8))


def _hits(target: ServiceProcess) -> float:
    return metric(scrape(target.metrics_url), "vllm:prefix_cache_hits_total")


def test_cache_aware_routing_follows_the_kv_events_to_the_target_holding_the_prefix(tmp_path):
    targets = [ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "512"],
                              log_path=tmp_path / f"target{i}.log", http_port=free_port()) for i in range(2)]
    gateway = GatewayProcess([t.address for t in targets], tmp_path / "smg.log", policy="cache_aware")
    try:
        for target in targets:
            target.start()
        for target in targets:
            target.wait_healthy()
        url = gateway.start().wait_ready(MODEL).url
        for topic, warmed in zip(TOPICS, WARMED_ON):
            body = {"model": MODEL, "prompt": _prompt(topic), "max_tokens": 1}
            assert httpx.post(f"{targets[warmed].http_url}/completions", json=body, timeout=60).status_code == 200
        time.sleep(1.0)  # the events reach the gateway within milliseconds
        for topic, warmed in zip(TOPICS, WARMED_ON):
            before = [_hits(t) for t in targets]
            body = {"model": MODEL, "prompt": _prompt(topic), "max_tokens": 4}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            gained = [_hits(t) - b for t, b in zip(targets, before)]
            assert gained[warmed] >= 64 and gained[1 - warmed] == 0, f"{topic}: hits gained per target {gained}"
    finally:
        gateway.kill()
        for target in targets:
            target.kill()
