"""Penalties and the other logits rules: vLLM's definitions, per position, and the kernel equals its reference."""
from __future__ import annotations

import pytest
import torch

from tandem_kernels.checks import KernelInputError
from tandem_kernels.logits_processors import LogitsContext, process_logits
from tandem_kernels.penalties import RowPenalties, apply_penalties, apply_penalties_reference, penalty_entries
from tandem_kernels.sampling import Sampling

VOCAB = 50


def _dense_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float,
                     frequency: float, repetition: float) -> torch.Tensor:
    """One row penalized as vLLM writes it, densely over the vocabulary."""
    counts = torch.zeros(logits.shape[0])
    for t in output:
        counts[t] += 1
    seen = counts > 0
    seen[prompt] = True
    penalties = torch.where(seen, torch.tensor(repetition), torch.tensor(1.0))
    out = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    return out - frequency * counts - presence * (counts > 0).float()


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return 4 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_each_verify_row_is_penalized_with_the_drafts_before_it():
    prompt, output, drafts = [3, 4, 4, 9], [7, 7, 3], [7, 11, 4]
    sampling = Sampling(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)
    logits = _logits(len(drafts) + 1)
    expected = torch.stack([_dense_penalties(logits[i], prompt, output + drafts[:i], 0.5, 0.3, 1.3)
                            for i in range(len(drafts) + 1)])
    process_logits(logits, [(0, sampling, LogitsContext(prompt + output, len(prompt), drafts))])
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_rows_outside_the_items_are_left_alone():
    logits = _logits(6, seed=1)
    before = logits.clone()
    penalized = Sampling(repetition_penalty=2.0)
    process_logits(logits, [(1, penalized, LogitsContext([5, 6], 2, [8, 9])), (5, Sampling(), LogitsContext([1], 1))])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[4:], before[4:])
    for row, seen in ((1, [5, 6]), (2, [5, 6, 8]), (3, [5, 6, 8, 9])):
        torch.testing.assert_close(logits[row], _dense_penalties(before[row], seen, [], 0, 0, 2.0), rtol=0, atol=0)


def test_presence_and_frequency_count_generated_tokens_only():
    logits = _logits(1, seed=2)
    before = logits.clone()
    process_logits(logits, [(0, Sampling(presence_penalty=1.0, frequency_penalty=0.5), LogitsContext([1, 2, 2], 3))])
    assert torch.equal(logits, before), "the prompt alone is not penalized by presence or frequency"


def test_allowed_bad_words_ban_and_bias_follow_vllms_order():
    logits = torch.zeros(3, VOCAB)
    sampling = Sampling(allowed_token_ids=(1, 2, 3, 4, 5), bad_words=((2,), (6, 3), (7, 8, 4)),
                        logit_bias=((5, 2.5), (9, 1.0)))
    # Generated tokens [6, 7, 8] then draft 6, so row 0 follows ...7 8, row 1 follows ...8 6, row 2 ...6 6.
    context = LogitsContext([0, 0, 6, 7, 8], 2, drafts=[6, 6], banned=(1,), banned_rows=2)
    process_logits(logits, [(0, sampling, context)])
    allowed = {0: [3, 5], 1: [4, 5], 2: [1, 4, 5]}
    for row, tokens in allowed.items():
        finite = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert finite == tokens, row
        assert logits[row, 5] == 2.5
    assert torch.isinf(logits[:, 9]).all(), "a bias does not lift a token the allow list bans"


def test_bad_words_match_generated_tokens_not_the_prompt():
    logits = torch.zeros(1, VOCAB)
    process_logits(logits, [(0, Sampling(bad_words=((6, 3),)), LogitsContext([5, 6], 2))])
    assert torch.isfinite(logits).all()


def test_the_bias_is_added_before_the_repetition_penalty():
    logits = torch.full((1, VOCAB), -1.0)
    process_logits(logits, [(0, Sampling(logit_bias=((4, 3.0),), repetition_penalty=2.0), LogitsContext([4], 1))])
    assert logits[0, 4] == 1.0  # (-1 + 3) / 2


def test_penalty_entries_count_each_row_and_token_once():
    entries = penalty_entries(torch.tensor([0, 0, 0, 1, 1]), torch.tensor([5, 5, 2, 5, 7]),
                              torch.tensor([True, True, False, False, True]), VOCAB)
    got = sorted(zip(entries.rows.tolist(), entries.tokens.tolist(), entries.counts.tolist()))
    assert got == [(0, 2, 0), (0, 5, 2), (1, 5, 0), (1, 7, 1)]


def test_apply_penalties_refuses_bad_arguments():
    entries = penalty_entries(torch.tensor([0]), torch.tensor([1]), torch.tensor([True]), VOCAB)
    penalties = RowPenalties(torch.zeros(1), torch.zeros(1), torch.ones(1))
    with pytest.raises(KernelInputError, match="logits"):
        apply_penalties(torch.zeros(1, VOCAB, dtype=torch.float64), entries, penalties)
    with pytest.raises(KernelInputError, match="repetition"):
        apply_penalties(torch.zeros(1, VOCAB), entries, RowPenalties(torch.zeros(1), torch.zeros(1), torch.zeros(1)))
    with pytest.raises(KernelInputError, match="presence"):
        apply_penalties(torch.zeros(2, VOCAB), entries, penalties)


def test_reference_keeps_untouched_entries_bit_exact():
    logits = _logits(2, seed=5)
    before = logits.clone()
    entries = penalty_entries(torch.tensor([1]), torch.tensor([3]), torch.tensor([True]), VOCAB)
    apply_penalties_reference(logits, entries, RowPenalties(torch.ones(2), torch.ones(2), torch.full((2,), 1.5)),
                              1.0 / torch.full((2,), 1.5))
    changed = (logits != before).nonzero().tolist()
    assert changed == [[1, 3]]
