"""The two drafters in-process (the model one on a tiny random model): drafts equal the reference loops."""
from __future__ import annotations

import json

import pytest
import torch

from draft_service.drafter import DraftJob, DraftSequence
from draft_service.metrics import DraftMetrics
from draft_service.drafters.model import ModelDrafter, draw_tokens, noise_seed
from draft_service.drafters.ngram import NgramDrafter, lookup
from draft_service.server import model_vocab_size
from tandem_kernels.compression import ONE, encode, sample_compressed, unpack
from tandem_kernels.logits_processors import process_logits
from tandem_kernels.sampling import Sampling, processed_probs, sample
from bench.greedy import greedy_generate
from tandem.model.batch import SequenceChunk
from tandem.runtime import load_tokenizer
from tests.support.tiny_drafter import MAX_LEN, VOCAB, tiny_draft_model

TOP_K = 8


@pytest.fixture
def drafter():
    return ModelDrafter(tiny_draft_model(), TOP_K, DraftMetrics("tiny"))


@pytest.fixture(scope="module")
def reference():
    return tiny_draft_model()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _open(drafter, seq_id: int, prompt: list[int], k: int = 4, sampling: Sampling = Sampling()) -> DraftSequence:
    sequence = DraftSequence((1, seq_id), list(prompt), sampling, k)
    drafter.open(sequence.key)
    return sequence


def _draft_one(drafter, sequence: DraftSequence):
    [draft] = drafter.draft([DraftJob(sequence, list(sequence.tokens))])
    assert draft.key == sequence.key and draft.base_len == len(sequence.tokens)
    return draft


def _reused(drafter) -> float:
    return drafter.metrics.registry.get_sample_value("tandem_draft_reused_tokens_total",
                                                     {"model": "tiny", "service": "draft"})


def test_greedy_drafts_follow_extends_and_rollbacks(drafter, reference):
    prompt = _prompt(12, 0)
    sequence = _open(drafter, 1, prompt)
    greedy = greedy_generate(reference, prompt, 8)
    assert _draft_one(drafter, sequence).token_ids == greedy[:4]

    sequence.tokens += greedy[:2]  # two drafts committed: their KV is reused ...
    assert _draft_one(drafter, sequence).token_ids == greedy[2:6]
    assert _reused(drafter) == 1  # ... but the last committed token is fed again for its logits

    sequence.tokens += greedy[2:7]  # all 4 drafts accepted plus the bonus token, as a target commits
    assert _draft_one(drafter, sequence).token_ids == greedy_generate(reference, prompt + greedy[:7], 4)
    assert _reused(drafter) == 1 + 3  # d1..d3: the slot never holds the last draft

    other = (greedy[0] + 1) % VOCAB  # roll back to the prompt, then a token the drafts did not guess
    sequence.tokens[len(prompt):] = [other]
    assert _draft_one(drafter, sequence).token_ids == greedy_generate(reference, prompt + [other], 4)

    del sequence.tokens[5:]  # a pure rollback into the prompt
    assert _draft_one(drafter, sequence).token_ids == greedy_generate(reference, prompt[:5], 4)

    sequence.tokens[3:] = _prompt(15, 9)  # a rollback, then more new tokens than were there
    assert _draft_one(drafter, sequence).token_ids == greedy_generate(reference, sequence.tokens, 4)


def test_batched_sequences_equal_each_alone(drafter, reference):
    prompts = [_prompt(n, seed) for n, seed in ((5, 1), (17, 2), (9, 3))]
    sequences = [_open(drafter, i, p, k) for i, (p, k) in enumerate(zip(prompts, (4, 2, 6)))]
    drafts = drafter.draft([DraftJob(s, list(s.tokens)) for s in sequences])
    for draft, sequence, prompt in zip(drafts, sequences, prompts):
        assert draft.key == sequence.key
        assert draft.token_ids == greedy_generate(reference, prompt, sequence.k)
        assert draft.to_proto().probs == b""


