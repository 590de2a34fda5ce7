"""Keyed randomness: uniform, exponential, independent across salts, and a function of its key only."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from tandem_kernels.random import (
    ACCEPT_SALT,
    DRAFT_SALT,
    TARGET_SALT,
    accept_uniforms,
    fresh_seed,
    race_weights,
    random_bits,
)

ALPHA = 1e-3


def _keys(n: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """n draws of one seeded request at positions 0..n-1."""
    return torch.full((n,), seed, dtype=torch.int64), torch.arange(n, dtype=torch.int64)


def test_accept_uniforms_are_uniform():
    seeds, positions = _keys(20_000)
    u = accept_uniforms(seeds, positions).numpy()
    assert u.min() > 0 and u.max() < 1
    assert stats.kstest(u, "uniform").pvalue > ALPHA


def test_race_weights_invert_unit_exponentials():
    seeds, positions = _keys(200)
    weights = race_weights(seeds, positions, TARGET_SALT, torch.arange(100))  # [200, 100]
    assert bool((weights > 0).all()) and bool(weights.isfinite().all())
    assert stats.kstest(1.0 / weights.double().flatten().numpy(), "expon").pvalue > ALPHA


def test_bits_are_uniform_over_bytes():
    seeds, positions = _keys(100)
    bits = random_bits(seeds, positions, DRAFT_SALT, torch.arange(512))  # [100, 512]
    for byte in (bits & 0xFF, bits >> 24):
        assert stats.chisquare(np.bincount(byte.flatten().numpy(), minlength=256)).pvalue > ALPHA


def test_salts_give_independent_streams():
    seeds, positions = _keys(20_000, seed=3)
    index = torch.zeros(1, dtype=torch.int64)
    streams = [random_bits(seeds, positions, salt, index)[:, 0] for salt in (TARGET_SALT, ACCEPT_SALT, DRAFT_SALT)]
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        grid = np.zeros((8, 8), dtype=np.int64)
        np.add.at(grid, ((streams[a] >> 29).numpy(), (streams[b] >> 29).numpy()), 1)
        assert stats.chi2_contingency(grid).pvalue > ALPHA


def test_positions_of_one_stream_never_share_noise():
    seeds, positions = _keys(4096)
    bits = random_bits(seeds, positions, TARGET_SALT, torch.arange(2))  # [4096, 2]
    pairs = bits[:, 0] * 2**32 + bits[:, 1]
    assert pairs.unique().numel() == 4096


def test_a_draw_depends_on_its_key_only():
    seeds = torch.tensor([5, -1, 2**63 - 1, -(2**63)], dtype=torch.int64)
    positions = torch.tensor([0, 2**40 + 3, 17, 1], dtype=torch.int64)
    index = torch.tensor([0, 3, 49151])
    together = random_bits(seeds, positions, TARGET_SALT, index)
    alone = torch.cat([random_bits(seeds[i : i + 1], positions[i : i + 1], TARGET_SALT, index) for i in range(4)])
    assert torch.equal(together, alone)
    assert bool((together >= 0).all() & (together < 2**32).all())


def test_seed_and_position_both_change_the_draw():
    index = torch.arange(4)
    base = random_bits(torch.tensor([1]), torch.tensor([10]), TARGET_SALT, index)
    assert not torch.equal(base, random_bits(torch.tensor([2]), torch.tensor([10]), TARGET_SALT, index))
    assert not torch.equal(base, random_bits(torch.tensor([1]), torch.tensor([11]), TARGET_SALT, index))
    assert not torch.equal(base, random_bits(torch.tensor([1 + 2**32]), torch.tensor([10]), TARGET_SALT, index))


def test_fresh_seeds_are_non_negative_int64_and_differ():
    seeds = {fresh_seed() for _ in range(100)}
    assert len(seeds) == 100
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("salt", [TARGET_SALT, DRAFT_SALT])
def test_race_picks_each_token_with_its_probability(salt):
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    seeds, positions = _keys(20_000, seed=11)
    keys = probs * race_weights(seeds, positions, salt, torch.arange(5))
    counts = np.bincount(keys.argmax(dim=1).numpy(), minlength=5)
    assert counts[4] == 0
    assert stats.chisquare(counts[:4], probs[:4].numpy() * 20_000).pvalue > ALPHA
