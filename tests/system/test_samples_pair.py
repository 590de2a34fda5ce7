"""n > 1 under speculation, on the synchronous model pair: a request's samples share one prefill,
and each is speculated on its own. Sample i of a request seeded s is the target alone's output for
one sample seeded s + i, bit for bit (drafter-invariant mode); greedy samples are all the greedy output."""
from __future__ import annotations

import asyncio

from tandem.client import GenerationResult, generate_samples, open_channel
from tandem.v1 import generation_pb2_grpc
from tests.support.service_fixtures import greedy_request, run_requests

PROMPT = "Write a short poem about the sea and the sky."


def _samples(address: str, request) -> list[GenerationResult]:
    async def main() -> list[GenerationResult]:
        async with open_channel(address) as channel:
            return await generate_samples(generation_pb2_grpc.GenerationStub(channel), request, timeout=120)

    return asyncio.run(main())


def _seeded(seed: int, speculate: bool = True, **extra):
    request = greedy_request(PROMPT, 24, speculate=speculate, seed=seed, drafter_invariant=True, **extra)
    request.sampling_params.temperature = 1.0
    return request


def test_each_sample_is_the_target_alones_sample_with_its_own_seed(model_pair):
    address = model_pair[1].address
    samples = _samples(address, _seeded(40, n=3, logprobs=1))
    alone = run_requests(address, [_seeded(40 + i, speculate=False, logprobs=1) for i in range(3)])
    assert [s.token_ids for s in samples] == [a.token_ids for a in alone]
    assert [s.logprobs for s in samples] == [a.logprobs for a in alone]
    assert len({tuple(s.token_ids) for s in samples}) == 3, "three seeds, three samples"
    assert sum(s.draft_tokens for s in samples) > 0 and all(s.finish_reason for s in samples)
    assert all(s.prompt_tokens == alone[0].prompt_tokens for s in samples)


def test_greedy_samples_are_each_the_greedy_output(model_pair):
    address = model_pair[1].address
    [alone] = run_requests(address, [greedy_request(PROMPT, 24, speculate=False)])
    samples = _samples(address, greedy_request(PROMPT, 24, n=4))
    assert [s.token_ids for s in samples] == [alone.token_ids] * 4
    assert all(s.accepted_tokens > 0 for s in samples), "each sample speculated"
