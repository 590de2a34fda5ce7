"""The draft service as a process on loopback, spoken to over gRPC the way a target does.

One model-drafter process (the embedded SmolLM2) and one n-gram process serve the whole module;
the reference drafts come from the same SmolLM2 in this process, built while the services start.
"""
from __future__ import annotations

import asyncio
import signal
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from draft_service.drafters.model import noise_seed
from tandem_kernels.compression import DEFAULT_TOP_K, ONE, sample_compressed, unpack, wire_bytes_per_token
from tests.support.service_fixtures import metric, scrape
from bench.greedy import greedy_generate
from tandem.launch import ServiceProcess
from tandem.model.batch import SequenceChunk
from tandem.model.llama import LlamaModel, build_model
from tandem.runtime import load_tokenizer
from tandem.tokenizer import Tokenizer
from tandem.v1 import drafter_pb2 as pb
from tandem.v1 import drafter_pb2_grpc

MAX_MODEL_LEN = 128
MAX_K = 6
K = 4
GRACE_S = 5
WAIT_S = 60  # a busy 2-core machine: model rounds can take seconds


def _metric(server: ServiceProcess, name: str, **labels: str) -> float:
    """One sample scraped from /metrics over HTTP; every draft metric carries these two labels."""
    return metric(scrape(server.metrics_url), name, service="draft", model="smollm2-135m", **labels)


