"""What the target counts of drafts, and what it tells the drafter, against a drafter that knows the answer.

The scripted drafter proposes, on each Open, the first k tokens of the target's own greedy
continuation, and answers every Extend with nothing. Those drafts are all accepted, and the target
runs synchronous speculation, which verifies every draft it has: what it must count is known.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from tests.support.service_fixtures import PROMPTS, metric, run_requests, scrape, target_with_drafter, timed_responses
from tandem.launch import ServiceProcess
from tandem.runtime import load_tokenizer
from tandem.v1 import drafter_pb2, drafter_pb2_grpc, generation_pb2, generation_pb2_grpc

K = 4
VOCAB = 49152


def ids_request(prompt_ids: list[int], max_tokens: int, **extra) -> generation_pb2.GenerateRequest:
    """Greedy, and past EOS, so that every continuation has max_tokens tokens."""
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt_ids),
        sampling_params=generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                      **extra))


@dataclass
class StreamLog:
    """What one Speculate stream received."""

    first_update_at: float | None = None
    opened: list[int] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)


class OracleDrafter(drafter_pb2_grpc.DrafterServicer):
    """Proposes the target's greedy continuation on Open; answers each Extend with an empty proposal.

    end_stream_at = (prompt ids, length): once a sequence with that prompt is extended to that
    length, the stream ends at the next update, unanswered, and the target reconnects.
    """

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        self.end_stream_at: tuple[tuple[int, ...], int] | None = None
        self.streams: list[StreamLog] = []
        self.lock = threading.Lock()

    def Info(self, request, context):
        return drafter_pb2.DrafterInfo(model="oracle", vocab_size=VOCAB, tokenizer_fingerprint=self.fingerprint,
                                       max_k=K, kind="model", probs_top_k=4)

    def Speculate(self, request_iterator, context):
        log = StreamLog()
        with self.lock:
            self.streams.append(log)
        prompts: dict[int, tuple[int, ...]] = {}
        ending = False
        for update in request_iterator:
            if ending:
                return
            log.first_update_at = log.first_update_at or time.monotonic()
            proposals = []
            for opened in update.opens:
                log.opened.append(opened.seq_id)
                prompts[opened.seq_id] = tuple(opened.prompt_ids)
                guess = self.continuations.get(prompts[opened.seq_id], [])[: opened.k]
                proposals.append(drafter_pb2.DraftProposal(seq_id=opened.seq_id, base_len=len(opened.prompt_ids),
                                                           token_ids=guess))
            for extend in update.extends:
                length = extend.start + len(extend.token_ids)
                proposals.append(drafter_pb2.DraftProposal(seq_id=extend.seq_id, base_len=length))
                if (prompts.get(extend.seq_id), length) == self.end_stream_at:
                    ending, self.end_stream_at = True, None
            log.closed.extend(closed.seq_id for closed in update.closes)
            if proposals:
                yield drafter_pb2.DraftProposals(proposals=proposals)


@dataclass
class Oracle:
    drafter: OracleDrafter
    target: ServiceProcess
    prompts: list[list[int]]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    drafter = OracleDrafter(tokenizer.fingerprint)
    with target_with_drafter(drafter, tmp_path_factory.mktemp("oracle"), "--sync-speculation",
                             "--num-speculative-tokens", str(K)) as target:
        prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
        alone = run_requests(target.address, [ids_request(p, 48, speculate=False) for p in prompts])
        drafter.continuations = {tuple(p): a.token_ids for p, a in zip(prompts, alone)}
        yield Oracle(drafter, target, prompts)


def _delta(before, after, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def test_a_proposal_whose_drafts_were_all_accepted_is_not_counted_stale(oracle):
    before = scrape(oracle.target.metrics_url)
    results = run_requests(oracle.target.address, [ids_request(p, 12) for p in oracle.prompts])
    after = scrape(oracle.target.metrics_url)
    for prompt, result in zip(oracle.prompts, results):
        assert result.token_ids == oracle.drafter.continuations[tuple(prompt)][:12]
        # The prefill commits d1 (salvaged), and one step verifies and accepts d2..dk: the proposal is used up.
        assert (result.draft_tokens, result.accepted_tokens) == (K - 1, K - 1)
    assert _delta(before, after, "tandem_draft_stale_total", outcome="salvaged") == len(results)
    assert _delta(before, after, "tandem_draft_stale_total", outcome="dropped") == 0


def test_accepted_drafts_after_a_stop_token_are_not_counted(oracle):
    prompt = oracle.prompts[0]
    greedy = oracle.drafter.continuations[tuple(prompt)]
    assert greedy[2] not in greedy[:2], "the stop token must end the sequence at the third token"
    before = scrape(oracle.target.metrics_url)
    [result] = run_requests(oracle.target.address, [ids_request(prompt, 12, stop_token_ids=[greedy[2]])])
    after = scrape(oracle.target.metrics_url)
    # d2, d3 and d4 were verified and accepted; the stop at d3 (greedy[2]) discards d4 and the bonus.
    assert (result.token_ids, result.finish_reason) == (greedy[:3], "stop")
    assert (result.draft_tokens, result.accepted_tokens) == (K - 1, 2)
    assert _delta(before, after, "tandem_spec_decode_num_accepted_tokens_total") == 2
    assert _delta(before, after, "tandem_spec_decode_num_accepted_tokens_per_pos_total", position="2") == 0


def test_after_a_reconnect_only_sequences_opened_on_the_new_stream_are_closed_on_it(oracle):
    """A sequence that finished while the link reconnected was never opened on the new stream."""
    short, long = oracle.prompts[0], oracle.prompts[1]
    drafter = oracle.drafter
    streams_before = len(drafter.streams)
    # The short request's last token comes at the step after this Extend; the drafter then ends the
    # stream, and the synchronous step waits for the long request's drafts while the link reconnects.
    drafter.end_stream_at = (tuple(short), len(short) + 7)

    async def both():
        async with grpc.aio.insecure_channel(oracle.target.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(timed_responses(stub, ids_request(short, 8)),
                                        timed_responses(stub, ids_request(long, 40)))

    short_responses, _ = asyncio.run(both())
    assert len(drafter.streams) == streams_before + 1, "the target did not reconnect once"
    second = drafter.streams[-1]
    short_finished_at = short_responses[-1][0]
    assert second.first_update_at < short_finished_at, "the link reconnected only after the short request ended"
    deadline = time.monotonic() + 30
    while sorted(second.closed) != sorted(second.opened) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(second.opened) == 1  # the long request, reopened
    assert sorted(second.closed) == sorted(second.opened)
