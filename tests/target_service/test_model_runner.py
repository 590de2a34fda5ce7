"""ModelRunner on a tiny random model: the greedy fast path against the verifier kernels' rule."""
from __future__ import annotations

import pytest
import torch

from tandem_kernels.compression import encode, no_probs
from tandem_kernels.ragged import VerifyBatch
from tandem_kernels.rejection import rejection_sample_reference
from tandem_kernels.sampling import Sampling, probs_of, sample
from tandem_kernels.logits_processors import LogitsContext
from target_service.model_runner import ModelRunner, _process_logits, verify_greedy
from target_service.step_items import Chunk, ChunkResult, Drafts
from bench.greedy import greedy_generate
from tandem.model.batch import SequenceChunk
from tandem.model.llama import build_model
from tandem.model.random_weights import SHAPES, random_weights


def _options(temperature: float, seed: int = 7) -> Sampling:
    return Sampling(temperature=temperature, seed=seed)


def _prompt(slot: int, prompt: list[int], sampling: Sampling, cached: int = 0, **fields) -> Chunk:
    """A prompt's last chunk from position `cached` (the KV its slot holds), as Sequence.prompt_chunk makes it."""
    scored = tuple(prompt[cached + 1:]) if fields.get("prompt_logprobs") is not None else ()
    return Chunk(seq_id=slot, slot=slot, start=cached, token_ids=tuple(prompt[cached:]), sampling=sampling,
                 scored=scored, **fields)


def _part(slot: int, prompt: list[int], start: int, end: int, prompt_logprobs: int | None = None) -> Chunk:
    """An earlier chunk of a prompt: positions start .. end - 1, scoring the tokens after them when asked."""
    scored = tuple(prompt[start + 1:end + 1]) if prompt_logprobs is not None else ()
    return Chunk(seq_id=slot, slot=slot, start=start, token_ids=tuple(prompt[start:end]), sampling=Sampling(),
                 samples=False, prompt_logprobs=prompt_logprobs, scored=scored)


def _running(slot: int, length: int, last_token: int, drafts: Drafts | None, sampling: Sampling,
             replay: tuple[int, ...] = (), **fields) -> Chunk:
    """A running sequence's step, `length` tokens committed, as Sequence.running_chunk makes it."""
    return Chunk(seq_id=slot, slot=slot, start=length - 1 - len(replay), token_ids=(*replay, last_token),
                 sampling=sampling, drafts=drafts, replayed=len(replay), **fields)


@pytest.mark.parametrize("drafts, targets, tokens, accepted", [
    ((), [5], [5], 0),  # a plain decode step
    ((3, 4, 9), [3, 4, 9, 2], [3, 4, 9, 2], 3),  # all accepted, then the bonus token
    ((3, 4, 9), [3, 6, 9, 2], [3, 6], 1),  # the second is rejected: the recovered token follows
    ((3,), [8, 1], [8], 0),  # the first is rejected
])
def test_verify_greedy(drafts, targets, tokens, accepted):
    result = verify_greedy(drafts, targets)
    assert (result.tokens, result.num_accepted) == (tokens, accepted)


def test_verify_greedy_is_the_rejection_kernels_greedy_rule():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(10, 50, generator=gen), dim=1)  # rows: 3 + 2 + 5
    argmax = probs.argmax(dim=1).tolist()
    draft_lists = [[argmax[0], argmax[1]], [11], [argmax[5], argmax[6], 3, argmax[8]]]
    one_hot = torch.zeros_like(probs).scatter_(1, probs.argmax(dim=1, keepdim=True), 1.0)
    flat = [t for drafts in draft_lists for t in drafts]
    cu = torch.cumsum(torch.tensor([len(d) for d in draft_lists]), 0)
    batch = VerifyBatch(one_hot, torch.tensor(flat), cu, torch.zeros(3, dtype=torch.int64),
                        torch.zeros(3, dtype=torch.int64))
    kernel = rejection_sample_reference(batch, no_probs(len(flat)), torch.ones(3, dtype=torch.bool))
    start = 0
    for b, drafts in enumerate(draft_lists):
        ours = verify_greedy(tuple(drafts), argmax[start:start + len(drafts) + 1])
        n = int(kernel.num_accepted[b])
        assert ours.num_accepted == n and ours.tokens == kernel.tokens[b, : n + 1].tolist()
        start += len(drafts) + 1


