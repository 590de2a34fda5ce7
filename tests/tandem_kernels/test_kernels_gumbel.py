"""Drafter-invariant verification: the output is the target's own seeded sampling, whatever the drafter."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from tandem_kernels import VerifyBatch, processed_probs, sample, verify_invariant

VOCAB = 30
PROMPT_LEN = 7
# A bigram target: row i holds the logits that follow token i.
TARGET_LOGITS = 2 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))


def _probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Processed rows [N, V] with one temperature and top-p."""
    n = logits.shape[0]
    no_top_k, no_min_p = torch.zeros(n, dtype=torch.int64), torch.zeros(n)
    return processed_probs(logits, torch.full((n,), temperature), no_top_k, torch.full((n,), top_p), no_min_p)


def _target(previous: list[int], temperature: float, top_p: float) -> torch.Tensor:
    return _probs(TARGET_LOGITS[previous], temperature, top_p)


def _generate_plain(seed: int, length: int, temperature: float, top_p: float) -> list[int]:
    """The target alone: one keyed draw per position."""
    tokens = [seed % VOCAB]
    for position in range(PROMPT_LEN, PROMPT_LEN + length):
        p = _target([tokens[-1]], temperature, top_p)
        tokens.append(int(sample(p, torch.tensor([seed]), torch.tensor([position]))[0]))
    return tokens[1:]


def _generate_speculative(
    seeds: list[int], length: int, drafter_logits: torch.Tensor, temperature: float, top_p: float
) -> tuple[list[list[int]], int]:
    """All seeds in one batch per step; request i drafts 1 + i % 4 tokens. Returns tokens, accepted."""
    sequences = [[seed % VOCAB] for seed in seeds]
    accepted = 0
    while min(len(s) for s in sequences) <= length:
        rows, drafts, counts, positions = [], [], [], []
        for i, (seed, sequence) in enumerate(zip(seeds, sequences)):
            position = PROMPT_LEN + len(sequence) - 1
            own = []
            for j in range(1 + i % 4):  # the drafter shares the target's noise: the default salt
                previous = own[-1] if own else sequence[-1]
                q = _probs(drafter_logits[[previous]], temperature, top_p)
                own.append(int(sample(q, torch.tensor([seed]), torch.tensor([position + j]))[0]))
            rows.append(_target([sequence[-1]] + own, temperature, top_p))
            drafts += own
            counts.append(len(own))
            positions.append(position)
        cu = torch.tensor(counts).cumsum(0)
        result = verify_invariant(
            VerifyBatch(torch.cat(rows), torch.tensor(drafts), cu, torch.tensor(seeds), torch.tensor(positions))
        )
        for sequence, tokens, n in zip(sequences, result.tokens.tolist(), result.num_accepted.tolist()):
            sequence += tokens[: n + 1]
            accepted += n
    return [s[1 : length + 1] for s in sequences], accepted


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_output_equals_the_target_alone_for_two_drafters(temperature, top_p):
    seeds, length = [3, 1234567, 2**62 + 5, 77], 24
    plain = [_generate_plain(seed, length, temperature, top_p) for seed in seeds]
    close = TARGET_LOGITS + 0.3 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))
    far = 2 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(2))
    close_tokens, close_accepted = _generate_speculative(seeds, length, close, temperature, top_p)
    far_tokens, far_accepted = _generate_speculative(seeds, length, far, temperature, top_p)
    assert close_tokens == plain
    assert far_tokens == plain
    assert close_accepted > far_accepted


def test_greedy_rows_follow_the_argmax():
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    p = _probs(logits, 0.0, 1.0)
    argmax = p.argmax(dim=1)
    drafts = torch.tensor([int(argmax[0]), int(argmax[1]), (int(argmax[2]) + 1) % 12])
    result = verify_invariant(VerifyBatch(p, drafts, torch.tensor([3]), torch.tensor([5]), torch.tensor([0])))
    assert result.tokens.tolist() == [argmax[:3].tolist() + [-1]]
    assert result.num_accepted.tolist() == [2]


def test_emitted_tokens_are_distributed_as_p():
    trials = 20_000
    p = _probs(torch.randn(2, 25, generator=torch.Generator().manual_seed(4)), 1.0, 1.0)
    drafts = torch.randint(0, 25, (trials,), generator=torch.Generator().manual_seed(5))
    result = verify_invariant(
        VerifyBatch(p.repeat(trials, 1), drafts, torch.arange(1, trials + 1), torch.arange(trials), torch.full((trials,), 9))
    )
    counts = np.bincount(result.tokens[:, 0].numpy(), minlength=25)
    expected = p[0].double().numpy()
    assert stats.chisquare(counts, expected / expected.sum() * trials).pvalue > 1e-3