def test_drafts_stop_at_max_model_len(drafter, reference):
    prompt = _prompt(MAX_LEN - 1, 4)
    sequence = _open(drafter, 1, prompt, k=6)
    assert _draft_one(drafter, sequence).token_ids == greedy_generate(reference, prompt, 2)
    sequence.tokens += [1, 2]
    assert drafter.draft([DraftJob(sequence, list(sequence.tokens))]) == []


def test_closed_sequences_are_not_drafted(drafter):
    sequence = _open(drafter, 1, _prompt(6, 5))
    sequence.closed = True
    assert drafter.draft([DraftJob(sequence, list(sequence.tokens))]) == []


def test_close_frees_the_slot(drafter):
    free = drafter.model.kv_cache.num_free_slots
    sequence = _open(drafter, 1, _prompt(6, 5))
    assert drafter.model.kv_cache.num_free_slots == free - 1
    drafter.close(sequence.key)
    assert drafter.model.kv_cache.num_free_slots == free


def _logits_along(model, prompt: list[int], drafts: list[int]) -> torch.Tensor:
    """The drafter's own computation path for one sequence: prefill, then one draft token at a time."""
    rows = [model.run([SequenceChunk(slot=0, start=0, token_ids=prompt)])]
    for i, token in enumerate(drafts[:-1]):
        rows.append(model.run([SequenceChunk(slot=0, start=len(prompt) + i, token_ids=[token])]))
    return torch.cat(rows)  # [k, V]


SAMPLED = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=1234)


def test_rejection_mode_draws_from_the_q_prime_it_sends(drafter, reference):
    prompt = _prompt(10, 6)
    draft = _draft_one(drafter, _open(drafter, 1, prompt, k=5, sampling=SAMPLED))
    assert draft.to_proto().probs_top_k == TOP_K
    sent = unpack(draft.to_proto().probs, 5, TOP_K, VOCAB)
    logits = _logits_along(reference, prompt, draft.token_ids)
    params = (torch.full((5,), SAMPLED.temperature), torch.full((5,), SAMPLED.top_k),
              torch.full((5,), SAMPLED.top_p), torch.zeros(5))
    expected = encode(processed_probs(logits, *params), TOP_K)
    assert torch.equal(sent.ids, expected.ids) and torch.equal(sent.fixed, expected.fixed)
    positions = torch.arange(len(prompt), len(prompt) + 5)
    assert sample_compressed(sent, torch.full((5,), noise_seed(SAMPLED.seed, prompt)), positions).tolist() == draft.token_ids


def test_drafts_after_different_prefixes_draw_independent_noise_at_the_same_positions():
    """A pre-draft and the proposal under verification draft at overlapping positions; which pre-drafts
    exist depends on the other proposals' drafts, so their noise must not be shared (the lossless
    argument in draft_service/predraft.py). The same prefix draws the same tokens."""
    n = 400
    flat = torch.zeros(2 * n, VOCAB)  # [2n, V]: q' is uniform over the TOP_K lowest ids in every row
    positions = list(range(20, 20 + n)) * 2
    prefix, other, same = [5, 6, 7], [5, 6, 8], [5, 6, 7]
    samplings = [SAMPLED] * (2 * n)

    def agreements(second: list[int]) -> int:
        seeds = [noise_seed(SAMPLED.seed, prefix)] * n + [noise_seed(SAMPLED.seed, second)] * n
        tokens = draw_tokens(flat, samplings, positions, seeds, TOP_K).tokens
        return sum(a == b for a, b in zip(tokens[:n], tokens[n:]))

    assert agreements(same) == n
    assert agreements(other) < 2 * n // TOP_K  # about n / TOP_K by chance; every one with shared noise


def test_invariant_mode_draws_with_the_targets_noise(drafter, reference):
    sampling = Sampling(temperature=1.0, seed=99, drafter_invariant=True)
    prompt = _prompt(10, 7)
    draft = _draft_one(drafter, _open(drafter, 1, prompt, k=4, sampling=sampling))
    assert draft.to_proto().probs == b"" and draft.to_proto().probs_top_k == 0
    logits = _logits_along(reference, prompt, draft.token_ids)
    q = processed_probs(logits, torch.ones(4), torch.zeros(4, dtype=torch.int64), torch.ones(4), torch.zeros(4))
    positions = torch.arange(len(prompt), len(prompt) + 4)
    assert sample(q, torch.full((4,), 99), positions).tolist() == draft.token_ids