@pytest.fixture(params=["torch", "auto"])
def runner(request):
    config = SHAPES["tiny"]
    model = build_model(config, random_weights(config, seed=2), dtype=torch.float32, device=torch.device("cpu"),
                        num_slots=4, max_model_len=64, backend=request.param)
    return ModelRunner(model)


def test_greedy_and_sampled_rows_in_one_step_equal_each_alone(runner):
    """The greedy fast path and the sampled path share a forward; neither changes the other."""
    model = runner.model
    prompt = list(range(3, 15))
    for slot in range(3):
        model.run([SequenceChunk(slot, 0, prompt)])
    continuation = greedy_generate(model, prompt + [20], 3, slot=3)  # the target's own next 3 tokens
    q = torch.softmax(torch.randn(2, 256, generator=torch.Generator().manual_seed(3)), dim=1)
    chunks = [
        _running(0, len(prompt) + 1, 20, Drafts(tuple(continuation[:2]), None, False), _options(0.0)),
        _running(1, len(prompt) + 1, 20, Drafts((21, 5), encode(q, 8), False), _options(0.9)),
        _running(2, len(prompt) + 1, 20, None, _options(0.0)),
    ]
    together = runner.run(chunks)
    alone = [runner.run([chunk])[0] for chunk in chunks]
    assert together == alone
    assert together[0].tokens == continuation and together[0].num_accepted == 2
    assert together[2].tokens == continuation[:1]


def test_prefill_mixes_greedy_and_sampled_requests(runner):
    prompts = [list(range(3, 15)), list(range(30, 41))]
    options = [_options(0.0), _options(1.0, seed=11)]
    together = [r.tokens[0] for r in runner.run([_prompt(s, p, o) for s, (p, o) in
                                                 enumerate(zip(prompts, options))])]
    alone = [runner.run([_prompt(2, p, o)])[0].tokens[0] for p, o in zip(prompts, options)]
    assert together == alone
    assert together[0] == runner.model.greedy_tokens(runner.model.run([SequenceChunk(3, 0, prompts[0])]))[0]


@pytest.mark.parametrize("invariant", [False, True], ids=["standard", "drafter_invariant"])
def test_a_prompts_first_token_is_the_targets_keyed_draw_at_the_prompts_end(runner, invariant):
    """A prompt's last chunk is verified with no drafts: its first token is the keyed draw from p at
    position len(prompt), as sample() makes it, whatever the seed (standard and drafter-invariant)."""
    prompt = list(range(3, 15))
    logits = runner.model.run([SequenceChunk(1, 0, prompt)])  # [1, vocab]
    drawn = []
    for seed in range(8):
        sampling = Sampling(temperature=8.0, seed=seed, drafter_invariant=invariant)
        [result] = runner.run([_prompt(0, prompt, sampling)])
        expected = sample(probs_of(logits, [sampling]), torch.tensor([seed]), torch.tensor([len(prompt)]))
        assert result.tokens == expected.tolist()
        drawn += result.tokens
    assert len(set(drawn)) > 1, "the seeds draw different tokens: the check above can fail"


