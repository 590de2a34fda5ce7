"""Raw log-probabilities of emitted tokens: the log-softmax of the logits, the token's rank, the top-N."""
from __future__ import annotations

import math

import torch

from tandem_kernels.logprobs import row_logprobs, sequence_logprobs, token_logprobs, top_entries


def test_each_token_gets_its_rows_logprob_rank_and_top():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 1.0], [1.0, 1.0, 1.0, 1.0]])
    rows = row_logprobs(logits, top_n=2)
    [first, second] = token_logprobs(rows, [0, 1], [1, 3], [2, 2])  # the third row goes unused
    expected = torch.log_softmax(logits, dim=-1)
    assert (first.token, first.rank) == (1, 2) and first.logprob == expected[0, 1].item()
    assert [t for t, _ in first.top] == [0, 1] and first.top[0][1] == expected[0, 0].item()
    assert (second.token, second.rank) == (3, 3) and [t for t, _ in second.top] == [2, 1]
    assert math.isclose(sum(math.exp(v) for v in expected[1].tolist()), 1.0, rel_tol=1e-6)


def test_top_zero_returns_the_token_alone_and_a_row_does_not_depend_on_its_batch():
    logits = 5 * torch.randn(6, 999, generator=torch.Generator().manual_seed(3))
    together = token_logprobs(row_logprobs(logits, 0), list(range(6)), [7, 8, 9, 10, 11, 12], [0] * 6)
    alone = [token_logprobs(row_logprobs(logits[i : i + 1], 0), [0], [7 + i], [0])[0] for i in range(6)]
    assert together == alone and all(lp.top == () for lp in together)


def test_each_token_gets_the_top_it_asked_for_from_rows_in_any_order():
    logits = 5 * torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    rows = row_logprobs(logits, 4)
    lps = token_logprobs(rows, [2, 0, 2], [1, 2, 3], [4, 0, 1])
    assert [len(lp.top) for lp in lps] == [4, 0, 1]
    assert lps[0].top[:1] == lps[2].top and lps[0].logprob == torch.log_softmax(logits[2], -1)[1].item()


def test_the_rank_counts_every_more_likely_token_inside_the_top_or_not():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 4.0]])
    for token, rank in ((0, 1), (5, 1), (1, 3), (2, 4), (4, 6)):
        for top_n in (0, 1, 2, 5):
            [lp] = token_logprobs(row_logprobs(logits, top_n), [0], [token], [top_n])
            assert lp.rank == rank and len(lp.top) == top_n, (token, top_n)


def test_top_entries_equal_torch_topk():
    gen = torch.Generator().manual_seed(5)
    for vocab, n in ((49152, 5), (49157, 20), (1000, 3), (7000, 1)):
        rows = torch.randn(4, vocab, generator=gen)
        rows[1, vocab - 1] = 100.0  # in the padded last block
        values, ids = top_entries(rows, n)
        expected_values, expected_ids = rows.topk(n, dim=-1)
        assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)


def test_a_sequences_logprobs_in_chunks_equal_its_rows_at_once():
    logits = 5 * torch.randn(11, 300, generator=torch.Generator().manual_seed(6))
    tokens = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(7)).tolist()
    at_once = token_logprobs(row_logprobs(logits, 3), list(range(11)), tokens, [3] * 11)
    assert sequence_logprobs(logits, tokens, 3, chunk_rows=4) == at_once
    assert sequence_logprobs(logits[:0], [], 3) == []
