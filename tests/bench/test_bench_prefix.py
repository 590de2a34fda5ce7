"""The multi-turn load of bench.prefix_cache and bench.prefix_routing, against one target."""
from __future__ import annotations

import asyncio

from bench.prefix_routing import load
from tandem.launch import ServiceProcess, free_port
from tandem.metrics_scrape import metric, scrape
from tandem.registry import DEFAULT_MODEL


def test_a_conversations_next_turn_finds_its_history_in_the_prefix_cache(tmp_path):
    """The load's system prompt is long (about 1,000 tokens): a target of the default --max-model-len."""
    target = ServiceProcess("target_service", ["--threads", "1"], log_path=tmp_path / "target.log",
                            http_port=free_port()).start()
    try:
        target.wait_healthy()
        ttfts = asyncio.run(load(target.http_url, DEFAULT_MODEL, ["What is a KV cache?"], turns=2, max_tokens=4,
                                 concurrency=1))
        samples = scrape(target.metrics_url)
    finally:
        target.kill()
    assert len(ttfts) == 1 and ttfts[0] > 0  # turn 2's
    # Turn 2 finds turn 1's prompt (the system prompt and question) and answer cached.
    assert metric(samples, "tandem_prefix_cache_hits_total") >= 500