def test_a_chunk_that_replays_verifies_as_one_whose_slot_held_those_tokens(runner):
    """Back from a preemption, a sequence's slot holds only its first positions: its chunk runs the
    committed tokens past them in front of its newest, then its drafts. Its tokens and features are
    those of a sequence whose slot held them all, and its features start at its newest token."""
    prompt, greedy, layers = list(range(3, 20)), Sampling(), (0, 1)
    [first] = runner.run([_prompt(0, prompt, greedy)])
    committed = prompt + first.tokens
    for _ in range(3):  # slot 0 decodes on: its KV holds every committed token but the newest
        [step] = runner.run([_running(0, len(committed), committed[-1], None, greedy)])
        committed += step.tokens
    continuation = greedy_generate(runner.model, committed, 3, slot=2)
    drafts = Drafts(tuple(continuation[:2]), None, False)
    runner.run([_part(1, prompt, 0, 8)])  # slot 1 holds positions 0..7, as a new slot's cached prefix would
    held, replayed = [runner.run([chunk], layers)[0] for chunk in (
        _running(0, len(committed), committed[-1], drafts, greedy),
        _running(1, len(committed), committed[-1], drafts, greedy, replay=tuple(committed[8:-1])))]
    assert replayed.tokens == held.tokens == continuation and replayed.num_accepted == 2
    assert replayed.features.shape[0] == held.features.shape[0] == 3
    if runner.model.native:
        assert torch.equal(replayed.features, held.features)
    else:
        torch.testing.assert_close(replayed.features, held.features, rtol=1e-2, atol=1e-2)  # bf16 rows of float32 sums


def test_a_banned_draft_is_rejected_and_its_position_emits_another_token(runner):
    """This random model repeats its last token: drafting that token is right, unless it is banned."""
    model = runner.model
    prompt = list(range(3, 15))
    model.run([SequenceChunk(0, 0, prompt)])
    continuation = greedy_generate(model, prompt + [20], 3, slot=1)
    drafts = Drafts(tuple(continuation[:2]), None, False)

    def verify(ban: LogitsContext | None):
        [result] = runner.run([_running(0, len(prompt) + 1, 20, drafts, _options(0.0), logits_context=ban)])
        return result

    assert verify(None).tokens == continuation
    banned = verify(_ban((continuation[0],), 1, drafts.tokens))
    assert banned.num_accepted == 0 and banned.tokens[0] != continuation[0]


def _ban(token_ids: tuple[int, ...], rows: int, drafts: tuple[int, ...] = ()) -> LogitsContext:
    return LogitsContext((), 0, drafts, token_ids, rows)


def test_a_stop_ban_covers_a_chunks_first_rows_only():
    logits = torch.zeros(5, 8)  # two chunks: 3 rows (k = 2), then 2 rows
    chunks = [_running(0, 1, 0, None, Sampling(), logits_context=_ban((1, 4), 2, (0, 0))),
              _running(1, 1, 0, None, Sampling(), logits_context=_ban((7,), 5, (0,)))]
    _process_logits(logits, [(0, chunks[0]), (3, chunks[1])])
    banned = (logits == float("-inf")).nonzero().tolist()
    assert banned == [[0, 1], [0, 4], [1, 1], [1, 4], [3, 7], [4, 7]]


def test_a_prefill_with_a_stop_ban_never_emits_the_banned_token(runner):
    prompt = list(range(3, 15))
    [free] = runner.run([_prompt(0, prompt, _options(0.0))])
    [banned] = runner.run([_prompt(1, prompt, _options(0.0), logits_context=_ban((free.tokens[0],), 1))])
    assert banned.tokens[0] != free.tokens[0]


@pytest.mark.parametrize("sampling", [
    Sampling(repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0),
    Sampling(temperature=0.9, seed=11, drafter_invariant=True, repetition_penalty=2.0, frequency_penalty=2.0,
             presence_penalty=2.0),
    Sampling(logit_bias=((101, 15.0),), bad_words=((101, 101),)),
])
def test_penalized_drafts_verify_to_the_tokens_the_target_alone_decodes(runner, sampling):
    """Row i of a verify step is penalized with d1..di counted, so drafts equal to what the target
    alone emits one step at a time are all accepted, and the bonus is its next token too."""
    prompt = list(range(3, 15))
    alone = _decode_alone(runner, prompt, sampling, steps=5)
    assert alone != _decode_alone(runner, prompt, Sampling(temperature=sampling.temperature, seed=sampling.seed), 5)
    runner.run([_prompt(0, prompt, sampling, logits_context=LogitsContext(tuple(prompt), len(prompt)))])
    committed = prompt + alone[:1]
    drafts = Drafts(tuple(alone[1:4]), None, False)
    context = LogitsContext(tuple(committed), len(prompt), drafts.tokens)
    [result] = runner.run([_running(0, len(committed), committed[-1], drafts, sampling, logits_context=context)])
    assert result.tokens == alone[1:5] and result.num_accepted == 3


