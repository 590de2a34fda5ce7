"""The target's processed distribution p, and keyed sampling from it (PyTorch path)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from tandem_kernels import KernelInputError, processed_probs, sample
from tandem_kernels.sampling import MAX_TEMPERATURE, Sampling, probs_of

ALPHA = 1e-3


def _params(batch: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> dict[str, torch.Tensor]:
    """Per-row sampling parameters, each a scalar or a list of length batch."""
    def column(value, dtype):
        return torch.tensor(value if isinstance(value, list) else [value] * batch, dtype=dtype)

    return {
        "temperature": column(temperature, torch.float32),
        "top_k": column(top_k, torch.int64),
        "top_p": column(top_p, torch.float32),
        "min_p": column(min_p, torch.float32),
    }


LOGITS = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])


def test_temperature_scales_logits():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    probs = processed_probs(logits, **_params(3, temperature=[0.5, 1.0, 2.0]))
    expected = torch.softmax(logits / torch.tensor([[0.5], [1.0], [2.0]]), dim=1)
    torch.testing.assert_close(probs, expected)


def test_greedy_row_is_one_hot_at_the_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    probs = processed_probs(logits, **_params(1, temperature=0.0, top_k=1, top_p=0.5))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


@pytest.mark.parametrize(
    "filters, expected",
    [
        ({"top_k": 2}, [0.625, 0.375, 0.0, 0.0]),
        ({"top_k": 9}, [0.5, 0.3, 0.15, 0.05]),
        ({"top_p": 0.75}, [0.625, 0.375, 0.0, 0.0]),
        ({"top_p": 0.85}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        ({"top_p": 0.01}, [1.0, 0.0, 0.0, 0.0]),
        ({"min_p": 0.2}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        ({"top_k": 3, "top_p": 0.6}, [0.625, 0.375, 0.0, 0.0]),
    ],
)
def test_filters_keep_the_documented_tokens(filters, expected):
    probs = processed_probs(LOGITS, **_params(1, **filters))
    torch.testing.assert_close(probs, torch.tensor([expected]))


def test_top_p_applies_to_the_top_k_distribution():
    # After top-k=2 the distribution is [0.625, 0.375]: a top-p of 0.6 keeps only the first.
    probs = processed_probs(LOGITS, **_params(1, top_k=2, top_p=0.6))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_rows_are_processed_independently():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = _params(
        4, temperature=[0.0, 0.7, 1.0, 1.3], top_k=[0, 5, 0, 0], top_p=[1.0, 1.0, 0.9, 1.0], min_p=[0.0, 0.0, 0.0, 0.1]
    )
    together = processed_probs(logits, **params)
    for row in range(4):
        alone = processed_probs(logits[row : row + 1], **{name: value[row : row + 1] for name, value in params.items()})
        assert torch.equal(together[row : row + 1], alone)
        assert abs(float(together[row].sum()) - 1.0) < 1e-6


def test_temperatures_below_1e_5_are_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(6))
    probs = processed_probs(logits, **_params(3, temperature=[1e-40, 9e-6, 0.0]))
    assert torch.equal(probs, processed_probs(logits, **_params(3, temperature=0.0)))


@pytest.mark.parametrize("name, value, off", [("top_k", 5, 0), ("top_p", 0.9, 1.0), ("min_p", 0.05, 0.0)])
def test_a_row_without_filters_is_bit_identical_beside_a_filtered_one(name, value, off):
    # A large vocabulary with spread logits: a filter's float32 cumulative sum would reach 1 before
    # the far tail, and its renormalization would move the other probabilities.
    logits = 4 * torch.randn(2, 4097, generator=torch.Generator().manual_seed(5))
    together = processed_probs(logits, **_params(2, temperature=0.9, **{name: [value, off]}))
    alone = processed_probs(logits[1:], **_params(1, temperature=0.9))
    assert torch.equal(together[1:], alone)
    assert bool((alone > 0).all())  # the far tail is kept


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
    ],
)
def test_bad_parameters_name_the_field(params, field):
    with pytest.raises(KernelInputError, match=field):
        processed_probs(LOGITS, **_params(1, **params))


@pytest.mark.parametrize("params, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": MAX_TEMPERATURE * 2}, "temperature"), ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"min_p": 2.0}, "min_p"),
])
def test_a_sampling_out_of_range_names_its_field(params, field):
    """The one range check both services run; processed_probs would refuse the same values."""
    assert Sampling(**params).problem().field == field
    assert Sampling(temperature=1.0, top_k=5, top_p=0.5, min_p=0.1).problem() is None


@pytest.mark.parametrize("params, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"), ({"logit_bias": ((3, 100.5),)}, "logit_bias"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"), ({"logit_bias": ((50, 1.0),)}, "logit_bias"),
    ({"allowed_token_ids": (1, 50)}, "allowed_token_ids"), ({"bad_words": ((1, 2), ())}, "bad_words"),
    ({"bad_words": ((1, 99),)}, "bad_words"),
])
def test_logits_rules_out_of_range_name_their_field(params, field):
    assert Sampling(**params).problem(vocab_size=50).field == field
    fine = Sampling(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=2.0, logit_bias=((49, -100.0),),
                    allowed_token_ids=(0, 49), bad_words=((1, 2), (3,)))
    assert fine.problem(vocab_size=50) is None and fine.processes_logits and fine.reads_history


@pytest.mark.parametrize("sampling, penalized, processes_logits, reads_history", [
    (Sampling(), False, False, False),
    (Sampling(repetition_penalty=1.1), True, True, True),
    (Sampling(logit_bias=((1, 1.0),)), False, True, False),
    (Sampling(allowed_token_ids=(1,)), False, True, False),
    (Sampling(bad_words=((1,),)), False, True, True),
])
def test_which_rules_read_the_tokens_before_each_position(sampling, penalized, processes_logits, reads_history):
    assert (sampling.penalized, sampling.processes_logits, sampling.reads_history) == (
        penalized, processes_logits, reads_history)


@pytest.mark.parametrize("sampling, greedy, needs_draft_probs", [
    (Sampling(), True, False),
    (Sampling(temperature=9e-6), True, False),
    (Sampling(temperature=0.7), False, True),
    (Sampling(temperature=0.7, drafter_invariant=True), False, False),
    (Sampling(temperature=0.0, drafter_invariant=True), True, False),
])
def test_greedy_and_needs_draft_probs(sampling, greedy, needs_draft_probs):
    assert sampling.greedy is greedy and sampling.needs_draft_probs is needs_draft_probs
    one_hot = probs_of(LOGITS[:1], [sampling])[0]
    assert bool(one_hot.max() == 1.0) is greedy  # the kernels agree on what greedy is


def test_wrong_dtype_or_shape_is_a_clear_error():
    params = _params(1)
    with pytest.raises(KernelInputError, match="top_k"):
        processed_probs(LOGITS, **{**params, "top_k": params["top_k"].int()})
    with pytest.raises(KernelInputError, match="temperature"):
        processed_probs(LOGITS, **{**params, "temperature": torch.ones(2)})
    with pytest.raises(KernelInputError, match="probs"):
        sample(LOGITS.double(), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(KernelInputError, match="contiguous"):
        sample(torch.ones(4, 2).t(), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("temperature, top_p", [(0.5, 1.0), (1.0, 1.0), (1.5, 1.0), (1.0, 0.9)])
def test_sample_draws_from_p(temperature, top_p):
    trials = 20_000
    logits = 2 * torch.randn(1, 30, generator=torch.Generator().manual_seed(2))
    p = processed_probs(logits, **_params(1, temperature=temperature, top_p=top_p))
    tokens = sample(p.expand(trials, -1).contiguous(), torch.arange(trials), torch.full((trials,), 42))
    counts = np.bincount(tokens.numpy(), minlength=30)
    support = p[0].numpy() > 0
    assert counts[~support].sum() == 0
    expected = p[0].double().numpy()[support] * trials
    assert stats.chisquare(counts[support], expected * trials / expected.sum()).pvalue > ALPHA


def test_sample_of_a_one_hot_row_is_its_argmax():
    p = processed_probs(torch.randn(50, 20, generator=torch.Generator().manual_seed(3)), **_params(50, temperature=0.0))
    assert torch.equal(sample(p, torch.arange(50), torch.arange(50)), p.argmax(dim=1))


def test_a_seeded_draw_does_not_depend_on_its_batch():
    p = torch.softmax(torch.randn(6, 40, generator=torch.Generator().manual_seed(4)), dim=1)
    seeds, positions = torch.tensor([9, 9, 1, 2, 3, 4]), torch.tensor([100, 101, 5, 6, 7, 8])
    together = sample(p, seeds, positions)
    for row in range(6):
        assert together[row] == sample(p[row : row + 1], seeds[row : row + 1], positions[row : row + 1])[0]
