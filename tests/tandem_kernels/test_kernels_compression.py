"""Compressed draft probabilities: exact fixed point, deterministic ties, strict wire validation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from tandem_kernels import DRAFT_SALT, ONE, CompressedProbs, InvalidDraftProbs, sample
from tandem_kernels.compression import (concat, decode, encode, no_probs, pack, point_mass, sample_compressed, to_dense,
                                 unpack, wire_bytes_per_token)

ALPHA = 1e-3


def _random_q(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.softmax(3 * torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)), dim=1)


@pytest.mark.parametrize("k", [1, 2, 16, 50])
def test_rows_sum_to_exactly_one(k):
    compressed = encode(_random_q(200, 50), k)
    assert compressed.ids.dtype == torch.int32 and compressed.fixed.dtype == torch.uint16
    assert compressed.ids.shape == (200, k)
    assert bool((compressed.fixed.to(torch.int64).sum(dim=1) == ONE).all())
    assert bool((decode(compressed).double().sum(dim=1) == 1.0).all())


def test_ids_are_the_top_k_in_order_and_probabilities_round_the_renormalized_top_k():
    q = _random_q(100, 300, seed=1)
    compressed = encode(q, 8)
    top, ids = q.topk(8, dim=1)
    assert torch.equal(compressed.ids, ids.int())
    exact = top.double() / top.double().sum(dim=1, keepdim=True)
    assert float((decode(compressed).double() - exact).abs().max()) < 1.0 / ONE


def test_decode_is_exact_fixed_point():
    compressed = encode(_random_q(10, 40), 16)
    assert torch.equal(decode(compressed) * ONE, compressed.fixed.float())


def test_ties_go_to_the_lower_id_and_leftovers_to_the_earlier_entries():
    compressed = encode(torch.full((1, 5), 0.2), 3)
    assert compressed.ids.tolist() == [[0, 1, 2]]
    assert compressed.fixed.tolist() == [[10923, 10923, 10922]]
    assert encode(torch.tensor([[0.1, 0.4, 0.1, 0.4]]), 3).ids.tolist() == [[1, 3, 0]]


def test_fewer_non_zeros_than_k_leave_zero_entries():
    q = torch.tensor([[0.0, 0.75, 0.0, 0.25, 0.0, 0.0]])
    compressed = encode(q, 4)
    assert compressed.ids.tolist() == [[1, 3, 0, 2]]
    assert compressed.fixed.tolist() == [[ONE * 3 // 4, ONE // 4, 0, 0]]


def test_k_larger_than_the_vocabulary_keeps_the_whole_vocabulary():
    compressed = encode(_random_q(3, 5), 16)
    assert compressed.k == 5
    assert torch.equal(compressed.ids.sort(dim=1).values, torch.arange(5, dtype=torch.int32).expand(3, 5))


def test_unnormalized_q_is_renormalized():
    assert torch.equal(encode(torch.tensor([[2.0, 6.0]]), 2).fixed, encode(torch.tensor([[0.25, 0.75]]), 2).fixed)


@pytest.mark.parametrize(
    "q, k, message",
    [
        (torch.tensor([[0.5, float("nan")]]), 2, "NaN"),
        (torch.tensor([[0.5, float("inf")]]), 2, "NaN or infinite"),
        (torch.tensor([[1.5, -0.5]]), 2, "negative"),
        (torch.tensor([[0.0, 0.0]]), 2, "no probability mass"),
        (torch.tensor([[0.5, 0.5]]), 0, "k"),
        (torch.tensor([0.5, 0.5]), 2, r"\[N, V\]"),
        (torch.tensor([[1, 0]]), 2, "float"),
    ],
)
def test_bad_q_is_a_clear_error(q, k, message):
    with pytest.raises(ValueError, match=message):
        encode(q, k)


def test_pack_round_trips_exactly_within_96_bytes_per_token_at_k16():
    compressed = encode(_random_q(7, 49152), 16)
    data = pack(compressed)
    assert len(data) == 7 * wire_bytes_per_token(16) and wire_bytes_per_token(16) <= 96
    back = unpack(data, 7, 16, 49152)
    assert torch.equal(back.ids, compressed.ids) and torch.equal(back.fixed, compressed.fixed)
    assert torch.equal(decode(back), decode(compressed))


def test_unpack_accepts_an_empty_message_and_large_ids():
    assert unpack(b"", 0, 16, 100).ids.shape == (0, 16)
    big = _compressed([[2**24 - 1, 0]], [[ONE, 0]])
    assert unpack(pack(big), 1, 2, 2**24).ids.tolist() == [[2**24 - 1, 0]]


def _compressed(ids: list[list[int]], fixed: list[list[int]]) -> CompressedProbs:
    fixed_uint16 = torch.tensor(fixed, dtype=torch.int32).to(torch.uint16)
    return CompressedProbs(torch.tensor(ids, dtype=torch.int32), fixed_uint16)


def _message(ids: list[list[int]], fixed: list[list[int]]) -> bytes:
    return pack(_compressed(ids, fixed))


@pytest.mark.parametrize(
    "data, num_tokens, k, vocab, message",
    [
        (_message([[1, 2]], [[ONE - 1, 1]]), 1, 2, 10, None),
        (_message([[1, 2]], [[ONE - 1, 1]])[:-1], 1, 2, 10, "expected 10 bytes"),
        (_message([[1, 2]], [[ONE - 1, 1]]) + b"\0", 1, 2, 10, "expected 10 bytes"),
        (_message([[1, 2]], [[ONE - 1, 1]]), 2, 2, 10, "expected 20 bytes"),
        (_message([[1, 10]], [[ONE - 1, 1]]), 1, 2, 10, "outside the vocabulary"),
        (_message([[3, 3]], [[ONE - 1, 1]]), 1, 2, 10, "repeats"),
        (_message([[1, 2]], [[ONE, 1]]), 1, 2, 10, "sum to 32768"),
        (_message([[1, 2]], [[100, 1]]), 1, 2, 10, "sum to 32768"),
        (_message([[1, 2]], [[ONE - 1, 1]]), 1, 0, 10, "bad sizes"),
        (_message([[1, 2]], [[ONE - 1, 1]]), 1, 2, 1, "bad sizes"),
        ("not bytes", 1, 2, 10, "expected bytes"),
    ],
)
def test_unpack_rejects_malformed_messages(data, num_tokens, k, vocab, message):
    if message is None:
        assert unpack(data, num_tokens, k, vocab).ids.tolist() == [[1, 2]]
        return
    with pytest.raises(InvalidDraftProbs, match=message):
        unpack(data, num_tokens, k, vocab)


def test_invalid_draft_probs_is_a_value_error():
    assert issubclass(InvalidDraftProbs, ValueError)


def test_sparse_draw_equals_the_dense_draw():
    compressed = encode(_random_q(300, 64, seed=2), 6)
    seeds, positions = torch.arange(300) * 7919, torch.arange(300) + 5
    dense = sample(to_dense(compressed, 64), seeds, positions, salt=DRAFT_SALT)
    assert torch.equal(sample_compressed(compressed, seeds, positions), dense)


def test_drafter_draws_from_the_compressed_q_and_never_a_zero_entry():
    trials = 20_000
    q = torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.03, 0.01]])
    compressed = encode(q, 4)
    rows = CompressedProbs(compressed.ids.repeat(trials, 1), compressed.fixed.repeat(trials, 1))
    drafts = sample_compressed(rows, torch.arange(trials), torch.full((trials,), 3))
    counts = np.bincount(drafts.numpy(), minlength=6)
    assert counts[4:].sum() == 0
    expected = to_dense(compressed, 6)[0, :4].double().numpy() * trials
    assert stats.chisquare(counts[:4], expected).pvalue > ALPHA


def test_concat_pads_rows_with_entries_that_change_nothing():
    parts = [encode(_random_q(2, 30, seed=3), 2), no_probs(1), encode(_random_q(3, 30, seed=4), 5)]
    batch = concat(parts)
    assert batch.ids.shape == (6, 5) and batch.fixed.dtype == torch.uint16
    assert torch.equal(to_dense(batch, 30), torch.cat([to_dense(part, 30) for part in parts]))
    assert concat([]).num_tokens == 0


@pytest.mark.parametrize("k", [1, 4])
def test_a_point_mass_is_a_valid_wire_row_of_any_k(k):
    """Each row puts all of q' on its token; wider rows pad with other ids at probability 0."""
    tokens = [2, 0, 7]
    rows = point_mass(tokens, k)
    sent = unpack(pack(rows), len(tokens), k, 10)
    assert sent.ids[:, 0].tolist() == tokens
    assert torch.equal(to_dense(sent, 10), torch.nn.functional.one_hot(torch.tensor(tokens), 10).float())
