"""bench.load over OpenAI HTTP records what it records over gRPC, for the same greedy prompts."""
from __future__ import annotations

import asyncio

from bench.http_client import run_http_load
from bench.load import Arrivals, run_load
from bench.prompt_set import load_prompts
from tandem.registry import DEFAULT_MODEL


def test_the_http_load_sees_the_tokens_the_grpc_load_sees(front_doors):
    prompts = load_prompts(3)
    arrivals = Arrivals("closed", 2)
    grpc = asyncio.run(run_load(front_doors.address, prompts, arrivals, temperature=0.0, max_tokens=16,
                                speculate=False))
    http = asyncio.run(run_http_load(front_doors.http_url + "/chat/completions", DEFAULT_MODEL, prompts, arrivals,
                                     temperature=0.0, max_tokens=16, speculate=False))
    by_id = {r.prompt_id: r for r in grpc.records}
    assert len(http.records) == 3 and not any(r.error for r in http.records)
    for record in http.records:
        twin = by_id[record.prompt_id]
        assert (record.prompt_tokens, record.completion_tokens, record.finish_reason) == \
            (twin.prompt_tokens, twin.completion_tokens, twin.finish_reason)
        assert 0 < record.ttft <= record.e2e
        assert record.draft_tokens == 0 and len(record.itl) <= record.completion_tokens - 1
    bad = asyncio.run(run_http_load(front_doors.http_url + "/chat/completions", "no-such-model", prompts[:1], arrivals,
                                    temperature=0.0, max_tokens=4, speculate=None))
    assert bad.records[0].error.startswith("HTTP 404")
