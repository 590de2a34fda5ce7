"""Preemption on a real target: a KV pool too small for its concurrent requests preempts the newest,
which recomputes its KV when readmitted, and every request still gives the target alone's tokens."""
from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from tandem.launch import ServiceProcess, free_port
from tandem.metrics_scrape import metric, scrape
from tests.support.service_fixtures import greedy_request, run_requests

PROMPTS = ["Count from one to forty in words, separated by commas.",
           "List the days of the week, then list them again backwards.",
           "Write the alphabet with a word for each letter.",
           "Repeat the word 'tandem' twenty times, then say why."]
MODES = ({}, {"temperature": 1.0, "seed": 11, "drafter_invariant": True})


VARIANTS = {"cached": [], "uncached": ["--no-prefix-caching"], "chunked": ["--max-num-batched-tokens", "16"]}


@pytest.mark.parametrize("flags", VARIANTS.values(), ids=VARIANTS.keys())
def test_preempted_sequences_recompute_their_kv_and_keep_the_target_alones_tokens(shared_drafter, tmp_path, request,
                                                                                  flags):
    """256 positions of KV (16 blocks) and 4 slots; each request reaches about 140 positions (9
    blocks), so four at once run the pool dry, with or without shared prefix blocks. With the prefix cache, prompts find the blocks of their runs alone
    and a preempted sequence finds its full blocks again (unless evicted); without it, its new slot
    holds nothing. Greedy, and sampled in drafter-invariant mode (keyed by seed and position,
    bit-identical to the target alone): both give each request's tokens alone, with speculation.

    chunked: a step runs 16 prompt positions beside the running sequences' tokens, so the prompts
    (about 45 tokens with the chat template) are prefilled in chunks, and sequences may be preempted
    between chunks; the tokens alone then come from a target that prefills whole prompts. Every
    request there asks its prompt's logprobs too, which its chunks score: they are those of the
    whole prompt, bit for bit."""
    target = ServiceProcess("target_service", [
        "--threads", "1", "--max-model-len", "256", "--kv-cache-tokens", "256", "--max-num-seqs", "4",
        *flags, "--drafter", shared_drafter.address],
        log_path=tmp_path / "target.log", http_port=free_port()).start()
    chunked = "--max-num-batched-tokens" in flags
    reference = request.getfixturevalue("front_doors") if chunked else target
    modes = [{**mode, "prompt_logprobs": 1} for mode in MODES] if chunked else MODES
    try:
        target.wait_healthy().wait_metric("tandem_drafter_connected", 1)
        if "--no-prefix-caching" in flags:
            _assert_no_kv_events(target.address)
        alone = run_requests(reference.address,
                             [_request(p, speculate=False, **mode) for mode in modes for p in PROMPTS], concurrency=1)
        assert metric(scrape(target.metrics_url), "tandem_num_preemptions_total") == 0
        together = []
        for mode in modes:
            before = metric(scrape(target.metrics_url), "tandem_num_preemptions_total")
            together += run_requests(target.address, [_request(p, **mode) for p in PROMPTS])
            samples = scrape(target.metrics_url)
            assert metric(samples, "tandem_num_preemptions_total") > before, f"{mode}: the pool never ran dry"
    finally:
        target.kill()
    assert metric(samples, "vllm:num_preemptions_total") == metric(samples, "tandem_num_preemptions_total")
    assert sum(r.accepted_tokens for r in together) > 0, "speculation ran"
    if chunked:  # more prefill steps than prompts: some ran in chunks
        assert metric(samples, "tandem_step_duration_seconds_count", kind="prefill") > len(together)
    for mine, expected in zip(together, alone):
        assert mine.token_ids == expected.token_ids
        assert mine.prompt_logprobs == expected.prompt_logprobs and len(mine.prompt_logprobs) == (
            mine.prompt_tokens - 1 if chunked else 0)


def _assert_no_kv_events(address: str) -> None:
    """Without a prefix cache there is nothing to publish: UNIMPLEMENTED, which the gateway takes as
    'never subscribe again'."""
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            next(vllm_engine_pb2_grpc.VllmEngineStub(channel).SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest(), timeout=30))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "--no-prefix-caching" in info.value.details()


def _request(prompt: str, speculate: bool = True, **mode):
    # ignore_eos: every request reaches its prompt plus 100 tokens, so that the pool surely runs dry
    request = greedy_request(prompt, 100, speculate=speculate, ignore_eos=True,
                             **{k: v for k, v in mode.items() if k != "temperature"})
    request.sampling_params.temperature = mode.get("temperature", 0.0)
    return request