async def _wait_metric(server: ServiceProcess, name: str, value: float) -> None:
    deadline = time.monotonic() + WAIT_S
    while (current := _metric(server, name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed at {current}, not {value}"
        await asyncio.sleep(0.05)


@dataclass
class Speculation:
    """One Speculate stream, held the way a target holds it."""

    call: grpc.aio.StreamStreamCall
    received: list[pb.DraftProposal] = field(default_factory=list)

    async def send(self, opens=(), extends=(), closes=()) -> None:
        await self.call.write(pb.TargetUpdate(opens=opens, extends=extends,
                                              closes=[pb.SequenceClose(seq_id=i) for i in closes]))

    async def proposal(self, seq_id: int, base_len: int | None = None) -> pb.DraftProposal:
        """The first unread proposal for seq_id (at base_len, if given); earlier ones for it are skipped."""
        while True:
            for i, p in enumerate(self.received):
                if p.seq_id == seq_id and (base_len is None or p.base_len == base_len):
                    del self.received[: i + 1]
                    return p
            message = await asyncio.wait_for(self.call.read(), WAIT_S)
            assert message is not grpc.aio.EOF, "the stream ended"
            # Drafts took drafting time; an answer of nothing (a refused Open) may come at once.
            assert message.draft_time_ns > 0 or not any(p.token_ids for p in message.proposals)
            self.received.extend(message.proposals)


    async def predrafts(self, seq_id: int, known_len: int, count: int) -> list[pb.DraftProposal]:
        """The next `count` pre-drafts for seq_id that continue its first known_len committed tokens."""
        found: list[pb.DraftProposal] = []
        while True:
            mine = [p for p in self.received
                    if p.seq_id == seq_id and p.assumed_ids and p.base_len - len(p.assumed_ids) == known_len]
            found += mine
            self.received = [p for p in self.received if p not in mine]
            if len(found) >= count:
                return found
            message = await asyncio.wait_for(self.call.read(), WAIT_S)
            assert message is not grpc.aio.EOF, "the stream ended"
            self.received.extend(message.proposals)


@asynccontextmanager
async def speculate(server: ServiceProcess):
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = drafter_pb2_grpc.DrafterStub(channel).Speculate()
        yield Speculation(call)
        call.cancel()


def _open(seq_id: int, prompt: list[int], k: int = K, accepts_assumed: bool = False, prompt_len: int = 0,
          **sampling) -> pb.SequenceOpen:
    return pb.SequenceOpen(seq_id=seq_id, prompt_ids=prompt, k=k, sampling=pb.DraftSampling(**sampling),
                           accepts_assumed=accepts_assumed, prompt_len=prompt_len)


def _extend(seq_id: int, start: int, token_ids: list[int]) -> pb.SequenceExtend:
    return pb.SequenceExtend(seq_id=seq_id, start=start, token_ids=token_ids)


async def _info(server: ServiceProcess) -> pb.DrafterInfo:
    async with grpc.aio.insecure_channel(server.address) as channel:
        return await drafter_pb2_grpc.DrafterStub(channel).Info(pb.DrafterInfoRequest(), timeout=10)


def _start(tmp_path_factory, name: str, *args: str) -> ServiceProcess:
    log_path = tmp_path_factory.mktemp("draft") / f"{name}.log"
    return ServiceProcess("draft_service", ["--model", "smollm2-135m", "--dtype", "float32",  # as `reference`
                                            "--max-model-len", str(MAX_MODEL_LEN), "--max-k", str(MAX_K), *args],
                          log_path=log_path).start()


@pytest.fixture(scope="module")
def model_process(tmp_path_factory):
    service = _start(tmp_path_factory, "model", "--drafter", "model", "--num-slots", "4",
                     "--grace-seconds", str(GRACE_S), "--predraft-guesses", "1")
    yield service
    service.kill()


@pytest.fixture(scope="module")
def ngram_process(tmp_path_factory):
    service = _start(tmp_path_factory, "ngram", "--drafter", "ngram", "--num-slots", "3")
    yield service
    service.kill()


@dataclass
class Reference:
    model: LlamaModel
    tokenizer: Tokenizer


@pytest.fixture(scope="module")
def reference(model_process, ngram_process, request):
    """The same SmolLM2 in this process, built while the services start."""
    config, weights = request.getfixturevalue("smollm2_checkpoint")  # only now: after the services started
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server: the same kernels, so the same argmax
    model = build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"), num_slots=1,
                        max_model_len=MAX_MODEL_LEN)
    yield Reference(model, load_tokenizer(request.getfixturevalue("smollm2_path")))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_server(model_process, reference):
    return model_process.wait_healthy(timeout=180)


@pytest.fixture(scope="module")
def ngram_server(ngram_process):
    return ngram_process.wait_healthy(timeout=180)


async def test_info(model_server, ngram_server, reference):
    model, ngram = await _info(model_server), await _info(ngram_server)
    fingerprint = reference.tokenizer.fingerprint
    assert (model.model, model.kind, model.vocab_size, model.tokenizer_fingerprint, model.max_k, model.probs_top_k) \
        == ("smollm2-135m", "model", reference.model.config.vocab_size, fingerprint, MAX_K, DEFAULT_TOP_K)
    assert (ngram.model, ngram.kind, ngram.vocab_size, ngram.tokenizer_fingerprint, ngram.max_k, ngram.probs_top_k) \
        == ("smollm2-135m", "ngram", reference.model.config.vocab_size, fingerprint, MAX_K, 1)


async def test_greedy_drafts_after_open_extend_and_rollback(model_server, reference):
    prompt = reference.tokenizer.encode("The capital of France is")
    n = len(prompt)
    greedy = greedy_generate(reference.model, prompt, K + 2)
    reused = _metric(model_server, "tandem_draft_reused_tokens_total")
    async with speculate(model_server) as stream:
        await stream.send(opens=[_open(1, prompt)])
        first = await stream.proposal(1)
        assert (first.base_len, list(first.token_ids), first.probs) == (n, greedy[:K], b"")

        await stream.send(extends=[_extend(1, n, greedy[:2])])
        assert list((await stream.proposal(1, n + 2)).token_ids) == greedy[2 : K + 2]
        assert _metric(model_server, "tandem_draft_reused_tokens_total") == reused + 1  # d1 came from the slot

        other = (greedy[0] + 1) % reference.model.config.vocab_size
        await stream.send(extends=[_extend(1, n - 1, [other])])  # roll back into the prompt
        rolled_back = await stream.proposal(1, n)
        assert list(rolled_back.token_ids) == greedy_generate(reference.model, prompt[:-1] + [other], K)


async def test_sampled_drafts_carry_the_q_prime_they_were_drawn_from(model_server, reference):
    prompt = reference.tokenizer.encode("Once upon a time")
    n, vocab = len(prompt), reference.model.config.vocab_size
    async with speculate(model_server) as stream:
        await stream.send(opens=[_open(1, prompt, temperature=1.0, seed=42), _open(2, prompt, temperature=1.0, seed=42),
                                 _open(3, prompt, temperature=1.0, top_p=0.9, seed=7)])
        proposals = [await stream.proposal(i) for i in (1, 2, 3)]
    for p, seed in zip(proposals, (42, 42, 7)):
        assert p.base_len == n and len(p.token_ids) == K and p.probs_top_k == DEFAULT_TOP_K
        assert len(p.probs) == K * wire_bytes_per_token(DEFAULT_TOP_K)
        q_prime = unpack(p.probs, K, DEFAULT_TOP_K, vocab)  # validates: ids in the vocabulary, rows sum to ONE
        assert all(t in row for t, row in zip(p.token_ids, q_prime.ids.tolist()))
        drawn = sample_compressed(q_prime, torch.full((K,), noise_seed(seed, prompt)), torch.arange(n, n + K))
        assert drawn.tolist() == list(p.token_ids)
    assert proposals[0].token_ids == proposals[1].token_ids and proposals[0].probs == proposals[1].probs


async def test_a_temperature_below_1e_5_drafts_greedily_beside_a_sampled_sequence(model_server, reference):
    """logits / 1e-40 overflows to a NaN q, which must not fail the batched round of the other sequence."""
    prompt = reference.tokenizer.encode("The capital of France is")
    greedy = greedy_generate(reference.model, prompt, K)
    async with speculate(model_server) as stream:
        await stream.send(opens=[_open(1, prompt, temperature=1e-40, seed=3),
                                 _open(2, prompt, temperature=1.0, seed=3)])
        tiny, sampled = await stream.proposal(1), await stream.proposal(2)
    assert (list(tiny.token_ids), tiny.probs) == (greedy, b"")
    assert len(sampled.token_ids) == K and sampled.probs


def _runner_up(logits: torch.Tensor, token: int) -> int:
    """The most likely token other than `token` in logits [V]."""
    return int(logits.index_fill(0, torch.tensor([token]), float("-inf")).argmax())


async def test_predrafts_for_a_target_that_keeps_them_and_a_hit_skips_the_fresh_round(model_server, reference):
    """k = 2: three outcomes, each drafted as greedy decoding from its prefix would; the process has 4 slots."""
    prompt = reference.tokenizer.encode("The capital of France is")
    n, model = len(prompt), reference.model
    hits = _metric(model_server, "tandem_draft_predraft_hits_total")
    async with speculate(model_server) as stream:
        await stream.send(opens=[_open(1, prompt, k=2, accepts_assumed=True)])
        fresh = await stream.proposal(1, n)
        d = greedy_generate(model, prompt, 3)
        assert (list(fresh.token_ids), list(fresh.assumed_ids)) == (d[:2], [])
        # Along the server's path: the prompt prefilled, then d1 fed alone.
        logits = [model.run([SequenceChunk(slot=0, start=0, token_ids=prompt)])[-1],
                  model.run([SequenceChunk(slot=0, start=n, token_ids=d[:1])])[-1]]
        expected = {(_runner_up(logits[0], d[0]),), (d[0], _runner_up(logits[1], d[1])), tuple(d)}
        predrafts = {tuple(p.assumed_ids): p for p in await stream.predrafts(1, n, 3)}
        assert set(predrafts) == expected
        for assumed, predraft in predrafts.items():
            assert predraft.base_len == n + len(assumed)
            assert list(predraft.token_ids) == greedy_generate(model, prompt + list(assumed), 2)

        await stream.send(extends=[_extend(1, n, d)])  # both drafts accepted, and the bonus token guessed
        outcomes = await stream.predrafts(1, n + 3, 3)  # the next pre-drafts follow at once ...
        assert not [p for p in stream.received if p.seq_id == 1 and not p.assumed_ids]  # ... with no fresh round
        assert _metric(model_server, "tandem_draft_predraft_hits_total") == hits + 1
        e = list(predrafts[tuple(d)].token_ids)
        assert {tuple(p.assumed_ids[:2]) for p in outcomes if len(p.assumed_ids) == 3} == {tuple(e)}


async def test_close_and_stream_end_free_sequences(model_server, reference):
    prompt = reference.tokenizer.encode("Hello")
    async with speculate(model_server) as stream:
        await stream.send(opens=[_open(1, prompt), _open(2, prompt + prompt)])
        await stream.proposal(1)
        await stream.proposal(2)
        assert _metric(model_server, "tandem_draft_sequences") == 2
        assert _metric(model_server, "tandem_draft_streams") == 1
        await stream.send(closes=[1])
        await _wait_metric(model_server, "tandem_draft_sequences", 1)
    await _wait_metric(model_server, "tandem_draft_sequences", 0)  # the stream ended with sequence 2 open
    await _wait_metric(model_server, "tandem_draft_streams", 0)


async def test_info_answers_while_a_round_runs(model_server):
    """Forwards run off the event loop: a ~1 s round must not hold up Info."""
    async with speculate(model_server) as stream:
        await stream.send(opens=[_open(1, list(range(1000, 1000 + MAX_MODEL_LEN - MAX_K)), k=MAX_K)])
        proposal = asyncio.create_task(stream.proposal(1))
        await asyncio.sleep(0.05)
        began = time.monotonic()
        await _info(model_server)
        assert time.monotonic() - began < 0.25
        assert not proposal.done()  # the round was still running
        await proposal


def _invalid(server: ServiceProcess) -> dict[str, float]:
    reasons = ("unknown_seq", "prompt_too_long", "bad_k", "bad_token_id", "bad_sampling", "no_free_slot", "duplicate_seq",
               "bad_prompt_len")
    return {r: _metric(server, "tandem_draft_invalid_updates_total", reason=r) for r in reasons}


async def test_bad_updates_are_counted_and_skipped(model_server, reference):
    prompt = reference.tokenizer.encode("One, two, three,")
    vocab = reference.model.config.vocab_size
    before = _invalid(model_server)
    async with speculate(model_server) as stream:
        await stream.send(
            opens=[_open(1, [5] * (MAX_MODEL_LEN + 1)), _open(2, prompt, k=MAX_K + 1), _open(3, prompt + [vocab]),
                   _open(5, prompt, temperature=1.0, top_p=1.5), _open(6, prompt, logit_bias={vocab: 1.0}),
                   _open(7, prompt, repetition_penalty=2.5), _open(8, prompt, prompt_len=len(prompt) + 1),
                   _open(9, prompt, min_tokens=2, min_tokens_banned_ids=[vocab])],
            extends=[_extend(77, 0, [1])],
        )
        await stream.send(extends=[_extend(1, 3, [5])], closes=[2])  # refused earlier: ignored, not counted again
        await stream.send(opens=[_open(4, prompt)])
        first = await stream.proposal(4)
        await stream.send(extends=[_extend(4, len(prompt), [vocab + 3])])
        await stream.send(extends=[_extend(4, len(prompt), list(first.token_ids[:1]))])
        second = await stream.proposal(4, len(prompt) + 1)
        assert second.token_ids[: K - 1] == first.token_ids[1:]  # greedy drafting went on from the good token
    after = _invalid(model_server)
    assert {r: after[r] - before[r] for r in after} == {
        "unknown_seq": 1, "prompt_too_long": 1, "bad_k": 1, "bad_token_id": 3, "bad_sampling": 3, "no_free_slot": 0,
        "duplicate_seq": 0, "bad_prompt_len": 1}


async def test_every_open_and_extend_is_answered_even_with_nothing(model_server, reference):
    """A refused Open, an Extend of it, and a job past the drafter's length get an empty proposal."""
    prompt = reference.tokenizer.encode("One, two, three,")
    full = [5] * MAX_MODEL_LEN  # fits; one more token leaves no room to draft
    async with speculate(model_server) as stream:
        await stream.send(opens=[_open(1, [5] * (MAX_MODEL_LEN + 1)), _open(2, prompt, k=MAX_K + 1), _open(3, full)])
        for seq_id, base_len in ((1, MAX_MODEL_LEN + 1), (2, len(prompt))):
            assert list((await stream.proposal(seq_id, base_len)).token_ids) == []
        assert len((await stream.proposal(3, MAX_MODEL_LEN)).token_ids) == 1
        await stream.send(extends=[_extend(1, MAX_MODEL_LEN + 1, [7]), _extend(3, MAX_MODEL_LEN, [7])])
        for seq_id in (1, 3):
            assert list((await stream.proposal(seq_id, MAX_MODEL_LEN + 1 + (seq_id == 1))).token_ids) == []


async def test_an_extend_can_pause_drafting_and_ask_for_fewer_drafts(model_server, reference):
    """k=0 on an Extend: nothing drafted or answered for the sequence until an Extend asks again;
    k above the Open's is refused, and the Extend's tokens stand."""
    prompt = reference.tokenizer.encode("The capital of France is")
    other_prompt = reference.tokenizer.encode("One, two, three,")
    n = len(prompt)
    greedy = greedy_generate(reference.model, prompt, K + 4)
    async with speculate(model_server) as stream:
        await stream.send(opens=[_open(1, prompt), _open(2, other_prompt)])
        await stream.proposal(1)
        other = await stream.proposal(2)
        proposals = _metric(model_server, "tandem_draft_proposals_total")
        paused = pb.SequenceExtend(seq_id=1, start=n, token_ids=greedy[:2], k=0)
        await stream.send(extends=[paused, _extend(2, len(other_prompt), list(other.token_ids[:1]))])
        await stream.proposal(2, len(other_prompt) + 1)  # the same update's other sequence was answered
        await stream.send(extends=[_extend(1, n + 2, greedy[2:3])])  # still paused: k was not set again
        await stream.send(extends=[_extend(2, len(other_prompt) + 1, [5])])
        await stream.proposal(2, len(other_prompt) + 2)
        assert _metric(model_server, "tandem_draft_proposals_total") == proposals + 2
        assert [p for p in stream.received if p.seq_id == 1] == []

        bad_k = _metric(model_server, "tandem_draft_invalid_updates_total", reason="bad_k")
        await stream.send(extends=[pb.SequenceExtend(seq_id=1, start=n + 3, token_ids=greedy[3:4], k=K + 1)])
        await stream.send(extends=[pb.SequenceExtend(seq_id=1, start=n + 4, token_ids=[], k=2)])
        resumed = await stream.proposal(1)
        assert (resumed.base_len, list(resumed.token_ids)) == (n + 4, greedy[4:6])
        assert _metric(model_server, "tandem_draft_invalid_updates_total", reason="bad_k") == bad_k + 1


PHRASE = " the quick brown fox jumps over the lazy dog"


async def test_ngram_drafts_continue_a_repeated_phrase(ngram_server, reference):
    encode = reference.tokenizer.encode
    phrase = encode(PHRASE, add_special_tokens=False)
    prompt = encode("Say", add_special_tokens=False) + phrase + encode(" and", add_special_tokens=False) + phrase[:3]
    n = len(prompt)
    async with speculate(ngram_server) as stream:
        await stream.send(opens=[_open(1, prompt), _open(2, prompt, temperature=0.7, seed=1)])
        greedy, sampled = await stream.proposal(1), await stream.proposal(2)
        assert (greedy.base_len, list(greedy.token_ids), greedy.probs) == (n, phrase[3 : 3 + K], b"")
        assert sampled.token_ids == greedy.token_ids and sampled.probs_top_k == 1
        point_mass = unpack(sampled.probs, K, 1, reference.tokenizer.vocab_size)
        assert point_mass.ids[:, 0].tolist() == phrase[3 : 3 + K] and point_mass.fixed[:, 0].tolist() == [ONE] * K

        await stream.send(extends=[_extend(1, n, phrase[3:5])])
        assert list((await stream.proposal(1, n + 2)).token_ids) == phrase[5 : 5 + K]


async def test_streams_are_independent(ngram_server):
    """Two targets may use the same sequence ids; closing one stream leaves the other's sequences."""
    async with speculate(ngram_server) as first, speculate(ngram_server) as second:
        await first.send(opens=[_open(1, [10, 11, 12, 13, 10, 11])])
        await second.send(opens=[_open(1, [20, 21, 22, 23, 20, 21])])
        assert list((await first.proposal(1)).token_ids) == [12, 13, 10, 11]
        assert list((await second.proposal(1)).token_ids) == [22, 23, 20, 21]
        await _wait_metric(ngram_server, "tandem_draft_sequences", 2)
        first.call.cancel()
        await _wait_metric(ngram_server, "tandem_draft_sequences", 1)
        await second.send(extends=[_extend(1, 6, [22])])
        assert list((await second.proposal(1, 7)).token_ids) == [23, 20, 21, 22]
    await _wait_metric(ngram_server, "tandem_draft_streams", 0)


async def test_full_slots_and_duplicates_are_refused(ngram_server):
    before = _invalid(ngram_server)
    prompt = [1, 2, 3, 1, 2]
    async with speculate(ngram_server) as stream:
        await stream.send(opens=[_open(i, prompt) for i in range(4)] + [_open(0, prompt)])  # 3 slots
        await stream.send(closes=[3])  # refused: ignored
        await stream.send(closes=[0], opens=[_open(5, prompt)])  # Opens come before Closes in one update
        await stream.send(opens=[_open(6, prompt)])
        assert list((await stream.proposal(6)).token_ids) == [3, 1, 2]
    after = _invalid(ngram_server)
    assert after["no_free_slot"] - before["no_free_slot"] == 2  # sequences 3 and 5
    assert after["duplicate_seq"] - before["duplicate_seq"] == 1


async def test_sigterm_mid_round_exits_cleanly_within_the_grace_period(model_server, reference):
    """Stops the shared model server, so it runs last."""
    async with speculate(model_server) as stream:
        await stream.send(opens=[_open(1, reference.tokenizer.encode("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10"), k=MAX_K)])
        await asyncio.sleep(0.2)  # the round has begun
        began = time.monotonic()
        model_server.process.send_signal(signal.SIGTERM)
        while (message := await asyncio.wait_for(stream.call.read(), GRACE_S)) is not grpc.aio.EOF:
            assert message.proposals  # the running round may still deliver; then the service ends the stream
        while model_server.process.poll() is None:
            # The interpreter's own exit (torch, grpc) takes a moment after the service has stopped.
            assert time.monotonic() - began < GRACE_S + 2, "still running after the grace period"
            await asyncio.sleep(0.05)
    assert model_server.process.returncode == 0, model_server.log_path.read_text()
