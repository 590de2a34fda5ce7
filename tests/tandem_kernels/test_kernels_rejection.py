"""Rejection sampling: lossless (chi-square against p), greedy semantics, reproducibility, safety."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import stats

from tandem_kernels import (
    CompressedProbs,
    KernelInputError,
    VerifyBatch,
    concat,
    encode,
    no_probs,
    processed_probs,
    rejection_sample,
    sample,
    sample_compressed,
    to_dense,
)

ALPHA = 1e-3
TRIALS = 20_000
NO_PROBS = no_probs(0)


@dataclass(eq=False)
class Request:
    """One request of a verification batch: its target rows [k+1, V], drafts [k], q' [k, K]."""

    p: torch.Tensor
    drafts: list[int]
    q: CompressedProbs
    greedy: bool = False
    seed: int = 0
    position: int = 0


def _verify(requests: list[Request]):
    """Flatten requests into one ragged batch and run rejection_sample."""
    batch = VerifyBatch(
        torch.cat([r.p for r in requests]),
        torch.tensor([d for r in requests for d in r.drafts], dtype=torch.int64),
        torch.tensor([len(r.drafts) for r in requests]).cumsum(0),
        torch.tensor([r.seed for r in requests]),
        torch.tensor([r.position for r in requests]),
    )
    return rejection_sample(batch, concat([r.q for r in requests]), torch.tensor([r.greedy for r in requests]))


# Greedy targets: the argmax of rows 0..3 is 3, 5, 1, 7.
GREEDY_P = processed_probs(
    torch.nn.functional.one_hot(torch.tensor([3, 5, 1, 7]), 8).float() * 4 + 0.1 * torch.arange(8.0),
    torch.zeros(4), torch.zeros(4, dtype=torch.int64), torch.ones(4), torch.zeros(4),
)  # fmt: skip


@pytest.mark.parametrize(
    "drafts, tokens, accepted",
    [
        ([3, 5, 1], [3, 5, 1, 7], 3),
        ([4, 5, 1], [3, -1, -1, -1], 0),
        ([3, 6, 1], [3, 5, -1, -1], 1),
        ([3, 5, 0], [3, 5, 1, -1], 2),
        ([], [3], 0),
    ],
    ids=["all-accepted", "first-rejected", "middle-rejected", "last-rejected", "no-drafts"],
)
def test_greedy_table(drafts, tokens, accepted):
    # Greedy drafts come without q', which would reject every random draft.
    result = _verify([Request(GREEDY_P[: len(drafts) + 1], drafts, no_probs(len(drafts)), greedy=True)])
    assert result.tokens.tolist() == [tokens]
    assert result.num_accepted.tolist() == [accepted]


def test_greedy_uses_argmax_of_p_even_when_p_is_not_one_hot():
    p = torch.softmax(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]]), dim=1)
    q = encode(torch.tensor([[1.0, 0.0, 0.0]]), 3)
    result = _verify([Request(p, [1], q, greedy=True)])
    assert result.tokens.tolist() == [[1, 0]]


def test_greedy_table_in_one_mixed_batch():
    requests = [
        Request(GREEDY_P, [3, 5, 1], no_probs(3), greedy=True),
        Request(GREEDY_P[:1], [], NO_PROBS, greedy=True),
        Request(GREEDY_P, [3, 6, 1], no_probs(3), greedy=True),
        Request(GREEDY_P[:2], [4], no_probs(1), greedy=True),
    ]
    result = _verify(requests)
    assert result.tokens.tolist() == [[3, 5, 1, 7], [3, -1, -1, -1], [3, 5, -1, -1], [3, -1, -1, -1]]
    assert result.num_accepted.tolist() == [3, 0, 1, 0]


def _target_rows(vocab: int, num_rows: int, temperature: float, top_p: float, seed: int) -> torch.Tensor:
    """p [num_rows, V]: distinct processed rows, so a row mix-up shows."""
    logits = 1.5 * torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed))
    ones = torch.ones(num_rows)
    return processed_probs(logits, temperature * ones, torch.zeros(num_rows, dtype=torch.int64), top_p * ones, 0 * ones)


