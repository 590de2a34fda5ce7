"""bench/drafter_mal.py's replay on a real draft service: the steps a synchronous greedy target takes."""
from __future__ import annotations

import asyncio

import pytest

from bench.drafter_mal import Case, measure
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
