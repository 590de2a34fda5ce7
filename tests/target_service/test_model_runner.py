"""ModelRunner on a tiny random model: the greedy fast path against the verifier kernels' rule."""
from __future__ import annotations

import pytest
import torch

from kernels.compression import encode, no_probs
from kernels.rejection import rejection_sample_reference
from kernels.sampling import Sampling
from target_service.drafts import UsableDrafts
from target_service.model_runner import PrefillItem, ModelRunner, VerifyItem, _ban_stops, verify_greedy
from target_service.sequence import StopBan
from tandem.generate import greedy_generate
from tandem.model.batch import SequenceChunk
from tandem.model.llama import build_model
from tandem.model.random_weights import SHAPES, random_weights


def _options(temperature: float, seed: int = 7) -> Sampling:
    return Sampling(temperature=temperature, seed=seed)


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
    kernel = rejection_sample_reference(one_hot, torch.tensor(flat), cu, no_probs(len(flat)),
                                        torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.int64),
                                        torch.zeros(3, dtype=torch.int64))
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
    items = [
        VerifyItem(0, len(prompt) + 1, 20, UsableDrafts(tuple(continuation[:2]), None, False), _options(0.0)),
        VerifyItem(1, len(prompt) + 1, 20, UsableDrafts((21, 5), encode(q, 8), False), _options(0.9)),
        VerifyItem(2, len(prompt) + 1, 20, None, _options(0.0)),
    ]
    together = runner.verify(items)
    alone = [runner.verify([item])[0] for item in items]
    assert together == alone
    assert together[0].tokens == continuation and together[0].num_accepted == 2
    assert together[2].tokens == continuation[:1]


def test_prefill_mixes_greedy_and_sampled_requests(runner):
    prompts = [list(range(3, 15)), list(range(30, 41))]
    options = [_options(0.0), _options(1.0, seed=11)]
    together = [r.tokens[0] for r in runner.prefill([PrefillItem(s, p, o) for s, (p, o) in
                                                     enumerate(zip(prompts, options))])]
    alone = [runner.prefill([PrefillItem(2, p, o)])[0].tokens[0] for p, o in zip(prompts, options)]
    assert together == alone
    assert together[0] == runner.model.greedy_tokens(runner.model.run([SequenceChunk(3, 0, prompts[0])]))[0]


def test_a_banned_draft_is_rejected_and_its_position_emits_another_token(runner):
    """This random model repeats its last token: drafting that token is right, unless it is banned."""
    model = runner.model
    prompt = list(range(3, 15))
    model.run([SequenceChunk(0, 0, prompt)])
    continuation = greedy_generate(model, prompt + [20], 3, slot=1)
    drafts = UsableDrafts(tuple(continuation[:2]), None, False)

    def verify(ban: StopBan | None):
        [result] = runner.verify([VerifyItem(0, len(prompt) + 1, 20, drafts, _options(0.0), stop_ban=ban)])
        return result

    assert verify(None).tokens == continuation
    banned = verify(StopBan((continuation[0],), 1))
    assert banned.num_accepted == 0 and banned.tokens[0] != continuation[0]


def test_a_stop_ban_covers_an_items_first_rows_only():
    logits = torch.zeros(5, 8)  # two items: 3 rows (k = 2), then 2 rows
    _ban_stops(logits, [(StopBan((1, 4), 2), 3), (StopBan((7,), 5), 2)])
    banned = (logits == float("-inf")).nonzero().tolist()
    assert banned == [[0, 1], [0, 4], [1, 1], [1, 4], [3, 7], [4, 7]]


def test_a_prefill_with_a_stop_ban_never_emits_the_banned_token(runner):
    prompt = list(range(3, 15))
    [free] = runner.prefill([PrefillItem(0, prompt, _options(0.0))])
    [banned] = runner.prefill([PrefillItem(1, prompt, _options(0.0), stop_ban=StopBan((free.tokens[0],), 1))])
    assert banned.tokens[0] != free.tokens[0]