def _draft_rows(p: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    """q [k, V] for the draft positions: near p, far from p, or without mass where p has much."""
    gen = torch.Generator().manual_seed(seed + 1)
    if kind == "near":
        return torch.softmax(torch.log(p + 1e-3) + 0.5 * torch.randn(p.shape, generator=gen), dim=1)
    if kind == "far":
        return torch.softmax(-3 * p / p.max(dim=1, keepdim=True).values, dim=1)
    # "zeros": no mass on p's three most likely tokens, nor on a random half of the rest.
    q = torch.rand(p.shape, generator=gen) * (torch.rand(p.shape, generator=gen) < 0.5)
    q.scatter_(1, p.topk(3, dim=1).indices, 0.0)
    return q + (q.sum(dim=1, keepdim=True) == 0) * torch.nn.functional.one_hot(p.argmin(dim=1), p.shape[1])


def _speculate(p: torch.Tensor, q: torch.Tensor, k_top: int, seed: int):
    """TRIALS requests with the same rows p [k+1, V] and q [k, V]; the drafter samples from q'."""
    k = q.shape[0]
    compressed = encode(q, k_top)
    seeds = seed * 10**6 + torch.arange(TRIALS)
    draft_seeds = seeds.repeat_interleave(k)
    draft_positions = torch.arange(k).repeat(TRIALS) + 100
    q_rows = CompressedProbs(compressed.ids.repeat(TRIALS, 1), compressed.fixed.repeat(TRIALS, 1))
    drafts = sample_compressed(q_rows, draft_seeds, draft_positions)
    batch = VerifyBatch(p.repeat(TRIALS, 1), drafts, torch.arange(1, TRIALS + 1) * k, seeds, torch.full((TRIALS,), 100))
    result = rejection_sample(batch, q_rows, torch.zeros(TRIALS, dtype=torch.bool))
    return result, to_dense(compressed, p.shape[1])


def _assert_distributed_as(tokens: np.ndarray, probs: torch.Tensor) -> None:
    """Chi-square of tokens against probs; no token outside the support; sparse bins merged."""
    counts = np.bincount(tokens, minlength=probs.numel())
    probs = probs.double().numpy()
    assert counts[probs == 0].sum() == 0, "a token outside the support of p"
    expected = probs * tokens.size
    big = expected >= 5
    observed = np.append(counts[big], counts[~big & (probs > 0)].sum())
    expected = np.append(expected[big], expected[~big].sum())
    observed, expected = observed[expected > 0], expected[expected > 0]
    if observed.size == 1:  # a single token has mass: the support check above was the whole test
        return
    assert stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > ALPHA


LOSSLESS_CASES = [
    # (seed, vocab, temperature, top_p, K, q, k)
    (10, 32, 0.5, 1.0, 32, "near", 2),
    (11, 32, 1.0, 1.0, 32, "near", 2),
    (12, 32, 1.5, 1.0, 32, "near", 2),
    (13, 32, 1.0, 1.0, 1, "near", 2),
    (14, 32, 1.0, 1.0, 4, "near", 3),
    (15, 40, 1.0, 0.9, 4, "near", 2),
    (16, 40, 0.5, 0.9, 1, "near", 2),
    (17, 24, 1.0, 1.0, 24, "far", 2),
    (18, 24, 1.5, 0.9, 4, "far", 2),
    (19, 48, 1.0, 1.0, 48, "zeros", 2),
    (20, 48, 1.0, 1.0, 4, "zeros", 2),
]


@pytest.mark.parametrize("seed, vocab, temperature, top_p, k_top, kind, k", LOSSLESS_CASES)
def test_emitted_tokens_are_distributed_as_p(seed, vocab, temperature, top_p, k_top, kind, k):
    p = _target_rows(vocab, k + 1, temperature, top_p, seed)
    q = _draft_rows(p[:k], kind, seed)
    result, q_dense = _speculate(p, q, k_top, seed)
    emitted = result.num_accepted.numpy() + 1
    for position in range(k + 1):
        reached = emitted > position
        assert position > 0 or reached.all()
        if reached.sum() >= 200:
            _assert_distributed_as(result.tokens[reached, position].numpy(), p[position])
    acceptance = float(torch.minimum(p[0], q_dense[0]).sum())
    observed = int((result.num_accepted > 0).sum())
    assert stats.binomtest(observed, TRIALS, acceptance).pvalue > ALPHA


def test_each_request_emits_its_accepted_drafts_then_one_token():
    p = _target_rows(20, 4, 1.0, 1.0, seed=5)
    result, _ = _speculate(p, _draft_rows(p[:3], "near", 5), 20, seed=5)
    tokens, accepted = result.tokens, result.num_accepted.long()
    assert bool((tokens.gather(1, accepted[:, None]) >= 0).all())
    assert bool(((tokens >= 0).sum(dim=1) == accepted + 1).all())
    assert 0 < float(accepted.float().mean()) < 3


def test_identical_p_and_q_accept_every_draft():
    p = _target_rows(30, 4, 1.0, 1.0, seed=6)
    compressed = encode(p[:3], 30)
    q_dense = to_dense(compressed, 30)
    p = torch.cat([q_dense, p[3:]])
    drafts = sample_compressed(compressed, torch.full((3,), 4), torch.arange(3))
    result = _verify([Request(p, drafts.tolist(), compressed, seed=4)])
    assert result.num_accepted.tolist() == [3]


def test_residual_that_is_zero_everywhere_falls_back_to_p():
    # p = q' / 2: a draft is rejected half the time, and max(0, p - q') is zero everywhere.
    compressed = encode(torch.tensor([[0.5, 0.25, 0.25, 0.0]]), 4)
    p = torch.cat([to_dense(compressed, 4) / 2, torch.tensor([[0.0, 0.0, 0.0, 1.0]])])
    rejected = 0
    for seed in range(40):
        draft = int(sample_compressed(compressed, torch.tensor([seed]), torch.tensor([0]))[0])
        result = _verify([Request(p, [draft], compressed, seed=seed)])
        if result.num_accepted[0] == 0:
            rejected += 1
            assert result.tokens[0, 0] == sample(p[:1].contiguous(), torch.tensor([seed]), torch.tensor([0]))[0]
    assert 5 < rejected < 35


def test_draft_outside_the_support_of_q_is_rejected_and_replaced_by_a_draw_from_p():
    # A dishonest drafter: token 2 has q'(2) = 0 yet p(2) = 1.
    compressed = encode(torch.tensor([[1.0, 0.0, 0.0]]), 1)
    p = torch.tensor([[0.2, 0.0, 0.8], [0.0, 1.0, 0.0]])
    for seed in range(20):
        result = _verify([Request(p, [2], compressed, seed=seed)])
        assert result.num_accepted.tolist() == [0]
        assert result.tokens[0, 0] == sample(p[:1].contiguous(), torch.tensor([seed]), torch.tensor([0]))[0]


def test_a_seeded_request_gives_the_same_tokens_in_any_batch():
    p = _target_rows(64, 5, 1.0, 1.0, seed=7)
    q = _draft_rows(p[:4], "near", 7)
    compressed = encode(q, 8)
    drafts = sample_compressed(compressed, torch.full((4,), 99), torch.arange(4) + 30).tolist()
    mine = Request(p, drafts, compressed, seed=99, position=30)
    others = [
        Request(p[:1], [], NO_PROBS, seed=1, position=3),
        Request(p[:3], [5, 6], no_probs(2), greedy=True),
        Request(p, mine.drafts, compressed, seed=98, position=30),
    ]
    alone = _verify([mine])
    for batch in ([others[0], mine], [others[1], mine, others[2]], [mine, others[2], others[0], others[1]]):
        result = _verify(batch)
        row = batch.index(mine)
        assert torch.equal(result.tokens[row, :5], alone.tokens[0])
        assert result.num_accepted[row] == alone.num_accepted[0]


def test_batch_checks_are_clear_errors():
    p = _target_rows(10, 2, 1.0, 1.0, seed=8)
    compressed = encode(p[:1], 4)
    good = Request(p, [3], compressed)
    with pytest.raises(KernelInputError, match="draft_tokens"):
        _verify([Request(p, [10], compressed)])
    with pytest.raises(KernelInputError, match="target_probs: expected 2 rows"):
        _verify([Request(p[:1], [3], compressed)])
    batch = {"target_probs": p, "draft_tokens": torch.tensor([3]), "cu_num_draft_tokens": torch.tensor([1]),
             "seeds": torch.tensor([0]), "positions": torch.tensor([0])}
    rest = {"draft_probs": compressed, "is_greedy": torch.tensor([False])}
    wrong = {"draft_probs": NO_PROBS, "is_greedy": torch.tensor([0]), "cu_num_draft_tokens": torch.tensor([1]).int()}
    for name, bad in wrong.items():
        with pytest.raises(KernelInputError, match=name):
            args = {**batch, **rest, name: bad}
            rejection_sample(VerifyBatch(**{key: args[key] for key in batch}), args["draft_probs"], args["is_greedy"])
    assert _verify([good]).tokens.shape == (1, 2)


def test_a_request_without_drafts_emits_what_sample_draws():
    p = _target_rows(50, 6, 0.8, 0.95, seed=9)
    p[5] = torch.nn.functional.one_hot(p[5].argmax(), 50).float()  # a greedy row
    seeds, positions = torch.arange(6) * 31 + 2, torch.arange(6) + 400
    requests = [Request(p[i : i + 1], [], NO_PROBS, i == 5, int(seeds[i]), int(positions[i])) for i in range(6)]
    result = _verify(requests)
    assert torch.equal(result.tokens[:, 0], sample(p, seeds, positions))
    assert result.num_accepted.tolist() == [0] * 6
