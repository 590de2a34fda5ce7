"""A drafter that sends garbage cannot crash the target or change its output; each bad proposal is counted."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from tests.support.service_fixtures import PROMPTS, greedy_request, metric, run_requests, scrape, target_with_drafter
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
    drafter = HostileDrafter(load_tokenizer(smollm2_path).fingerprint)
    # Without the target's own lookup, every draft a step verifies would be the drafter's.
    with target_with_drafter(drafter, tmp_path_factory.mktemp("hostile"), "--num-speculative-tokens", "4",
                             "--no-local-drafts") as target:
        yield target


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


# ---- a drafter whose misbehaviour the test switches: one target process for every mode ---------

ONE = 1 << 15


class ScriptedDrafter(drafter_pb2_grpc.DrafterServicer):
    """Tracks each sequence's length from the updates, and answers them as `mode` says.

    bad_sum: well-formed probabilities whose rows do not sum to ONE. closed: proposals for
    sequences the target has closed. out_of_order: a current proposal, then an older one.
    flood: hundreds of proposals per update. hang: reads updates, never answers. stall: stops
    reading updates at all.
    """

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.mode = "hang"
        self.lengths: dict[int, int] = {}
        self.prompt_lens: dict[int, int] = {}
        self.closed: list[int] = []
        self.release = threading.Event()

    def Info(self, request, context):
        return drafter_pb2.DrafterInfo(model="scripted", vocab_size=VOCAB, tokenizer_fingerprint=self.fingerprint,
                                       max_k=MAX_K, kind="model", probs_top_k=PROBS_TOP_K)

    def Speculate(self, request_iterator, context):
        for update in request_iterator:
            if self.mode == "stall":
                self.release.wait(timeout=120)  # stop reading: the target's sends back up
            for opened in update.opens:
                self.lengths[opened.seq_id] = self.prompt_lens[opened.seq_id] = len(opened.prompt_ids)
            for extend in update.extends:
                self.lengths[extend.seq_id] = extend.start + len(extend.token_ids)
            for closed in update.closes:
                self.lengths.pop(closed.seq_id, None)
                self.closed.append(closed.seq_id)
            yield from self._answer(update)

    def _answer(self, update):
        P = drafter_pb2.DraftProposal
        live = list(self.lengths.items())
        if self.mode == "bad_sum":
            ids = b"".join(i.to_bytes(3, "little") for i in range(1, PROBS_TOP_K + 1))
            fixed = b"".join(v.to_bytes(2, "little") for v in (ONE // 2, ONE // 2, 1, 0))  # sums to ONE + 1
            yield drafter_pb2.DraftProposals(proposals=[
                P(seq_id=s, base_len=n, token_ids=[1], probs=ids + fixed, probs_top_k=PROBS_TOP_K) for s, n in live])
        elif self.mode == "closed":
            yield drafter_pb2.DraftProposals(proposals=[P(seq_id=s, base_len=1, token_ids=[1, 2]) for s in self.closed])
        elif self.mode == "out_of_order":
            for s, n in live:
                yield drafter_pb2.DraftProposals(proposals=[P(seq_id=s, base_len=n, token_ids=[2, 3])])
                yield drafter_pb2.DraftProposals(proposals=[P(seq_id=s, base_len=self.prompt_lens[s], token_ids=[4])])
        elif self.mode == "flood":
            batch = drafter_pb2.DraftProposals(proposals=[
                P(seq_id=s, base_len=n, token_ids=[(s * 7 + j) % VOCAB for j in range(MAX_K)])
                for s, n in live for _ in range(25)])
            for _ in range(40):
                yield batch


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, smollm2_path):
    drafter = ScriptedDrafter(load_tokenizer(smollm2_path).fingerprint)
    with target_with_drafter(drafter, tmp_path_factory.mktemp("scripted"), "--num-speculative-tokens", "4",
                             "--draft-wait-ms", "20", "--no-local-drafts") as target:  # only the drafter drafts
        alone = run_requests(target.address, [greedy_request(p, 10, speculate=False) for p in PROMPTS[:2]])
        yield drafter, target, [a.token_ids for a in alone]
        drafter.release.set()


def _rss(pid: int) -> int:
    status = open(f"/proc/{pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def _greedy_unchanged(target, alone) -> None:
    spec = run_requests(target.address, [greedy_request(p, 10) for p in PROMPTS[:2]], timeout=60)
    assert [s.token_ids for s in spec] == alone


@pytest.mark.parametrize("mode", ["hang", "closed", "out_of_order", "flood", "bad_sum"])
def test_scripted_misbehaviour_leaves_output_and_memory_alone(scripted, mode):
    drafter, target, alone = scripted
    drafter.mode = mode
    before, rss_before = scrape(target.metrics_url), _rss(target.process.pid)
    _greedy_unchanged(target, alone)
    sampled = [generation_pb2.GenerateRequest(prompt="Once upon a time", sampling_params=generation_pb2.SamplingParams(
        temperature=0.8, max_tokens=8, seed=11, speculate=speculate)) for speculate in (False, True)]
    plain, spec = run_requests(target.address, sampled, timeout=60)
    after = scrape(target.metrics_url)
    if mode in ("hang", "closed", "bad_sum"):
        # No usable draft ever reaches a step, so sampling is keyed exactly as without speculation.
        assert spec.token_ids == plain.token_ids
    if mode == "bad_sum":
        assert _rejected(after, "probs") > _rejected(before, "probs")
    if mode == "flood":
        assert metric(after, "tandem_draft_wire_bytes_total") - metric(before, "tandem_draft_wire_bytes_total") > 1e5
        assert _rss(target.process.pid) - rss_before < 64 * 2**20, "the flood grew the target's memory"
    assert metric(after, "tandem_num_requests_running") == 0


def test_a_drafter_that_stops_reading_does_not_stall_the_target(scripted):
    drafter, target, alone = scripted
    drafter.mode = "stall"
    started = time.monotonic()
    for _ in range(3):
        _greedy_unchanged(target, alone)
    assert time.monotonic() - started < 120
    drafter.release.set()


async def test_a_drafter_that_stops_reading_cannot_grow_the_update_queue():
    """In process: updates pile up for a drafter that never reads; past the bound the link is remade."""
    import asyncio

    from target_service.speculation.link import DrafterLink
    from target_service.metrics import TargetMetrics

    class NeverReads(drafter_pb2_grpc.DrafterServicer):
        async def Info(self, request, context):
            return drafter_pb2.DrafterInfo(model="stalled", vocab_size=VOCAB, tokenizer_fingerprint="fp", max_k=4)

        async def Speculate(self, request_iterator, context):
            await asyncio.Event().wait()

    class Peer:  # the link's DrafterPeer
        def reopen_all(self):
            return drafter_pb2.TargetUpdate()

        def on_proposals(self, message, wire_bytes):
            raise AssertionError("a drafter that never answers sent a proposal")

    server = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServicer_to_server(NeverReads(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    link = DrafterLink(f"127.0.0.1:{port}", Peer(), TargetMetrics("test"), vocab_size=VOCAB,
                       tokenizer_fingerprint="fp", reconnect_max_seconds=0.2, max_message_bytes=2**24,
                       max_pending_updates=64)
    link.start()
    try:
        update = drafter_pb2.TargetUpdate(extends=[drafter_pb2.SequenceExtend(seq_id=1, start=10,
                                                                              token_ids=list(range(4000)))])
        drops = peak = 0
        for _ in range(3000):  # ~ 40 MB offered; a bound of 64 updates holds well under 1 MB
            was = link.connected
            link.send(update)
            peak = max(peak, link._queue.qsize())
            drops += was and not link.connected
            await asyncio.sleep(0.001)
        assert peak <= 64 and drops >= 1
        for _ in range(100):  # and it reconnects
            if link.connected:
                break
            await asyncio.sleep(0.05)
        assert link.connected
    finally:
        await link.stop()
        await server.stop(0)
