"""bench.kv_capacity's load against a target whose KV pool holds three of its requests."""
from __future__ import annotations

import asyncio

from bench.kv_capacity import load, prompts
from tandem.launch import ServiceProcess, free_port


def test_requests_beyond_the_kv_pool_wait_for_blocks_and_all_complete(tmp_path):
    """2,048 tokens of KV (128 blocks) and 8 slots: prompts of 588 tokens plus 24 new ones need 39 blocks
    each, so three run at once while the others wait, and every request gets all its tokens."""
    target = ServiceProcess("target_service", ["--threads", "1", "--max-num-seqs", "8", "--kv-cache-tokens", "2048"],
                            log_path=tmp_path / "target.log", http_port=free_port()).start()
    try:
        target.wait_healthy()
        result = asyncio.run(load(target.http_url, target.metrics_url, prompts(6, 500), max_tokens=24))
    finally:
        target.kill()
    assert result.output_tokens == 6 * 24
    assert 1 <= result.peak_running <= 3
