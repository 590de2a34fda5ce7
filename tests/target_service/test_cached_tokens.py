"""The target's prefix caching: the cached tokens each front door reports (which slot a prompt gets:
tests/tandem/test_prefix_cache.py; the runner's prefill past a cached prefix: test_model_runner.py)."""
from __future__ import annotations

import grpc
import httpx
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from tandem.launch import ServiceProcess
from tandem.metrics_scrape import metric, scrape
from tandem.model.kv_cache import DEFAULT_BLOCK_SIZE
from tandem.runtime import load_tokenizer
from tests.support.service_fixtures import greedy_request, run_requests


PROMPT = "Tell me about prefix caching in two sentences."


def cacheable(prompt_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The prompt tokens in the full KV blocks before its last token: what a repeat finds cached."""
    return (prompt_tokens - 1) // block_size * block_size


def test_every_front_door_reports_the_cached_prompt_tokens(front_doors, smollm2_path):
    """The second identical request finds the full blocks before its last prompt token cached, and gives
    the same tokens."""
    [first] = run_requests(front_doors.address, [greedy_request(PROMPT + " 1", 8)])
    [again] = run_requests(front_doors.address, [greedy_request(PROMPT + " 1", 8)])
    assert again.cached_tokens == cacheable(again.prompt_tokens) > 0 and again.token_ids == first.token_ids
    body = {"messages": [{"role": "user", "content": PROMPT + " 1"}], "max_tokens": 8, "temperature": 0}
    usage = httpx.post(front_doors.http_url + "/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": cacheable(usage["prompt_tokens"])}
    ids = load_tokenizer(smollm2_path).encode_chat([{"role": "user", "content": PROMPT + " 1"}])
    with grpc.insecure_channel(front_doors.address) as channel:
        [complete] = [r.complete for r in vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
            vllm_engine_pb2.GenerateRequest(request_id="cached", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
                                            sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=8)),
            timeout=60)]
    assert complete.cached_tokens == cacheable(len(ids)) and list(complete.output_ids) == first.token_ids
    samples = scrape(front_doors.metrics_url)
    assert metric(samples, "vllm:prefix_cache_hits_total") >= 3 * cacheable(len(ids))
    assert metric(samples, "vllm:prefix_cache_queries_total") >= metric(samples, "vllm:prefix_cache_hits_total")


def test_with_blocks_of_64_a_target_caches_whole_blocks_and_gives_the_same_tokens(front_doors, tmp_path):
    """--block-size 64: a repeat finds whole blocks of 64 cached, and greedy tokens are those of the
    target with blocks of 16."""
    prompt = PROMPT + (" Then name every step a request takes through a serving engine, one per line: the"
                       " queue, admission, the prefill, each decode step, and what the cache keeps at the end.")
    target = ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "512", "--block-size", "64"],
                            log_path=tmp_path / "target.log").start()
    try:
        target.wait_healthy()
        first, again = (run_requests(target.address, [greedy_request(prompt, 8)])[0] for _ in range(2))
        [reference] = run_requests(front_doors.address, [greedy_request(prompt, 8)])
        samples = scrape(target.metrics_url)
    finally:
        target.kill()
    assert first.cached_tokens == 0 and again.cached_tokens == cacheable(again.prompt_tokens, 64) > 0
    assert first.token_ids == again.token_ids == reference.token_ids
    assert metric(samples, "vllm:cache_config_info", block_size="64") == 1