def _decode_alone(runner: ModelRunner, prompt: list[int], sampling: Sampling, steps: int,
                  logprobs: int | None = None) -> list:
    """Tokens from a prefill, then plain decode steps, in slot 1; with logprobs, each token's TokenLogprob."""
    [first] = runner.run([_prompt(1, prompt, sampling, logits_context=LogitsContext(tuple(prompt), len(prompt)),
                                  logprobs=logprobs)])
    tokens, results = list(prompt) + first.tokens, list(first.logprobs or first.tokens)
    while len(tokens) < len(prompt) + steps:
        context = LogitsContext(tuple(tokens), len(prompt))
        [step] = runner.run([_running(1, len(tokens), tokens[-1], None, sampling, logits_context=context,
                                      logprobs=logprobs)])
        tokens += step.tokens
        results += step.logprobs or step.tokens
    return results


def test_logprobs_of_verified_tokens_are_the_target_alones_bit_for_bit(runner):
    """Raw logprobs come from the logits before any rule or mask: a verify row holds the logits the
    target alone computes at that position (the decoders are batch-invariant), so they are equal,
    accepted drafts and bonus alike, and penalties do not change them."""
    prompt = list(range(3, 15))
    sampling = Sampling(repetition_penalty=2.0, frequency_penalty=2.0)
    alone = _decode_alone(runner, prompt, sampling, steps=5, logprobs=3)
    tokens = [lp.token for lp in alone]
    runner.run([_prompt(0, prompt, sampling)])
    committed = prompt + tokens[:1]
    drafts = Drafts(tuple(tokens[1:4]), None, False)
    context = LogitsContext(tuple(committed), len(prompt), drafts.tokens)
    [result] = runner.run([_running(0, len(committed), committed[-1], drafts, sampling, logits_context=context,
                                    logprobs=3)])
    assert result.tokens == tokens[1:5] and all(len(lp.top) == 3 and lp.rank >= 1 for lp in result.logprobs)
    if runner.model.native:
        assert result.logprobs == alone[1:5]
        return
    # The PyTorch decoder's matrix products sum in an order that depends on the number of rows, so a
    # verify row's logits may differ from a decode step's by float32 rounding, a few ulps.
    for ours, theirs in zip(result.logprobs, alone[1:5]):
        assert (ours.token, ours.rank, [t for t, _ in ours.top]) == (theirs.token, theirs.rank, [t for t, _ in theirs.top])
        values = torch.tensor([ours.logprob, *(v for _, v in ours.top)])
        torch.testing.assert_close(values, torch.tensor([theirs.logprob, *(v for _, v in theirs.top)]),
                                   rtol=1e-5, atol=1e-5)


def test_prompt_logprobs_score_each_prompt_token_after_the_ones_before_it(runner):
    """Row j of the prompt scores token j + 1: the logits a prefill of the first j + 1 tokens ends on.
    Asking for them changes neither the first token nor another chunk of the batch."""
    prompt, other = list(range(3, 12)), list(range(20, 26))
    sampling = Sampling(temperature=1.0, seed=5)
    plain = runner.run([_prompt(0, prompt, sampling), _prompt(1, other, sampling)])
    asked = runner.run([_prompt(0, prompt, sampling, prompt_logprobs=2), _prompt(1, other, sampling)])
    assert [r.tokens for r in asked] == [r.tokens for r in plain] and asked[1].prompt_logprobs is None
    scored = asked[0].prompt_logprobs
    assert [lp.token for lp in scored] == prompt[1:]
    for j, lp in enumerate(scored):
        row = torch.log_softmax(runner.model.run([SequenceChunk(slot=2, start=0, token_ids=prompt[: j + 1])])[0], -1)
        top_values, top_ids = row.topk(2)
        assert lp.rank == int((row > row[lp.token]).sum()) + 1 and [t for t, _ in lp.top] == top_ids.tolist()
        values = torch.tensor([lp.logprob, *(v for _, v in lp.top)])
        expected = torch.cat([row[lp.token : lp.token + 1], top_values])
        if runner.model.native:  # batch-invariant: a row does not depend on how many rows run with it
            assert torch.equal(values, expected)
        else:  # the PyTorch decoder's sums depend on the number of rows: float32 rounding, a few ulps
            torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)


