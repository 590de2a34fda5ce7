"""bench/drafter_mal.py's replay on a real draft service: the steps a synchronous greedy target takes."""
from __future__ import annotations

import asyncio

import pytest

from bench.drafter_mal import Case, copy_oracle, measure
from tandem.launch import ServiceProcess


@pytest.fixture(scope="module")
def suffix_drafter(tmp_path_factory):
    draft = ServiceProcess("draft_service", ["--drafter", "suffix", "--model", "smollm2-135m", "--threads", "1"],
                           log_path=tmp_path_factory.mktemp("mal") / "draft.log").start()
    draft.wait_healthy()
    yield draft
    draft.kill()


def test_an_output_that_copies_its_prompt_is_drafted_four_tokens_a_step(suffix_drafter):
    prompt = list(range(100, 140))
    # Step 1: nothing to look up (139 never came before), one token. Then each step drafts 4 tokens
    # of the copy, all accepted, and commits 5: 39 tokens in 8 steps. 40 tokens in 9 steps.
    mal = asyncio.run(measure(suffix_drafter.address, [Case("rewrite", prompt, list(prompt))], k=4))
    assert mal == {"rewrite": pytest.approx(40 / 9), "all": pytest.approx(40 / 9)}


def test_a_mismatch_costs_the_rest_of_the_draft(suffix_drafter):
    prompt = list(range(200, 220))
    output = prompt[:6] + [7] + prompt[7:12]  # the copy breaks at its 7th token
    mal = asyncio.run(measure(suffix_drafter.address, [Case("code", prompt, output)], k=4))
    # Steps: +200 (nothing to look up) | 201..204 accepted, +205 | 206 rejected, +7 | nothing after 7
    # before: +207 | 208..211 accepted, the output ends. 12 tokens in 5 steps.
    assert mal["code"] == pytest.approx(len(output) / 5)


def test_the_copy_oracle_drafts_the_best_earlier_occurrence_not_the_most_frequent():
    prompt = [1, 2, 3, 4, 5, 1, 2, 8, 9, 10, 1, 2, 8, 9, 11]  # after 1: "2 3 4 5" once, "2 8 9" twice
    output = [1, 2, 3, 4, 5]
    # Step 1: 11 never came before, +1. Step 2: of the three continuations of 1, "2 3 4 5" matches
    # all four next tokens (the most frequent, "2 8 9 ..", only one): 4 accepted, the output ends.
    assert copy_oracle([Case("rewrite", prompt, output)], k=4) == {"rewrite": 2.5, "all": 2.5}


def test_the_copy_oracle_copies_from_earlier_outputs():
    first = Case("chat", [20, 21], [7, 6, 5, 4])  # nothing to copy: a token a step
    second = Case("code", [20, 21], [7, 6, 5, 4])  # +7, then the first output's "6 5 4"
    assert copy_oracle([first, second], k=4) == {"chat": 1.0, "code": 2.0, "all": 8 / 6}
