"""An EAGLE-3 head drafting for the embedded model over real gRPC: the target sends its features with
each Extend, the head drafts from them, and output stays the target's own."""
from __future__ import annotations

import threading
import time

import pytest

from tests.support.pairs import TWO_THREADS, restart_drafter, start_pair
from tests.support.service_fixtures import PROMPTS, greedy_request, metric, run_requests, scrape
from tandem.hidden_states import FeatureLayout
from tandem.loaders import load_checkpoint
from tandem.model.eagle3 import default_feature_layers
from tandem.registry import resolve_model_path
from tests.support.tiny_eagle3 import write_eagle3_head

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory) -> tuple[list[str], FeatureLayout]:
    """The draft service's flags for a random head on SmolLM2's features, and the features' layout."""
    config, _ = load_checkpoint(resolve_model_path("smollm2-135m"))
    head = write_eagle3_head(tmp_path_factory.mktemp("head") / "eagle3", config, None, list(range(2048)))
    layout = FeatureLayout(default_feature_layers(config.num_layers), config.hidden_size)
    return ["--drafter", "eagle3", "--model", str(head), "--drafter-target", "smollm2-135m"], layout


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory, eagle_head):
    """A step runs at most 16 prompt tokens here, so the prompts (about 45 tokens with the chat
    template) are prefilled in chunks, and their features go to the head chunk by chunk."""
    draft_args, layout = eagle_head
    draft, target = start_pair(tmp_path_factory, "eagle3", [*draft_args, *TWO_THREADS],
                               ["--sync-speculation", "--max-num-batched-tokens", "16", *TWO_THREADS])
    yield draft, target, layout
    target.kill()
    draft.kill()


def test_drafts_from_target_features_and_greedy_output_is_the_targets(eagle_pair):
    draft, target, layout = eagle_pair
    requests = {speculate: [greedy_request(p, MAX_TOKENS, speculate=speculate) for p in PROMPTS]
                for speculate in (False, True)}
    alone = run_requests(target.address, requests[False])
    paired = run_requests(target.address, requests[True])
    assert [r.token_ids for r in paired] == [r.token_ids for r in alone]
    samples = scrape(target.metrics_url)
    sent = metric(samples, "tandem_hidden_state_bytes_total")
    assert sent > 0 and sent % layout.row_bytes == 0
    assert layout.row_bytes == 3 * 576 * 2  # layers 2, 15 and 27 of SmolLM2-135M, bf16
    # Every position but each sequence's last few is sent once: at least the prompts' positions.
    assert sent >= sum(r.prompt_tokens for r in paired) * layout.row_bytes
    assert metric(samples, "tandem_spec_decode_num_draft_tokens_total") > 0, "no draft reached verification"
    assert metric(scrape(draft.metrics_url), "tandem_draft_invalid_updates_total") == 0


def test_the_heads_prefix_cache_serves_a_repeated_prompt_with_its_kv_and_features(eagle_pair):
    """The head's slot keeps its KV and the target features it read: the same prompt again finds them
    there, and drafts from them (the target prefills whole: it must send every position's features)."""
    draft, target, _ = eagle_pair
    request = greedy_request(PROMPTS[2], MAX_TOKENS, speculate=True)
    [first] = run_requests(target.address, [request])
    hits_before = metric(scrape(draft.metrics_url), "tandem_draft_prefix_cache_hits_total")
    [again] = run_requests(target.address, [request])
    hits = metric(scrape(draft.metrics_url), "tandem_draft_prefix_cache_hits_total") - hits_before
    assert again.token_ids == first.token_ids and again.cached_tokens == 0
    assert hits >= again.prompt_tokens - 1  # the drafter's first job holds the prompt and the tokens committed by then
    assert again.draft_tokens > 0  # the head drafts from what it kept (random, its drafts are rarely accepted)


def test_sampled_requests_with_the_heads_probabilities_finish(eagle_pair):
    _, target, _ = eagle_pair
    requests = [greedy_request(p, MAX_TOKENS, speculate=True, seed=i) for i, p in enumerate(PROMPTS)]
    for request in requests:
        request.sampling_params.temperature = 0.8
    results = run_requests(target.address, requests)
    assert all(r.finish_reason in ("length", "stop") and r.token_ids for r in results)


def test_the_acceptance_bench_replays_features_the_drafter_takes(eagle_pair):
    """bench/drafter_mal.py plays the target's part: its Extends carry exactly the rows a head expects."""
    import asyncio

    from bench.drafter_mal import Case, case_features, measure

    draft, _, layout = eagle_pair
    before = scrape(draft.metrics_url)
    case = Case("chat", list(range(1000, 1040)), list(range(2000, 2030)))
    features = case_features([case], "smollm2-135m", layout)
    assert features[0].rows.shape == (69, 3, 576)
    mal = asyncio.run(measure(draft.address, [case], k=4, features=features))
    after = scrape(draft.metrics_url)
    assert mal["all"] >= 1
    assert metric(after, "tandem_draft_invalid_updates_total") == metric(before, "tandem_draft_invalid_updates_total")
    assert metric(after, "tandem_draft_tokens_total") > metric(before, "tandem_draft_tokens_total")


@pytest.mark.slow  # a long run; the reopen itself is also checked by the constrained restart and the engine tests
def test_a_restarted_head_drafts_the_running_sequences_from_the_features_sent_after_it(tmp_path_factory, eagle_head,
                                                                                      eagle_pair):
    """The drafter dies mid-generation and comes back. The target reopens the running sequences; the
    new drafter never gets the features of the positions committed before, which its head reads as
    zeros, and the Extends after the reopen carry exactly the rows it expects: none is refused, the
    drafts are verified again and the output stays the target's own.
    The requests must outlast the restart (about 5 s on a slow machine): 150 tokens at 80 ms a step.
    The other pair's target, the same model without the slow steps, gives the output alone."""
    draft_args, layout = eagle_head
    alone = run_requests(eagle_pair[1].address, [greedy_request(p, 150, ignore_eos=True, speculate=False)
                                                 for p in PROMPTS[:2]])
    draft, target = start_pair(tmp_path_factory, "eagle3-restart", draft_args,
                               ["--sync-speculation", "--min-step-ms", "80", "--reconnect-max-seconds", "0.3"])
    requests = [greedy_request(p, 150, ignore_eos=True) for p in PROMPTS[:2]]
    try:
        results = []
        worker = threading.Thread(target=lambda: results.extend(run_requests(target.address, requests)))
        worker.start()
        time.sleep(1.0)
        draft = restart_drafter(draft, target)
        before = scrape(target.metrics_url)
        worker.join(300)
        after, drafter = scrape(target.metrics_url), scrape(draft.metrics_url)
        assert [r.token_ids for r in results] == [a.token_ids for a in alone]
        for name in ("tandem_spec_decode_num_draft_tokens_total", "tandem_hidden_state_bytes_total"):
            assert metric(after, name) > metric(before, name), f"{name} did not grow after the restart"
        assert metric(drafter, "tandem_draft_tokens_total") > 0
        assert metric(drafter, "tandem_draft_invalid_updates_total") == 0
        assert (metric(after, "tandem_hidden_state_bytes_total")
                - metric(before, "tandem_hidden_state_bytes_total")) % layout.row_bytes == 0
    finally:
        target.kill()
        draft.kill()