def test_samples_of_one_prompt_share_its_prefill_and_continue_as_if_each_had_run_it(runner):
    """A copy_of chunk runs no prompt: it shares the first chunk's full KV blocks, copies its partial one,
    takes its logits row, and samples with its own seed. Its first token, and every decode step after,
    is what a prefill of its own gives."""
    prompt, samplings = list(range(3, 30)), [Sampling(temperature=1.0, seed=s) for s in (11, 12, 13)]
    shared = runner.run([_prompt(0, prompt, samplings[0]), _prompt(1, prompt, samplings[1], copy_of=0),
                         _prompt(2, prompt, samplings[2], copy_of=0)])
    tables = [runner.model.kv_cache.block_table(slot)[:2] for slot in (0, 1, 2)]
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 3
    own = [runner.run([_prompt(3, prompt, sampling)])[0] for sampling in samplings]
    assert [r.tokens for r in shared] == [r.tokens for r in own]
    greedy = Sampling()
    for slot in (1, 2):  # decode on in each copied slot and in a slot that ran the prompt itself
        runner.run([_prompt(3, prompt, greedy)])
        tokens = {}
        for s in (slot, 3):
            committed = prompt + shared[slot].tokens
            for _ in range(4):
                [step] = runner.run([_running(s, len(committed), committed[-1], None, greedy)])
                committed += step.tokens
            tokens[s] = committed
        assert tokens[slot] == tokens[3]


def _finish_prefill_and_decode(runner, slot: int, prompt: list[int], cached: int, steps: int):
    """Prefill the prompt past its first `cached` positions (whose KV the slot holds), then decode
    greedily: the committed tokens and the logprobs (top 2) of each token generated."""
    greedy = Sampling()
    [step] = runner.run([_prompt(slot, prompt, greedy, cached=cached, logprobs=2)])
    committed, logprobs = prompt + step.tokens, list(step.logprobs)
    for _ in range(steps):
        [step] = runner.run([_running(slot, len(committed), committed[-1], None, greedy, logprobs=2)])
        committed += step.tokens
        logprobs += step.logprobs
    return committed, logprobs


def _assert_same_logprobs(runner, got, expected) -> None:
    if runner.model.native:  # batch-invariant: a row's KV does not depend on the rows run with it
        assert got == expected
    else:  # the PyTorch decoder's sums depend on the number of rows: float32 rounding, a few ulps
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]),
                                   torch.tensor([lp.logprob for lp in expected]), rtol=1e-5, atol=1e-5)


def test_a_prompt_prefilled_in_chunks_beside_other_prompts_gives_the_whole_prefills_tokens(runner):
    """Slot 0 runs a prompt in three calls (two chunks, then its end with its first token), each
    beside another prompt's whole prefill; slot 1 runs it whole. The first token and the logprobs of
    it and of the decode steps after it are the whole prefill's, and the prompts run beside the chunks
    get what they get alone."""
    prompt, greedy = list(range(3, 40)), Sampling()
    others = [list(range(50, 50 + n)) for n in (5, 9)]
    alone = [runner.run([_prompt(2, other, greedy, logprobs=2)])[0] for other in others]
    beside = []
    for start, end, other in ((0, 16, others[0]), (16, 30, others[1])):
        result, chunk = runner.run([_prompt(2, other, greedy, logprobs=2), _part(0, prompt, start, end)])
        assert chunk == ChunkResult([], 0), "a chunk samples nothing"
        beside.append(result)
    assert [r.tokens for r in beside] == [r.tokens for r in alone]
    _assert_same_logprobs(runner, [lp for r in beside for lp in r.logprobs], [lp for r in alone for lp in r.logprobs])
    chunked_tokens, chunked_logprobs = _finish_prefill_and_decode(runner, 0, prompt, cached=30, steps=3)
    whole_tokens, whole_logprobs = _finish_prefill_and_decode(runner, 1, prompt, cached=0, steps=3)
    assert chunked_tokens == whole_tokens
    _assert_same_logprobs(runner, chunked_logprobs, whole_logprobs)
    # A call of chunks alone writes their KV; one beside a prompt's logprobs leaves those as they are alone.
    assert runner.run([_part(3, prompt, 0, 8)]) == [ChunkResult([], 0)]
    assert _finish_prefill_and_decode(runner, 3, prompt, cached=8, steps=3)[0] == whole_tokens
    scored = [runner.run([_prompt(2, others[1], greedy, prompt_logprobs=2), *parts])[0].prompt_logprobs
              for parts in ([], [_part(3, prompt, 0, 16)])]
    _assert_same_logprobs(runner, scored[1], scored[0])


