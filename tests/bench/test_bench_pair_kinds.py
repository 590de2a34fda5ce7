"""bench.pair_kinds: the mix that chooses the default drafter."""
from __future__ import annotations

import math

import pytest

from bench import network
from bench.pair_kinds import mix, mix_table


def _row(config: str, kind: str, concurrency: int, vs_alone: float) -> dict:
    return {"config": config, "kind": kind, "concurrency": concurrency, "vs_alone": vs_alone,
            "identical": 4, "prompts": 4}


ROWS = [
    _row(network.ALONE, "chat", 1, 1.0), _row(network.ALONE, "rewrite", 1, 1.0),
    _row("suffix", "chat", 1, 0.9), _row("suffix", "rewrite", 1, 1.6),
    _row("model", "chat", 1, 1.1), _row("model", "rewrite", 1, 1.1),
    _row("suffix", "chat", 8, 1.0), _row("suffix", "rewrite", 8, 1.21),
]


def test_the_mix_is_each_drafters_geometric_mean_over_kinds_per_concurrency():
    mixes = {(m["config"], m["concurrency"]): m for m in mix(ROWS)}
    assert set(mixes) == {("suffix", 1), ("model", 1), ("suffix", 8)}, "the target alone is no drafter"
    assert mixes[("suffix", 1)]["mix"] == pytest.approx(math.sqrt(0.9 * 1.6))  # 1.2: above model's 1.1
    assert mixes[("model", 1)]["mix"] == pytest.approx(1.1)
    assert mixes[("suffix", 8)]["mix"] == pytest.approx(1.1)
    assert (mixes[("suffix", 1)]["worst"], mixes[("suffix", 1)]["worst_kind"]) == (0.9, "chat")
    assert (mixes[("suffix", 1)]["identical"], mixes[("suffix", 1)]["prompts"]) == (8, 8)


def test_the_mix_table_has_a_row_per_drafter_and_concurrency():
    lines = mix_table(mix(ROWS)).splitlines()
    assert len(lines) == 2 + 3
    assert lines[2] == "| suffix | 1 | 1.200 | 0.90 (chat) | 8/8 |"