def test_mixed_modes_in_one_batch(drafter):
    """Greedy, rejection and invariant rows drafted together each match their own mode alone."""
    prompt = _prompt(8, 8)
    modes = [Sampling(), SAMPLED, Sampling(temperature=1.0, seed=5, drafter_invariant=True)]
    sequences = [_open(drafter, i, prompt, sampling=mode) for i, mode in enumerate(modes)]
    together = drafter.draft([DraftJob(s, list(prompt)) for s in sequences])
    for i, mode in enumerate(modes):
        alone = ModelDrafter(tiny_draft_model(), TOP_K, DraftMetrics("tiny"))
        assert _draft_one(alone, _open(alone, i, prompt, sampling=mode)).token_ids == together[i].token_ids


def test_a_reduced_head_drafts_only_its_vocabulary_in_every_mode():
    """q' is zero outside the draft vocabulary: drafts and sent probabilities stay inside it."""
    head_ids = torch.arange(3, VOCAB, 2)  # [N] target ids of the head rows
    drafter = ModelDrafter(tiny_draft_model(head_ids), TOP_K, DraftMetrics("tiny"), head_ids)
    full = tiny_draft_model()
    prompt = _prompt(9, 10)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[head_ids] = False

    greedy = _draft_one(drafter, _open(drafter, 1, prompt, k=4))
    expected = []
    for _ in range(4):  # the full model's greedy choice among the head's ids, fed back one at a time
        logits = full.run([SequenceChunk(slot=0, start=0, token_ids=prompt + expected)])[-1]
        expected.append(int(logits.masked_fill(outside, float("-inf")).argmax()))
    assert greedy.token_ids == expected

    sampled = _draft_one(drafter, _open(drafter, 2, prompt, k=4, sampling=SAMPLED))
    sent = unpack(sampled.to_proto().probs, 4, TOP_K, VOCAB)
    assert set(sampled.token_ids) <= set(head_ids.tolist())
    assert not bool(outside[sent.ids.long()][sent.fixed.int() > 0].any())
    positions = torch.arange(len(prompt), len(prompt) + 4)
    assert sample_compressed(sent, torch.full((4,), noise_seed(SAMPLED.seed, prompt)), positions).tolist() == sampled.token_ids

    sampling = Sampling(temperature=1.0, seed=99, drafter_invariant=True)
    invariant = _draft_one(drafter, _open(drafter, 3, prompt, k=4, sampling=sampling))
    assert set(invariant.token_ids) <= set(head_ids.tolist())


@pytest.mark.parametrize("tokens, k, min_n, expected", [
    ([10, 11, 12, 13, 14, 15, 30, 10, 11, 12], 3, 1, [13, 14, 15]),  # the trailing 3-gram occurred at 0
    ([5, 6, 1, 5, 6, 2, 5, 6], 4, 1, [2, 5, 6]),  # the most recent occurrence; fewer than k follow it
    ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 1, [9, 2]),  # the longest n-gram wins over a more recent shorter one
    ([1, 2, 3, 4], 4, 1, []),  # nothing repeats
    ([4, 8, 5, 8], 4, 1, [5, 8]),  # a 1-gram
    ([4, 8, 5, 8], 4, 2, []),  # ... unless min_n forbids it
    ([7], 4, 1, []),
])
def test_ngram_lookup(tokens, k, min_n, expected):
    assert lookup(tokens, k, min_n, 4) == expected