@pytest.mark.parametrize("capture", [(), (0, 1)], ids=["logits", "features"])
def test_a_prompts_logprobs_come_in_its_chunks_as_they_come_whole(runner, capture):
    """Prompt logprobs asked of a prompt run in three calls: each part scores the tokens after its
    positions, the first beside a prompt that asks none (its first token is what it is alone), and
    together with the last call's they are the whole prefill's, as is the first token. With
    features captured the rows come as logits, else as hidden states turned into logits."""
    prompt, greedy, other = list(range(3, 40)), Sampling(), list(range(50, 59))
    [whole] = runner.run([_prompt(1, prompt, greedy, prompt_logprobs=2)], capture)
    [alone] = runner.run([_prompt(2, other, greedy)], capture)
    beside, first = runner.run([_prompt(2, other, greedy), _part(0, prompt, 0, 16, prompt_logprobs=2)], capture)
    [second] = runner.run([_part(0, prompt, 16, 30, prompt_logprobs=2)], capture)
    [last] = runner.run([_prompt(0, prompt, greedy, prompt_logprobs=2, cached=30)], capture)
    assert beside.tokens == alone.tokens and last.tokens == whole.tokens
    assert [len(r.prompt_logprobs) for r in (first, second, last)] == [16, 14, 6]
    assert [lp.token for lp in whole.prompt_logprobs] == prompt[1:]
    _assert_same_logprobs(runner, first.prompt_logprobs + second.prompt_logprobs + last.prompt_logprobs,
                          whole.prompt_logprobs)


def test_a_prompts_features_come_in_its_chunks_as_they_come_whole(runner):
    """A drafter that reads target features gets each chunk's rows: together with the last chunk's,
    they are the whole prefill's rows, and the first token is the same."""
    prompt, greedy, layers = list(range(3, 40)), Sampling(), (0, 1)
    [whole] = runner.run([_prompt(1, prompt, greedy)], layers)
    [first] = runner.run([_part(0, prompt, 0, 16)], layers)
    other, second = runner.run([_prompt(2, list(range(50, 59)), greedy), _part(0, prompt, 16, 30)], layers)
    [last] = runner.run([_prompt(0, prompt, greedy, cached=30)], layers)
    assert last.tokens == whole.tokens and other.features.shape[0] == 9
    chunked = torch.cat([first.features, second.features, last.features])  # [37, layers, hidden]
    if runner.model.native:
        assert torch.equal(chunked, whole.features)
    else:
        torch.testing.assert_close(chunked, whole.features, rtol=1e-2, atol=1e-2)  # bf16 rows of float32 sums


def test_a_prefill_past_a_cached_prefix_continues_as_a_whole_prefill_does(runner):
    """The first turn's KV stays in slot 0; the second turn prefills only its new tokens there. Its
    first token and the decode steps after it are the whole prefill's (slot 1)."""
    first_turn = list(range(3, 20))
    [answer] = runner.run([_prompt(0, first_turn, Sampling())])
    second_turn = first_turn + answer.tokens + [40, 41, 42]
    cached_tokens, cached_logprobs = _finish_prefill_and_decode(runner, 0, second_turn, cached=len(first_turn), steps=4)
    whole_tokens, whole_logprobs = _finish_prefill_and_decode(runner, 1, second_turn, cached=0, steps=4)
    assert cached_tokens == whole_tokens
    _assert_same_logprobs(runner, cached_logprobs, whole_logprobs)
