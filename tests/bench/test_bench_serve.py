"""The benchmark's load generator, end to end on a tiny run against real services (under a minute)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package

from bench.load import RequestRecord, poisson_arrivals  # noqa: E402
from bench.prompt_set import KINDS, load_prompts  # noqa: E402
from bench.stats import percentile, summarize  # noqa: E402


def test_prompt_set_has_three_main_kinds_interleaved_then_six_spec_bench_like_kinds():
    prompts = load_prompts()
    main, categories = KINDS[:3], KINDS[3:]
    assert len({p.id for p in prompts}) == len(prompts) == 208 + 8 * len(categories)
    assert all(p.messages and p.messages[-1][0] == "user" and p.messages[-1][1].strip() for p in prompts)
    for kind in main:
        assert sum(p.kind == kind for p in prompts[:208]) >= 60
    assert {p.kind for p in load_prompts(3)} == set(main)  # any short prefix has every main kind
    assert [p.kind for p in prompts[208:]] == list(categories) * 8  # interleaved, 8 of each
    assert all(len(p.messages) == 3 for p in prompts if p.kind == "multiturn")  # user, assistant, user


def test_percentiles_and_summary():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    records = [RequestRecord("a", "chat", 0.0, 0.1, 1.1, 10, 11, 8, 4, 2, "length", [0.1] * 10),
               RequestRecord("b", "code", 0.0, 0.3, 0.3, 10, 1, 0, 0, 0, "stop")]
    s = summarize(records, duration=2.0)
    assert s["output_tokens"] == 12 and s["throughput_tok_s"] == 6.0
    assert s["tpot_s"]["n"] == 1 and abs(s["tpot_s"]["p50"] - 0.1) < 1e-12  # one token: no TPOT
    assert s["acceptance"]["acceptance_rate"] == 0.5 and s["acceptance"]["mean_acceptance_length"] == 3.0


def test_poisson_schedule_is_seeded():
    a, b = poisson_arrivals(50, 4.0, seed=1), poisson_arrivals(50, 4.0, seed=1)
    assert a == b and a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert 5 < a[-1] < 25  # about 49 gaps of 0.25 s


@pytest.mark.slow  # three services and six cells: the bench's own check before its figures are reported
def test_tiny_run_end_to_end(tmp_path):
    from bench.serve import main

    report = main(["--num-prompts", "2", "--max-tokens", "4", "--concurrency", "2", "--temperatures", "0",
                   "--rate", "20", "--rounds", "1", "--no-hf", "--drafters", "ngram", "--out", str(tmp_path)])
    cells = json.loads((tmp_path / "latest.json").read_text())["cells"]
    assert (tmp_path / "latency_ngram.png").stat().st_size > 10_000
    loads = {"c=2", "rate=20/s"}
    assert {(c["mode"], c["label"]) for c in cells} == {
        (m, load) for m in ("alone", "async", "sync") for load in loads}
    for cell in cells:
        records = cell["records"]
        assert len(records) == 2 and not any(r["error"] for r in records), cell["mode"]
        assert all(r["completion_tokens"] == 4 and r["finish_reason"] == "length" for r in records)
        assert all(0 < r["ttft"] <= r["e2e"] and len(r["itl"]) == 3 for r in records)
        assert cell["summary"]["ttft_s"]["p50"] > 0
        if cell["mode"] == "alone":
            assert cell["summary"]["acceptance"]["draft_tokens"] == 0
        else:
            assert cell["server"]["draft_miss"] + cell["server"]["drafts"] > 0  # the target speculated
    assert len(report["ratios"]) == len(loads)