def test_ngram_drafter_sends_a_point_mass_only_when_sampling():
    drafter = NgramDrafter(1, 4)
    tokens = [10, 11, 12, 13, 14, 30, 10, 11]
    greedy = DraftSequence((1, 1), tokens, Sampling(), 3)
    sampled = DraftSequence((1, 2), tokens, SAMPLED, 3)
    nothing = DraftSequence((1, 3), [1, 2, 3], SAMPLED, 3)
    drafts = drafter.draft([DraftJob(s, list(s.tokens)) for s in (greedy, sampled, nothing)])
    assert [d.key for d in drafts] == [greedy.key, sampled.key, nothing.key]
    assert drafts[0].token_ids == drafts[1].token_ids == [12, 13, 14]
    assert drafts[2].token_ids == [] and drafts[2].to_proto().probs == b"", "a miss is answered with an empty proposal"
    assert drafts[0].to_proto().probs == b""
    q_prime = unpack(drafts[1].to_proto().probs, 3, 1, VOCAB)
    assert drafts[1].to_proto().probs_top_k == 1
    assert q_prime.ids[:, 0].tolist() == [12, 13, 14] and q_prime.fixed[:, 0].tolist() == [ONE] * 3


def test_the_ngram_drafter_reports_the_models_logits_width(tmp_path, smollm2_path):
    """What a target compares with its own config.vocab_size: config.json's, padding included."""
    tokenizer = load_tokenizer(smollm2_path)
    config = {"model_type": "llama", "vocab_size": 49408, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_vocab_size(tmp_path, tokenizer) == 49408
    assert model_vocab_size(smollm2_path, tokenizer) == tokenizer.vocab_size == 49152


def _greedy_with_rules(model, sequence: DraftSequence, steps: int) -> list[int]:
    """The target's rule, one token at a time: logits processed with every token before the position."""
    tokens = list(sequence.tokens)
    for _ in range(steps):
        logits = model.run([SequenceChunk(slot=0, start=0, token_ids=tokens)]).clone()  # [1, V]
        process_logits(logits, [(0, sequence.sampling, sequence.logits_context(tokens))])
        tokens.append(int(logits.argmax()))
    return tokens[len(sequence.tokens):]


@pytest.mark.parametrize("sampling, min_tokens", [
    (Sampling(repetition_penalty=0.5, frequency_penalty=-2.0, presence_penalty=-2.0), 0),  # repeat: it bites
    (Sampling(logit_bias=((3, 40.0),), bad_words=((3, 3),)), 0),
    (Sampling(allowed_token_ids=(1, 2, 3, 4, 5, 6)), 3),
])
def test_greedy_drafts_follow_the_requests_logits_rules(drafter, reference, sampling, min_tokens):
    """Each draft position counts the drafts before it, as the target's verify rows do, so greedy
    drafts are what the drafter's model emits under the request's penalties, bias and bans."""
    prompt = _prompt(10, 6)
    sequence = _open(drafter, 1, prompt, k=6, sampling=sampling)
    sequence.prompt_len, sequence.min_tokens, sequence.min_tokens_banned = len(prompt), min_tokens, (4, 5)
    drafts = _draft_one(drafter, sequence).token_ids
    assert drafts == _greedy_with_rules(reference, sequence, 6)
    assert drafts != greedy_generate(reference, prompt, 6)
    if min_tokens:
        assert not {4, 5} & set(drafts[:min_tokens]) and set(drafts) <= set(sampling.allowed_token_ids)


def _prefix_hits(drafter) -> float:
    return drafter.metrics.registry.get_sample_value("tandem_draft_prefix_cache_hits_total",
                                                     {"model": "tiny", "service": "draft"})


@pytest.mark.parametrize("mode", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_a_next_turn_drafts_from_the_kv_its_last_turn_left_as_a_whole_prefill_does(mode):
    """A closed sequence's slot keeps its KV: the next turn of the conversation prefills only what is
    new, and its drafts and q' are those of a drafter that prefills it whole."""
    cached, whole = (ModelDrafter(tiny_draft_model(), TOP_K, DraftMetrics("tiny"), prefix_caching=on)
                     for on in (True, False))
    turn = _prompt(20, 11)
    drafts = {}
    for drafter in (cached, whole):
        first = _open(drafter, 1, turn, sampling=mode)
        drafts[drafter] = _draft_one(drafter, first)
        drafter.close(first.key)
        _draft_one(drafter, _open(drafter, 2, _prompt(9, 12), sampling=mode))  # another sequence, in another slot
    assert drafts[cached].token_ids == drafts[whole].token_ids
    next_turn = turn + [(drafts[cached].token_ids[0] + 1) % VOCAB] + _prompt(6, 13)  # not what was drafted
    again = {drafter: _draft_one(drafter, _open(drafter, 3, next_turn, sampling=mode)) for drafter in (cached, whole)}
    assert again[cached].token_ids == again[whole].token_ids
    sent = [again[d].to_proto() for d in (cached, whole)]
    assert sent[0].probs == sent[1].probs and sent[0].probs_top_k == sent[1].probs_top_k
    assert _prefix_hits(cached) == len(turn) and _prefix_hits(whole) == 0


def _prefix_queries(drafter) -> float:
    return drafter.metrics.registry.get_sample_value("tandem_draft_prefix_cache_queries_total",
                                                     {"model": "tiny", "service": "draft"})


@pytest.mark.parametrize("mode", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_a_long_prompt_is_prefilled_in_chunks_in_rounds_between_the_short_ones(mode):
    """A catch-up budget of 16, a 40-token prompt beside a 5-token one: the first round drafts the
    short one while the long one waits; the next runs a 16-token chunk of the long one alone (the
    short one waits, left behind too); the next drafts the short one again; then chunks of 16 and
    8, the last of which drafts. The long prompt's drafts and q' are those of a drafter that
    prefills it whole, and its tokens are looked up once."""
    chunked, whole = (ModelDrafter(tiny_draft_model(), TOP_K, DraftMetrics("tiny"), max_num_batched_tokens=budget)
                      for budget in (16, 512))
    long_prompt, short_prompt = _prompt(40, 21), _prompt(5, 22)
    long, short = _open(chunked, 1, long_prompt, sampling=mode), _open(chunked, 2, short_prompt, sampling=mode)
    drafted, behind, held = [], [], []
    for with_short in (True, True, True, False, False):
        jobs = [DraftJob(long, list(long_prompt))] + ([DraftJob(short, list(short_prompt))] if with_short else [])
        drafted.append([d.key for d in chunked.draft(jobs)])
        behind.append(chunked.behind())
        held.append(len(chunked.slots.own(long.key).cached))
    assert drafted == [[short.key], [], [short.key], [], [long.key]]
    assert behind == [[long.key], [long.key, short.key], [long.key], [long.key], []]
    assert held == [0, 16, 16, 32, 40 + 3]  # the last round also feeds d1..d3
    draft = chunked.draft([DraftJob(long, list(long_prompt))])[0]
    expected = _draft_one(whole, _open(whole, 1, long_prompt, sampling=mode))
    assert draft.token_ids == expected.token_ids and draft.to_proto().probs == expected.to_proto().probs
    assert _prefix_queries(chunked) == len(long_prompt) + len(short_prompt)


def test_a_prompt_once_begun_is_prefilled_to_its_end_before_the_next_begins():
    """A catch-up budget of 16 and two long prompts, 40 and 24 tokens: the first runs 16, 16, then
    its last 8 (and drafts), while the second waits, though it is shorter; the 8 left over are
    too few for a chunk. Then the second runs 16 and 8."""
    drafter = ModelDrafter(tiny_draft_model(), TOP_K, DraftMetrics("tiny"), max_num_batched_tokens=16)
    first, second = _open(drafter, 1, _prompt(40, 31)), _open(drafter, 2, _prompt(24, 32))
    drafted, held = [], []
    for _ in range(5):
        jobs = [DraftJob(s, list(s.tokens)) for s in (first, second) if s.key not in sum(drafted, [])]
        drafted.append([d.key for d in drafter.draft(jobs)])
        held.append([len(drafter.slots.own(s.key).cached) for s in (first, second)])
    assert drafted == [[], [], [first.key], [], [second.key]]
    assert held == [[16, 0], [32, 0], [40 + 3, 0], [43, 16], [43, 24 + 3]]  # a drafting round feeds d1..d3 too
