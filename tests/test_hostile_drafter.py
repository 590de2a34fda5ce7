"""A drafter that sends garbage cannot crash the target or change its output; each bad proposal is counted."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from service_fixtures import PROMPTS, greedy_request, metric, run_requests, scrape
from tandem.launch import ServiceProcess, free_port
from tandem.runtime import load_tokenizer
from tandem.v1 import drafter_pb2, drafter_pb2_grpc, generation_pb2

MAX_K = 4
PROBS_TOP_K = 4
VOCAB = 49152


def _bad_proposals(seq_id: int, prompt_len: int, sampled: bool) -> dict[str, drafter_pb2.DraftProposal]:
    """One proposal per way of being wrong, keyed by the reason the target should count."""
    P = drafter_pb2.DraftProposal
    if sampled:
        return {
            "probs": P(seq_id=seq_id, base_len=prompt_len, token_ids=[5], probs=b"\x07garbage",
                       probs_top_k=PROBS_TOP_K),
        }
    return {
        "token_id": P(seq_id=seq_id, base_len=prompt_len, token_ids=[VOCAB + 7]),
        "length": P(seq_id=seq_id, base_len=prompt_len, token_ids=[1, 2, 3, 4, 5]),
        "base_len": P(seq_id=seq_id, base_len=prompt_len + 50, token_ids=[1]),
    }


class HostileDrafter(drafter_pb2_grpc.DrafterServicer):
    """Answers every Open with malformed proposals, and with proposals for sequences that don't exist."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint

    def Info(self, request, context):
        return drafter_pb2.DrafterInfo(model="hostile", vocab_size=VOCAB, tokenizer_fingerprint=self.fingerprint,
                                       max_k=MAX_K, kind="model", probs_top_k=PROBS_TOP_K)

    def Speculate(self, request_iterator, context):
        for update in request_iterator:
            for opened in update.opens:
                sampled = opened.sampling.temperature > 0
                bad = _bad_proposals(opened.seq_id, len(opened.prompt_ids), sampled)
                yield drafter_pb2.DraftProposals(proposals=list(bad.values()))
                yield drafter_pb2.DraftProposals(proposals=[
                    drafter_pb2.DraftProposal(seq_id=10**9, base_len=1, token_ids=[1])])


@pytest.fixture(scope="module")
def hostile_target(tmp_path_factory, smollm2_path):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServicer_to_server(HostileDrafter(load_tokenizer(smollm2_path).fingerprint), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    target = ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "512", "--num-speculative-tokens",
                                               "4", "--drafter", f"127.0.0.1:{port}"],
                            log_path=tmp_path_factory.mktemp("hostile") / "target.log").start().wait_healthy()
    yield target
    target.kill()
    server.stop(0)


def _rejected(samples: dict[str, float], reason: str) -> float:
    return metric(samples, "tandem_draft_rejected_proposals_total", reason=reason)


def test_bad_proposals_are_dropped_counted_and_harmless(hostile_target):
    target = hostile_target
    before = scrape(target.metrics_url)
    alone = run_requests(target.address, [greedy_request(p, 12, speculate=False) for p in PROMPTS[:2]])
    spec = run_requests(target.address, [greedy_request(p, 12) for p in PROMPTS[:2]])
    assert [s.token_ids for s in spec] == [a.token_ids for a in alone]
    sampled = generation_pb2.GenerateRequest(
        prompt="Hello", sampling_params=generation_pb2.SamplingParams(temperature=1.0, max_tokens=8, seed=3))
    run_requests(target.address, [sampled])
    after = scrape(target.metrics_url)
    for reason in ("token_id", "length", "base_len"):
        assert _rejected(after, reason) - _rejected(before, reason) == 2, reason
    assert _rejected(after, "probs") - _rejected(before, "probs") == 1
    assert metric(after, "tandem_spec_decode_num_draft_tokens_total") == metric(
        before, "tandem_spec_decode_num_draft_tokens_total"), "a bad draft was verified"
