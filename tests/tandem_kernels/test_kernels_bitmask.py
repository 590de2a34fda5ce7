"""Token bitmasks: the Triton kernel equals the PyTorch reference, and both follow the bit layout."""
from __future__ import annotations

import pytest
import torch

from tandem_kernels._triton import INTERPRETED
from tandem_kernels.bitmask import allowed_tokens, apply_token_bitmask, apply_token_bitmask_reference
from tandem.structured.grammar import words_for

VOCABS = [1, 31, 32, 999, 4097, 49152]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="kernels are compiled for CUDA here")),
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


def _random_mask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (rows, words_for(vocab)), generator=g, dtype=torch.int64).to(torch.int32)


def test_bit_t_of_word_t_over_32_allows_token_t():
    vocab = 70
    mask = torch.zeros(1, words_for(vocab), dtype=torch.int32)
    for token in (0, 31, 32, 69):
        mask[0, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    assert allowed_tokens(mask, vocab)[0].nonzero().flatten().tolist() == [0, 31, 32, 69]


def test_a_short_bitmask_forbids_the_tokens_it_does_not_cover():
    assert allowed_tokens(torch.full((1, 1), -1, dtype=torch.int32), 40)[0].tolist() == [True] * 32 + [False] * 8


def test_only_the_named_rows_are_masked():
    logits = torch.randn(4, 64)
    before = logits.clone()
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 1] = 1 << 3  # token 35 only
    apply_token_bitmask(logits, mask, torch.tensor([2]))
    assert torch.equal(logits[[0, 1, 3]], before[[0, 1, 3]])
    assert logits[2].argmax() == 35 and torch.isinf(logits[2]).sum() == 63


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_triton_kernel_equals_the_reference(vocab, device):
    pytest.importorskip("triton")
    from tandem_kernels.bitmask import apply_token_bitmask_triton

    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    mask = _random_mask(3, vocab, vocab)
    rows = torch.tensor([4, 0, 5])
    expected = logits.clone()
    apply_token_bitmask_reference(expected, mask, rows)
    actual = logits.to(device)
    if device == "cpu":
        apply_token_bitmask_triton(actual, mask, rows)
    else:
        apply_token_bitmask(actual, mask.to(device), rows.to(device))
    assert torch.equal(actual.cpu(), expected)
